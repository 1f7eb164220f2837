"""The embedded demo (`clawrl demo`): a procedurally generated arithmetic task (task.py) and its recipe
(recipe.py: hyperparameters as data, job configs, and an in-process run used as experiment harness)."""
