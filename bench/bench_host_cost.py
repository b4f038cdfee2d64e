"""What MJP costs the host: dispatched operations and host time of MJP's part of a step, at tiny sizes.

The steps, models and counters are the test harness's (tests/harness/host_cost.py, which tests/test_host_cost.py
holds to ceilings), so the benchmark and the tests measure the same thing: a timm ViT with no blocks (``depth=0``),
the position step of a training step, forward and backward, plain against MJP (``mjp``, ``mjp explicit``), the
patch embedding with it (``plain embed``, ``mjp fused embed``), and the sampler's call against a tiny ``torch.add``.
At tiny sizes the kernels take no time, so what is timed is what a slow host pays per step on a GPU: Python, the
dispatcher and the launches, compared in the same run.

On the CPU the embedding steps are also measured under bfloat16 autocast (``... (autocast)``), as a GPU's training
step runs them (a GPU's rows run under it already). Operations are counted with a ``TorchDispatchMode`` (views
included; an operator of ours counts once). Aims (docs/benchmarks.md): the MJP part dispatches at most 25
operations, and costs at most 2.5x the host time of the plain position step.

    python bench/bench_host_cost.py [--smoke] [--repeats N] [--out DIR] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `mjp_fast` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from bench.common import (
    Timing,
    aim_line,
    aim_verdict,
    compared_backends,
    format_timing,
    markdown_table,
    measure,
    run_standalone,
    where_measured,
)
from tests.harness.host_cost import (  # noqa: F401 - OpCounter and counting_triton_launches: re-exported
    BATCH,
    DIM,
    IMAGE,
    PATCH,
    OpCounter,
    count_ops,
    count_triton_launches,
    counting_triton_launches,
    position_steps,
    sampler_steps,
    tiny_models,
)

NAME = "host_cost"
OPS_AIM, HOST_AIM = 25, 2.5
TIMING_FIELDS = ("median_s", "p20_s", "p80_s", "min_s", "samples", "calls_per_sample")


def collect(*, smoke: bool, device: str, repeats: int | None = None, backends: Sequence[str] | None = None) -> dict:
    """Measures the case; returns its section: ``config``, ``backends``, ``results``, ``aims``.

    ``backends``: the MJP models' backends, one set of rows each (default :func:`bench.common.compared_backends`:
    the automatic choice, and on a GPU the other GPU backend too). Each set is timed with its own baselines, in its
    own interleaved rounds."""
    backends = list(backends) if backends is not None else compared_backends(device)
    repeats = repeats or (2 if smoke else 15)
    rows, aims = [], []
    for backend in backends:
        backend_rows = _measure_backend(backend, smoke=smoke, device=device, repeats=repeats)
        rows += backend_rows
        aims += _aims(backend_rows, backend, named=len(backends) > 1, smoke=smoke)
    return {
        "config": {"batch": BATCH, "dim": DIM, "image_size": IMAGE, "patch": PATCH, "depth": 0, "repeats": repeats},
        "backends": backends,
        "results": rows,
        "aims": aims,
    }


def _measure_backend(backend: str, *, smoke: bool, device: str, repeats: int) -> list[dict]:
    """The rows of one backend: every step counted and timed against its baseline (``baseline``)."""
    models = tiny_models(device, backend)
    steps = position_steps(models, device)
    if device == "cpu":
        # The embedding steps under bfloat16 autocast as well, as a GPU's training step runs them (a GPU's rows are
        # these already): the CPU's autocast dispatches the same operators, so the counts are a GPU host's.
        autocast_steps = position_steps(models, device, autocast=True)
        steps.update({f"{name} (autocast)": autocast_steps[name] for name in ("plain embed", "mjp fused embed")})
    samplers = sampler_steps(models, device)
    counts = {name: count_ops(function) for name, function in {**steps, **samplers}.items()}
    triton_launches = {name: count_triton_launches(function) for name, function in {**steps, **samplers}.items()}
    min_sample = 0.0 if smoke else 0.05
    timings = measure(steps, repeats=repeats, warmup=3, min_sample_s=min_sample, device=device)
    timings.update(measure(samplers, repeats=repeats, warmup=3, min_sample_s=min_sample, device=device))
    baselines = {"plain": "plain", "mjp": "plain", "mjp explicit": "plain"}
    baselines.update({"plain embed": "plain embed", "mjp fused embed": "plain embed"})
    baselines.update({f"{name} (autocast)": "plain embed (autocast)" for name in ("plain embed", "mjp fused embed")})
    baselines.update({"torch.add": "torch.add", "sampler": "torch.add"})
    return [
        {
            "implementation": name,
            "backend": backend,
            "baseline": baselines[name],
            "ops": counts[name].total,
            "op_counts": dict(counts[name].counts),
            "triton_launches": sum(triton_launches[name].values()),
            "triton_kernels": dict(triton_launches[name]),
            **timing.to_dict(),
            "ratio": timing.median_s / timings[baselines[name]].median_s,
        }
        for name, timing in timings.items()
    ]


def _aims(rows: list[dict], backend: str, *, named: bool, smoke: bool) -> list[dict]:
    """The aims judged on one backend's rows; ``named``: their text names the backend (a run of several)."""
    by_name = {row["implementation"]: row for row in rows}
    on = f" (backend {backend})" if named else ""
    aims = []
    for name in ("mjp", "mjp fused embed"):
        aims.append(
            {
                "aim": f"{name}{on}: the MJP part (sampler, move, position term, DAL; forward and backward) dispatches "
                f"at most {OPS_AIM} operations",
                "threshold": OPS_AIM,
                "measured": float(by_name[name]["ops"]),
                "unit": " ops",
                "verdict": aim_verdict(by_name[name]["ops"], OPS_AIM, higher_is_better=False),
            }
        )
    if smoke:  # a smoke run judges nothing (its counts are right, but it is not the recorded run)
        for aim in aims:
            aim.update(verdict="NOT JUDGED", note="smoke run: tiny sizes")
    aims.append(
        {
            "aim": f"mjp{on}: host time of the position step at most {HOST_AIM:g}x the plain position add's (tiny "
            "sizes)",
            "threshold": HOST_AIM,
            "measured": by_name["mjp"]["ratio"],
            "unit": "x",
            "verdict": "NOT JUDGED"
            if smoke
            else aim_verdict(by_name["mjp"]["ratio"], HOST_AIM, higher_is_better=False),
        }
    )
    return aims


