"""What MJP adds to a whole training step of timm's DeiT-Tiny and DeiT-Small: the overhead in percent.

Compared, in the same run, with identical starting weights:

- ``plain``: ``timm.create_model(<deit>, pretrained=False)``; loss: cross-entropy.
- ``plain + linear embed``: a deep copy of it whose ``patch_embed.proj`` (the Conv2d) is a
  :class:`LinearPatchProjection` holding the same weight and bias: the images reshaped into patch rows and one
  ``F.linear`` (:func:`bench.bench_patch_embed.linear_patch_embed`, flash-attention's patch embedding), the
  strongest non-fused patch embedding; the rest of the model unchanged.
- ``plain + fast patch embed``: a deep copy with our fused patch embedding (``mjp_fast.timm.fast_patch_embed``),
  the baseline of MJP's own cost, as the MJP models run it too.
- ``mjp prob=0.5`` and ``mjp prob=1.0``: a deep copy of it through ``mjp_fast.timm.convert(copy, ratio=0.1,
  prob=..., dal="nonlinear", dal_weight=0.01)``; loss: cross-entropy, whose backward trains DAL too (the forward
  attaches the DAL loss to the tokens at ``mjp_dal_weight``, as in ``mjp train`` and any timm loop).

A step is forward, loss, backward, ``AdamW.step()`` and ``zero_grad(set_to_none=True)``, on one fixed synthetic
batch already on the device (no data loading: it is the same for both). After warm-up rounds, the variants run
in interleaved rounds (plain, linear, fast, 0.5, 1.0, then 1.0, 0.5, fast, linear, plain, ...), one step each, so
that the machine's drifts hit them alike. The overhead of a round is ``t_mjp / t_plain - 1`` of that round's
steps; we report its median over the rounds (the pairs) and its 20th/80th percentiles, and also the ratio of the
median step times; the same against plain timm with the fast patch embedding (what the aims judge) and against
the linear embedding.

Steady state: each step above is timed alone, the device synchronized after it. Beside it, after the pairs, every
variant runs blocks of steps back to back, the device synchronized only at a block's start and end (so the host
queues the next step while the GPU runs this one, as a training loop does), in alternating order (plain ... mjp,
then mjp ... plain, ...), so drifts hit them alike: images per second per block, and per block the overhead
``ips_baseline / ips_variant - 1``, whose median over the blocks is reported. On the CPU, 2 blocks of 3 steps
(a DeiT-Tiny step takes seconds: the figure is coarse and the CPU aim is not judged on it); on a GPU, 4 blocks
of 8 steps. A model's seconds budget covers its blocks: the pairs stop early enough to leave room for them.

On the CPU: float32, small batches (a DeiT-Tiny step at batch 32 takes seconds on 2 cores), wall-clock time.
On a GPU: bfloat16 autocast, CUDA events around each step, optionally ``torch.compile`` (``--compile``).

A second, low-noise estimate, "isolated": MJP's own work in a step (the jigsaw sampling, the token gather, the
position term with ``unk_embed``, the DAL loss, forward and backward) timed alone with many repeats against the
plain position-embedding add, divided by the plain step's median. It leaves out the optimizer's update of MJP's
few extra parameters.

Aims: on the CPU, DeiT-Tiny, batch 32, 224 px: overhead at most 2%. On an H100, bfloat16, DeiT-S, batch 256:
at most 0.25%. The GPU aims are judged twice, on the pairs' median and on the steady state's: they must hold on
both.

    python bench/bench_train_step.py [--smoke] [--repeats PAIRS] [--out DIR] [--device cpu|cuda] [--threads N]
        [--compile] [--steady-blocks N] [--steady-steps N]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `mjp_fast` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F

from bench.bench_patch_embed import linear_patch_embed  # the patch_embed case's linear baseline, shared
from bench.common import (
    Timing,
    aim_line,
    aim_verdict,
    compared_backends,
    format_seconds,
    format_timing,
    markdown_table,
    measure,
    run_standalone,
    synchronizer,
    where_measured,
)
from mjp_fast._argtypes import COMPILE_MODES  # torch.compile's modes, as `mjp train compile_mode=` takes them

NAME = "train_step"
MJP_RATIO = 0.1
MJP_PROBS = (0.5, 1.0)
DAL_KIND = "nonlinear"
DAL_WEIGHT = 0.01
PLAIN = "plain"
MODEL_TITLES = {"deit_tiny_patch16_224": "DeiT-Tiny", "deit_small_patch16_224": "DeiT-Small"}

# (model, batch, pairs, seconds budget); the budget ends a run early, after at least MIN_PAIRS pairs.
# On these shared CPUs a single step's time wanders by about 5% (the neighbours' load: a thread's own CPU time
# wanders with it, so it is not steal), against an MJP cost near 0.2%: resolving a 2% aim needs dozens of pairs.
CPU_RUNS = (("deit_tiny_patch16_224", 32, 80, 600.0), ("deit_small_patch16_224", 8, 30, 150.0))
# On a GPU each backend (triton, cuda) runs its own rounds: 30 pairs each resolved the H200's overheads to within
# about +-0.5% (its 40 pairs of 2026-11-27: 95% CIs 1-1.9 points wide), in half the stage's time.
GPU_RUNS = (("deit_tiny_patch16_224", 256, 30, 30.0), ("deit_small_patch16_224", 256, 30, 30.0))
SMOKE_RUNS = (("deit_tiny_patch16_224", 2, 2, None),)  # one block (see run_model): seconds, not minutes
# Steady state (blocks, steps per block): few on the CPU, whose steps take seconds, to keep its run's time (DeiT-Tiny
# at batch 32: 2 x 3 steps of 5 variants, about a minute, which the model's seconds budget takes from the pairs); on
# a GPU enough steps per block that the queue fills, an even number of blocks so each order runs as often.
STEADY = {"cpu": (2, 3), "cuda": (4, 8), "smoke": (2, 1)}
MIN_PAIRS = 5
QUIET_MARGIN = 1.25  # a "quiet" pair: both steps within 25% of the fastest step measured for the model
BOOTSTRAP_RESAMPLES = 2000  # for the 95% confidence interval of the median overhead
DEVICE_TIME_CALLS, DEVICE_TIME_ROUNDS = 10, 3  # the GPU busy time of the isolated work: calls per round, rounds
TOP_KERNELS = 12  # per variant, the kernels of its isolated work that a row lists with their GPU time
GPU_WORK_AIM_S = 80e-6  # MJP's isolated work at most 80 us of GPU busy time per step (issue 21), DeiT-S batch 256
CPU_AIM_PCT, GPU_AIM_PCT = 2.0, 0.25
AIMS = (  # device kind, model, batch, dtype, threshold in percent, compiled (torch.compile) or eager
    ("cpu", "deit_tiny_patch16_224", 32, "float32", CPU_AIM_PCT, False),
    ("H100", "deit_small_patch16_224", 256, "bfloat16", GPU_AIM_PCT, False),
    ("H100", "deit_tiny_patch16_224", 256, "bfloat16", 2.0, False),  # host-bound on the lent machines' slow CPU
    ("H100", "deit_small_patch16_224", 256, "bfloat16", GPU_AIM_PCT, True),
    ("H100", "deit_tiny_patch16_224", 256, "bfloat16", 0.5, True),
)
GPU_KINDS = ("H100", "H200")  # the aims' GPU: either of the machines the project is lent


FAST = "fast"  # the key of plain timm with our fused patch embedding (mjp_fast.timm.fast_patch_embed)
LINEAR = "linear"  # the key of plain timm with its Conv2d replaced by reshape + F.linear (LinearPatchProjection)


def variant_name(prob: float | str | None) -> str:
    if prob is None:
        return PLAIN
    if prob == FAST:
        return "plain + fast patch embed"
    if prob == LINEAR:
        return "plain + linear embed"
    return f"mjp prob={prob:g}"


class LinearPatchProjection(torch.nn.Module):
    """Stands in for timm's ``PatchEmbed.proj`` (a Conv2d whose stride is its square kernel P, no padding): the same
    ``weight [D, C, P, P]`` and ``bias [D]`` parameters (same names, so the state dict is unchanged), applied as a
    reshape into patch rows and one ``F.linear`` (:func:`~bench.bench_patch_embed.linear_patch_embed`).

    Returns ``[B, D, H/P, W/P]`` as the convolution does: a permuted view of the linear's contiguous ``[B, N, D]``
    output, so ``PatchEmbed``'s ``flatten(2).transpose(1, 2)`` gives that output back as a view, without a copy,
    and the model runs unchanged.
    """

    def __init__(self, conv: torch.nn.Conv2d) -> None:
        super().__init__()
        patch = conv.kernel_size
        if (
            patch[0] != patch[1]
            or tuple(conv.stride) != tuple(patch)
            or tuple(conv.padding) != (0, 0)
            or tuple(conv.dilation) != (1, 1)
            or conv.groups != 1
        ):
            raise ValueError(
                "conv must be a patch embedding's Conv2d (square kernel, stride = kernel, no padding, dilation or "
                f"groups), got {conv}"
            )
        self.weight = conv.weight
        self.bias = conv.bias

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = images.shape
        patch = self.weight.shape[-1]
        tokens = linear_patch_embed(images, self.weight, self.bias)  # [B, N, D]
        return tokens.unflatten(1, (height // patch, width // patch)).permute(0, 3, 1, 2)


def linear_embed(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a timm ViT with ``patch_embed.proj`` a Conv2d) with that Conv2d replaced, in place, by a
    :class:`LinearPatchProjection` of the same parameters; returns the model."""
    model.patch_embed.proj = LinearPatchProjection(model.patch_embed.proj)
    return model


