"""Cost of the MJP patch embedding against timm's plain patch embedding and against a reshape plus one GEMM,
forward and forward+backward.

Compared, in the same run, at each batch size of a sweep (images 3 x 224 x 224, patch 16, D = 384, DeiT-S;
default batches: 16 and 64 on the CPU, 32 to 512 on a GPU):

- ``timm``: ``timm.layers.PatchEmbed`` followed by the position-embedding add, the baseline.
- ``linear``: the strongest non-fused alternative, flash-attention's ``PatchEmbed``: the images reshaped into
  patch rows ``[B, N, C*P*P]`` in the ``(c, py, px)`` order of the convolution's weight ``[D, C, P, P]`` (one
  copy), then ``F.linear`` with ``weight.reshape(D, -1)`` and the same bias, then the position-embedding add; the
  same parameters as ``timm``. Its forward is checked against timm's once per batch (:meth:`Problem.check_linear`).
- ``mjp[<backend>]``: ``mjp_patch_embed`` with a per-sample jigsaw (ratio 0.1, prob 1) on each available backend,
  with the same weight, bias and position embedding, and ``validate=False`` as ``MJPPatchEmbed`` calls it.
- ``mjp[<backend>] + sampling`` (forward+backward only): the same, sampling a fresh jigsaw each call on the same
  backend, as a training step pays it.

float32 on the CPU, bfloat16 on a GPU. "forward" runs under ``torch.no_grad()``; "forward+backward" computes the
gradients of weight, bias, pos_embed and unk_embed (not of the images, as in training), with grads set to None
before each call. Each row has its time over timm's (``ratio_vs_timm``) and over the linear baseline's
(``ratio_vs_linear``) in the same mode and batch. "max abs error vs ref" (forward rows): ours against the oracle
``mjp_patch_embed_ref`` in float32; timm's and linear's against the float32 convolution (in bfloat16, their own
rounding), the linear row also with ``max_abs_error_vs_timm`` and ``matches_timm``.

Aims:

- the ``cpu`` backend's forward+backward at most 1.10x the timm baseline, judged at batch 64 (the one batch the
  runs measured before the sweep, so the recorded ratios stay comparable); the other batches are reported only.
- on a GPU (``--device cuda``) only: the default GPU backend's (``resolve_backend(None, cuda)`` at run time, named
  in the aim) forward+backward with the jigsaw (``mjp[<backend>]``, the jigsaw given) at most 1.00x the ``linear``
  baseline, judged at batch 256; NOT RUN on the CPU.

Each row carries its ``batch``; ``config["batch"]`` is the batch the CPU aim is judged at, ``config["batches"]``
the sweep.

    python bench/bench_patch_embed.py [--smoke] [--repeats N] [--out DIR] [--device cpu|cuda] [--threads N]
        [--batches 16,64]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `mjp_fast` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

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
LINEAR = "linear"  # reshape into patch rows + F.linear: the strongest non-fused baseline
GPU_AIM_RATIO = 1.0  # the default GPU backend's fwd+bwd / linear fwd+bwd, judged on a GPU only
GPU_AIM_BATCH = 256
RATIO, PROB = 0.1, 1.0
AIM_BATCH = 64  # the aim is judged at this batch only: the runs before the batch sweep measured it alone
# The sweep per device. The CPU's stays short: a batch of 16 adds about half to the case's time on 2 cores (about
# 15 s), not a quarter, as the backward costs more per image at a small batch, timm's too. The GPU's spans the
# batch sizes of training, one power-of-two autotuning bucket of the Triton GEMMs each.
DEFAULT_BATCHES = {"cpu": (16, AIM_BATCH), "cuda": (32, AIM_BATCH, 128, 256, 512)}
SMOKE_BATCH = 2  # the smoke run's "judged" batch (a smoke run judges nothing)
SMOKE_BATCHES = (1, SMOKE_BATCH)


def linear_patch_embed(images: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The patch embedding as one GEMM over patch rows, without a convolution (as flash-attention's PatchEmbed).

    Args:
        images: ``[B, C, H, W]``, H and W multiples of the patch size P.
        weight: the convolution's ``[D, C, P, P]`` (timm's ``PatchEmbed.proj.weight``).
        bias: ``[D]`` or None.

    Returns:
        ``[B, N, D]`` tokens, N = (H/P)(W/P) in row-major grid order: timm's ``PatchEmbed`` output, equal within
        float tolerance (the sums run in another order). Under autocast the GEMM runs in the autocast dtype, as
        the convolution does.
    """
    batch, channels, height, width = images.shape
    dim, _, patch, _ = weight.shape
    rows, cols = height // patch, width // patch
    if torch.is_autocast_enabled(images.device.type):
        # Cast before the copy below, as the convolution casts its input under autocast: the patch rows then move
        # half the bytes of float32 ones (F.linear would cast them after the copy).
        images = images.to(torch.get_autocast_dtype(images.device.type))
    # (c, py, px) within a row, as weight.reshape(D, -1) flattens [C, P, P]; the reshape is the one copy (im2col)
    patches = images.reshape(batch, channels, rows, patch, cols, patch).permute(0, 2, 4, 1, 3, 5)
    patches = patches.reshape(batch, rows * cols, channels * patch * patch)
    return F.linear(patches, weight.reshape(dim, -1), bias)


