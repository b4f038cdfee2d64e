"""Cost of applying a jigsaw to a batch: the paper code's pixel pipeline against ``jigsaw_images`` and the fused
MJP patch embedding, which never makes a shuffled image.

Compared, in the same run, on one float32 batch (default 64 x 3 x 224 x 224, patch 16, D = 384: DeiT-S):

- ``paper pixel pipeline``: the approach of the paper's code, written here from its description: one block mask
  per batch by the Python loop and one permutation of its masked patches, shared by every image; ``Unfold`` into
  patches, a deep copy of the unfolded batch, fancy indexing that moves the masked patches, ``Fold`` back.
- ``jigsaw_images``: a jigsaw per sample from ``sample_jigsaw``, applied by ``mjp_fast.jigsaw_images``.
- ``timm PatchEmbed + pos_embed``: the plain patch embedding, no jigsaw: the cost every ViT pays anyway.
- ``paper pixel pipeline + timm PatchEmbed`` and ``jigsaw_images + timm PatchEmbed``: shuffled pixels, then the
  plain embedding and the position term (``unk_embed`` at masked positions): tokens, as a training step needs.
- ``fused mjp_patch_embed[<backend>]``: a jigsaw per sample and ``mjp_patch_embed``: the same tokens in one pass.
- ``timm PatchEmbed + mjp_pos_embed[<backend>]``: the plain embedding, then ``mjp_pos_embed`` moves the embedded
  tokens and adds the position term (``P(XW) = (PX)W``): the path of models whose patch embedding cannot be fused
  (a norm after it, a dynamic image size).

Every call samples a fresh jigsaw with its own sampler (the Python loop for the paper's pipeline, the compiled
sampler for ours), as a training step does. Forward only, under ``torch.no_grad()``: a training step needs no
gradient of the input pixels. The jigsaw's own cost is the time of the pixel-only rows; for the token rows it is
their time minus that of the plain embedding measured in the same run.

    python bench/bench_jigsaw_apply.py [--smoke] [--repeats N] [--out DIR] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `mjp_fast` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from torch import nn

from bench.common import (
    Timing,
    aim_line,
    error_lines,
    format_seconds,
    format_timing,
    markdown_table,
    measure,
    run_standalone,
    where_measured,
)

NAME = "jigsaw_apply"
MIN_BLOCK, MIN_ASPECT = 8, 0.3  # the paper's code
PAPER = "paper pixel pipeline"
PLAIN = "timm PatchEmbed + pos_embed"
TOKEN_PATH = "timm PatchEmbed + mjp_pos_embed"  # the unfused path, per backend


class PaperPixelJigsaw:
    """The paper code's way of jigsawing a batch, written from its description (docs/design.md section 6).

    One mask (BEiT's Python loop) and one permutation of its masked patches per call, shared by the batch;
    ``Unfold`` into ``[B, C*P*P, N]``, a deep copy of it, fancy indexing, ``Fold`` back to ``[B, C, H, W]``.
    """

    def __init__(self, image_size: tuple[int, int], patch_size: int, ratio: float, seed: int = 0) -> None:
        self.grid = (image_size[0] // patch_size, image_size[1] // patch_size)
        self.ratio = ratio
        self.rng = random.Random(seed)
        self.unfold = nn.Unfold(kernel_size=patch_size, stride=patch_size)
        self.fold = nn.Fold(output_size=image_size, kernel_size=patch_size, stride=patch_size)
        self.last_mask: np.ndarray | None = None  # bool [N]
        self.last_perm: np.ndarray | None = None  # int64 [N]: token n shows patch perm[n]

    def sample(self) -> tuple[np.ndarray, np.ndarray]:
        """The shared mask bool ``[N]`` and the masked positions in shuffled order."""
        from tests.harness.paper_sampler import block_mask_python

        mask = block_mask_python(self.grid, self.ratio, min_block=MIN_BLOCK, min_aspect=MIN_ASPECT, rng=self.rng)
        mask = mask.reshape(-1)
        masked = np.flatnonzero(mask)
        shuffled = masked.copy()
        self.rng.shuffle(shuffled)
        perm = np.arange(mask.size)
        perm[masked] = shuffled
        self.last_mask, self.last_perm = mask, perm
        return masked, shuffled

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        masked, shuffled = self.sample()
        masked = torch.from_numpy(masked).to(images.device)
        shuffled = torch.from_numpy(shuffled).to(images.device)
        patches = self.unfold(images)  # [B, C*P*P, N]
        source = copy.deepcopy(patches)
        patches[:, :, masked] = source[:, :, shuffled]
        return self.fold(patches)


class Problem:
    """The tensors of one configuration, shared by every implementation."""

    def __init__(self, batch: int, image_size: int, patch_size: int, dim: int, ratio: float, device: str) -> None:
        from timm.layers import PatchEmbed

        generator = torch.Generator().manual_seed(0)
        self.batch, self.patch_size, self.ratio, self.device = batch, patch_size, ratio, device
        self.grid = image_size // patch_size
        self.embed = PatchEmbed(img_size=image_size, patch_size=patch_size, in_chans=3, embed_dim=dim).to(device)
        num_positions = self.grid * self.grid
        self.pos_embed = (0.02 * torch.randn(1, num_positions, dim, generator=generator)).to(device)
        self.unk_embed = (0.02 * torch.randn(dim, generator=generator)).to(device)
        self.images = torch.randn(batch, 3, image_size, image_size, generator=generator).to(device)
        self.paper = PaperPixelJigsaw((image_size, image_size), patch_size, ratio)
        self.offset = 0

    def sample(self, backend: str | None = None):
        """A fresh per-sample jigsaw (prob 1: every image jigsawed), the stream moving on as in training."""
        from mjp_fast import sample_jigsaw

        jigsaw = sample_jigsaw(
            self.batch,
            self.grid,
            self.ratio,
            seed=0,
            offset=self.offset,
            min_block=MIN_BLOCK,
            min_aspect=MIN_ASPECT,
            device=self.device,
            backend=backend,
        )
        self.offset += self.batch
        return jigsaw

    def position_term(self, mask: torch.Tensor) -> torch.Tensor:
        """``unk_embed`` at masked positions, ``pos_embed[n]`` elsewhere: ``[B or 1, N, D]``."""
        return torch.where(mask[..., None], self.unk_embed, self.pos_embed)

    def paper_pixels(self) -> torch.Tensor:
        return self.paper(self.images)

    def ours_pixels(self) -> torch.Tensor:
        from mjp_fast import jigsaw_images

        return jigsaw_images(self.images, self.sample(), self.patch_size, validate=False)

    def plain_tokens(self) -> torch.Tensor:
        return self.embed(self.images) + self.pos_embed

    def paper_tokens(self) -> torch.Tensor:
        shuffled = self.paper(self.images)
        mask = torch.from_numpy(self.paper.last_mask).to(self.device)[None]
        return self.embed(shuffled) + self.position_term(mask)

    def ours_pixel_tokens(self) -> torch.Tensor:
        from mjp_fast import jigsaw_images

        jigsaw = self.sample()
        shuffled = jigsaw_images(self.images, jigsaw, self.patch_size, validate=False)
        return self.embed(shuffled) + self.position_term(jigsaw.mask)

    def fused_tokens(self, backend: str) -> torch.Tensor:
        from mjp_fast import mjp_patch_embed

        jigsaw = self.sample(backend)
        proj = self.embed.proj
        return mjp_patch_embed(
            self.images, proj.weight, proj.bias, self.pos_embed, self.unk_embed, jigsaw, backend=backend, validate=False
        )

    def moved_tokens(self, backend: str) -> torch.Tensor:
        from mjp_fast import mjp_pos_embed

        jigsaw = self.sample(backend)
        return mjp_pos_embed(
            self.embed(self.images), self.pos_embed, self.unk_embed, jigsaw, backend=backend, validate=False
        )

    def checks(self, backends: list[str], measured: Sequence[str]) -> dict[str, float | bool]:
        """The implementations compute the same thing: the paper's pixels equal ``jigsaw_images`` given its shared
        jigsaw; the fused embedding and the move of embedded tokens equal pixels-then-embedding on the same jigsaw
        (max abs error). ``measured``: the labels that ran (one that raised gets no check)."""
        from mjp_fast import Jigsaw, jigsaw_images, mjp_patch_embed, mjp_pos_embed

        with torch.no_grad():
            paper = self.paper(self.images)
            mask = torch.from_numpy(self.paper.last_mask).to(self.device)
            perm = torch.from_numpy(self.paper.last_perm).to(self.device)
            shared = Jigsaw(mask.expand(self.batch, -1).contiguous(), perm.expand(self.batch, -1).contiguous())
            results: dict[str, float | bool] = {
                PAPER: bool(torch.equal(paper, jigsaw_images(self.images, shared, self.patch_size)))
            }
            jigsaw = self.sample()
            expected = self.embed(jigsaw_images(self.images, jigsaw, self.patch_size)) + self.position_term(jigsaw.mask)
            proj = self.embed.proj
            for backend in backends:
                if f"fused mjp_patch_embed[{backend}]" in measured:
                    got = mjp_patch_embed(
                        self.images, proj.weight, proj.bias, self.pos_embed, self.unk_embed, jigsaw, backend=backend
                    )
                    results[f"fused mjp_patch_embed[{backend}]"] = float((got - expected).abs().max())
                if f"{TOKEN_PATH}[{backend}]" in measured:
                    got = mjp_pos_embed(
                        self.embed(self.images), self.pos_embed, self.unk_embed, jigsaw, backend=backend
                    )
                    results[f"{TOKEN_PATH}[{backend}]"] = float((got - expected).abs().max())
        return results


def backends_on(device: str) -> list[str]:
    import mjp_fast

    fits = {"cpu": ("torch", "cpu"), "cuda": ("torch", "cuda", "triton")}[device]
    return [name for name in reversed(mjp_fast.available_backends()) if name in fits]


def _no_grad(function: Callable[[], torch.Tensor]) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return function()

    return run


def run(
    *,
    batch: int,
    image_size: int,
    patch_size: int,
    dim: int,
    ratios: Sequence[float],
    repeats: int,
    warmup: int,
    min_sample_s: float,
    device: str,
    errors: dict[str, str] | None = None,
) -> tuple[list[dict], list[str]]:
    """Measures every ratio; returns the result rows and the backends. An implementation that raises is left out
    of the rows and its error recorded in ``errors``."""
    errors = {} if errors is None else errors
    backends = backends_on(device)
    rows = []
    for ratio in ratios:
        problem = Problem(batch, image_size, patch_size, dim, ratio, device)
        functions = {
            PAPER: (problem.paper_pixels, "pixels"),
            "jigsaw_images": (problem.ours_pixels, "pixels"),
            PLAIN: (problem.plain_tokens, "tokens"),
            f"{PAPER} + timm PatchEmbed": (problem.paper_tokens, "tokens"),
            "jigsaw_images + timm PatchEmbed": (problem.ours_pixel_tokens, "tokens"),
        }
        for name in backends:
            fused = lambda name=name, problem=problem: problem.fused_tokens(name)
            functions[f"fused mjp_patch_embed[{name}]"] = (fused, "tokens")
            moved = lambda name=name, problem=problem: problem.moved_tokens(name)
            functions[f"{TOKEN_PATH}[{name}]"] = (moved, "tokens")
        timings = measure(
            {label: _no_grad(function) for label, (function, _) in functions.items()},
            repeats=repeats,
            warmup=warmup,
            min_sample_s=min_sample_s,
            device=device,
            errors=errors,
        )
        checks = problem.checks(backends, list(timings))
        plain = timings[PLAIN].median_s
        # the paper's jigsaw cost in the same output: its pixel pipeline alone, or its tokens minus the plain ones
        paper_cost = {
            "pixels": timings[PAPER].median_s,
            "tokens": timings[f"{PAPER} + timm PatchEmbed"].median_s - plain,
        }
        for label, timing in timings.items():
            output = functions[label][1]
            if label == PLAIN:
                jigsaw_cost = None
            elif output == "pixels":
                jigsaw_cost = timing.median_s
            else:
                jigsaw_cost = timing.median_s - plain
            rows.append(
                {
                    "ratio": ratio,
                    "implementation": label,
                    "output": output,
                    "backend": label.split("[")[1].rstrip("]") if "[" in label else None,
                    **timing.to_dict(),
                    "jigsaw_cost_s": jigsaw_cost,
                    "jigsaw_cost_vs_plain_embedding": None if jigsaw_cost is None else jigsaw_cost / plain,
                    "paper_cost_over_jigsaw_cost": (
                        None if jigsaw_cost is None or jigsaw_cost <= 0 else paper_cost[output] / jigsaw_cost
                    ),
                    "check": checks.get(label),
                }
            )
    return rows, backends


def table(rows: list[dict]) -> str:
    headers = [
        "ratio",
        "implementation",
        "output",
        "median [p20, p80]",
        "jigsaw's cost",
        "vs plain embedding",
        "paper's cost / this",
        "check",
    ]
    body = []
    for row in rows:
        cost = row["jigsaw_cost_s"]
        body.append(
            [
                row["ratio"],
                row["implementation"],
                row["output"],
                format_timing(Timing(*(row[key] for key in TIMING_FIELDS))),
                "" if cost is None else ("-" if cost < 0 else "") + format_seconds(abs(cost)),
                "" if cost is None else f"{100 * row['jigsaw_cost_vs_plain_embedding']:+.1f}%",
                "" if row["paper_cost_over_jigsaw_cost"] is None else f"{row['paper_cost_over_jigsaw_cost']:.1f}x",
                _format_check(row["check"]),
            ]
        )
    return markdown_table(headers, body)


TIMING_FIELDS = ("median_s", "p20_s", "p80_s", "min_s", "samples", "calls_per_sample")


def _format_check(check: bool | float | None) -> str:
    if check is None:
        return ""
    if isinstance(check, bool):
        return "equal" if check else "DIFFERS"
    return f"{check:.1e}"


def collect(*, smoke: bool, device: str, repeats: int | None = None) -> dict:
    """Measures the case; returns its section of the results: ``config``, ``backends``, ``results``, ``aims``."""
    if smoke:
        config = {"batch": 2, "image_size": 32, "patch_size": 8, "dim": 32, "ratios": [0.1, 0.5]}
        config.update(warmup=1, min_sample_s=0.0, repeats=repeats or 2)
    else:
        config = {"batch": 64, "image_size": 224, "patch_size": 16, "dim": 384, "ratios": [0.1, 0.5]}
        config.update(warmup=2, min_sample_s=0.0, repeats=repeats or 15)
    errors: dict[str, str] = {}
    rows, backends = run(device=device, errors=errors, **config)
    return {
        "config": {**config, "dtype": "float32", "jigsaw_prob": 1.0, "min_block": MIN_BLOCK, "min_aspect": MIN_ASPECT},
        "backends": backends,
        "results": rows,
        "errors": errors,
        "aims": [],  # the issue sets no aim for this case: it shows where the paper's cost went
    }


def report(section: dict, info: dict) -> str:
    """The printed Markdown of a section: title with device and shapes, the table, the checks."""
    config = section["config"]
    shape = f"{config['batch']}x3x{config['image_size']}x{config['image_size']}"
    lines = [
        f"## Applying the jigsaw, {shape} {config['dtype']}, patch {config['patch_size']}, D={config['dim']}, "
        f"forward ({where_measured(info)})",
        "",
        table(section["results"]),
        "",
        "jigsaw's cost: the time of a pixel row; for a token row, its time minus the plain embedding's (the "
        "difference of two noisy medians: it can come out negative). paper's cost / this: the paper pipeline's "
        "jigsaw cost for the same output over this row's. check: the paper's pixels equal jigsaw_images on its "
        "shared jigsaw; the fused embedding's max abs difference from jigsaw_images + timm PatchEmbed.",
    ]
    lines += error_lines(section) + [aim_line(aim) for aim in section["aims"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(NAME, __doc__.split("\n\n")[0], collect, report, argv)


if __name__ == "__main__":
    sys.exit(main())
