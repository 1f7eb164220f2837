"""Fault-tolerance flags: engine health monitoring and recovery, fault injection for tests, deadlines.

slime's names and defaults for the health monitor (`--use-fault-tolerance`, `--rollout-health-check-*`:
30 s interval, 30 s timeout, no first wait). clawrl recovers without losing work: requests that were in
flight on a dead engine are re-sent to a live one, the replacement loads the current weights before it
takes traffic (see clawrl/cluster/health.py). Every wait of the driver on an actor has a deadline; the
`--*-timeout` flags set them.

A fault-injection SPEC is `engine=I,rollout=K,mode=kill|hang`: once, while rollout K (the first with id >= K)
is in flight, engine I is killed (its process exits) or hangs (its server stops answering).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clawrl.config.errors import ConfigError, above, at_least
from clawrl.config.fields import check_types, option

_SPEC = re.compile(r"^engine=(\d+),rollout=(\d+),mode=(kill|hang)$")


@dataclass(kw_only=True)
class FaultConfig:
    """Fault tolerance and deadlines."""

    use_fault_tolerance: bool = False
    """Health-check the engines while rollouts run; replace a dead or hung engine and re-send its requests."""
    ci_fault_tolerance: bool = False
    """Same as --use-fault-tolerance (the name some CI scripts use)."""
    rollout_health_check_interval: float = 30.0
    """Seconds between two health checks of the engines (a one-token /health_generate each)."""
    rollout_health_check_timeout: float = 30.0
    """Seconds an engine may take to answer a health check before it is declared dead and replaced."""
    rollout_health_check_first_wait: float = 0.0
    """Seconds to wait after a rollout starts before the first health check."""
    fault_injection: str | None = option(metavar="SPEC")
    """Test switch: engine=I,rollout=K,mode=kill|hang breaks engine I once during rollout K."""
    engine_start_timeout: float = 600.0
    """Seconds an engine may take to start (load weights, capture CUDA graphs) before the run fails."""
    rollout_timeout: float = 3600.0
    """Seconds one rollout or eval may take before the run fails with the stacks of the stuck processes."""
    train_timeout: float = 3600.0
    """Seconds one trainer call (start, init, train, save) may take before the run fails with the ranks' stacks."""
    update_weights_timeout: float = 600.0
    """Seconds one weight sync (and control calls such as memory release) may take before the run fails."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("rollout_health_check_interval", "rollout_health_check_timeout", "engine_start_timeout",
                     "rollout_timeout", "train_timeout", "update_weights_timeout"):  # fmt: skip
            above(self, name, 0.0)
        at_least(self, "rollout_health_check_first_wait", 0.0)
        if self.fault_injection is not None and not _SPEC.match(self.fault_injection):
            raise ConfigError(
                f"--fault-injection must look like engine=0,rollout=2,mode=kill (or mode=hang), "
                f"got {self.fault_injection!r}"
            )

    @property
    def fault_tolerant(self) -> bool:
        """--use-fault-tolerance or its alias --ci-fault-tolerance."""
        return self.use_fault_tolerance or self.ci_fault_tolerance


@dataclass(kw_only=True, frozen=True)
class FaultSpec:
    """One injected fault: which engine breaks, during which rollout, and how."""

    engine: int
    """Index of the engine to break."""
    rollout: int
    """It breaks during the first rollout whose id is >= this."""
    mode: str
    """"kill" (the process exits) or "hang" (the server stops answering)."""

    @classmethod
    def parse(cls, spec: str) -> FaultSpec:
        match = _SPEC.match(spec)
        if match is None:
            raise ConfigError(f"--fault-injection: bad SPEC {spec!r}")
        return cls(engine=int(match[1]), rollout=int(match[2]), mode=match[3])
