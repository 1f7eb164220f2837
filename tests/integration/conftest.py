"""Fixtures of the integration tests that run `clawrl train` in the test process."""

import pytest


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray instance for the module's in-process runs (each run creates and ends its own actors)."""
    import ray

    from clawrl.cluster.ray_cluster import start_ray

    start_ray(num_cpus=2)
    yield
    ray.shutdown()