class Problem:
    """The tensors of one benchmark configuration, shared by every implementation."""

    def __init__(self, batch: int, image_size: int, patch_size: int, dim: int, dtype: torch.dtype, device: str):
        from timm.layers import PatchEmbed

        from mjp_fast import sample_jigsaw

        generator = torch.Generator().manual_seed(0)
        self.batch, self.grid, self.device = batch, image_size // patch_size, device
        self.patch_size, self.dtype = patch_size, dtype
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

    def linear_forward(self) -> torch.Tensor:
        return linear_patch_embed(self.images, self.weight, self.bias) + self.pos_embed

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

    def plain_reference(self) -> torch.Tensor:
        """timm's computation (convolution + position add, no jigsaw) in float32: ``[B, N, D]``, the oracle of the
        ``timm`` and ``linear`` rows."""
        with torch.no_grad():
            tokens = F.conv2d(self.images.float(), self.weight.float(), self.bias.float(), stride=self.patch_size)
            return tokens.flatten(2).transpose(1, 2) + self.pos_embed.float()

    def check_linear(self) -> dict:
        """The ``linear`` baseline's forward against timm's, both against :meth:`plain_reference`.

        Returns ``timm_error`` and ``linear_error`` (largest absolute differences from the float32 oracle),
        ``linear_vs_timm`` (from timm's output), ``tolerance`` and ``matches``: the linear error at most twice
        timm's own in this dtype (the house rule for low precision; in float32 on the CPU timm's is 0, the oracle
        being its own convolution) plus the rounding of a float32 sum of K = C*P*P products in another order, about
        ``eps * sqrt(K)`` of the output's scale (3e-6 measured at DeiT-S shapes on the CPU, against 9e-6 allowed).
        """
        with torch.no_grad():
            expected = self.plain_reference()
            timm_out, linear_out = self.timm_forward().float(), self.linear_forward().float()
        timm_error = float((timm_out - expected).abs().max())
        linear_error = float((linear_out - expected).abs().max())
        scale = max(1.0, float(expected.abs().max()))
        terms = self.weight[0].numel()  # C*P*P products per output, summed in float32 by both (bf16: its GEMMs too)
        tolerance = 2.0 * timm_error + torch.finfo(torch.float32).eps * terms**0.5 * scale
        return {
            "timm_error": timm_error,
            "linear_error": linear_error,
            "linear_vs_timm": float((linear_out - timm_out).abs().max()),
            "tolerance": tolerance,
            "matches": linear_error <= tolerance,
        }


def backends_on(device: str) -> list[str]:
    import mjp_fast

    fits = {"cpu": ("torch", "cpu"), "cuda": ("torch", "cuda", "triton")}[device]
    return [name for name in reversed(mjp_fast.available_backends()) if name in fits]


