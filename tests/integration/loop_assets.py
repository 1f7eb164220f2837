"""Shared inputs of the loop tests: a tiny random qwen2 checkpoint and the demo task's jsonl files, built
offline, and the reward they train with (tests/integration/loop_reward.py)."""

from pathlib import Path

REWARD = str(Path(__file__).with_name("loop_reward.py")) + ":reward"


def build_loop_assets(root: Path, *, num_train: int = 64, num_eval: int = 8) -> dict[str, str]:
    """{"model", "train", "eval"} paths under `root`."""
    from clawrl.demo.task import TaskSpec, write_task_files
    from clawrl.models.tiny import build_tiny_model

    model = build_tiny_model(root / "model", arch="qwen2", vocab_size=2048, hidden_size=64, num_layers=2)
    paths = write_task_files(root / "data", TaskSpec(), seed=0, num_train=num_train, num_eval=num_eval)
    return {"model": str(model), "train": str(paths["train"]), "eval": str(paths["eval"])}
