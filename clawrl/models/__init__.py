"""Decoder-only model definitions (Qwen2/Qwen3/Llama with HF weight names) and builders of tiny offline assets."""
