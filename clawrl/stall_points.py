"""Stall points: named places in clawrl's processes that hang on request, to prove a deadline fires.

    CLAWRL_STALL_AT=trainer.save clawrl train ... --train-timeout 30

A listed point sleeps for an hour where it stands, as a process wedged in a filesystem call, a collective
or a dead peer would. The driver's environment reaches every Ray actor (the job's runtime_env), so the
variable works for the engines, the rollout manager and the trainer ranks alike. The tests use it to make
each blocking call of the driver stuck once; a user can use it to check their own `--*-timeout` settings.
Unknown names are refused before anything starts (clawrl/cli/preflight.py), so a typo cannot silently test
nothing. No dependencies: the engine, the trainer and the cluster code all import it.
"""

from __future__ import annotations

import logging
import os
import time

ENV_VAR = "CLAWRL_STALL_AT"

POINTS = {
    "engine.start": "an engine actor building its engine and HTTP server",
    "engine.update_weights": "an engine loading a weight-update bucket (the engine thread)",
    "trainer.start": "a trainer rank's process constructing its TrainActor",
    "trainer.init": "a trainer rank loading the model and the checkpoint",
    "trainer.train": "a trainer rank's train step",
    "trainer.save": "a trainer rank writing a checkpoint",
    "trainer.update_weights": "a trainer rank gathering and sending the weights",
    "rollout.generate": "the rollout manager generating a rollout",
    "rollout.eval": "the rollout manager running an eval",
    "rollout.state_dict": "the rollout manager returning its data cursor for a checkpoint",
}

STALL_S = 3600.0
logger = logging.getLogger(__name__)


def requested() -> list[str]:
    """The point names in CLAWRL_STALL_AT (comma-separated), in order."""
    return [name.strip() for name in os.environ.get(ENV_VAR, "").split(",") if name.strip()]


def unknown() -> list[str]:
    """Requested names that are not stall points (for the preflight check)."""
    return [name for name in requested() if name not in POINTS]


def stall_point(name: str) -> None:
    """Hang here for an hour if `name` is listed in CLAWRL_STALL_AT; return at once otherwise."""
    assert name in POINTS, name
    if name in requested():
        logger.warning("%s=%s: stalling at %s (%s)", ENV_VAR, os.environ[ENV_VAR], name, POINTS[name])
        time.sleep(STALL_S)
