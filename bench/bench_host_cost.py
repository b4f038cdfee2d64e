"""What MJP costs the host: dispatched operations and host time of MJP's part of a step, at tiny sizes.

At tiny sizes the kernels take no time, so what is timed is what a slow host pays per step on a GPU: Python,
the dispatcher and the launches. Compared in the same run, on a timm ViT with no blocks (``depth=0``), the
position step of a training step, forward and backward, gradients set to None between calls as in training:

- ``plain``: timm's ``model._pos_embed(tokens)`` (class token, position add), backward.
- ``mjp``: the same step of the MJP model on the token path (``fused_patch_embed=False``), as a training step runs
  it: the sampler, the move of the tokens, the position term with ``unk_embed``, and the DAL loss attached to the
  tokens (at ``mjp_dal_weight``); backward of the tokens alone, which trains DAL too.
- ``mjp explicit``: the same, for a loop that also adds ``model.mjp_aux_loss()`` to its loss (its weight replaces
  the attached one): backward of the tokens and that loss.
- ``plain embed`` / ``mjp fused embed``: the patch embedding and the position step together: timm's
  ``PatchEmbed`` and ``_pos_embed``, against the MJP model's fused embedding (jigsaw and position term in the GEMM)
  with its DAL loss attached.
- ``sampler``: one call of the model's ``JigsawSampler`` against one ``torch.add`` of two tiny tensors.

Operations are counted with a ``TorchDispatchMode`` (every operator the dispatcher hands to Python: aten ops,
views included, and our operators, each once). Aims (docs/benchmarks.md): the MJP part dispatches at most 25
operations, and costs at most 2.5x the host time of the plain position step.

    python bench/bench_host_cost.py [--smoke] [--repeats N] [--out DIR] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `mjp_fast` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import (
    Timing,
    aim_line,
    aim_verdict,
    format_timing,
    markdown_table,
    measure,
    run_standalone,
    where_measured,
)

NAME = "host_cost"
BATCH, DIM, IMAGE, PATCH = 2, 16, 16, 4  # a 4x4 grid: the kernels take no time, the host's work is what counts
OPS_AIM, HOST_AIM = 25, 2.5
TIMING_FIELDS = ("median_s", "p20_s", "p80_s", "min_s", "samples", "calls_per_sample")


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def tiny_models(device: torch.device | str = "cpu", backend: str | None = None) -> dict[str, torch.nn.Module]:
    """``plain`` (timm ViT, depth 0), ``mjp`` (its MJP copy on the token path) and ``mjp fused`` (fused embedding);
    MJP at ratio 0.5, prob 1.0 (every sample jigsawed), nonlinear DAL."""
    import timm

    import mjp_fast.timm as mjp_timm

    torch.manual_seed(0)
    plain = timm.create_model(
        "vit_tiny_patch16_224", img_size=IMAGE, patch_size=PATCH, embed_dim=DIM, depth=0, num_heads=2, num_classes=4
    ).to(device)
    settings = dict(ratio=0.5, prob=1.0, dal="nonlinear", min_block=2, backend=backend)
    models = {
        "plain": plain,
        "mjp": mjp_timm.convert(copy.deepcopy(plain), fused_patch_embed=False, **settings),
        "mjp fused": mjp_timm.convert(copy.deepcopy(plain), fused_patch_embed=True, **settings),
    }
    for model in models.values():
        model.train()
    return models


def position_steps(models: dict[str, torch.nn.Module], device: torch.device | str = "cpu") -> dict[str, Callable]:
    """The timed steps: name -> a callable running one forward and backward (see the module's docstring)."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(1)
    plain = models["plain"]
    num_positions = plain.patch_embed.num_patches
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = torch.randn(BATCH, num_positions, DIM, generator=generator).to(device, dtype).requires_grad_(True)
    images = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator).to(device)
    grad = torch.randn(BATCH, num_positions + plain.num_prefix_tokens, DIM, generator=generator).to(device, dtype)
    grads = {dtype: grad.to(dtype) for dtype in (torch.float32, torch.bfloat16)}  # made once, not per step

    def step(model: torch.nn.Module, *, explicit: bool, embed: bool) -> Callable[[], None]:
        parameters = list(model.parameters())  # listed once: walking the modules is the harness's cost, not MJP's

        def run() -> None:
            for parameter in parameters:
                parameter.grad = None
            tokens.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = model._pos_embed(model.patch_embed(images) if embed else tokens)
                aux = model.mjp_aux_loss() if explicit else None
            if aux is None:  # an MJP model's training forward attached its DAL loss to out
                out.backward(grads[out.dtype])
            else:
                torch.autograd.backward([out, aux], [grads[out.dtype], weight])

        return run

    weight = torch.full((), 0.01, device=device)  # the explicit loss's weight, as a loop's dal_weight * aux
    return {
        "plain": step(plain, explicit=False, embed=False),
        "mjp": step(models["mjp"], explicit=False, embed=False),
        "mjp explicit": step(models["mjp"], explicit=True, embed=False),
        "plain embed": step(plain, explicit=False, embed=True),
        "mjp fused embed": step(models["mjp fused"], explicit=False, embed=True),
    }