class Trainer:
    """One model, its optimizer and its training step."""

    def __init__(
        self, model: torch.nn.Module, *, device: torch.device, compile_model: bool, compile_mode: str | None = None
    ) -> None:
        # The same step for every variant: an MJP model's forward attaches its DAL loss to the output.
        self.model = model
        self.device = device
        self.forward = torch.compile(model, mode=compile_mode) if compile_model else model
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=5e-4 * 32 / 512, weight_decay=0.05, fused=device.type == "cuda"
        )

    def step(self, images: torch.Tensor, targets: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.forward(images)
            loss = F.cross_entropy(logits.float(), targets)  # MJP models: DAL rides on it (mjp_dal_weight)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class BlockTimer:
    """Times ``steps`` calls back to back by the wall clock, the device synchronized only before the first and after
    the last (a no-op on the CPU): a steady state's throughput, the host running ahead of the GPU as in training."""

    def __init__(self, device: torch.device) -> None:
        self.synchronize = synchronizer(device)

    def __call__(self, function: Callable[[], object], steps: int) -> float:
        self.synchronize()
        begin = time.perf_counter()
        for _ in range(steps):
            function()
        self.synchronize()
        return time.perf_counter() - begin


class StepTimer:
    """Times one call: wall clock on the CPU, CUDA events on a GPU (then waits for the device)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self, function: Callable[[], object]) -> float:
        if self.cuda:
            self.start.record()
            function()
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        begin = time.perf_counter()
        function()
        return time.perf_counter() - begin


def _models(
    name: str,
    image_size: int,
    device: torch.device,
    depth: int | None = None,
    backend: str | None = None,
    overrides: dict | None = None,
) -> dict[float | str | None, torch.nn.Module]:
    """The plain model, its copies with the linear patch embedding (key ``LINEAR``, :func:`linear_embed`) and with
    the fused one (key ``FAST``), and its MJP copies (one per prob), all with the same initial weights, in training
    mode.

    ``depth``: fewer transformer blocks than the model has (smoke runs, and parts of a step timed alone).
    ``backend``: the fused embedding's and the MJP models' backend (default automatic). ``overrides``: more of
    ``timm.create_model``'s keyword arguments (smaller shapes for smoke runs).
    """
    import timm

    import mjp_fast.timm as mjp_timm

    torch.manual_seed(0)
    overrides = dict(overrides or {})
    if depth is not None:
        overrides["depth"] = depth
    plain = timm.create_model(name, pretrained=False, img_size=image_size, num_classes=1000, **overrides)
    models: dict[float | str | None, torch.nn.Module] = {None: plain}
    # The strongest non-fused patch embedding: what the fused one (and MJP riding on it) should beat.
    models[LINEAR] = linear_embed(copy.deepcopy(plain))
    # The honest baseline for MJP's own cost: MJP models run the fused patch embedding, so this one does too.
    models[FAST] = mjp_timm.fast_patch_embed(copy.deepcopy(plain), backend=backend)
    for prob in MJP_PROBS:
        models[prob] = mjp_timm.convert(
            copy.deepcopy(plain),
            ratio=MJP_RATIO,
            prob=prob,
            dal=DAL_KIND,
            seed=0,
            dal_weight=DAL_WEIGHT,
            backend=backend,
        )
    return {prob: model.to(device).train() for prob, model in models.items()}


def _isolated(
    models: dict[float | None, torch.nn.Module], batch: int, device: torch.device, repeats: int, smoke: bool
) -> tuple[dict[float, float], dict[float | str, float], dict[float | str | None, list[list]]]:
    """MJP's own work in a step, timed alone: per prob, the time of the MJP model's patch embedding and position
    step (jigsaw, DAL; forward and backward) minus that of the plain model with the same fused embedding, in s;
    and on a GPU the same difference of the GPU's busy time (:func:`_device_busy_seconds`; empty elsewhere), with,
    under the key ``FAST``, the fused embedding's busy time minus timm's own (its conv and position add); and on a
    GPU, per variant (None: timm's), the kernels of that part with their GPU time per call (:func:`_top_kernels`)."""
    baseline = models[FAST]
    images, grad = part_inputs(baseline, batch, device)
    functions = {variant_name(FAST): position_part(baseline, images, grad)}
    for prob in MJP_PROBS:
        functions[variant_name(prob)] = position_part(models[prob], images, grad)
    timings = measure(functions, repeats=repeats, warmup=2, min_sample_s=0.0 if smoke else 0.05, device=device)
    extra = {prob: timings[variant_name(prob)].median_s - timings[variant_name(FAST)].median_s for prob in MJP_PROBS}
    if device.type != "cuda":
        return extra, {}, {}
    functions[variant_name(None)] = position_part(models[None], images, grad)
    busy, kernels = _device_busy_seconds(functions, calls=3 if smoke else DEVICE_TIME_CALLS)
    gpu = {prob: busy[variant_name(prob)] - busy[variant_name(FAST)] for prob in MJP_PROBS}
    by_variant = {prob: _top_kernels(kernels[variant_name(prob)]) for prob in (None, FAST, *MJP_PROBS)}
    return extra, {**gpu, FAST: busy[variant_name(FAST)] - busy[variant_name(None)]}, by_variant


def part_inputs(model: torch.nn.Module, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images [B, 3, H, W], grad [B, P + N, D])`` for :func:`position_part`: random float32 images of the
    model's input size and a random gradient of its tokens (the same for every model of one shape)."""
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, *model.patch_embed.img_size, generator=generator).to(device)
    num_tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    grad = torch.randn(batch, num_tokens, model.embed_dim, generator=generator).to(device)
    return images, grad


def position_part(model: torch.nn.Module, images: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One call of a model's patch embedding and position step (for MJP also the jigsaw and the DAL loss), forward
    and backward, gradients set to None as in training; under bfloat16 autocast on a GPU. ``images``: ``[B, 3, H,
    W]``; ``grad``: ``[B, P + N, D]``, the gradient of the step's tokens (cast to their dtype once per call)."""
    autocast = images.device.type == "cuda"

    def run() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model._pos_embed(model.patch_embed(images))  # MJP: DAL attached at mjp_dal_weight
        out.backward(grad.to(out.dtype))

    return run


def _device_busy_seconds(
    functions: dict[str, Callable[[], None]], calls: int, rounds: int = DEVICE_TIME_ROUNDS
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Per function, the median of :func:`device_busy_samples`'s rounds, and its kernels' GPU time per call."""
    samples, kernels = device_busy_samples(functions, calls, rounds)
    return {name: float(np.median(values)) for name, values in samples.items()}, kernels


def device_busy_samples(
    functions: dict[str, Callable[[], None]], calls: int, rounds: int = DEVICE_TIME_ROUNDS
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Per function, the GPU's busy time per call in each of ``rounds`` interleaved rounds of ``calls`` calls: the
    summed durations of the kernels (and copies, fills) it runs, as the profiler's CUDA activity records them.
    Also per function, each kernel's (copy's, fill's) GPU time per call, in s, averaged over all the rounds.

    Unlike CUDA events around a call, this leaves out the gaps where the GPU waits for the host: on the lent
    machines' slow host CPU a small step is host-bound, and its events measure the host's time, not the GPU's."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    samples: dict[str, list[float]] = {name: [] for name in functions}
    kernels: dict[str, dict[str, float]] = {name: {} for name in functions}
    for _ in range(rounds):
        for name, function in functions.items():
            function()  # the profiler's own start-up stays out of the round
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as profiler:
                for _ in range(calls):
                    function()
                torch.cuda.synchronize()
            device_events = [event for event in profiler.events() if event.device_type == DeviceType.CUDA]
            samples[name].append(sum(event.device_time_total for event in device_events) * 1e-6 / calls)
            for event in device_events:
                share = event.device_time_total * 1e-6 / (calls * rounds)
                kernels[name][event.name] = kernels[name].get(event.name, 0.0) + share
    return samples, kernels


def _top_kernels(kernels: dict[str, float], count: int = TOP_KERNELS) -> list[list]:
    """The ``count`` kernels with the most GPU time per call, as ``[name, seconds]``, most first; kernel names
    (C++ templates) cut to 120 characters."""
    ranked = sorted(kernels.items(), key=lambda item: item[1], reverse=True)[:count]
    return [[name if len(name) <= 120 else name[:117] + "...", seconds] for name, seconds in ranked]


def _percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    array = np.asarray(values)
    return float(np.median(array)), float(np.percentile(array, 20)), float(np.percentile(array, 80))


def _median_interval(values: Sequence[float], seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap (percentile) confidence interval of the median of ``values``: how well this run pins the
    median overhead down, whatever its verdict."""
    array = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(array, size=(BOOTSTRAP_RESAMPLES, array.size), replace=True), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def run_model(
    name: str,
    *,
    batch: int,
    image_size: int,
    pairs: int,
    max_seconds: float | None,
    warmup: int,
    device: str,
    compile_model: bool,
    smoke: bool,
    backend: str | None = None,
    compile_mode: str | None = None,
    steady_blocks: int = 0,
    steady_steps: int = 0,
) -> list[dict]:
    """Interleaved training steps of the plain and MJP models; one result row per variant. ``backend``: the fused
    embedding's and the MJP models' (default automatic), named in every row. ``steady_blocks`` blocks of
    ``steady_steps`` steps back to back per variant after the pairs (:func:`steady_state`; 0: none); the pairs stop
    early enough that the blocks fit in ``max_seconds`` too, as their step times so far predict."""
    from mjp_fast.backend import resolve_backend

    device = torch.device(device)
    backend = backend or resolve_backend(None, device)
    models = _models(name, image_size, device, depth=1 if smoke else None, backend=backend)
    trainers = {
        prob: Trainer(model, device=device, compile_model=compile_model, compile_mode=compile_mode)
        for prob, model in models.items()
    }
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator).to(device)
    targets = torch.randint(0, 1000, (batch,), generator=generator).to(device)
    timer = StepTimer(device)
    synchronize = synchronizer(device)
    order = list(trainers)

    for _ in range(warmup):
        for prob in order:
            trainers[prob].step(images, targets)
    synchronize()

    times: dict[float | str | None, list[float]] = {prob: [] for prob in order}
    begin = time.perf_counter()
    for round_index in range(pairs):
        for prob in order if round_index % 2 == 0 else reversed(order):
            times[prob].append(timer(lambda prob=prob: trainers[prob].step(images, targets)))
        # the steady-state blocks still to run, at the median step times so far
        steady_s = steady_blocks * steady_steps * sum(float(np.median(values)) for values in times.values())
        elapsed = time.perf_counter() - begin
        if max_seconds is not None and round_index + 1 >= MIN_PAIRS and elapsed + steady_s > max_seconds:
            break
    measured_s = time.perf_counter() - begin
    begin = time.perf_counter()
    steady = steady_state(trainers, images, targets, blocks=steady_blocks, steps=steady_steps, device=device)
    steady_measured_s = time.perf_counter() - begin
    isolated, isolated_gpu, kernels = _isolated(models, batch, device, repeats=3 if smoke else 15, smoke=smoke)

    plain = np.asarray(times[None])
    fast = np.asarray(times[FAST])
    linear = np.asarray(times[LINEAR]) if LINEAR in times else None  # runs of models without it: tests' stand-ins
    plain_median = float(np.median(plain))
    # Steps that other processes slowed down: more than QUIET_MARGIN above the fastest step of any variant.
    quiet_limit = QUIET_MARGIN * min(min(values) for values in times.values())
    rows = []
    for prob in order:
        values = np.asarray(times[prob])
        timing = Timing.from_samples(values, 1)
        row = {
            "model": name,
            "batch": batch,
            "image_size": image_size,
            "implementation": variant_name(prob),
            "prob": prob,
            **timing.to_dict(),
            "images_per_s": batch / timing.median_s,
            "pairs": timing.samples,
            "measured_s": measured_s,
            "overhead_median_pct": None,
            "overhead_p20_pct": None,
            "overhead_p80_pct": None,
            "overhead_ci95_low_pct": None,
            "overhead_ci95_high_pct": None,
            "overhead_of_medians_pct": None,
            "quiet_pairs": None,
            "quiet_overhead_median_pct": None,
            "isolated_extra_s": None,
            "isolated_overhead_pct": None,
            "isolated_gpu_extra_s": None,
            "overhead_vs_fast_median_pct": None,
            "overhead_vs_fast_p20_pct": None,
            "overhead_vs_fast_p80_pct": None,
            "overhead_vs_fast_ci95_low_pct": None,
            "overhead_vs_fast_ci95_high_pct": None,
            "overhead_vs_linear_median_pct": None,
            "overhead_vs_linear_p20_pct": None,
            "overhead_vs_linear_p80_pct": None,
            **_steady_fields(prob, steady, steady_steps, steady_measured_s),
            "backend": backend,
            "sampler_backend": backend,  # the model's one backend (its sampler's too): the name older runs used
            "gpu_kernels": kernels.get(prob),
        }
        if linear is not None and prob not in (None, LINEAR):
            median, p20, p80 = _percentiles(100.0 * (values / linear - 1.0))
            row.update(
                overhead_vs_linear_median_pct=median, overhead_vs_linear_p20_pct=p20, overhead_vs_linear_p80_pct=p80
            )
        if prob in (FAST, LINEAR):
            overheads = 100.0 * (values / plain - 1.0)
            median, p20, p80 = _percentiles(overheads)
            row.update(
                overhead_median_pct=median,
                overhead_p20_pct=p20,
                overhead_p80_pct=p80,
                overhead_of_medians_pct=100.0 * (row["median_s"] / plain_median - 1.0),
                isolated_gpu_extra_s=isolated_gpu.get(FAST) if prob == FAST else None,
            )
        elif prob is not None:
            against_fast = 100.0 * (values / fast - 1.0)
            fast_median, fast_p20, fast_p80 = _percentiles(against_fast)
            fast_low, fast_high = _median_interval(against_fast)
            row.update(
                overhead_vs_fast_median_pct=fast_median,
                overhead_vs_fast_p20_pct=fast_p20,
                overhead_vs_fast_p80_pct=fast_p80,
                overhead_vs_fast_ci95_low_pct=fast_low,
                overhead_vs_fast_ci95_high_pct=fast_high,
            )
            overheads = 100.0 * (values / plain - 1.0)
            median, p20, p80 = _percentiles(overheads)
            low, high = _median_interval(overheads)
            quiet = (values <= quiet_limit) & (plain <= quiet_limit)
            row.update(
                quiet_pairs=int(quiet.sum()),
                quiet_overhead_median_pct=(
                    float(np.median(100.0 * (values[quiet] / plain[quiet] - 1.0))) if quiet.any() else None
                ),
                overhead_median_pct=median,
                overhead_p20_pct=p20,
                overhead_p80_pct=p80,
                overhead_ci95_low_pct=low,
                overhead_ci95_high_pct=high,
                overhead_of_medians_pct=100.0 * (row["median_s"] / plain_median - 1.0),
                isolated_extra_s=isolated[prob],
                isolated_overhead_pct=100.0 * isolated[prob] / plain_median,
                isolated_gpu_extra_s=isolated_gpu.get(prob),
            )
        rows.append(row)
    return rows


def steady_state(
    trainers: dict[float | str | None, Trainer],
    images: torch.Tensor,
    targets: torch.Tensor,
    *,
    blocks: int,
    steps: int,
    device: torch.device,
) -> dict[float | str | None, list[float]]:
    """Per variant, the images per second of each of ``blocks`` blocks of ``steps`` training steps back to back
    (:class:`BlockTimer`), the variants in alternating order block by block (as given, reversed, ...); empty
    lists for ``blocks`` or ``steps`` 0. ``images``: ``[B, 3, H, W]``, ``targets``: ``[B]``, as the pairs use."""
    timer = BlockTimer(device)
    order = list(trainers)
    per_block: dict[float | str | None, list[float]] = {key: [] for key in order}
    if steps < 1:
        return per_block
    batch = images.shape[0]
    for block in range(blocks):
        for key in order if block % 2 == 0 else reversed(order):
            seconds = timer(lambda key=key: trainers[key].step(images, targets), steps)
            per_block[key].append(batch * steps / seconds)
    return per_block


def _steady_fields(
    key: float | str | None, steady: dict[float | str | None, list[float]], steps: int, measured_s: float
) -> dict:
    """A row's steady-state fields (:func:`steady_state`'s ``steady``): its images/s, median over the blocks and per
    block, and per block its overhead in time, ``ips_baseline / ips_row - 1`` in percent, against plain timm (rows
    but plain), against plain with the fast patch embedding (MJP rows) and with the linear embedding (fast and MJP
    rows): the median over the blocks, and the per-block values against the fast embedding. None where not
    measured."""
    own = np.asarray(steady.get(key) or [])
    fields: dict = {
        "steady_blocks": int(own.size),
        "steady_steps": steps if own.size else None,
        "steady_measured_s": measured_s if own.size else None,
        "steady_images_per_s": float(np.median(own)) if own.size else None,
        "steady_images_per_s_blocks": own.tolist(),
        "steady_overhead_median_pct": None,
        "steady_overhead_vs_fast_median_pct": None,
        "steady_overhead_vs_fast_blocks_pct": None,
        "steady_overhead_vs_linear_median_pct": None,
    }
    if not own.size:
        return fields

    def against(baseline: float | str | None) -> np.ndarray | None:
        theirs = np.asarray(steady.get(baseline) or [])
        return 100.0 * (theirs / own - 1.0) if theirs.size == own.size else None

    if key is not None and (overheads := against(None)) is not None:
        fields["steady_overhead_median_pct"] = float(np.median(overheads))
    if key not in (None, FAST, LINEAR) and (overheads := against(FAST)) is not None:
        fields["steady_overhead_vs_fast_median_pct"] = float(np.median(overheads))
        fields["steady_overhead_vs_fast_blocks_pct"] = overheads.tolist()
    if key not in (None, LINEAR) and (overheads := against(LINEAR)) is not None:
        fields["steady_overhead_vs_linear_median_pct"] = float(np.median(overheads))
    return fields


def table(rows: list[dict]) -> str:
    """The rows as Markdown, one per variant; columns that no row fills (older runs': the backend, the linear
    embedding) left out."""
    several = len({row.get("backend") for row in rows}) > 1  # older runs' rows name no backend
    linear = any(row.get("overhead_vs_linear_median_pct") is not None for row in rows)
    headers = [
        "model",
        "batch",
        *(["backend"] if several else []),
        "variant",
        "step: median [p20, p80]",
        "images/s",
        "pairs",
        "overhead: median [p20, p80]",
        "median's 95% CI",
        "ratio of medians",
        "quiet pairs: n, median",
        "isolated MJP work",
        "overhead vs fast patch embed: median [p20, p80], 95% CI",
        *(["overhead vs linear embed: median [p20, p80]"] if linear else []),
    ]
    body = []
    for row in rows:
        timing = Timing(*(row[key] for key in ("median_s", "p20_s", "p80_s", "min_s", "samples", "calls_per_sample")))
        overhead = isolated = ratio = quiet = interval = versus_fast = versus_linear = ""
        if row.get("overhead_vs_linear_median_pct") is not None:  # runs before the linear embedding: none
            versus_linear = (
                f"{row['overhead_vs_linear_median_pct']:+.2f}% [{row['overhead_vs_linear_p20_pct']:+.2f}%, "
                f"{row['overhead_vs_linear_p80_pct']:+.2f}%]"
            )
        if row.get("overhead_vs_fast_median_pct") is not None:
            versus_fast = (
                f"{row['overhead_vs_fast_median_pct']:+.2f}% [{row['overhead_vs_fast_p20_pct']:+.2f}%, "
                f"{row['overhead_vs_fast_p80_pct']:+.2f}%], [{row['overhead_vs_fast_ci95_low_pct']:+.2f}%, "
                f"{row['overhead_vs_fast_ci95_high_pct']:+.2f}%]"
            )
        if row["overhead_median_pct"] is not None:
            quiet_median = row.get("quiet_overhead_median_pct")
            if row.get("quiet_pairs") is not None:
                quiet = f"{row['quiet_pairs']}" + ("" if quiet_median is None else f", {quiet_median:+.2f}%")
            overhead = (
                f"{row['overhead_median_pct']:+.2f}% [{row['overhead_p20_pct']:+.2f}%, {row['overhead_p80_pct']:+.2f}%]"
            )
            ratio = f"{row['overhead_of_medians_pct']:+.2f}%"
            if row.get("overhead_ci95_low_pct") is not None:
                interval = f"[{row['overhead_ci95_low_pct']:+.2f}%, {row['overhead_ci95_high_pct']:+.2f}%]"
            extra = row["isolated_extra_s"]
            if extra is not None:
                isolated = (
                    f"{'-' if extra < 0 else ''}{format_seconds(abs(extra))} = {row['isolated_overhead_pct']:+.3f}%"
                )
            gpu_extra = row.get("isolated_gpu_extra_s")
            if gpu_extra is not None:
                busy = f"GPU busy {'-' if gpu_extra < 0 else ''}{format_seconds(abs(gpu_extra))}"
                isolated = f"{isolated}; {busy}" if isolated else busy
        body.append(
            [
                MODEL_TITLES.get(row["model"], row["model"]),
                row["batch"],
                *([row.get("backend")] if several else []),
                row["implementation"],
                format_timing(timing),
                f"{row['images_per_s']:.1f}",
                row["pairs"],
                overhead,
                interval,
                ratio,
                quiet,
                isolated,
                versus_fast,
                *([versus_linear] if linear else []),
            ]
        )
    return markdown_table(headers, body)


def steady_table(rows: list[dict]) -> str:
    """The steady-state figures (:func:`steady_state`) as Markdown: per variant its images/s, median [min, max] over
    the blocks, and its overheads from them (medians over the blocks); empty when no row has them (runs before
    the steady state was measured, or ``--steady-blocks 0``)."""
    measured = [row for row in rows if row.get("steady_images_per_s") is not None]
    if not measured:
        return ""
    several = len({row.get("backend") for row in measured}) > 1

    def percent(value: float | None) -> str:
        return "" if value is None else f"{value:+.2f}%"

    body = []
    for row in measured:
        blocks = row["steady_images_per_s_blocks"]
        body.append(
            [
                MODEL_TITLES.get(row["model"], row["model"]),
                row["batch"],
                *([row.get("backend")] if several else []),
                row["implementation"],
                f"{row['steady_images_per_s']:.1f} [{min(blocks):.1f}, {max(blocks):.1f}]",
                f"{row['steady_blocks']} x {row['steady_steps']}",
                percent(row.get("steady_overhead_median_pct")),
                percent(row.get("steady_overhead_vs_fast_median_pct")),
                percent(row.get("steady_overhead_vs_linear_median_pct")),
            ]
        )
    headers = [
        "model",
        "batch",
        *(["backend"] if several else []),
        "variant",
        "steady images/s: median [min, max]",
        "blocks x steps",
        "overhead vs plain",
        "overhead vs fast patch embed",
        "overhead vs linear embed",
    ]
    return markdown_table(headers, body)


def kernel_table(rows: list[dict], count: int = 5) -> str:
    """The GPU kernels that take the most time in each variant's isolated position part (GPU runs record them),
    ``count`` per variant, in microseconds per step; empty when no row has them."""
    body = []
    for row in rows:
        for name, seconds in (row.get("gpu_kernels") or [])[:count]:
            model = MODEL_TITLES.get(row["model"], row["model"])
            body.append([model, row.get("backend"), row["implementation"], f"{seconds * 1e6:.1f}", name])
    if not body:
        return ""
    return markdown_table(["model", "backend", "variant", "GPU us per step", "kernel"], body)


def _aims(
    rows: list[dict],
    *,
    smoke: bool,
    device: str,
    gpu: str | None,
    dtype: str,
    compiled: bool = False,
    compile_mode: str | None = None,
) -> list[dict]:
    """The aims, judged on each backend's rows alone; a run of several backends names the backend in each aim, a
    compiled run in another mode than torch.compile's default names the mode."""
    backends = list(dict.fromkeys(row.get("backend") for row in rows)) or [None]
    aims = []
    for backend in backends:
        on = f" (backend {backend})" if len(backends) > 1 else ""
        if compiled and compile_mode not in (None, "default"):
            on += f" (mode {compile_mode})"
        own = [row for row in rows if row.get("backend") == backend]
        aims += _overhead_aims(own, on, smoke=smoke, device=device, gpu=gpu, dtype=dtype, compiled=compiled)
        if not compiled:
            aims += _gpu_work_aims(own, on, smoke=smoke, device=device, gpu=gpu, dtype=dtype)
    return aims


def _overhead_aims(
    rows: list[dict], on: str, *, smoke: bool, device: str, gpu: str | None, dtype: str, compiled: bool
) -> list[dict]:
    """The step-overhead aims on one backend's rows (``on``: how an aim names that backend, or empty): per aim of
    :data:`AIMS` and prob, judged on the pairs' median overhead; a GPU aim also on the steady state's
    (:func:`steady_state`), after the pairs' aims of the same configuration."""
    aims = []
    for spec in AIMS:
        kind, aim_compiled = spec[0], spec[-1]
        if aim_compiled != compiled:
            continue
        figures = ("pairs",) if kind == "cpu" else ("pairs", "steady")  # the CPU's blocks are too few to judge
        for figure in figures:
            for prob in MJP_PROBS:
                aims.append(
                    _overhead_aim(rows, on, figure, spec, prob, smoke=smoke, device=device, gpu=gpu, dtype=dtype)
                )
    return aims


def _overhead_aim(
    rows: list[dict],
    on: str,
    figure: str,
    spec: tuple[str, str, int, str, float, bool],
    prob: float,
    *,
    smoke: bool,
    device: str,
    gpu: str | None,
    dtype: str,
) -> dict:
    """One step-overhead aim of ``spec`` (an entry of :data:`AIMS`) for ``prob``: ``figure`` ``"pairs"`` judges the
    median over the interleaved pairs, ``"steady"`` the median over the steady-state blocks, each against plain
    timm with the same fast patch embedding."""
    kind, model, batch, aim_dtype, threshold, aim_compiled = spec
    title = MODEL_TITLES[model]
    where = "on the CPU" if kind == "cpu" else "on an H100/H200"
    where += ", torch.compile" if aim_compiled else ""
    steady = figure == "steady"
    aim = {
        "aim": f"{where}, {title}, batch {batch}, {aim_dtype}: MJP (ratio {MJP_RATIO:g}, prob {prob:g}, DAL) "
        f"training-step overhead{' in the steady state (steps back to back)' if steady else ''} at most "
        f"{threshold:g}% against plain timm with the same fast patch embedding{on}",
        "threshold": threshold,
        "measured": None,
        "unit": "%",
        "verdict": "NOT RUN",
    }
    on_device = device == "cpu" if kind == "cpu" else (device == "cuda" and any(k in (gpu or "") for k in GPU_KINDS))
    wanted = (model, batch, prob, 224)
    key = lambda row: (row["model"], row["batch"], row["prob"], row["image_size"])  # noqa: E731
    row = next((row for row in rows if key(row) == wanted), None)
    if not on_device:
        aim["note"] = f"needs {'the CPU' if kind == 'cpu' else 'an ' + kind}; measured on {gpu or device}"
    elif row is None or dtype != aim_dtype:
        aim["note"] = "this configuration was not measured"
    elif steady:
        measured = row.get("steady_overhead_vs_fast_median_pct")
        if measured is None:
            aim["note"] = "the steady state was not measured"
        else:
            aim["measured"] = measured
            aim["verdict"] = aim_verdict(measured, threshold, higher_is_better=False)
            blocks = row.get("steady_overhead_vs_fast_blocks_pct") or []
            spread = f", per block {min(blocks):+.2f}% to {max(blocks):+.2f}%" if blocks else ""
            aim["note"] = f"median over {row['steady_blocks']} blocks of {row['steady_steps']} steps{spread}"
    else:
        aim["measured"] = row["overhead_vs_fast_median_pct"]
        aim["verdict"] = aim_verdict(aim["measured"], threshold, higher_is_better=False)
        low, high = row.get("overhead_vs_fast_ci95_low_pct"), row.get("overhead_vs_fast_ci95_high_pct")
        if low is not None:
            resolved = (low <= threshold) == (high <= threshold)  # the interval is on one side
            aim["note"] = f"median's 95% CI [{low:+.2f}%, {high:+.2f}%] over {row['pairs']} pairs" + (
                "" if resolved else ": this run does not resolve the aim"
            )
    if smoke:
        aim.update(verdict="NOT JUDGED", note="smoke run: tiny sizes")
    return aim


def _gpu_work_aims(
    rows: list[dict], on: str = "", *, smoke: bool, device: str, gpu: str | None, dtype: str
) -> list[dict]:
    """The aim on MJP's own GPU work (eager, DeiT-Small, batch 256, bfloat16): the isolated work's GPU busy time."""
    model, batch = "deit_small_patch16_224", 256
    aims = []
    for prob in MJP_PROBS:
        aim = {
            "aim": f"on an H100/H200, {MODEL_TITLES[model]}, batch {batch}, bfloat16: MJP's own work (ratio "
            f"{MJP_RATIO:g}, prob {prob:g}, DAL; forward and backward) at most {GPU_WORK_AIM_S * 1e6:g} us of GPU "
            f"busy time per step{on}",
            "threshold": GPU_WORK_AIM_S * 1e6,
            "measured": None,
            "unit": " us",
            "verdict": "NOT RUN",
        }
        row = next((r for r in rows if (r["model"], r["batch"], r["prob"]) == (model, batch, prob)), None)
        if device != "cuda" or not any(kind in (gpu or "") for kind in GPU_KINDS):
            aim["note"] = f"needs an H100/H200; measured on {gpu or device}"
        elif row is None or row.get("isolated_gpu_extra_s") is None or dtype != "bfloat16":
            aim["note"] = "this configuration was not measured"
        else:
            aim["measured"] = row["isolated_gpu_extra_s"] * 1e6
            aim["verdict"] = aim_verdict(aim["measured"], aim["threshold"], higher_is_better=False)
        if smoke:
            aim.update(verdict="NOT JUDGED", note="smoke run: tiny sizes")
        aims.append(aim)
    return aims


def collect(
    *,
    smoke: bool,
    device: str,
    repeats: int | None = None,
    compile_model: bool = False,
    backends: Sequence[str] | str | None = None,
    compile_mode: str | None = None,
    steady_blocks: int | None = None,
    steady_steps: int | None = None,
) -> dict:
    """Measures the case; returns its section of the results: ``config``, ``backends``, ``results``, ``aims``.

    ``repeats`` overrides the number of interleaved rounds (pairs) per model; ``steady_blocks`` and
    ``steady_steps`` the steady state's blocks per variant and steps per block (default :data:`STEADY`'s for the
    device; 0 blocks: no steady state). ``backends``: the fused embedding's
    and the MJP models' backends (a list, or comma-separated), each measured in its own interleaved rounds against
    its own plain and fast-embedding baselines, and judged alone; default :func:`bench.common.compared_backends`
    (on a GPU: ``triton`` and ``cuda``, which on the lent machines' slow host differ in host cost).
    """
    if isinstance(backends, str):
        backends = [name.strip() for name in backends.split(",") if name.strip()]
    backends = list(backends) if backends else compared_backends(device)
    if smoke:
        runs, image_size, warmup = SMOKE_RUNS, 64, 1
    elif device == "cuda":
        runs, image_size, warmup = GPU_RUNS, 224, 10 if compile_model else 5
    else:
        runs, image_size, warmup = CPU_RUNS, 224, 2
    dtype = "bfloat16" if device == "cuda" else "float32"
    default_blocks, default_steps = STEADY["smoke" if smoke else device]
    steady_blocks = default_blocks if steady_blocks is None else steady_blocks
    steady_steps = default_steps if steady_steps is None else steady_steps
    if steady_blocks < 0 or steady_steps < 1:
        raise ValueError(
            f"steady_blocks must be at least 0 and steady_steps at least 1, got {steady_blocks} and {steady_steps}"
        )
    rows, plan = [], []
    for name, batch, pairs, max_seconds in runs:
        pairs = repeats or pairs
        plan.append({"model": name, "batch": batch, "pairs": pairs, "max_seconds": max_seconds})
        for backend in backends:
            rows += run_model(
                name,
                batch=batch,
                image_size=image_size,
                pairs=pairs,
                max_seconds=max_seconds,
                warmup=warmup,
                device=device,
                compile_model=compile_model,
                smoke=smoke,
                backend=backend,
                compile_mode=compile_mode,
                steady_blocks=steady_blocks,
                steady_steps=steady_steps,
            )
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    return {
        "config": {
            "runs": plan,
            "image_size": image_size,
            "dtype": dtype,
            "autocast": device == "cuda",
            "compile": compile_model,
            "compile_mode": (compile_mode or "default") if compile_model else None,
            "warmup_rounds": warmup,
            "min_pairs": MIN_PAIRS,
            "mjp_ratio": MJP_RATIO,
            "mjp_probs": list(MJP_PROBS),
            "dal": DAL_KIND,
            "dal_weight": DAL_WEIGHT,
            "optimizer": "AdamW(lr=5e-4*32/512, weight_decay=0.05" + (", fused)" if device == "cuda" else ")"),
            "timer": "CUDA events" if device == "cuda" else "wall clock (perf_counter)",
            "steady_blocks": steady_blocks,
            "steady_steps": steady_steps,
            "steady_timer": "wall clock (perf_counter), the device synchronized at each block's start and end",
        },
        "backends": backends,
        "results": rows,
        "aims": _aims(
            rows, smoke=smoke, device=device, gpu=gpu, dtype=dtype, compiled=compile_model, compile_mode=compile_mode
        ),
    }


def report(section: dict, info: dict) -> str:
    """The printed Markdown of a section: title with device and shapes, the table, one line per aim."""
    config = section["config"]
    how = config["dtype"] + (" autocast" if config["autocast"] else "")
    how += ", torch.compile" if config["compile"] else ""
    how += f" ({config['compile_mode']})" if config.get("compile_mode") not in (None, "default") else ""
    lines = [
        f"## Training step, plain vs MJP (ratio {config['mjp_ratio']:g}, DAL {config['dal']}), "
        f"{config['image_size']} px, {how}, backend {', '.join(section['backends'])} ({where_measured(info)})",
        "",
        table(section["results"]),
        "",
        "overhead: per interleaved pair, t_mjp / t_plain - 1, median [p20, p80] over the pairs (the aims judge "
        "this), and a 95% bootstrap confidence interval of that median; ratio of medians: median MJP step / "
        "median plain step - 1; quiet pairs: the pairs whose two steps "
        f"both ran within {100 * (QUIET_MARGIN - 1):.0f}% of the fastest step of the model (the others were slowed "
        "by other processes), and their median overhead; isolated MJP work: MJP's position term + DAL (forward "
        "and backward) timed alone minus the plain model's with the same fast patch embedding, and its share of "
        "the plain step's median; on a GPU also the difference of the GPU's busy time (the summed durations of "
        "the kernels, from the profiler: no host time), and for the fast patch embedding its busy time against "
        "timm's patch embedding and position add."
        + (
            " Overhead vs linear embed: the same per pair against plain timm whose Conv2d patch embedding is a "
            "reshape + F.linear (the strongest non-fused one)."
            if any(row.get("overhead_vs_linear_median_pct") is not None for row in section["results"])
            else ""  # runs from before that baseline
        ),
        "",
    ]
    steady = steady_table(section["results"])
    if steady:
        lines += [
            "Steady state: each variant's blocks of steps back to back, the device synchronized only at a block's "
            "start and end, in alternating order; images/s median [min, max] over the blocks, and the overheads "
            "from them (per block ips_baseline / ips_variant - 1, median over the blocks):",
            "",
            steady,
            "",
        ]
    kernels = kernel_table(section["results"])
    if kernels:
        lines += [
            "GPU kernels of each variant's isolated part (the most time first; the JSON lists more):",
            "",
            kernels,
            "",
        ]
    aim_pct = GPU_AIM_PCT if info.get("gpu") else CPU_AIM_PCT
    return "\n".join(lines + [aim_line(aim) for aim in section["aims"]] + noise_warnings(section["results"], aim_pct))


def noise_warnings(rows: list[dict], aim_pct: float) -> list[str]:
    """A caution for each MJP variant whose per-pair overheads spread (p20 to p80) wider than ``aim_pct``: its
    median cannot resolve an aim of that size on this run, whatever the verdict says."""
    lines = []
    for row in rows:
        if row.get("overhead_vs_fast_median_pct") is None:
            continue  # the plain models: no aim to resolve
        spread = row["overhead_vs_fast_p80_pct"] - row["overhead_vs_fast_p20_pct"]
        if spread > aim_pct:
            lines.append(
                f"NOISY: {MODEL_TITLES.get(row['model'], row['model'])}, batch {row['batch']}, "
                f"{row['implementation']}: the per-pair overheads spread over {spread:.1f} percentage points "
                f"against plain timm with the fast patch embedding (p20 {row['overhead_vs_fast_p20_pct']:+.2f}%, "
                f"p80 {row['overhead_vs_fast_p80_pct']:+.2f}%), more than the {aim_pct:g}% aim: the median does not "
                "resolve it on this run; see the isolated MJP work"
            )
    return lines


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile", dest="compile_model", action="store_true", help="torch.compile the models (GPU runs)"
    )
    parser.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        default=None,
        help="torch.compile's mode with --compile (default: its own; reduce-overhead: CUDA graphs, no host launches)",
    )
    parser.add_argument(
        "--backends",
        default=None,
        help="comma-separated backends of the MJP models, each measured alone (default: the automatic one, and on "
        "a GPU every GPU backend built)",
    )
    parser.add_argument(
        "--steady-blocks",
        type=int,
        default=None,
        help=f"steady-state blocks per variant, alternating order (default: {STEADY['cpu'][0]} on the CPU, "
        f"{STEADY['cuda'][0]} on a GPU; 0: no steady state)",
    )
    parser.add_argument(
        "--steady-steps",
        type=int,
        default=None,
        help=f"steps back to back per steady-state block (default: {STEADY['cpu'][1]} on the CPU, "
        f"{STEADY['cuda'][1]} on a GPU)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(NAME, __doc__.split("\n\n")[0], collect, report, argv, _add_arguments)


if __name__ == "__main__":
    sys.exit(main())
