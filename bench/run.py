"""The whole benchmark suite in one run: every case, one JSON file, the tables printed as they are measured.

Cases (each measures its baselines in the same run, interleaved):

- ``sampler``: per-sample jigsaw sampling against the Python loop of BEiT and the paper's code.
- ``patch_embed``: timm's ``PatchEmbed`` + position add against ``mjp_patch_embed`` on every backend.
- ``jigsaw_apply``: the paper code's pixel pipeline against ``jigsaw_images`` and the fused embedding.
- ``host_cost``: dispatched operations and host time of MJP's part of a step at tiny sizes, against timm's plain
  position add.
- ``train_step``: whole DeiT-Tiny / DeiT-Small training steps, plain against MJP: the overhead in percent.
- ``kernels`` (GPU): the GPU time of each Triton kernel of MJP's part of a step, with and without the jigsaw,
  under each pipeline setting in question (a smoke run on the CPU runs them in the interpreter).
- ``train_loop``: ``mjp train`` (mjp=false and mjp=true) against timm's own ``train.py``: training images per
  second over a fixed number of steps (timm's script from ``$TIMM_TRAIN_PY``; without it the timm rows are NOT RUN).

The file is ``<out>/<device>-<YYYY-MM-DD>.json`` (``-smoke`` for a smoke run, ``-suite-<cases>`` for a subset of
the cases, ``-threads<N>`` for a thread count other than the machine's). ``<out>`` is ``bench/results``, except for
smoke runs, which go to a folder in the system's temporary directory unless ``--out`` says otherwise: their numbers
mean nothing, and the checkout keeps only recorded results. ``python bench/render.py`` turns the recorded files
into ``docs/benchmarks.md``.

    python -m bench.run [--smoke] [--cases sampler,patch_embed,jigsaw_apply,host_cost,train_step,kernels,train_loop]
        [--out DIR] [--device cpu|cuda] [--threads N] [--repeats N] [--compile]

``mjp bench`` runs the same from a checkout of the repository.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TextIO

if __package__ in (None, ""):  # run as a script: make `bench` and `mjp_fast` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import (
    PartialResults,
    aim_line,
    default_device,
    device_info,
    machine_threads,
    out_help,
    quiet_extension_warning,
    results_dir,
    utc_now,
    versions_line,
    where_measured,
    write_results,
)

SUITE = "mjp_fast"
CASES = {
    "sampler": "bench.bench_sampler",
    "patch_embed": "bench.bench_patch_embed",
    "gathered_patch_embed": "bench.bench_gathered_patch_embed",
    "jigsaw_apply": "bench.bench_jigsaw_apply",
    "host_cost": "bench.bench_host_cost",
    "train_step": "bench.bench_train_step",
    "kernels": "bench.bench_kernels",
    "train_loop": "bench.bench_train_loop",
}


def case_module(name: str) -> ModuleType:
    """The module of a case: ``collect(smoke=, device=, repeats=)``, ``report(section, info)``, ``table(rows)``."""
    return importlib.import_module(CASES[name])


def parse_cases(cases: str | Sequence[str] | None) -> list[str]:
    """``"sampler,train_step"`` or a list -> the case names in the order given (run first what matters most when
    time may run out), each once; None -> all of them, in the suite's order."""
    if cases is None:
        return list(CASES)
    names = [part.strip() for part in (cases.split(",") if isinstance(cases, str) else cases) if part.strip()]
    unknown = [name for name in names if name not in CASES]
    if unknown or not names:
        raise ValueError(f"cases must be a comma-separated subset of {','.join(CASES)}, got {cases!r}")
    return list(dict.fromkeys(names))


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def failed_section(error: BaseException) -> dict:
    """The section of a case that raised: its error and traceback instead of results."""
    return {
        "error": f"{type(error).__name__}: {error}",
        "traceback": traceback.format_exc(),
        "config": {},
        "backends": [],
        "results": [],
        "aims": [],
    }


def report(name: str, section: dict, info: dict) -> str:
    """A case's printed Markdown, or its error if it raised."""
    if section.get("error"):
        title = name.replace("_", " ")
        return f"## {title}: did not run\n\nERROR: {section['error']}"
    return case_module(name).report(section, info)


def _aims(sections: dict[str, dict]) -> list[dict]:
    """Every case's aims, each with its case's name."""
    return [{"case": name, **aim} for name, section in sections.items() for aim in section["aims"]]


def result_file_name(cases: list[str], *, smoke: bool, threads: int | None) -> str:
    """The part of the file name after ``<device>-<date>``: empty for the full suite at the machine's threads."""
    parts = []
    if cases != list(CASES):
        parts.append("suite-" + "-".join(cases))
    if threads is not None and threads != machine_threads():
        parts.append(f"threads{threads}")
    if smoke:
        parts.append("smoke")
    return "-".join(parts)