def run(
    *,
    batches: Sequence[int],
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
    """Measures both modes at each batch size, in the order given; returns the result rows (each with its
    ``batch``) and the backends. An implementation that raises is left out of that batch's rows and its error
    recorded in ``errors`` under ``"<implementation>, batch <B>"``."""
    errors = {} if errors is None else errors
    backends = backends_on(device)
    rows = []
    for batch in batches:
        # one batch's tensors at a time: the largest GPU batch's images and gradients alone fill a few hundred MB
        problem = Problem(batch, image_size, patch_size, dim, dtype, device)
        batch_errors: dict[str, str] = {}
        rows += _measure_batch(problem, backends, repeats, warmup, min_sample_s, device, batch_errors)
        errors.update({f"{name}, batch {batch}": message for name, message in batch_errors.items()})
        del problem
    return rows, backends


def _measure_batch(
    problem: Problem,
    backends: list[str],
    repeats: int,
    warmup: int,
    min_sample_s: float,
    device: str,
    errors: dict[str, str],
) -> list[dict]:
    """The rows of one batch size: every implementation in both modes, each mode's timings interleaved; the linear
    baseline checked against timm's once (:meth:`Problem.check_linear`; a mismatch is recorded in ``errors``)."""
    batch = problem.batch
    rows = []
    for mode in ("forward", "forward+backward"):
        wrap = problem.forward_only if mode == "forward" else problem.forward_backward
        functions = {BASELINE: wrap(problem.timm_forward), LINEAR: wrap(problem.linear_forward)}
        for name in backends:
            functions[f"mjp[{name}]"] = wrap(lambda name=name: problem.mjp_forward(name))
        if mode == "forward+backward":
            for name in backends:
                functions[f"mjp[{name}] + sampling"] = wrap(lambda name=name: problem.mjp_forward(name, sample=True))
        timings = measure(
            functions, repeats=repeats, warmup=warmup, min_sample_s=min_sample_s, device=device, errors=errors
        )
        baseline = timings[BASELINE].median_s
        linear = timings[LINEAR].median_s if LINEAR in timings else None
        check = problem.check_linear() if mode == "forward" and linear is not None else None
        if check is not None and not check["matches"]:
            errors[LINEAR] = (
                f"check: its forward is {check['linear_error']:.2e} from the float32 convolution, more than the "
                f"tolerance {check['tolerance']:.2e} (timm's: {check['timm_error']:.2e})"
            )
        for label, timing in timings.items():
            backend = None if label in (BASELINE, LINEAR) else label.split("[")[1].split("]")[0]
            error = problem.max_error(backend) if backend and mode == "forward" else None
            if check is not None and label in (BASELINE, LINEAR):
                error = check["timm_error" if label == BASELINE else "linear_error"]
            own_check = check is not None and label == LINEAR
            rows.append(
                {
                    "mode": mode,
                    "batch": batch,
                    "implementation": label,
                    "backend": backend,
                    **timing.to_dict(),
                    "ratio_vs_timm": timing.median_s / baseline,
                    "ratio_vs_linear": None if linear is None else timing.median_s / linear,
                    "images_per_s": batch / timing.median_s,
                    "max_abs_error_vs_ref": error,
                    "max_abs_error_vs_timm": check["linear_vs_timm"] if own_check else None,
                    "matches_timm": check["matches"] if own_check else None,
                }
            )
    return rows


def table(rows: list[dict], batch: int | None = None) -> str:
    """The rows as Markdown; ``batch``: the batch of rows that record none (runs from before the sweep). The "vs
    linear" column only where a row has that ratio (runs from before the linear baseline have none)."""
    linear = any(row.get("ratio_vs_linear") is not None for row in rows)
    headers = ["batch", "mode", "implementation", "median [p20, p80]", "vs timm", *(["vs linear"] if linear else [])]
    headers += ["images/s", "max abs error vs ref"]
    body = []
    for row in rows:
        ratio = row.get("ratio_vs_linear")
        versus_linear = ["" if ratio is None else f"{ratio:.2f}x"] if linear else []
        error = row["max_abs_error_vs_ref"]
        body.append(
            [
                row.get("batch", batch),
                row["mode"],
                row["implementation"],
                format_timing_from_row(row),
                f"{row['ratio_vs_timm']:.2f}x",
                *versus_linear,
                f"{row['images_per_s']:.0f}",
                "" if error is None else f"{error:.1e}",
            ]
        )
    return markdown_table(headers, body)


def format_timing_from_row(row: dict) -> str:
    fields = ("median_s", "p20_s", "p80_s", "min_s", "samples", "calls_per_sample")
    return format_timing(Timing(*(row[field] for field in fields)))


def _aims(
    rows: list[dict],
    *,
    smoke: bool,
    device: str,
    batch: int,
    errors: dict[str, str] | None = None,
    gpu_backend: str | None = None,
) -> list[dict]:
    """The aims: the CPU one judged on the rows of ``batch`` alone (:func:`_cpu_aim`), then the GPU one
    (:func:`_gpu_aim`; ``gpu_backend``: the default GPU backend of this run, None off a GPU)."""
    return [
        _cpu_aim(rows, smoke=smoke, device=device, batch=batch, errors=errors),
        _gpu_aim(rows, smoke=smoke, device=device, errors=errors, backend=gpu_backend),
    ]


def _cpu_aim(rows: list[dict], *, smoke: bool, device: str, batch: int, errors: dict[str, str] | None) -> dict:
    """The ``cpu`` backend's forward+backward against timm's, judged on the rows of ``batch`` alone."""
    measured = next(
        (
            row["ratio_vs_timm"]
            for row in rows
            if row["mode"] == "forward+backward" and row["implementation"] == "mjp[cpu]" and row["batch"] == batch
        ),
        None,
    )
    aim = {
        "aim": f"cpu backend forward+backward at most {AIM_RATIO:.2f}x the timm baseline, batch {batch}",
        "threshold": AIM_RATIO,
        "measured": measured,
        "unit": "x",
        "verdict": aim_verdict(measured, AIM_RATIO, higher_is_better=False),
        "batch": batch,
    }
    raised = [
        f"{name}: {message}"
        for name, message in (errors or {}).items()
        if name.startswith("mjp[cpu]") and name.endswith(f", batch {batch}")  # other batches: reported, not judged
    ]
    measured_batches = {row["batch"] for row in rows}
    if raised:  # a backend that raises misses the aim, whatever its other timings
        aim.update(verdict="FAIL", note=f"raised: {raised[0]}")
    elif measured is None and device == "cpu" and measured_batches and batch not in measured_batches:
        aim["note"] = f"batch {batch} not in the sweep"
    elif measured is None:
        why = "the compiled extension mjp_fast._C is not available" if device == "cpu" else "measured on the CPU only"
        aim["note"] = why
    elif smoke:
        aim.update(verdict="NOT JUDGED", note="smoke run: tiny sizes")
    return aim


def _gpu_aim(rows: list[dict], *, smoke: bool, device: str, errors: dict[str, str] | None, backend: str | None) -> dict:
    """The default GPU backend's forward+backward with the jigsaw (``mjp[<backend>]``) against the ``linear``
    baseline at :data:`GPU_AIM_BATCH`, judged on a GPU only: elsewhere NOT RUN (NOT JUDGED in a smoke run), with a
    note that says so."""
    batch = GPU_AIM_BATCH
    named = f"the default GPU backend ({backend})" if backend else "the default GPU backend"
    aim = {
        "aim": f"on a GPU, {named} forward+backward with the jigsaw at most {GPU_AIM_RATIO:.2f}x the linear "
        f"baseline (reshape + F.linear), batch {batch}",
        "threshold": GPU_AIM_RATIO,
        "measured": None,
        "unit": "x",
        "verdict": "NOT RUN",
        "batch": batch,
        "backend": backend,
    }
    implementation = f"mjp[{backend}]"
    errors = errors or {}
    raised = [  # "mjp[cuda], batch 256" or "mjp[cuda] + sampling, batch 256", as the CPU aim counts them
        f"{name}: {message}"
        for name, message in errors.items()
        if name.startswith(implementation) and name.endswith(f", batch {batch}")
    ]
    linear_failed = errors.get(f"{LINEAR}, batch {batch}")
    row = next(
        (
            row
            for row in rows
            if (row["mode"], row["implementation"], row["batch"]) == ("forward+backward", implementation, batch)
        ),
        None,
    )
    if device != "cuda":
        aim["note"] = f"judged on a GPU only (--device cuda); measured on {device}"
        if smoke:
            aim.update(verdict="NOT JUDGED", note="smoke run: tiny sizes; " + aim["note"])
    elif raised:  # the backend that a GPU run uses by default raises: the aim is missed
        aim.update(verdict="FAIL", note=f"raised: {raised[0]}")
    elif linear_failed:
        aim["note"] = f"the linear baseline did not give timm's output: {linear_failed}"
    elif row is None or row.get("ratio_vs_linear") is None:
        measured_batches = {row["batch"] for row in rows}
        aim["note"] = f"batch {batch} not in the sweep" if batch not in measured_batches else "not measured"
    else:
        aim["measured"] = row["ratio_vs_linear"]
        aim["verdict"] = aim_verdict(aim["measured"], GPU_AIM_RATIO, higher_is_better=False)
        if smoke:
            aim.update(verdict="NOT JUDGED", note="smoke run: tiny sizes")
    return aim


def parse_batches(text: str | Sequence[int]) -> tuple[int, ...]:
    """``"16,64"`` or ``[16, 64]`` -> ``(16, 64)``: positive batch sizes, in the order given, without repeats."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    try:
        batches = tuple(dict.fromkeys(int(part) for part in parts if str(part).strip()))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise ValueError(f"batches must be positive integers separated by commas, like 16,64; got {text!r}")
    return batches


def collect(
    *, smoke: bool, device: str, repeats: int | None = None, batches: str | Sequence[int] | None = None
) -> dict:
    """Measures the case; returns its section of the results: ``config``, ``backends``, ``results``, ``aims``.

    ``batches``: the batch sizes of the sweep (default: :data:`DEFAULT_BATCHES` of the device; a smoke run's
    tiny ones). ``config["batch"]`` is the batch the aim is judged at, whether or not the sweep holds it.
    """
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if smoke:
        config = {"batch": SMOKE_BATCH, "image_size": 32, "patch_size": 8, "dim": 32, "warmup": 2, "min_sample_s": 0.0}
        config["repeats"] = repeats or 2
        default_batches = SMOKE_BATCHES
    else:
        config = {"batch": AIM_BATCH, "image_size": 224, "patch_size": 16, "dim": 384, "warmup": 2, "min_sample_s": 0.0}
        config["repeats"] = repeats or 15
        default_batches = DEFAULT_BATCHES[device]
    config["batches"] = list(parse_batches(default_batches if batches is None else batches))
    errors: dict[str, str] = {}
    measured = {key: value for key, value in config.items() if key != "batch"}
    rows, backends = run(device=device, dtype=dtype, errors=errors, **measured)
    gpu_backend = None
    if device == "cuda":  # the GPU aim's backend: the one a GPU run takes by default, as this machine resolves it
        from mjp_fast.backend import resolve_backend

        gpu_backend = resolve_backend(None, torch.device("cuda"))
    config |= {"dtype": str(dtype).removeprefix("torch."), "jigsaw_ratio": RATIO, "jigsaw_prob": PROB}
    config |= {"gpu_aim_batch": GPU_AIM_BATCH, "gpu_aim_backend": gpu_backend}
    return {
        "config": config,
        "backends": backends,
        "results": rows,
        "errors": errors,
        "aims": _aims(rows, smoke=smoke, device=device, batch=config["batch"], errors=errors, gpu_backend=gpu_backend),
    }


def report(section: dict, info: dict) -> str:
    """The printed Markdown of a section: title with device and shapes, the table, one line per aim."""
    config = section["config"]
    batches = config.get("batches") or [config["batch"]]  # runs before the sweep measured config["batch"] alone
    image = f"3x{config['image_size']}x{config['image_size']}"
    shape = f"{batches[0]}x{image}" if len(batches) == 1 else f"Bx{image} for B in {', '.join(map(str, batches))}"
    lines = [
        f"## Patch embedding, {shape}, patch {config['patch_size']}, D={config['dim']}, {config['dtype']} "
        f"({where_measured(info)})",
        "",
        table(section["results"], config["batch"]),
        "",
    ]
    return "\n".join(lines + error_lines(section) + [aim_line(aim) for aim in section["aims"]])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The script's own option: the batch sizes of the sweep."""
    parser.add_argument(
        "--batches",
        type=_batches_argument,
        default=None,
        metavar="B[,B...]",
        help=f"batch sizes to measure (default: {','.join(map(str, DEFAULT_BATCHES['cpu']))} on the CPU, "
        f"{','.join(map(str, DEFAULT_BATCHES['cuda']))} on a GPU; the aim is judged at {AIM_BATCH} only)",
    )


def _batches_argument(text: str) -> tuple[int, ...]:
    try:
        return parse_batches(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(NAME, __doc__.split("\n\n")[0], collect, report, argv, add_arguments)


if __name__ == "__main__":
    sys.exit(main())
