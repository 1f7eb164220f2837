"""clawrl: RL post-training for LLMs and LLM agents (rollout engine, FSDP2 trainer, Ray loop, debug and CI tools)."""

__version__ = "0.1.0"
