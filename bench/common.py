"""Timing, machine description and result files shared by the benchmarks.

Measurement: every callable is warmed up, then timed in interleaved rounds (A B C, C B A, A B C, ...), so slow
drifts of the machine (frequency, other processes) spread over all of them alike. A sample times a loop of
``number`` calls, with ``number`` chosen in the warm-up so one sample lasts at least ``min_sample_s``; it reports
the time per call. We keep the median and the 20th/80th percentiles, and ratios against a baseline measured in
the same run: never against a number recorded earlier.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from mjp_fast._atomic import write_atomically

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one callable: median and spread over the samples."""

    median_s: float
    p20_s: float
    p80_s: float
    min_s: float
    samples: int
    calls_per_sample: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_samples(cls, samples: Sequence[float], calls_per_sample: int) -> Timing:
        """The timing of ``samples`` (seconds per call each, at least one): their median, 20th and 80th percentiles
        and minimum."""
        array = np.asarray(samples, dtype=np.float64)
        return cls(
            median_s=float(np.median(array)),
            p20_s=float(np.percentile(array, 20)),
            p80_s=float(np.percentile(array, 80)),
            min_s=float(array.min()),
            samples=len(array),
            calls_per_sample=calls_per_sample,
        )


class PartialResults(KeyboardInterrupt):
    """The interrupt of a case stopped midway (a lent GPU's deadline sends SIGINT), carrying the section of what it
    measured before it: ``bench.run`` records that section (``"cut_short": True``) before the run stops. A
    KeyboardInterrupt still, so every other handler treats it as the interrupt it is."""

    def __init__(self, section: dict) -> None:
        super().__init__()
        self.section = section


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """A function that waits for the device's queued work: a no-op on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _time_loop(function: Callable[[], object], number: int, device: torch.device) -> float:
    """Seconds per call of ``number`` back-to-back calls, by the wall clock.

    On a GPU the device is synchronized before and after the loop, so the time covers the queued kernels as well
    as the host's work and the launches: a training step pays all three, and the Python baseline runs on the host
    only, which CUDA events alone would not see.
    """
    synchronize = synchronizer(device)
    synchronize()
    begin = time.perf_counter()
    for _ in range(number):
        function()
    synchronize()
    return (time.perf_counter() - begin) / number


def measure(
    functions: dict[str, Callable[[], object]],
    *,
    repeats: int = 10,
    warmup: int = 2,
    min_sample_s: float = 0.05,
    max_calls_per_sample: int = 10_000,
    max_seconds_each: float | None = None,
    device: torch.device | str = "cpu",
    errors: dict[str, str] | None = None,
) -> dict[str, Timing]:
    """Times several callables against each other, interleaved.

    Args:
        functions: name -> callable taking no argument; the first is conventionally the baseline.
        repeats: samples per callable.
        warmup: untimed calls of each callable first (at least one, which also sizes the loop).
        min_sample_s: each sample loops over enough calls to last about this long (0: one call per sample).
        max_calls_per_sample: the loop's upper bound.
        max_seconds_each: a time budget per callable: one whose samples are slow gets fewer of them (at least
            3, or ``repeats`` if smaller), so a slow oracle does not hold up the run.
        device: where the callables run; on a GPU every sample synchronizes it before and after.
        errors: if given, a callable that raises in its first call is left out and its error recorded here
            (name -> ``"TypeName: message"``), so one broken backend does not stop the others' measurement.

    Returns:
        name -> :class:`Timing` in seconds per call.
    """
    device = torch.device(device)
    repeats = max(1, int(repeats))
    numbers, wanted = {}, {}
    functions = dict(functions)
    for name, function in list(functions.items()):
        if errors is not None:
            try:
                function()
            except Exception as error:  # recorded in the results, reported beside the table
                errors[name] = f"{type(error).__name__}: {error}"
                del functions[name]
                continue
        for _ in range(max(0, warmup - 1 - (errors is not None))):
            function()
        single = _time_loop(function, 1, device)
        calls = int(min_sample_s / single) if single > 0 else max_calls_per_sample
        numbers[name] = max(1, min(max_calls_per_sample, calls))
        wanted[name] = repeats
        if max_seconds_each is not None:
            affordable = int(max_seconds_each / max(single * numbers[name], 1e-9))
            wanted[name] = max(min(3, repeats), min(repeats, affordable))

    if not functions:
        return {}
    samples: dict[str, list[float]] = {name: [] for name in functions}
    order = list(functions)
    for round_index in range(max(wanted.values())):
        for name in order if round_index % 2 == 0 else reversed(order):
            if len(samples[name]) < wanted[name]:
                samples[name].append(_time_loop(functions[name], numbers[name], device))

    return {name: Timing.from_samples(values, numbers[name]) for name, values in samples.items()}


def cpu_model() -> str:
    """The CPU's model name, as the OS reports it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _git_dirty() -> bool | None:
    """Whether the checkout has uncommitted changes (so the commit alone does not say what ran)."""
    try:
        result = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(result.stdout.strip()) if result.returncode == 0 else None


