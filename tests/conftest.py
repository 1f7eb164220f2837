"""Shared pytest setup: GPU tests are skipped where CUDA is absent; Ray runs without token auth; the
`one_torch_thread` fixture (module scope) for files of tiny models."""

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for the module's tests: tiny matmuls gain nothing from a second thread on a shared
    2-core machine, and a second OpenMP thread competing with another process makes every op far slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_running(request):
    """Each test module starts without a Ray instance in this process. `start_ray` joins a Ray that is
    already initialised, so one a module left running would carry its actors' environment (and its
    resources) into the next module of the same xdist worker. A leftover is shut down and reported."""
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        import warnings

        warnings.warn(f"{request.module.__name__} left Ray running; shut down after the module", stacklevel=1)
