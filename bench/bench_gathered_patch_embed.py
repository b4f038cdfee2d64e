"""Cost of the gathered (NaFlex, pre-patchified) MJP patch embedding against what a user could run instead, forward and
forward+backward, and of the NaFlexVit front end fused against unfused.

Compared in the same run, on NaFlex-B's sizes (patch rows of K = 16*16*3 = 768, D = 768, N = 256 rows per sample
(a 16x16 grid), one position term per sample ``[B, N, D]``, a class token and 4 registers in front; a NaFlex jigsaw:
about 10% of the rows masked and permuted among themselves in each sample):

- ``gather+linear`` (the baseline): the oracle ``mjp_gathered_patch_embed_ref``: the patch rows gathered by the perm,
  ``F.linear``, ``torch.where(mask, unk, pos)`` added, the prefix ``cat`` in front: what a user writes in torch.
- ``linear+gather``: the same in the other order (embed, then move the D-wide tokens), the op's ``torch`` backend,
  ``mjp_gathered_patch_embed(..., backend="torch")``.
- ``mjp[<backend>]``: ``mjp_gathered_patch_embed`` on each other backend that runs on the device (``triton`` on a
  GPU; ``cpu`` runs the torch computation: the op has no compiled kernel), ``validate=False`` as the front end calls it.
- ``front end unfused`` / ``front end fused``: a converted NaFlexVit's embedding module in training (``model.embeds``
  on a NaFlex dict of the same sizes: the sampler's draw, timm's position term, the step), with
  ``fused_patch_embed=False`` and with the fused op; forward+backward reaches the projection, tables, prefix and
  ``unk_embed``.

float32 on the CPU, bfloat16 on a GPU. "forward" runs under ``torch.no_grad()``; "forward+backward" computes the
gradients of every floating input but the patches (as in training), grads set to None before each call. Each row
has its median with the 20th-80th percentile spread and its ratio to its group's baseline (``gather+linear``, or
``front end unfused``) in the same mode.

Aim (on a GPU only, NOT RUN on the CPU): ``mjp[triton]`` forward+backward at most 1.00x ``gather+linear`` at the GPU
batch. On the CPU the numbers say what the fused front end costs there (it runs the torch computation).

    python bench/bench_gathered_patch_embed.py [--smoke] [--repeats N] [--out DIR] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `mjp_fast` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import (
    Timing,
    aim_line,
    aim_verdict,
    error_lines,
    format_timing,
    markdown_table,
    measure,
    run_standalone,
    where_measured,
)

NAME = "gathered_patch_embed"
BASELINE = "gather+linear"
TORCH_ORDER = "linear+gather"
FRONT_UNFUSED, FRONT_FUSED = "front end unfused", "front end fused"
RATIO = 0.1
GPU_AIM_RATIO = 1.0
SIZES = {
    "cpu": dict(batch=16, grid=16, patch=16, dim=768, prefix=5),
    "cuda": dict(batch=256, grid=16, patch=16, dim=768, prefix=5),
    "smoke": dict(batch=2, grid=4, patch=4, dim=32, prefix=5),
}


def naflex_jigsaw(batch: int, length: int, ratio: float, generator: torch.Generator):
    """About ``ratio`` of each sample's rows masked and permuted among themselves (a NaFlex jigsaw's form)."""
    from mjp_fast import Jigsaw

    mask = torch.rand(batch, length, generator=generator) < ratio
    perm = torch.arange(length).repeat(batch, 1)
    for sample in range(batch):
        chosen = torch.nonzero(mask[sample]).flatten()
        perm[sample, chosen] = chosen[torch.randperm(len(chosen), generator=generator)]
    return Jigsaw(mask, perm)


class Problem:
    """One batch's inputs on the device: patch rows, weight, bias, position term, unk, prefix, jigsaw."""

    def __init__(self, sizes: dict, dtype: torch.dtype, device: str) -> None:
        generator = torch.Generator().manual_seed(0)
        batch, length = sizes["batch"], sizes["grid"] ** 2
        k, dim = sizes["patch"] ** 2 * 3, sizes["dim"]

        def randn(*shape, grad=True, scale=1.0):
            tensor = (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)
            return tensor.requires_grad_(grad)

        self.patches = randn(batch, length, k, grad=False)
        self.weight = randn(dim, k, scale=k**-0.5)
        self.bias = randn(dim, scale=0.02)
        self.pos = randn(batch, length, dim, scale=0.02)
        self.unk = randn(dim, scale=0.02)
        self.prefix = randn(1, sizes["prefix"], dim, scale=0.02)
        jigsaw = naflex_jigsaw(batch, length, RATIO, generator)
        self.jigsaw = type(jigsaw)(jigsaw.mask.to(device), jigsaw.perm.to(device))
        self.parameters = (self.weight, self.bias, self.pos, self.unk, self.prefix)

    def call(self, function: Callable, **keywords) -> torch.Tensor:
        return function(
            self.patches, self.weight, self.bias, self.pos, self.unk, self.jigsaw, prefix=self.prefix, **keywords
        )


