"""clawrl's configuration: one dataclass per component, the flag table assembled from them, validation.

    from clawrl.config import parse_job_args
    job = parse_job_args(["--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--num-rollout", "10"])
    job.rollout.rollout_batch_size       # 8
    job.train.global_batch_size          # 32 (derived by validate)
    args = job.to_namespace()            # slime-style flat namespace for user plugins

Flag names and meanings are slime's; `clawrl train --help` lists them by component.
"""

from clawrl.config.errors import ConfigError
from clawrl.config.flags import add_job_arguments, build_job_parser, job_from_namespace, parse_job_args
from clawrl.config.job import JobConfig
from clawrl.config.validate import validate

__all__ = [
    "ConfigError",
    "JobConfig",
    "add_job_arguments",
    "build_job_parser",
    "job_from_namespace",
    "parse_job_args",
    "validate",
]
