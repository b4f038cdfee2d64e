"""Per-mask cost of sampling block-wise jigsaws (mask + permutation), per sample, on a 14x14 grid.

Compared, in the same run:

- ``python loop``: the straightforward Python loop of BEiT and the paper's code (``block_mask_python``) for each
  sample, plus ``random.shuffle`` of the masked positions and the stacking into tensors: the same output as
  ``sample_jigsaw`` (mask ``[B, N]``, perm ``[B, N]``), made the way a per-sample Python data pipeline would.
- ``torch``: ``sample_jigsaw(backend="torch")``, the pure-PyTorch oracle.
- every other available backend (``cpu``: the compiled extension; ``cuda`` and ``triton`` on a GPU).

Aim: the compiled ``cpu`` sampler at least 50x faster per mask than the Python loop, in every configuration.

    python bench/bench_sampler.py [--smoke] [--repeats N] [--out DIR] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `mjp_fast` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from bench.common import (
    Timing,
    aim_line,
    aim_verdict,
    error_lines,
    format_seconds,
    format_timing,
    markdown_table,
    measure,
    run_standalone,
    where_measured,
)

NAME = "sampler"
AIM_SPEEDUP = 50.0  # compiled cpu sampler vs the Python loop, per mask
PYTHON_LOOP = "python loop"
MIN_BLOCK, MIN_ASPECT = 8, 0.3  # the paper's code


def python_jigsaws(batch: int, grid: tuple[int, int], ratio: float, rng: random.Random) -> tuple[torch.Tensor, ...]:
    """Mask bool ``[B, N]`` and perm int64 ``[B, N]`` by the Python loop, one sample at a time."""
    from tests.harness.paper_sampler import block_mask_python

    num_positions = grid[0] * grid[1]
    masks = np.zeros((batch, num_positions), dtype=bool)
    perms = np.tile(np.arange(num_positions, dtype=np.int64), (batch, 1))
    for sample in range(batch):
        mask = block_mask_python(grid, ratio, min_block=MIN_BLOCK, min_aspect=MIN_ASPECT, rng=rng).reshape(-1)
        positions = np.flatnonzero(mask).tolist()
        shuffled = positions.copy()
        rng.shuffle(shuffled)
        masks[sample] = mask
        perms[sample, positions] = shuffled
    return torch.from_numpy(masks), torch.from_numpy(perms)


def _sampler(batch: int, grid: tuple[int, int], ratio: float, backend: str, device: str) -> Callable[[], object]:
    """``sample_jigsaw`` on a fresh stream every call (the offset moves on by the batch, as in training)."""
    from mjp_fast import sample_jigsaw

    state = {"offset": 0}

    def run() -> object:
        jigsaw = sample_jigsaw(
            batch,
            grid,
            ratio,
            seed=1234,
            offset=state["offset"],
            min_block=MIN_BLOCK,
            min_aspect=MIN_ASPECT,
            device=device,
            backend=backend,
        )
        state["offset"] += batch
        return jigsaw

    return run


def backends_on(device: str) -> list[str]:
    """The available sampler backends that run on ``device``, the oracle first."""
    import mjp_fast

    available = mjp_fast.available_backends()
    fits = {"cpu": ("torch", "cpu"), "cuda": ("torch", "cuda", "triton")}[device]
    return ["torch"] + [name for name in available if name in fits and name != "torch"]


def _check_backends(
    batch: int, grid: tuple[int, int], ratio: float, backends: list[str], device: str
) -> tuple[dict[str, float], dict[str, bool]]:
    """Samples one batch on every backend: its mean masked count, and whether it equals the oracle's bit for bit."""
    from mjp_fast import sample_jigsaw

    def sample(name: str):
        jigsaw = sample_jigsaw(
            batch,
            grid,
            ratio,
            seed=99,
            offset=7,
            min_block=MIN_BLOCK,
            min_aspect=MIN_ASPECT,
            device=device,
            backend=name,
        )
        return jigsaw.mask.cpu(), jigsaw.perm.cpu()

    reference = sample("torch")
    mean_masked, matches = {}, {}
    for name in backends:
        mask, perm = reference if name == "torch" else sample(name)
        mean_masked[name] = float(mask.sum(1).float().mean())
        matches[name] = bool(torch.equal(mask, reference[0]) and torch.equal(perm, reference[1]))
    return mean_masked, matches