def _front_ends(sizes: dict, dtype: torch.dtype, device: str):
    """A NaFlexVit (one block: only its embedding runs) converted fused and unfused, and a NaFlex dict of the sizes."""
    import timm

    import mjp_fast.timm as mjp_timm

    torch.manual_seed(0)
    grid = sizes["grid"]
    plain = timm.create_model(
        "naflexvit_base_patch16_gap", pretrained=False, depth=1, embed_dim=sizes["dim"], num_heads=4,
        patch_size=sizes["patch"], pos_embed_grid_size=(grid, grid), num_classes=10,
    ).to(device=device, dtype=dtype)  # fmt: skip
    settings = dict(ratio=RATIO, prob=1.0, min_block=1 if grid < 8 else 8)
    unfused = mjp_timm.convert(copy.deepcopy(plain), fused_patch_embed=False, **settings).train()
    fused = mjp_timm.convert(copy.deepcopy(plain), fused_patch_embed=True, **settings).train()
    batch, length = sizes["batch"], grid * grid
    ys, xs = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    coord = torch.stack((ys.flatten(), xs.flatten()), -1).repeat(batch, 1, 1).to(device)
    generator = torch.Generator().manual_seed(1)
    patches = torch.randn(batch, length, sizes["patch"] ** 2 * 3, generator=generator).to(device=device, dtype=dtype)
    valid = torch.ones(batch, length, dtype=torch.bool, device=device)
    return unfused, fused, (patches, coord, valid)


def backends_on(device: str) -> list[str]:
    import mjp_fast

    fits = {"cpu": ("cpu",), "cuda": ("triton",)}[device]
    return [name for name in mjp_fast.available_backends() if name in fits]


def run(sizes: dict, *, repeats: int, device: str, dtype: torch.dtype, errors: dict[str, str]) -> list[dict]:
    from mjp_fast.ops.gathered_patch_embed import mjp_gathered_patch_embed, mjp_gathered_patch_embed_ref

    problem = Problem(sizes, dtype, device)
    ops: dict[str, Callable[[], torch.Tensor]] = {
        BASELINE: lambda: problem.call(mjp_gathered_patch_embed_ref),
        TORCH_ORDER: lambda: problem.call(mjp_gathered_patch_embed, backend="torch", validate=False),
    }
    for backend in backends_on(device):
        ops[f"mjp[{backend}]"] = lambda backend=backend: problem.call(
            mjp_gathered_patch_embed, backend=backend, validate=False
        )
    unfused, fused, (patches, coord, valid) = _front_ends(sizes, dtype, device)
    front: dict[str, Callable[[], torch.Tensor]] = {
        FRONT_UNFUSED: lambda: unfused.embeds(patches, coord, valid)[0],
        FRONT_FUSED: lambda: fused.embeds(patches, coord, valid)[0],
    }
    rows = []
    for group, functions, parameters in (
        ("op", ops, problem.parameters),
        ("front end", front, None),
    ):
        for mode in ("forward", "forward+backward"):
            timed = {name: _mode(function, mode, parameters, model) for name, function, model in _with_models(
                functions, group, unfused, fused
            )}  # fmt: skip
            timings = measure(timed, repeats=repeats, warmup=2, min_sample_s=0.0, device=device, errors=errors)
            baseline = timings.get(BASELINE if group == "op" else FRONT_UNFUSED)
            for name, timing in timings.items():
                rows.append(_row(group, mode, name, timing, baseline))
    return rows


