"""Cost of the MJP patch embedding against timm's plain patch embedding, forward and forward+backward.

Compared, in the same run, on one batch (default: 64 x 3 x 224 x 224, patch 16, D = 384, DeiT-S):

- ``timm``: ``timm.layers.PatchEmbed`` followed by the position-embedding add, the baseline.
- ``mjp[<backend>]``: ``mjp_patch_embed`` with a per-sample jigsaw (ratio 0.1, prob 1) on each available backend,
  with the same weight, bias and position embedding, and ``validate=False`` as ``MJPPatchEmbed`` calls it.
- ``mjp[<backend>] + sampling`` (forward+backward only): the same, sampling a fresh jigsaw each call on the same
  backend, as a training step pays it.

float32 on the CPU, bfloat16 on a GPU. "forward" runs under ``torch.no_grad()``; "forward+backward" computes the
gradients of weight, bias, pos_embed and unk_embed (not of the images, as in training), with grads set to None
before each call.

Aim: the ``cpu`` backend's forward+backward at most 1.10x the timm baseline.

    python bench/bench_patch_embed.py [--smoke] [--repeats N] [--out DIR] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

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

NAME = "patch_embed"
AIM_RATIO = 1.10  # cpu backend fwd+bwd / timm fwd+bwd
BASELINE = "timm"
RATIO, PROB = 0.1, 1.0


class Problem:
    """The tensors of one benchmark configuration, shared by every implementation."""

    def __init__(self, batch: int, image_size: int, patch_size: int, dim: int, dtype: torch.dtype, device: str):
        from timm.layers import PatchEmbed

        from mjp_fast import sample_jigsaw

        generator = torch.Generator().manual_seed(0)
        self.batch, self.grid, self.device = batch, image_size // patch_size, device
        self.timm_embed = PatchEmbed(img_size=image_size, patch_size=patch_size, in_chans=3, embed_dim=dim)
        self.timm_embed = self.timm_embed.to(device=device, dtype=dtype)
        num_positions = self.grid * self.grid
        self.pos_embed = torch.nn.Parameter(
            (0.02 * torch.randn(1, num_positions, dim, generator=generator)).to(device=device, dtype=dtype)
        )
        self.unk_embed = torch.nn.Parameter((0.02 * torch.randn(dim, generator=generator)).to(device, dtype))
        self.images = torch.randn(batch, 3, image_size, image_size, generator=generator).to(device, dtype)
        self.grad_tokens = torch.randn(batch, num_positions, dim, generator=generator).to(device, dtype)
        self.jigsaw = sample_jigsaw(batch, self.grid, RATIO, seed=0, prob=PROB, device=device)
        self.offset = batch

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.timm_embed.proj.weight

    @property
    def bias(self) -> torch.nn.Parameter:
        return self.timm_embed.proj.bias

    def parameters(self) -> list[torch.nn.Parameter]:
        return [self.weight, self.bias, self.pos_embed, self.unk_embed]

    def timm_forward(self) -> torch.Tensor:
        return self.timm_embed(self.images) + self.pos_embed

    def mjp_forward(self, backend: str, *, sample: bool = False) -> torch.Tensor:
        from mjp_fast import mjp_patch_embed, sample_jigsaw

        jigsaw = self.jigsaw
        if sample:
            jigsaw = sample_jigsaw(
                self.batch, self.grid, RATIO, seed=0, offset=self.offset, prob=PROB, device=self.device, backend=backend
            )
            self.offset += self.batch
        return mjp_patch_embed(
            self.images, self.weight, self.bias, self.pos_embed, self.unk_embed, jigsaw, backend=backend, validate=False
        )

    def forward_only(self, forward: Callable[[], torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return forward()

        return run

    def forward_backward(self, forward: Callable[[], torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            for parameter in self.parameters():
                parameter.grad = None
            forward().backward(self.grad_tokens)

        return run

    def max_error(self, backend: str) -> float:
        """Largest absolute difference of the forward from the oracle ``mjp_patch_embed_ref`` (in float32)."""
        from mjp_fast.ops.patch_embed import mjp_patch_embed_ref

        with torch.no_grad():
            expected = mjp_patch_embed_ref(
                self.images, self.weight, self.bias, self.pos_embed, self.unk_embed, self.jigsaw, upcast=True
            )
            got = self.mjp_forward(backend)
        return float((got.float() - expected.float()).abs().max())


def backends_on(device: str) -> list[str]:
    import mjp_fast

    fits = {"cpu": ("torch", "cpu"), "cuda": ("torch", "cuda", "triton")}[device]
    return [name for name in reversed(mjp_fast.available_backends()) if name in fits]


def run(
    *,
    batch: int,
    image_size: int,
    patch_size: int,
    dim: int,
    repeats: int,
    warmup: int,
    min_sample_s: float,
    device: str,
    dtype: torch.dtype,
    errors: dict[str, str] | None = None,
) -> tuple[list[dict], list[str]]:
    """Measures both modes; returns the result rows and the backends. An implementation that raises is left out
    of the rows and its error recorded in ``errors``."""
    errors = {} if errors is None else errors
    problem = Problem(batch, image_size, patch_size, dim, dtype, device)
    backends = backends_on(device)
    rows = []
    for mode in ("forward", "forward+backward"):
        wrap = problem.forward_only if mode == "forward" else problem.forward_backward
        functions = {BASELINE: wrap(problem.timm_forward)}
        for name in backends:
            functions[f"mjp[{name}]"] = wrap(lambda name=name: problem.mjp_forward(name))
        if mode == "forward+backward":
            for name in backends:
                functions[f"mjp[{name}] + sampling"] = wrap(lambda name=name: problem.mjp_forward(name, sample=True))
        timings = measure(
            functions, repeats=repeats, warmup=warmup, min_sample_s=min_sample_s, device=device, errors=errors
        )
        baseline = timings[BASELINE].median_s
        for label, timing in timings.items():
            backend = None if label == BASELINE else label.split("[")[1].split("]")[0]
            rows.append(
                {
                    "mode": mode,
                    "implementation": label,
                    "backend": backend,
                    **timing.to_dict(),
                    "ratio_vs_timm": timing.median_s / baseline,
                    "images_per_s": batch / timing.median_s,
                    "max_abs_error_vs_ref": problem.max_error(backend) if backend and mode == "forward" else None,
                }
            )
    return rows, backends


def table(rows: list[dict]) -> str:
    headers = ["mode", "implementation", "median [p20, p80]", "vs timm", "images/s", "max abs error vs ref"]
    body = [
        [
            row["mode"],
            row["implementation"],
            format_timing_from_row(row),
            f"{row['ratio_vs_timm']:.2f}x",
            f"{row['images_per_s']:.0f}",
            "" if row["max_abs_error_vs_ref"] is None else f"{row['max_abs_error_vs_ref']:.1e}",
        ]
        for row in rows
    ]
    return markdown_table(headers, body)


def format_timing_from_row(row: dict) -> str:
    fields = ("median_s", "p20_s", "p80_s", "min_s", "samples", "calls_per_sample")
    return format_timing(Timing(*(row[field] for field in fields)))


def _aims(rows: list[dict], *, smoke: bool, device: str, errors: dict[str, str] | None = None) -> list[dict]:
    measured = next(
        (
            row["ratio_vs_timm"]
            for row in rows
            if row["mode"] == "forward+backward" and row["implementation"] == "mjp[cpu]"
        ),
        None,
    )
    aim = {
        "aim": f"cpu backend forward+backward at most {AIM_RATIO:.2f}x the timm baseline",
        "threshold": AIM_RATIO,
        "measured": measured,
        "unit": "x",
        "verdict": aim_verdict(measured, AIM_RATIO, higher_is_better=False),
    }
    raised = [f"{name}: {message}" for name, message in (errors or {}).items() if name.startswith("mjp[cpu]")]
    if raised:  # a backend that raises misses the aim, whatever its other timings
        aim.update(verdict="FAIL", note=f"raised: {raised[0]}")
    elif measured is None:
        why = "the compiled extension mjp_fast._C is not available" if device == "cpu" else "measured on the CPU only"
        aim["note"] = why
    elif smoke:
        aim.update(verdict="NOT JUDGED", note="smoke run: tiny sizes")
    return [aim]


def collect(*, smoke: bool, device: str, repeats: int | None = None) -> dict:
    """Measures the case; returns its section of the results: ``config``, ``backends``, ``results``, ``aims``."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if smoke:
        config = {"batch": 2, "image_size": 32, "patch_size": 8, "dim": 32, "warmup": 2, "min_sample_s": 0.0}
        config["repeats"] = repeats or 2
    else:
        config = {"batch": 64, "image_size": 224, "patch_size": 16, "dim": 384, "warmup": 2, "min_sample_s": 0.0}
        config["repeats"] = repeats or 15
    errors: dict[str, str] = {}
    rows, backends = run(device=device, dtype=dtype, errors=errors, **config)
    return {
        "config": {**config, "dtype": str(dtype).removeprefix("torch."), "jigsaw_ratio": RATIO, "jigsaw_prob": PROB},
        "backends": backends,
        "results": rows,
        "errors": errors,
        "aims": _aims(rows, smoke=smoke, device=device, errors=errors),
    }


def report(section: dict, info: dict) -> str:
    """The printed Markdown of a section: title with device and shapes, the table, one line per aim."""
    config = section["config"]
    shape = f"{config['batch']}x3x{config['image_size']}x{config['image_size']}, patch {config['patch_size']}"
    lines = [
        f"## Patch embedding, {shape}, D={config['dim']}, {config['dtype']} ({where_measured(info)})",
        "",
        table(section["results"]),
        "",
    ]
    return "\n".join(lines + error_lines(section) + [aim_line(aim) for aim in section["aims"]])


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(NAME, __doc__.split("\n\n")[0], collect, report, argv)


if __name__ == "__main__":
    sys.exit(main())