def run_suite(
    *,
    cases: str | Sequence[str] | None = None,
    smoke: bool = False,
    out_dir: Path | str | None = None,
    device: str | None = None,
    threads: int | None = None,
    repeats: int | None = None,
    compile_model: bool = False,
    compile_mode: str | None = None,
    stream: TextIO | None = None,
) -> Path:
    """Runs the cases, prints their tables and aim lines, writes one JSON file; returns its path.

    Args:
        cases: which cases (default all), as names or one comma-separated string.
        smoke: tiny sizes and 1-2 repeats: checks that everything runs, judges no aim.
        out_dir: where the JSON goes (default ``bench/results``; for a smoke run, a folder in the system's
            temporary directory: :func:`bench.common.smoke_results_dir`).
        device: ``cpu`` or ``cuda`` (default: cuda when available).
        threads: torch CPU threads (default: every core this process may use); restored afterwards.
        repeats: overrides each case's repeat count (for ``train_step``: the interleaved pairs per model).
        compile_model: ``torch.compile`` the models of ``train_step``.
        compile_mode: ``torch.compile``'s mode there (default its own; ``reduce-overhead``: CUDA graphs).
        stream: where the report goes (default ``sys.stdout``).

    Raises:
        ValueError: unknown cases, or ``device="cuda"`` without a GPU.
    """
    stream = stream or sys.stdout
    names = parse_cases(cases)
    device = device or default_device()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda': no GPU is visible to torch")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads}")

    def say(text: str = "") -> None:
        print(text, file=stream, flush=True)

    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads or machine_threads())
    load_before = _load_average()
    begin = time.perf_counter()
    sections: dict[str, dict] = {}
    info: dict = {}
    file_name = result_file_name(names, smoke=smoke, threads=threads)
    folder = results_dir(out_dir, smoke=smoke)

    def save(*, interrupted: bool = False) -> Path:
        # Written again after every case (atomically): a run stopped at a deadline, as on a lent GPU whose time
        # runs out, keeps the cases it finished; "cases_missing" names the others.
        payload = {
            "suite": SUITE,
            "smoke": smoke,
            "date": utc_now(),
            "device": info,
            "cases_run": names,
            "cases": sections,
            "aims": _aims(sections),
            "elapsed_s": time.perf_counter() - begin,
            # other processes share the machine: its 1-minute load average, before and after
            "load_average": {"start": load_before, "end": _load_average()},
        }
        missing = [name for name in names if name not in sections]
        cut = [name for name, section in sections.items() if section.get("cut_short")]
        if missing or cut:
            payload["cases_missing"] = missing
            payload["cases_cut_short"] = cut
            payload["interrupted"] = interrupted
        return write_results(payload, file_name, folder)

    path = None
    try:
        with quiet_extension_warning():
            info = device_info(device)
            say(f"# mjp_fast benchmarks{' (smoke run: tiny sizes, the numbers mean nothing)' if smoke else ''}")
            say()
            say(f"{where_measured(info)}; {info['platform']}")
            say(versions_line(info))
            say()
            for name in names:
                module = case_module(name)
                case_begin = time.perf_counter()
                options = {"compile_model": compile_model, "compile_mode": compile_mode} if name == "train_step" else {}
                try:
                    section = module.collect(smoke=smoke, device=device, repeats=repeats, **options)
                except PartialResults as stopped:  # what the case measured before the interrupt, kept
                    sections[name] = {**stopped.section, "cut_short": True}
                    sections[name]["elapsed_s"] = time.perf_counter() - case_begin
                    raise
                except Exception as error:  # one broken case must not lose the others' results
                    section = failed_section(error)
                section["elapsed_s"] = time.perf_counter() - case_begin
                sections[name] = section
                path = save()
                say(report(name, section, info))
                say(f"({name}: {section['elapsed_s']:.0f} s)")
                say()
    except KeyboardInterrupt:
        if sections:
            say(f"interrupted: the finished cases are in {save(interrupted=True)}")
        raise
    finally:
        torch.set_num_threads(threads_before)

    aims = _aims(sections)
    elapsed = time.perf_counter() - begin
    say("## Aims")
    say()
    for aim in aims:
        say(f"- [{aim['case']}] {aim_line(aim)}")
    say()
    say(f"results: {path} ({elapsed:.0f} s)")
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mjp_fast._argtypes import COMPILE_MODES

    """The suite's options (``mjp bench`` takes the same)."""
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and 1-2 repeats: checks that it all runs")
    parser.add_argument(
        "--cases",
        default=None,
        metavar="CASE[,CASE...]",
        help=f"a comma-separated subset of {','.join(CASES)} (default: all)",
    )
    parser.add_argument("--out", default=None, help=out_help())
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all of this machine's)")
    parser.add_argument("--repeats", type=int, default=None, help="override every case's repeat count")
    parser.add_argument("--compile", dest="compile_model", action="store_true", help="torch.compile train_step models")
    parser.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        default=None,
        help="torch.compile's mode with --compile (default: its own; reduce-overhead: CUDA graphs)",
    )


def run_from_args(args: argparse.Namespace) -> Path:
    return run_suite(
        cases=args.cases,
        smoke=args.smoke,
        out_dir=args.out,
        device=args.device,
        threads=args.threads,
        repeats=args.repeats,
        compile_model=args.compile_model,
        compile_mode=args.compile_mode,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
