"""The engine's HTTP layer: the FastAPI app (app.py), SGLang's /generate (generate.py), the OpenAI routes
(openai.py), each next to its request models, and the Python client (client.py)."""
