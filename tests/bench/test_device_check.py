"""bench/device_check.sh: one call of the device tool must fit its 10-minute limit and the 15-minute session, and
no stage may spend that time hanging: each fails fast, with one clear line, and the run goes on or stops.

The behaviour tests run the script with a fake ``python3`` first on PATH (no torch is imported, nothing is built),
so they take seconds; bench/simulate_gpu_image.sh dry-runs it for real in a copy of the GPU image's versions."""

import os
import re
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_check.sh"
SIMULATION = ROOT / "bench" / "simulate_gpu_image.sh"
STAGES = (  # the stages of the default mode after the build, in order
    "tests",
    "sync-debug train, eager",
    "sync-debug train, compiled",
    "benchmarks, eager",
    "benchmarks, torch.compile",
    "benchmarks, eager, the rest",
)


def test_the_scripts_parse():
    for script in (SCRIPT, SIMULATION):
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_one_deadline_inside_one_call():
    text = SCRIPT.read_text()
    deadlines = [int(seconds) for seconds in re.findall(r"deadline_default=(\d+)", text)]
    assert deadlines and max(deadlines) <= 570  # a run(timeout_s=600) call, with room to pack and copy $OUT back
    # every stage runs through `stage`, which asks the shared deadline for its time: none can overrun it by its
    # own limit; the one check outside a stage asks it too
    limits = [int(limit) for limit in re.findall(r'stage "[^"]+" "?(\d+)"?', text)]
    assert limits and all(0 < limit <= 600 for limit in limits)
    assert 'timeout -s INT -k 10 "$seconds"' in text
    assert text.count("timeout ") >= 3  # the stages, the build check, the preflight's nvidia-smi and nvcc
    assert "steps)" not in text  # no second call planned


def test_the_benchmark_cases_it_runs_exist():
    import sys

    if str(ROOT) not in sys.path:  # `bench` is a folder of the checkout, not an installed package
        sys.path.insert(0, str(ROOT))
    from bench.run import parse_cases

    listed = re.findall(r"--cases ([\w,]+)", SCRIPT.read_text())
    assert listed
    for cases in listed:
        assert parse_cases(cases) == cases.split(",")  # each a known case, once
    # the default mode's eager stage: the judged train step and host cost first, then the kernels under each
    # setting, before the cases that earlier GPU runs measured already
    assert listed[0].split(",")[:3] == ["train_step", "host_cost", "kernels"]


def test_the_gpu_tests_it_runs_exist():
    text = SCRIPT.read_text()
    for path in re.findall(r"tests/[\w/]+(?:\.py)?", text):  # files and folders
        assert (ROOT / path).exists(), path
    for path in re.findall(r"bench/\w+\.(?:py|sh)", text):
        assert (ROOT / path).exists(), path


