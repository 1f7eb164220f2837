"""Unit tests of clawrl/ci/gpu_lock_exec.py in one process: option checks, GPU detection, all-or-nothing
attempts, holder records. Real flock locks on files under tmp_path (two open() calls of one file conflict
even inside one process). The multi-process behaviour is in tests/integration/test_gpu_lock_exec_processes.py.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

from clawrl.ci import gpu_lock_exec as gle
from clawrl.cli import main as cli_main


def make_request(tmp_path, **overrides) -> gle.LockRequest:
    fields = dict(
        count=None,
        devices=None,
        total_gpus=4,
        lock_path_pattern=str(tmp_path / "locks" / "gpu_{gpu_id}.lock"),
        timeout_s=0.0,
        max_backoff_s=0.01,
    )
    fields.update(overrides)
    return gle.LockRequest(**fields)


def hold(request: gle.LockRequest, gpu_id: int) -> int:
    """Lock one GPU through a separate open file, as another job would."""
    fd = gle.try_lock(request.lock_path(gpu_id))
    assert fd is not None
    return fd


def base_argv(tmp_path) -> list[str]:
    return [
        "--total-gpus",
        "4",
        "--lock-path-pattern",
        str(tmp_path / "gpu_{gpu_id}.lock"),
        "--max-backoff",
        "0.01",
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "exactly one of --count or --devices is required, got neither"),
        (["--count", "1", "--devices", "0"], "got both --count 1 and --devices 0"),
        (["--devices", "0,0"], "--devices lists a GPU twice: '0,0'"),
        (["--devices", "0,a"], "--devices must be comma-separated GPU ids like 0,1, got '0,a'"),
        (["--devices", "1,4"], "--devices 1,4 names GPU 4, but --total-gpus is 4 (ids 0..3)"),
        (["--count", "5"], "--count must be between 0 and --total-gpus (4), got 5"),
        (["--count", "1", "--timeout", "-1"], "--timeout must be >= 0, got -1.0"),
    ],
)
def test_bad_options_exit_2_with_one_clear_message_and_run_nothing(tmp_path, capsys, extra, message):
    marker = tmp_path / "ran"
    with pytest.raises(SystemExit) as exited:
        gle.main(base_argv(tmp_path) + extra + ["--", "touch", str(marker)])
    assert exited.value.code == gle.EXIT_USAGE == 2
    assert message in capsys.readouterr().err
    assert not marker.exists()


def test_lock_path_pattern_error_names_gpu_id_placeholder(tmp_path, capsys):
    for pattern in ["/tmp/gpu.lock", "/tmp/gpu_{i}.lock"]:
        with pytest.raises(SystemExit) as exited:
            gle.main(["--count", "1", "--total-gpus", "4", "--lock-path-pattern", pattern, "--", "true"])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "{gpu_id}" in err and pattern in err


def test_missing_command_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        gle.main(base_argv(tmp_path) + ["--count", "1", "--"])
    assert exited.value.code == 2
    assert "no command given" in capsys.readouterr().err


def write_fake_nvidia_smi(bin_dir, body: str) -> None:
    """A stand-in for the NVIDIA driver's tool, which cannot run on this CPU-only machine."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)


def test_total_gpus_detected_from_nvidia_smi_listing(tmp_path, monkeypatch):
    listing = "GPU 0: NVIDIA H200 (UUID: GPU-a)\\n  MIG 1g.18gb Device 0: (UUID: MIG-x)\\nGPU 1: NVIDIA H200 (UUID: GPU-b)\\nGPU 2: NVIDIA H200 (UUID: GPU-c)"
    write_fake_nvidia_smi(tmp_path / "bin", f'printf "{listing}\\n"')
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gle.detect_total_gpus() == 3  # MIG lines are not GPUs; nvidia-smi wins over the environment


