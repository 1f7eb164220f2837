"""Each blocking call of the driver to a trainer rank or an engine, made stuck once with a stall point
(clawrl/stall_points.py), fails the run within its deadline, with the stuck process's stack printed and the
wait named on the last line. Real `clawrl train` subprocesses on CPU (the rollout manager's points are in
test_deadlines.py)."""

import pytest
from deadline_runs import STALLS, build_assets, check_stall, ray_head

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    with ray_head() as address:  # every run joins it: one Ray start-up per module, not per run
        yield {**build_assets(tmp_path_factory.mktemp("stall_points")), "ray_address": address}


@pytest.mark.parametrize("point", [point for point in STALLS if not point.startswith("rollout.")])
def test_each_blocking_call_fails_within_its_deadline_with_the_stuck_process_stack(assets, tmp_path, point):
    check_stall(assets, tmp_path, point)
