"""The engine core, torch-free except engine.py: requests (request.py), sequences and stop rules (sequence.py),
the scheduler and block manager (scheduler.py), and the synchronous engine step (engine.py)."""