def _with_models(functions: dict, group: str, unfused, fused):
    for name, function in functions.items():
        model = (fused if name == FRONT_FUSED else unfused) if group == "front end" else None
        yield name, function, model


def _mode(function: Callable[[], torch.Tensor], mode: str, parameters, model) -> Callable[[], object]:
    if mode == "forward":

        def forward():
            with torch.no_grad():
                return function()

        return forward
    tensors = list(parameters) if parameters is not None else [p for p in model.parameters() if p.requires_grad]

    def forward_backward():
        for tensor in tensors:
            tensor.grad = None
        function().float().square().mean().backward()

    return forward_backward


def _row(group: str, mode: str, name: str, timing: Timing, baseline: Timing | None) -> dict:
    ratio = timing.median_s / baseline.median_s if baseline is not None else None
    return {"group": group, "mode": mode, "implementation": name, **timing.to_dict(), "ratio_vs_baseline": ratio}


def table(rows: list[dict]) -> str:
    body = [
        [
            row["group"],
            row["mode"],
            row["implementation"],
            format_timing(Timing(**{key: row[key] for key in Timing.__dataclass_fields__})),
            f"{row['ratio_vs_baseline']:.2f}x" if row["ratio_vs_baseline"] is not None else "n/a",
        ]
        for row in rows
    ]
    return markdown_table(["group", "mode", "implementation", "median [p20, p80]", "vs baseline"], body)


def _aims(rows: list[dict], *, smoke: bool, device: str) -> list[dict]:
    aim = f"mjp[triton] forward+backward <= {GPU_AIM_RATIO:.2f}x gather+linear (GPU only)"
    measured = None
    if device == "cuda" and not smoke:
        found = [r for r in rows if r["implementation"] == "mjp[triton]" and r["mode"] == "forward+backward"]
        measured = found[0]["ratio_vs_baseline"] if found else None
    if smoke:  # a smoke run judges nothing, as every case's
        verdict, note = "NOT JUDGED", "smoke run: tiny sizes"
    elif device != "cuda":
        verdict, note = "NOT RUN", "not run on the CPU"
    else:
        verdict, note = aim_verdict(measured, GPU_AIM_RATIO, higher_is_better=False), None
    return [{"aim": aim, "measured": measured, "unit": "x", "verdict": verdict, "note": note}]


def collect(*, smoke: bool, device: str, repeats: int | None = None) -> dict:
    """Measures the case; returns its section: ``config``, ``backends``, ``results``, ``errors``, ``aims``."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sizes = SIZES["smoke" if smoke else device]
    repeats = repeats or (2 if smoke else 10)
    errors: dict[str, str] = {}
    rows = run(sizes, repeats=repeats, device=device, dtype=dtype, errors=errors)
    config = {**sizes, "dtype": str(dtype).removeprefix("torch."), "repeats": repeats, "jigsaw_ratio": RATIO}
    return {
        "config": config,
        "backends": backends_on(device),
        "results": rows,
        "errors": errors,
        "aims": _aims(rows, smoke=smoke, device=device),
    }


def report(section: dict, info: dict) -> str:
    config = section["config"]
    grid = config["grid"]
    lines = [
        f"## Gathered patch embedding (NaFlex), B={config['batch']}, N={grid * grid}, K={config['patch'] ** 2 * 3}, "
        f"D={config['dim']}, P={config['prefix']}, {config['dtype']} ({where_measured(info)})",
        "",
        table(section["results"]),
        "",
    ]
    return "\n".join(lines + error_lines(section) + [aim_line(aim) for aim in section["aims"]])


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(NAME, __doc__.split("\n\n")[0], collect, report, argv)


if __name__ == "__main__":
    sys.exit(main())