def sampler_steps(models: dict[str, torch.nn.Module], device: torch.device | str = "cpu") -> dict[str, Callable]:
    """One call of the MJP model's sampler against one tiny ``torch.add``."""
    device = torch.device(device)
    sampler = models["mjp"].mjp.sampler
    a, b = torch.ones(4, device=device), torch.ones(4, device=device)
    return {"torch.add": lambda: torch.add(a, b), "sampler": lambda: sampler(BATCH, device)}


def count_ops(function: Callable[[], object], warmup: int = 2) -> OpCounter:
    """The operators one call of ``function`` dispatches (after ``warmup`` calls, so caches are filled)."""
    for _ in range(warmup):
        function()
    with OpCounter() as counter:
        function()
    return counter


@contextlib.contextmanager
def counting_triton_launches() -> Iterator[collections.Counter[str]]:
    """Counts the Triton kernel launches (by kernel name) made inside the context: the compiled kernels' on a GPU,
    the interpreter's on the CPU."""
    import triton.runtime.interpreter as interpreter
    from triton.runtime.jit import JITFunction

    launches: collections.Counter[str] = collections.Counter()
    originals = {cls: cls.run for cls in (JITFunction, interpreter.InterpretedFunction)}

    def counting(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup"):
                launches[self.fn.__name__] += 1
            return original(self, *args, **kwargs)

        return run

    for cls, original in originals.items():
        cls.run = counting(original)
    try:
        yield launches
    finally:
        for cls, original in originals.items():
            cls.run = original


def count_triton_launches(function: Callable[[], object], warmup: int = 1) -> collections.Counter[str]:
    """The Triton kernels one call of ``function`` launches, after ``warmup`` calls."""
    for _ in range(warmup):
        function()
    with counting_triton_launches() as launches:
        function()
    return launches


def collect(*, smoke: bool, device: str, repeats: int | None = None) -> dict:
    """Measures the case; returns its section: ``config``, ``backends``, ``results``, ``aims``."""
    from mjp_fast.backend import resolve_backend

    models = tiny_models(device)
    steps = position_steps(models, device)
    samplers = sampler_steps(models, device)
    counts = {name: count_ops(function) for name, function in {**steps, **samplers}.items()}
    triton_launches = {name: count_triton_launches(function) for name, function in {**steps, **samplers}.items()}
    repeats = repeats or (2 if smoke else 15)
    min_sample = 0.0 if smoke else 0.05
    timings = measure(steps, repeats=repeats, warmup=3, min_sample_s=min_sample, device=device)
    timings.update(measure(samplers, repeats=repeats, warmup=3, min_sample_s=min_sample, device=device))
    baselines = {"plain": "plain", "mjp": "plain", "mjp explicit": "plain"}
    baselines.update({"plain embed": "plain embed", "mjp fused embed": "plain embed"})
    baselines.update({"torch.add": "torch.add", "sampler": "torch.add"})
    rows = []
    for name, timing in timings.items():
        base = timings[baselines[name]]
        rows.append(
            {
                "implementation": name,
                "baseline": baselines[name],
                "ops": counts[name].total,
                "op_counts": dict(counts[name].counts),
                "triton_launches": sum(triton_launches[name].values()),
                "triton_kernels": dict(triton_launches[name]),
                **timing.to_dict(),
                "ratio": timing.median_s / base.median_s,
            }
        )
    by_name = {row["implementation"]: row for row in rows}
    aims = []
    for name in ("mjp", "mjp fused embed"):
        aims.append(
            {
                "aim": f"{name}: the MJP part (sampler, move, position term, DAL; forward and backward) dispatches at "
                f"most {OPS_AIM} operations",
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
            "aim": f"mjp: host time of the position step at most {HOST_AIM:g}x the plain position add's (tiny sizes)",
            "threshold": HOST_AIM,
            "measured": by_name["mjp"]["ratio"],
            "unit": "x",
            "verdict": "NOT JUDGED"
            if smoke
            else aim_verdict(by_name["mjp"]["ratio"], HOST_AIM, higher_is_better=False),
        }
    )
    return {
        "config": {"batch": BATCH, "dim": DIM, "image_size": IMAGE, "patch": PATCH, "depth": 0, "repeats": repeats},
        "backends": [resolve_backend(None, torch.device(device))],
        "results": rows,
        "aims": aims,
    }


def table(rows: list[dict]) -> str:
    body = [
        [
            row["implementation"],
            row["baseline"],
            row["ops"],
            row["triton_launches"],
            format_timing(Timing(*(row[key] for key in TIMING_FIELDS))),
            f"{row['ratio']:.2f}x",
        ]
        for row in rows
    ]
    headers = ["step", "against", "dispatched ops", "Triton launches", "host time, median [p20, p80]", "time ratio"]
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