def run(
    *,
    batches: Sequence[int],
    ratios: Sequence[float],
    grid: tuple[int, int],
    repeats: int,
    warmup: int,
    min_sample_s: float,
    max_seconds_each: float | None,
    device: str,
    errors: dict[str, str] | None = None,
) -> tuple[list[dict], list[str]]:
    """Measures every configuration; returns the result rows and the backends measured.

    A backend that raises is left out of the rows and its first error recorded in ``errors``.
    """
    errors = {} if errors is None else errors
    backends = backends_on(device)
    rows = []
    for batch in batches:
        for ratio in ratios:
            rng = random.Random(1234)
            functions = {PYTHON_LOOP: lambda: python_jigsaws(batch, grid, ratio, rng)}  # noqa: B023 - used at once
            for name in backends:
                functions[name] = _sampler(batch, grid, ratio, name, device)
            timings = measure(
                functions,
                repeats=repeats,
                warmup=warmup,
                min_sample_s=min_sample_s,
                max_seconds_each=max_seconds_each,
                device=device,
                errors=errors,
            )
            baseline = timings[PYTHON_LOOP].median_s
            working = [name for name in backends if name in timings]
            mean_masked, matches = _check_backends(batch, grid, ratio, working, device)
            mean_masked[PYTHON_LOOP] = float(
                python_jigsaws(batch, grid, ratio, random.Random(5))[0].sum(1).float().mean()
            )
            for name, timing in timings.items():
                rows.append(
                    {
                        "batch": batch,
                        "grid": list(grid),
                        "ratio": ratio,
                        "implementation": name,
                        "device": "cpu" if name == PYTHON_LOOP else device,
                        **timing.to_dict(),
                        "per_mask_median_s": timing.median_s / batch,
                        "per_mask_p20_s": timing.p20_s / batch,
                        "per_mask_p80_s": timing.p80_s / batch,
                        "speedup_vs_python": baseline / timing.median_s,
                        "mean_masked": mean_masked[name],
                        "target": math.floor(ratio * grid[0] * grid[1]),
                        "matches_oracle": None if name in (PYTHON_LOOP, "torch") else matches[name],
                    }
                )
    return rows, backends


def table(rows: list[dict]) -> str:
    headers = ["batch", "ratio", "implementation", "per mask: median [p20, p80]", "per batch", "vs python", "masked"]
    body = [
        [
            row["batch"],
            row["ratio"],
            row["implementation"] + ("" if row["matches_oracle"] in (None, True) else " (DIFFERS FROM ORACLE)"),
            format_timing_per_mask(row),
            format_seconds(row["median_s"]),
            f"{row['speedup_vs_python']:.1f}x",
            f"{row['mean_masked']:.1f}/{row['target']}",
        ]
        for row in rows
    ]
    return markdown_table(headers, body)


def format_timing_per_mask(row: dict) -> str:
    timing = Timing(row["median_s"], row["p20_s"], row["p80_s"], row["min_s"], row["samples"], row["calls_per_sample"])
    return format_timing(timing, scale=row["batch"])


def _aims(rows: list[dict], *, smoke: bool, errors: dict[str, str] | None = None, device: str = "cpu") -> list[dict]:
    speedups = [row["speedup_vs_python"] for row in rows if row["implementation"] == "cpu"]
    worst = min(speedups) if speedups else None
    aim = {
        "aim": f"compiled cpu sampler at least {AIM_SPEEDUP:g}x faster per mask than the Python loop "
        "(worst configuration)",
        "threshold": AIM_SPEEDUP,
        "measured": worst,
        "unit": "x",
        "verdict": aim_verdict(worst, AIM_SPEEDUP, higher_is_better=True),
    }
    if errors and "cpu" in errors:  # a sampler that raises misses the aim, whatever its other timings
        aim.update(verdict="FAIL", note=f"the cpu backend raised: {errors['cpu']}")
    elif worst is None and device != "cpu":
        aim["note"] = "measured on the CPU only: run the case with --device cpu"
    elif worst is None:
        aim["note"] = "the compiled extension mjp_fast._C is not available on this machine"
    elif smoke:
        aim.update(verdict="NOT JUDGED", note="smoke run: tiny sizes")
    return [aim]


def collect(*, smoke: bool, device: str, repeats: int | None = None) -> dict:
    """Measures the case; returns its section of the results: ``config``, ``backends``, ``results``, ``aims``."""
    if smoke:
        config = {"batches": [8], "ratios": [0.1, 0.5], "grid": (14, 14), "warmup": 2, "min_sample_s": 0.0}
        config["max_seconds_each"] = None
        config["repeats"] = repeats or 2
    else:
        config = {"batches": [64, 256, 1024], "ratios": [0.1, 0.5], "grid": (14, 14), "warmup": 2}
        # The torch oracle takes seconds per call at batch 1024: a budget gives it fewer samples, not all night.
        config.update(min_sample_s=0.05, max_seconds_each=15.0, repeats=repeats or 15)
    errors: dict[str, str] = {}
    rows, backends = run(device=device, errors=errors, **config)
    return {
        "config": {**config, "grid": list(config["grid"]), "min_block": MIN_BLOCK, "min_aspect": MIN_ASPECT},
        "backends": backends,
        "results": rows,
        "errors": errors,
        "aims": _aims(rows, smoke=smoke, errors=errors, device=device),
    }


def report(section: dict, info: dict) -> str:
    """The printed Markdown of a section: title with device and shapes, the table, one line per aim."""
    grid = section["config"]["grid"]
    lines = [
        f"## Jigsaw sampler, {grid[0]}x{grid[1]} grid, mask + permutation per sample ({where_measured(info)})",
        "",
        table(section["results"]),
        "",
    ]
    return "\n".join(lines + error_lines(section) + [aim_line(aim) for aim in section["aims"]])


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(NAME, __doc__.split("\n\n")[0], collect, report, argv)


if __name__ == "__main__":
    sys.exit(main())