def _fake_python(tmp_path: Path, body: str) -> dict[str, str]:
    """An environment whose ``python3`` is a bash script with ``body``; $OUT and TMPDIR under tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text("#!/usr/bin/env bash\n" + body + "\n")
    fake.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "OUT": str(tmp_path / "out"),
        "TMPDIR": str(tmp_path / "tmp"),
        "CUDA_VISIBLE_DEVICES": "",
    }


def _run(env: dict[str, str], *args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    result = subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    return result, time.perf_counter() - start


def _summary(env: dict[str, str]) -> list[str]:
    return (Path(env["OUT"]) / "summary.txt").read_text().splitlines()


NO_GPU = 'echo "fake python3: no CUDA GPU visible to torch" >&2; exit 1'


def test_without_a_gpu_it_stops_at_the_preflight(tmp_path):
    env = _fake_python(tmp_path, NO_GPU)
    result, seconds = _run(env)
    assert result.returncode == 3, result.stdout + result.stderr
    assert seconds < 20
    summary = _summary(env)
    assert summary[0].startswith("preflight: FAILED (exit 1)") and "no CUDA GPU visible" in summary[0]
    assert not any(line.startswith("build") for line in summary)  # nothing built, nothing else spent
    with tarfile.open(Path(env["OUT"]) / "logs.tar.gz") as logs:
        assert "./preflight.log" in logs.getnames()


def test_a_dry_run_goes_through_every_stage_and_each_fails_fast(tmp_path):
    # the build and the import pass; every later stage fails at once with the fake's clear line
    env = _fake_python(
        tmp_path, f'case "$*" in *"-m pip install"*|*"mjp_fast._C as C"*) echo built; exit 0;; esac; {NO_GPU}'
    )
    result, seconds = _run(env, "dry-run")
    assert result.returncode == 1, result.stdout + result.stderr
    assert seconds < 30
    summary = _summary(env)
    assert any(line.startswith("preflight: DRY RUN, going on without a GPU") for line in summary)
    for name in STAGES:
        matches = [line for line in summary if line.startswith(f"{name}")]
        assert matches, (name, summary)
        assert "FAILED (exit 1)" in matches[0] and "no CUDA GPU visible" in matches[0], matches[0]
    assert summary[-1].startswith("device check (all, dry run): 7 failed stage(s), exit 1")
    assert len(list(Path(env["OUT"]).iterdir())) <= 8  # the device tool brings back 8 files at most


def test_the_perf_mode_runs_the_compile_checks_then_the_benchmarks(tmp_path):
    env = _fake_python(
        tmp_path, f'case "$*" in *"-m pip install"*|*"mjp_fast._C as C"*) echo built; exit 0;; esac; {NO_GPU}'
    )
    result, seconds = _run(env, "dry-run", "perf")
    assert result.returncode == 1, result.stdout + result.stderr
    assert seconds < 30
    stages = [line.split(":")[0] for line in _summary(env) if "FAILED (exit 1)" in line]
    assert stages == ["preflight", "compile checks", "benchmarks, eager", "benchmarks, torch.compile"], _summary(env)
    assert _summary(env)[-1].startswith("device check (perf, dry run): 4 failed stage(s), exit 1")


def test_a_hanging_stage_is_stopped_at_the_deadline(tmp_path):
    env = _fake_python(tmp_path, "sleep 100")
    # 8 s: a stage starts only with 5 s left, and the preflight's own commands before its stage (nvcc, nvidia-smi
    # where installed) took over a second on a loaded CI machine, which left a 5 s deadline under 5 s at once
    env.update(DEADLINE_S="8", DEVICE_CHECK_DRY_RUN="1")
    result, seconds = _run(env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert seconds < 25  # 8 s of preflight, then nothing: the build check, the build and the rest are not run
    summary = _summary(env)
    assert summary[0].startswith("preflight: TIMED OUT after")
    assert any(line.startswith("build: NOT RUN (the 8 s deadline is reached)") for line in summary)


def test_the_sweep_mode_runs_the_timm_sweep_alone_with_the_calls_time(tmp_path):
    # the default mode no longer sweeps (one model in its 60 s on the last two GPU runs); the sweep mode gives it
    # the deadline less a minute as the time after which it starts no model
    env = _fake_python(
        tmp_path,
        f'case "$*" in *"-m pip install"*|*"mjp_fast._C as C"*) echo built; exit 0;; esac; '
        f'echo "$*" >> "{tmp_path}/calls"; {NO_GPU}',
    )
    result, _ = _run(env, "dry-run", "sweep")
    assert result.returncode == 1, result.stdout + result.stderr
    stages = [line.split(":")[0] for line in _summary(env) if "FAILED (exit 1)" in line]
    assert stages == ["preflight", "timm sweep, triton on cuda"], _summary(env)
    sweep = [line for line in (tmp_path / "calls").read_text().splitlines() if "timm_coverage" in line]
    assert len(sweep) == 1 and 400 < int(sweep[0].split("--time-limit ")[1].split()[0]) < 540, sweep
    _run(env, "dry-run")
    calls = (tmp_path / "calls").read_text()
    assert calls.count("timm_coverage") == 1  # the default mode did not sweep


@pytest.mark.parametrize("mode", ["nonsense"])
def test_an_unknown_mode_is_refused(tmp_path, mode):
    env = _fake_python(tmp_path, NO_GPU)
    result, _ = _run(env, mode)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_the_loop_mode_runs_the_train_loop_benchmark_per_data_set(tmp_path):
    """``loop``: CIFAR-10 first, then the embedded digits, each its own call of bench_train_loop.py on cuda, with
    the data set's folder and timm's train.py passed on."""
    data = tmp_path / "cifar10"
    (data / "train").mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    env = _fake_python(
        tmp_path,
        f'case "$*" in *"-m pip install"*|*"mjp_fast._C as C"*) echo built; exit 0;; '
        f'*bench_train_loop.py*) echo "$TIMM_TRAIN_PY|$*" >> {calls}; {NO_GPU};; esac; {NO_GPU}',
    )
    env.update(MJP_REPRODUCE_DATA=str(data), TIMM_TRAIN_PY=str(tmp_path / "train.py"))
    result, seconds = _run(env, "dry-run", "loop")
    assert result.returncode == 1, result.stdout + result.stderr
    assert seconds < 30
    failed = [line.split(":")[0] for line in _summary(env) if "FAILED (exit 1)" in line]
    assert failed == ["preflight", "train loop benchmark, cifar10", "train loop benchmark, embedded"], _summary(env)
    lines = calls.read_text().splitlines()
    assert [line.split("--datasets ")[1].split()[0] for line in lines] == ["cifar10", "embedded"]
    carried = ROOT / "runs" / "device-data" / "timm-train.py"  # a carried copy wins over the variable
    for line in lines:
        train_py, arguments = line.split("|")
        assert train_py == str(carried if carried.is_file() else tmp_path / "train.py")
        assert "--device cuda" in arguments and f"--cifar10 {data}" in arguments and "--repeats 2" in arguments
    assert _summary(env)[-1].startswith("device check (loop, dry run): 3 failed stage(s), exit 1")
