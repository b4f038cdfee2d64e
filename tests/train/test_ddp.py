"""``compare=true`` under ``torchrun --nproc_per_node=2`` (gloo on the CPU): both runs share one process group.

The comparison used to destroy the process group after the baseline and build a new one for the MJP run; the new
group read the old one's addresses from torchrun's store, so the MJP run died (connection reset) or hung, one time
in two. The test runs the whole comparison several times in a row, each under a timeout, so that a hang fails it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The failure was intermittent (two of four tries failed): one passing run proves little.
REPEATS = 3
# One comparison takes 13-19 s on 2 CPU cores (measured 2026-11-27, alone and beside a busy core); a hang is
# anything far beyond that. In the whole suite the other xdist worker's tests share the cores: 10x the margin.
RUN_TIMEOUT_SECONDS = 180

# The digits preset (compare=true), made tiny: 4 steps per epoch on each rank, one block of width 16.
TINY_COMPARE = [
    "epochs=2",
    "warmup_epochs=1",
    "embed_dim=16",
    "depth=1",
    "num_heads=2",
    "batch_size=16",
    "max_train_samples=128",
    "max_val_samples=32",
    "eval_interval=1",
    "threads=1",
    "progress=off",
]


def _free_port() -> int:
    """A TCP port that nothing listens on now (the OS picks it), for torchrun's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_torchrun(arguments: list[str], folder: Path) -> tuple[int, str, str]:
    """Runs ``mjp train`` in two processes in ``folder``; kills the whole process tree when it outlives the timeout."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
        "-m", "mjp_fast.cli", "train", *arguments, *TINY_COMPARE,
    ]  # fmt: skip
    # Keep the workers to one thread each: two ranks on two cores must not oversubscribe them.
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A session of its own, so a hang is ended for torchrun and both workers alike, not only for torchrun.
    process = subprocess.Popen(
        command,
        cwd=folder,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=RUN_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own: killing torchrun's group leaves them (and their
        # loader processes) alive, holding the pipes open, and communicate() would wait for them for ever.
        for pid in [process.pid, *_descendants(process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=30)
        pytest.fail(f"torchrun hung: no exit after {RUN_TIMEOUT_SECONDS} s\n{stderr[-3000:]}")
    return process.returncode, stdout, stderr


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), from /proc, whatever session or group they are in."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the field after the state
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


@pytest.mark.slow
@pytest.mark.timeout(REPEATS * RUN_TIMEOUT_SECONDS + 60)
def test_compare_under_torchrun_finishes_both_runs_every_time(tmp_path):
    for attempt in range(REPEATS):
        folder = tmp_path / f"attempt{attempt}"
        folder.mkdir()
        # The last attempt leaves the folder to the default, runs/digits-<date>-<time>, which each rank would
        # otherwise read from its own clock.
        arguments = ["--output", "ddp"] if attempt < REPEATS - 1 else []
        started = time.perf_counter()
        status, stdout, stderr = _run_torchrun(arguments, folder)
        seconds = time.perf_counter() - started
        assert status == 0, (
            f"attempt {attempt + 1} of {REPEATS} exited {status} after {seconds:.0f} s:\n{stderr[-3000:]}"
        )
        # rank 0 alone prints, once per run
        assert stdout.count("== baseline ==") == 1 and stdout.count("== mjp ==") == 1, stdout
        assert "| | baseline | mjp |" in stdout
        outputs = [folder / "ddp"] if arguments else sorted((folder / "runs").iterdir())
        assert len(outputs) == 1 and outputs[0].is_dir(), outputs  # the ranks agreed on one folder
        output = outputs[0]
        summary = json.loads((output / "summary.json").read_text())
        assert set(summary) == {"baseline", "mjp"}
        for name in ("baseline", "mjp"):
            assert (output / name / "last.pt").is_file(), name
            records = (output / name / "metrics.jsonl").read_text().splitlines()
            assert [json.loads(line)["epoch"] for line in records] == [1, 2], name
            assert summary[name]["top1"] is not None


def test_descendants_finds_processes_in_sessions_of_their_own(tmp_path):
    # what the hang handling above kills: a grandchild in a new session, as torchrun starts its workers
    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
        "time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not _descendants(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        found = _descendants(parent.pid)
        assert len(found) == 1 and os.getsid(found[0]) != os.getsid(parent.pid)
    finally:
        for pid in [parent.pid, *_descendants(parent.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait(timeout=30)