def table(rows: list[dict]) -> str:
    # A run of several backends names each row's (older runs' rows have no "backend").
    several = len({row.get("backend") for row in rows}) > 1
    body = [
        [
            row["implementation"],
            *([row["backend"]] if several else []),
            row["baseline"],
            row["ops"],
            row["triton_launches"],
            format_timing(Timing(*(row[key] for key in TIMING_FIELDS))),
            f"{row['ratio']:.2f}x",
        ]
        for row in rows
    ]
    headers = ["step", *(["backend"] if several else []), "against", "dispatched ops", "Triton launches"]
    headers += ["host time, median [p20, p80]", "time ratio"]
    return markdown_table(headers, body)


def report(section: dict, info: dict) -> str:
    config = section["config"]
    lines = [
        f"## Host cost of MJP's part of a step: batch {config['batch']}, D {config['dim']}, "
        f"{config['image_size'] // config['patch']}x{config['image_size'] // config['patch']} grid, backend "
        f"{', '.join(section['backends'])} ({where_measured(info)})",
        "",
        table(section["results"]),
        "",
        "dispatched ops: operators one call hands to the dispatcher from Python (TorchDispatchMode), views included; "
        "an operator of ours (C++ or Triton) counts once, as timm's Conv2d does. Triton launches: kernels launched by "
        "the triton backend (0 on the others). Time ratio: median time per call over the baseline's, same run, "
        "interleaved.",
        "",
    ]
    return "\n".join(lines + [aim_line(aim) for aim in section["aims"]])


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(NAME, __doc__.split("\n\n")[0], collect, report, argv)


if __name__ == "__main__":
    sys.exit(main())
