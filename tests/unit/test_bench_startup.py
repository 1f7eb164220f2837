"""bench/startup.py's reading of a run's start-up lines (the format Run.start prints, and the older one without
"at") and its median table. bench/ is not a package, so the script is loaded from its file. Nothing is timed.
"""

from __future__ import annotations

import pytest
from bench_scripts import load_bench, unload_bench

STDERR = """\
clawrl: no GPU found: 1 trainer process and 1 engine on CPU (set --actor-num-gpus-per-node / ...)
clawrl: Ray ready (4.0 s, at 4.0 s)
clawrl: 1 engine(s) ready (7.5 s, at 11.5 s)
clawrl: rollout manager ready (7.3 s, at 11.5 s)
clawrl: trainer ready: 2 rank(s), model and optimizer built (7.6 s, at 11.6 s)
clawrl: weights synced to the engines (0.4 s, at 12.0 s)
clawrl: start-up done in 12.0 s
[rollout 1/1] reward 0.000 (not a start-up line (0.5 s))
"""


@pytest.fixture(scope="module")
def bench():
    yield load_bench("startup")
    unload_bench("startup")


def test_reads_each_phase_its_seconds_and_when_it_was_ready(bench):
    found = bench.parse_startup(STDERR)
    assert found == {
        "Ray ready": 4.0, "Ray ready @": 4.0,
        "1 engine(s) ready": 7.5, "1 engine(s) ready @": 11.5,
        "rollout manager ready": 7.3, "rollout manager ready @": 11.5,
        "trainer ready": 7.6, "trainer ready @": 11.6,
        "weights synced to the engines": 0.4, "weights synced to the engines @": 12.0,
        "start-up total": 12.0,
    }  # fmt: skip


def test_reads_the_older_lines_without_the_time_since_start(bench):
    old = "clawrl: Ray ready (4.5 s)\nclawrl: 1 engine(s) ready (10.5 s)\nclawrl: start-up done in 21.5 s\n"
    assert bench.parse_startup(old) == {"Ray ready": 4.5, "1 engine(s) ready": 10.5, "start-up total": 21.5}


def test_a_run_without_the_total_line_is_an_error(bench):
    with pytest.raises(RuntimeError, match="no 'start-up done in' line"):
        bench.parse_startup("clawrl: Ray ready (4.0 s, at 4.0 s)\n")


def test_table_holds_the_median_of_each_number_per_source(bench):
    runs = {"before": [{"start-up total": t, "Ray ready": 4.0} for t in (21.5, 19.8, 22.9)],
            "after": [{"start-up total": t} for t in (11.6, 12.6, 12.0)]}  # fmt: skip
    lines = bench.table(runs).splitlines()
    assert lines[0] == "| number (s) | before | after |"
    assert "| start-up total | 21.5 | 12.0 |" in lines
    assert "| Ray ready | 4.0 | n/a |" in lines  # a number one source did not print