def _git_commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def device_info(device: torch.device | str) -> dict:
    """What the numbers were measured on: machine, device, versions and which backends were available."""
    import mjp_fast
    from mjp_fast import backend as backend_module

    device = torch.device(device)
    info = {
        "device": device.type,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "mjp_fast": mjp_fast.__version__,
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "backends": mjp_fast.available_backends(),
        "extension_loaded": backend_module.extension() is not None,
        "gpu": None,
        "cuda": None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def device_label(info: dict) -> str:
    """A short file-name-safe name of the device: ``cpu-amd-epyc`` or ``nvidia-h100-80gb-hbm3``."""
    if info.get("gpu"):
        return _slug(info["gpu"])
    return "cpu-" + _slug(info["cpu"])


def smoke_results_dir() -> Path:
    """Where smoke runs write by default: a folder in the system's temporary directory, one per user.

    Smoke numbers mean nothing, so they stay out of the checkout's ``bench/results`` (the recorded results).
    """
    user = str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return Path(tempfile.gettempdir()) / f"mjp_fast-bench-smoke-{user}"


def results_dir(out: Path | str | None, *, smoke: bool) -> Path:
    """The folder of a run's JSON file: ``out`` when given, else ``bench/results`` (the smoke folder for smoke)."""
    if out is not None:
        return Path(out)
    return smoke_results_dir() if smoke else RESULTS_DIR


def out_help() -> str:
    """The help of ``--out``: both defaults, spelled out for this machine."""
    return f"directory of the JSON results (default: {RESULTS_DIR}; with --smoke: {smoke_results_dir()})"


def write_results(payload: dict, name: str, out_dir: Path | str = RESULTS_DIR, *, date: str | None = None) -> Path:
    """Writes ``payload`` as JSON to ``out_dir/<device>-<YYYY-MM-DD>-<name>.json`` atomically; returns the path.

    An empty ``name`` gives ``<device>-<YYYY-MM-DD>.json``: the whole suite's file (``bench/run.py``).
    """
    out_dir = Path(out_dir)
    date = date or datetime.date.today().isoformat()
    path = out_dir / (f"{device_label(payload['device'])}-{date}" + (f"-{name}" if name else "") + ".json")
    with write_atomically(path, text=True) as stream:
        json.dump(payload, stream, indent=2, sort_keys=False)
        stream.write("\n")
    return path


def result_name(name: str, *, smoke: bool = False, threads: int | None = None) -> str:
    """The benchmark's name in its result file: ``sampler``, ``sampler-threads1``, ``sampler-smoke``."""
    return name + (f"-threads{threads}" if threads else "") + ("-smoke" if smoke else "")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; numbers right-aligned."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(headers[i]), *(len(row[i]) for row in cells)) for i in range(len(headers))]
    numeric = [all(_looks_numeric(row[i]) for row in cells) and bool(cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"]
    lines.append(
        "|"
        + "|".join(("-" * (w + 1) + ":") if n else ("-" * (w + 2)) for w, n in zip(widths, numeric, strict=True))
        + "|"
    )
    for row in cells:
        padded = [cell.rjust(w) if n else cell.ljust(w) for cell, w, n in zip(row, widths, numeric, strict=True)]
        lines.append("| " + " | ".join(padded) + " |")
    return "\n".join(lines)


def _looks_numeric(text: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[0-9.,/e+-]+( ?(x|s|ms|us|ns|%))?( \[.*\])?", text))


def format_seconds(seconds: float) -> str:
    """``1.23 ms``, ``45.6 us``: three significant digits in a unit that keeps the number readable."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def format_timing(timing: Timing, scale: float = 1.0) -> str:
    """``median [p20, p80]``, each divided by ``scale`` (e.g. the batch size for a per-item time)."""
    return (
        f"{format_seconds(timing.median_s / scale)} "
        f"[{format_seconds(timing.p20_s / scale)}, {format_seconds(timing.p80_s / scale)}]"
    )


def aim_verdict(measured: float | None, threshold: float, *, higher_is_better: bool) -> str:
    """``PASS``/``FAIL`` against ``threshold``, or ``NOT RUN`` when there is nothing measured."""
    if measured is None:
        return "NOT RUN"
    passed = measured >= threshold if higher_is_better else measured <= threshold
    return "PASS" if passed else "FAIL"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


GPU_BACKENDS = ("triton", "cuda")


def compared_backends(device: torch.device | str) -> list[str]:
    """The backends a model-level benchmark runs its MJP models on: the automatic choice first, then, on a GPU,
    every other GPU backend built here (``cuda`` beside ``triton``), so that one run on a lent GPU says which one
    a training step should use. On the CPU the automatic choice alone (the interpreter is for tests)."""
    from mjp_fast.backend import available_backends, resolve_backend

    device = torch.device(device)
    chosen = resolve_backend(None, device)
    if device.type != "cuda":
        return [chosen]
    return [chosen] + [name for name in available_backends() if name in GPU_BACKENDS and name != chosen]


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark script takes."""
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and 1-2 repeats: checks that it runs")
    parser.add_argument("--out", default=None, help=out_help())
    parser.add_argument("--repeats", type=int, default=None, help="timed samples per callable")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads, also used by the compiled extension (default: torch's choice); named in the file",
    )


def machine_threads() -> int:
    """The CPU cores this process may run on (its affinity mask), for ``torch.set_num_threads``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def format_measured(value: float | None, unit: str) -> str:
    """An aim's measured value: ``1.04x`` for ratios, ``+0.31%`` for overheads, ``n/a`` when not measured."""
    if value is None:
        return "n/a"
    if unit == "%":
        return f"{value:+.2f}%"
    return f"{value:.2f}{unit}"


def aim_line(aim: dict) -> str:
    """``PASS: <aim>: <measured> (<note>)``, one printed line per aim."""
    measured = format_measured(aim["measured"], aim.get("unit", "x"))
    return f"{aim['verdict']}: {aim['aim']}: {measured}" + (f" ({aim['note']})" if aim.get("note") else "")


def where_measured(info: dict) -> str:
    """``cpu: AMD EPYC, 2 torch threads`` or ``cuda: NVIDIA H100 80GB HBM3``."""
    if info.get("gpu"):
        return f"cuda: {info['gpu']}"
    threads = info["torch_threads"]
    return f"cpu: {info['cpu']}, {threads} torch thread{'' if threads == 1 else 's'}"


def versions_line(info: dict) -> str:
    """The software a result was measured with, in one line."""
    parts = [f"torch {info['torch']}"]
    if info.get("cuda"):
        parts.append(f"CUDA {info['cuda']}")
    parts += [f"python {info['python']}", f"mjp_fast {info['mjp_fast']}"]
    if info.get("git_commit"):
        parts.append(f"commit {info['git_commit'][:10]}" + (" + uncommitted changes" if info.get("git_dirty") else ""))
    extension = "loaded" if info.get("extension_loaded") else "not loaded"
    parts.append(f"backends {', '.join(info.get('backends', []))} (mjp_fast._C {extension})")
    return "; ".join(parts)


@contextlib.contextmanager
def quiet_extension_warning() -> Iterator[None]:
    """Silences the package's one-time "compiled extension missing" warning: the reports name the backends."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="mjp_fast: the compiled extension", category=RuntimeWarning)
        yield


def run_standalone(
    name: str,
    description: str,
    collect: Callable[..., dict],
    report: Callable[[dict, dict], str],
    argv: Sequence[str] | None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """The ``main`` of one benchmark script: parse the options, measure, write the JSON, print the report.

    ``collect(smoke=, device=, repeats=, **extra)`` returns the case's section (``config``, ``backends``,
    ``results``, ``aims``), where ``extra`` holds the options that ``add_arguments`` added; ``report(section,
    device_info)`` returns its printed Markdown.
    """
    parser = argparse.ArgumentParser(description=description)
    add_common_arguments(parser)
    common = set(vars(parser.parse_args([])))
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    extra = {key: value for key, value in vars(args).items() if key not in common}
    device = args.device or default_device()
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible to torch")
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with quiet_extension_warning():
            info = device_info(device)
            section = collect(smoke=args.smoke, device=device, repeats=args.repeats, **extra)
    finally:
        torch.set_num_threads(threads_before)
    payload = {"benchmark": name, "smoke": args.smoke, "date": utc_now(), "device": info, **section}
    path = write_results(
        payload, result_name(name, smoke=args.smoke, threads=args.threads), results_dir(args.out, smoke=args.smoke)
    )
    print(report(section, info))
    if args.smoke:
        print("(smoke run: tiny sizes, the numbers mean nothing)")
    print(f"results: {path}")
    return 0


def error_lines(section: dict) -> list[str]:
    """``ERROR <implementation>: <message>`` for each implementation that raised instead of running."""
    return [f"ERROR {name}: {message}" for name, message in section.get("errors", {}).items()]