def no_gpu_machine(tmp_path, monkeypatch) -> None:
    """This CPU machine as gpu-lock-exec sees it: no nvidia-smi on PATH, no visible-devices variable."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)


def test_total_gpus_falls_back_to_cuda_then_nvidia_visible_devices(tmp_path, monkeypatch):
    no_gpu_machine(tmp_path, monkeypatch)
    write_fake_nvidia_smi(tmp_path / "bin", 'echo "NVIDIA-SMI has failed" >&2; exit 9')
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5, 6")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "0,1")
    assert gle.detect_total_gpus() == 3
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gle.detect_total_gpus() == 2


@pytest.mark.parametrize(
    ("value", "count"),
    [
        ("0,1,2", 3),
        ("GPU-aa,GPU-bb", 2),
        ("2,-1,3", 1),
        ("-1", 0),
        ("", 0),
        ("none", 0),
        ("void", 0),
        ("all", 0),
    ],
)
def test_visible_device_count(monkeypatch, value, count):
    """CUDA ignores ids from the first negative one on; 'all' says nothing about how many GPUs there are."""
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", value)
    assert gle.visible_device_count("NVIDIA_VISIBLE_DEVICES") == count


@pytest.mark.parametrize("nvidia_smi", [None, 'echo "NVIDIA-SMI has failed" >&2; exit 9', "true"])
def test_no_gpu_found_is_one_line_naming_total_gpus_and_runs_nothing(
    tmp_path, monkeypatch, capsys, nvidia_smi
):
    no_gpu_machine(tmp_path, monkeypatch)
    if nvidia_smi is not None:
        write_fake_nvidia_smi(tmp_path / "bin", nvidia_smi)
        monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    marker = tmp_path / "ran"
    pattern = str(tmp_path / "gpu_{gpu_id}.lock")
    command = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    with pytest.raises(SystemExit) as exited:
        gle.main(["--count", "1", "--lock-path-pattern", pattern, *command], prog="clawrl gpu-lock-exec")
    assert exited.value.code == 2
    said = {None: "nvidia-smi not found", "true": "nvidia-smi -L lists none"}.get(
        nvidia_smi, "nvidia-smi -L exited 9"
    )
    assert capsys.readouterr().err == (
        f"clawrl gpu-lock-exec: error: no GPU found on this machine ({said}; CUDA_VISIBLE_DEVICES and "
        "NVIDIA_VISIBLE_DEVICES name none): pass --total-gpus N to lock GPU ids 0..N-1 anyway\n"
    )
    assert not marker.exists() and not list(tmp_path.glob("gpu_*.lock"))  # nothing locked or run
    # --total-gpus says how many GPU ids to lock where none can be detected: the command runs.
    assert gle.main(["--total-gpus", "2", "--count", "2", "--lock-path-pattern", pattern, *command]) == 0
    assert marker.exists() and "Acquired GPUs: 0,1" in capsys.readouterr().out


def test_fake_nvidia_smi_listing_four_gpus_gives_four(tmp_path, monkeypatch, capsys):
    no_gpu_machine(tmp_path, monkeypatch)
    listing = "\\n".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i})" for i in range(4))
    write_fake_nvidia_smi(tmp_path / "bin", f'printf "{listing}\\n"')
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert gle.detect_total_gpus() == 4
    assert gle.main(["--print-only", "--lock-path-pattern", str(tmp_path / "gpu_{gpu_id}.lock")]) == 0
    assert capsys.readouterr().out == "Free GPUs: 0,1,2,3\n"


def test_detected_total_bounds_devices(tmp_path, monkeypatch, capsys):
    write_fake_nvidia_smi(tmp_path / "bin", 'printf "GPU 0: A\\nGPU 1: B\\n"')
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    pattern = str(tmp_path / "gpu_{gpu_id}.lock")
    with pytest.raises(SystemExit):
        gle.main(["--devices", "2", "--lock-path-pattern", pattern, "--", "true"])
    assert "names GPU 2, but --total-gpus is 2" in capsys.readouterr().err


def test_devices_attempt_is_all_or_nothing(tmp_path):
    request = make_request(tmp_path, devices=[3, 0, 1])
    busy_fd = hold(request, 1)
    assert gle.try_acquire(request) is None
    # GPU 0 was locked first (ascending order) and must have been given back when GPU 1 was busy.
    assert gle.probe(request, [0, 1, 2, 3]) == ([0, 2, 3], [1])
    os.close(busy_fd)
    held = gle.try_acquire(request)
    assert sorted(held) == [0, 1, 3]
    assert gle.probe(request, [0, 1, 2, 3]) == ([2], [0, 1, 3])
    gle.release(held)
    assert held == {} and gle.probe(request, [0, 1, 2, 3]) == ([0, 1, 2, 3], [])


def test_count_attempt_takes_lowest_free_ids_or_nothing(tmp_path):
    busy_fd = hold(make_request(tmp_path), 1)
    held = gle.try_acquire(make_request(tmp_path, count=2))
    assert sorted(held) == [0, 2]
    gle.release(held)
    assert gle.try_acquire(make_request(tmp_path, count=4)) is None
    assert gle.probe(make_request(tmp_path), [0, 1, 2, 3]) == ([0, 2, 3], [1])
    assert gle.try_acquire(make_request(tmp_path, count=0)) == {}
    os.close(busy_fd)


def test_holder_record_replaces_stale_content_and_reads_back(tmp_path):
    request = make_request(tmp_path, devices=[2])
    path = request.lock_path(2)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as stale:
        stale.write(json.dumps({"pid": 1, "command": ["old"], "padding": "x" * 500}))
    held = gle.try_acquire(request)
    assert os.path.getsize(path) == 0  # acquiring drops the previous holder's record
    record = gle.holder_record(["python", "train.py", "--lr", "1e-6"], "supervise", [2])
    gle.write_holder(held, record)
    assert gle.read_holder(path) == record
    assert record["pid"] == os.getpid() and record["gpus"] == [2] and record["host"]
    line = gle.describe_holder(request, 2)
    assert line.startswith(f"GPU 2: busy, held by pid {os.getpid()} on host ")
    assert line.endswith(": python train.py --lr 1e-6")
    gle.release(held)


def test_print_only_lists_free_gpus_and_holders(tmp_path, capsys):
    request = make_request(tmp_path)
    held = gle.try_acquire(make_request(tmp_path, devices=[1]))
    gle.write_holder(held, {**gle.holder_record(["sleep", "9"], "supervise", [1]), "command_pid": 4242})
    unknown_fd = hold(request, 3)  # a lock whose holder wrote no record
    assert (
        gle.main(base_argv(tmp_path)[:2] + ["--lock-path-pattern", request.lock_path_pattern, "--print-only"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Free GPUs: 0,2"
    assert lines[1].startswith(f"GPU 1: busy, held by pid {os.getpid()}, command pid 4242 on host ")
    assert lines[2].startswith("GPU 3: busy, holder unknown")
    assert len(lines) == 3
    gle.release(held)
    os.close(unknown_fd)


def test_acquire_times_out_naming_busy_gpus_and_holder(tmp_path):
    request = make_request(tmp_path, count=2, total_gpus=2, timeout_s=0.3)
    held = gle.try_acquire(make_request(tmp_path, devices=[0]))
    gle.write_holder(held, gle.holder_record(["sleep", "9"], "exec", [0]))
    start = time.monotonic()
    with pytest.raises(gle.AcquireTimeout) as timed_out:
        gle.acquire(request)
    assert 0.3 <= time.monotonic() - start < 3.0
    message = str(timed_out.value)
    assert "timed out after 0.3 s waiting for --count 2 of 2 GPUs; free: 1" in message
    assert f"GPU 0: busy, held by pid {os.getpid()}" in message
    assert gle.probe(request, [0, 1]) == ([1], [0])  # the waiter gave GPU 1 back
    gle.release(held)


def test_acquire_retries_until_the_holder_leaves(tmp_path):
    request = make_request(tmp_path, devices=[0, 1], timeout_s=10.0)
    busy_fd = hold(request, 1)
    start = time.monotonic()  # before the timer starts: the timer thread may run first on a busy machine
    threading.Timer(0.3, os.close, args=(busy_fd,)).start()  # the other job ends after 0.3 s
    held = gle.acquire(request)
    assert 0.3 <= time.monotonic() - start < 5.0
    assert sorted(held) == [0, 1]
    gle.release(held)


def test_clawrl_cli_registers_gpu_lock_exec_and_passes_raw_arguments(tmp_path, capsys):
    assert cli_main.COMMANDS["gpu-lock-exec"] == "gpu_lock_exec"
    assert "gpu-lock-exec" in cli_main.build_parser().format_help()
    assert cli_main.main(["gpu-lock-exec", *base_argv(tmp_path), "--print-only"]) == 0
    assert capsys.readouterr().out == "Free GPUs: 0,1,2,3\n"
    with pytest.raises(SystemExit):
        cli_main.main(["gpu-lock-exec", *base_argv(tmp_path), "--", "true"])
    assert capsys.readouterr().err == (
        "clawrl gpu-lock-exec: error: exactly one of --count or --devices is required, got neither\n"
    )
