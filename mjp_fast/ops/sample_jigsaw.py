"""Block-wise jigsaw masks and permutations, one per sample (docs/design.md section 1, docs/sampler.md).

In this file, in order: the Philox generator and the pure-PyTorch oracle ``sample_jigsaw_ref``, the
straightforward Python loop of BEiT and the paper's code (``block_mask_python``, kept as the distributional
reference and the benchmark baseline), and the public ``sample_jigsaw`` that dispatches to a backend.

Every backend implements docs/sampler.md exactly, so a sample is a pure function of ``(seed, offset + i)`` and
the parameters, bit-identical on every backend and device.
"""

from __future__ import annotations

import functools
import math
import random
from typing import NamedTuple

import numpy as np
import torch

from mjp_fast import backend as backend_module
from mjp_fast._validate import (
    check_fraction,
    check_grid_size,
    check_int,
    check_positive_float,
    check_same_device,
    check_tensor,
    to_device,
    with_index,
)

ASPECT_BINS = 1024
ASPECT_BIN_SHIFT = 22  # 32 - log2(ASPECT_BINS): the aspect bin is the top 10 bits of a uint32
ATTEMPTS_PER_ROUND = 10  # BEiT's number of tries per rectangle
TAG_MASK, TAG_PERM, TAG_COIN = 0, 1, 2
MAX_GRID_POSITIONS = 1 << 30  # keeps every Q32 area and threshold inside int64

_UINT32 = 0xFFFFFFFF
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57


class Jigsaw(NamedTuple):
    """A batch of jigsaws.

    Attributes:
        mask: bool ``[B, N]``; True where the position is shuffled and gets the unknown position embedding.
        perm: int64 ``[B, N]``; token ``n`` of sample ``b`` shows patch ``perm[b, n]``. ``perm[b, n] == n`` where
            ``mask[b, n]`` is False; over the masked positions it is a permutation of them.
    """

    mask: torch.Tensor
    perm: torch.Tensor


def check_jigsaw(
    jigsaw: object, batch: int, num_positions: int, device: torch.device, *, validate: bool
) -> Jigsaw | None:
    """Checks a ``Jigsaw(mask [B, N] bool, perm [B, N] integer)`` against the batch; returns it with int64 perm.

    With ``validate``, also checks that ``perm`` permutes exactly the masked positions (a host sync on a GPU).
    """
    if jigsaw is None:
        return None
    if not isinstance(jigsaw, tuple) or len(jigsaw) != 2:
        raise TypeError(f"jigsaw must be a Jigsaw(mask, perm) or None, got {type(jigsaw).__name__}")
    mask = check_tensor("jigsaw.mask", jigsaw[0], ndims=(2,))
    perm = check_tensor("jigsaw.perm", jigsaw[1], ndims=(2,))
    if mask.dtype != torch.bool:
        raise TypeError(f"jigsaw.mask must be a bool tensor, got {mask.dtype}")
    if perm.dtype.is_floating_point or perm.dtype.is_complex or perm.dtype == torch.bool:
        raise TypeError(f"jigsaw.perm must be an integer tensor, got {perm.dtype}")
    expected = (batch, num_positions)
    for name, tensor in (("jigsaw.mask", mask), ("jigsaw.perm", perm)):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} must have shape [batch, N] = {list(expected)}, got {list(tensor.shape)}")
    check_same_device(inputs=torch.empty(0, device=device), mask=mask, perm=perm)
    perm = perm.to(torch.int64)
    if validate and perm.numel() > 0:
        positions = torch.arange(num_positions, device=device)
        if bool(((perm < 0) | (perm >= num_positions)).any()):
            raise ValueError(f"jigsaw.perm has values outside [0, {num_positions})")
        if not bool(((perm == positions) | mask).all()):
            raise ValueError("jigsaw.perm must be the identity where jigsaw.mask is False")
        hits = torch.zeros_like(perm).scatter_add_(1, perm, torch.ones_like(perm))
        if not bool((hits == 1).all()):
            raise ValueError("jigsaw.perm is not a permutation of the masked positions (a position repeats)")
    return Jigsaw(mask, perm)


# ----------------------------------------------------------------------------------------------------------------
# Oracle
# ----------------------------------------------------------------------------------------------------------------


def _mul_hi_lo(constant: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``constant * x`` for uint32 values held in int64, without int64 overflow."""
    p_high = x * (constant >> 16)  # < 2**48
    p_low = x * (constant & 0xFFFF)  # < 2**48
    high = (p_high + (p_low >> 16)) >> 16
    low = (((p_high & 0xFFFF) << 16) + p_low) & _UINT32
    return high, low


def philox_ref(
    seed: int, c0: torch.Tensor | int, c1: torch.Tensor | int, c2: torch.Tensor | int, c3: torch.Tensor | int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 (Triton's ``tl.philox``) on uint32 values held in int64 tensors.

    Args:
        seed: the 64-bit key; ``k0`` is its low word, ``k1`` its high word.
        c0..c3: counter words in ``[0, 2**32)``, tensors (broadcast together) or ints.

    Returns:
        The four output words, int64 tensors of the broadcast shape, each in ``[0, 2**32)``.
    """
    tensors = [c for c in (c0, c1, c2, c3) if isinstance(c, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64, device=device) for c in (c0, c1, c2, c3))
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)
    k0, k1 = seed & _UINT32, (seed >> 32) & _UINT32
    for _ in range(10):
        high_b, low_b = _mul_hi_lo(_PHILOX_ROUND_B, c2)
        high_a, low_a = _mul_hi_lo(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _UINT32, (k1 + _PHILOX_KEY_B) & _UINT32
    return c0, c1, c2, c3


@functools.lru_cache(maxsize=64)
def _threshold_tables_host(rows: int, cols: int, min_aspect: float) -> tuple[np.ndarray, np.ndarray]:
    log_low, log_high = math.log(min_aspect), math.log(1.0 / min_aspect)
    aspects = np.exp(log_low + (np.arange(ASPECT_BINS, dtype=np.float64) + 0.5) / ASPECT_BINS * (log_high - log_low))

    def table(size: int, scale: np.ndarray) -> np.ndarray:
        # Smallest Q32 area q with (q / 2**32) * scale >= (k + 0.5)**2, i.e. round(sqrt(area * scale)) > k.
        half_steps = (np.arange(size, dtype=np.float64) + 0.5) ** 2
        thresholds = np.ceil(half_steps[None, :] / scale[:, None] * 2.0**32)
        return np.minimum(thresholds, 2.0**62).astype(np.int64)

    return table(rows, aspects), table(cols, 1.0 / aspects)


def sampler_tables(
    rows: int, cols: int, min_aspect: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer tables that turn a Q32 area and an aspect bin into a rectangle's height and width.

    Computed once on the host (float64) and shared by every backend, so no device does floating-point geometry.

    Returns:
        ``h_thresholds`` int64 ``[1024, rows]`` and ``w_thresholds`` int64 ``[1024, cols]`` on ``device``.
    """
    device = to_device(device)
    return _threshold_tables_on_device(rows, cols, float(min_aspect), str(device))


@functools.lru_cache(maxsize=64)
def _threshold_tables_on_device(rows: int, cols: int, min_aspect: float, device: str) -> tuple[torch.Tensor, ...]:
    h_host, w_host = _threshold_tables_host(rows, cols, min_aspect)
    return torch.from_numpy(h_host).to(device), torch.from_numpy(w_host).to(device)


def _target_count(ratio: float, num_positions: int) -> int:
    return math.floor(ratio * num_positions)


def _prob_threshold(prob: float) -> int:
    return math.floor(prob * 2**32)


def sample_jigsaw_ref(
    batch_size: int,
    grid_size: int | tuple[int, int],
    ratio: float,
    *,
    seed: int,
    offset: int | torch.Tensor = 0,
    shared: bool = False,
    prob: float = 1.0,
    min_block: int = 8,
    min_aspect: float = 0.3,
    device: torch.device | str | None = None,
) -> Jigsaw:
    """Pure-PyTorch oracle of :func:`sample_jigsaw`: docs/sampler.md run for all samples in lockstep.

    Arguments are as :func:`sample_jigsaw` (already validated there). Returns ``Jigsaw(mask [B, N] bool,
    perm [B, N] int64)`` on ``device``.
    """
    device = to_device(device)
    rows, cols = check_grid_size(grid_size)
    num_positions = rows * cols
    target = _target_count(ratio, num_positions)
    h_thresholds, w_thresholds = sampler_tables(rows, cols, min_aspect, device)

    if isinstance(offset, torch.Tensor):
        stream = offset.reshape(1).to(device=device, dtype=torch.int64).expand(batch_size).clone()
    else:
        stream = torch.full((batch_size,), offset, dtype=torch.int64, device=device)
    if not shared:
        stream += torch.arange(batch_size, dtype=torch.int64, device=device)
    counter_1, counter_2 = stream & _UINT32, stream >> 32

    coin = philox_ref(seed, 0, counter_1, counter_2, TAG_COIN)[0]
    active = coin < _prob_threshold(prob)
    if target == 0:
        active &= False

    positions = torch.arange(num_positions, device=device)
    row_of, col_of = positions // cols, positions % cols
    mask = torch.zeros(batch_size, num_positions, dtype=torch.bool, device=device)
    count = torch.zeros(batch_size, dtype=torch.int64, device=device)
    round_index = 0
    while bool(active.any()):
        remaining = target - count
        low = remaining.clamp(max=min_block)
        high = remaining.clamp(min=min_block)
        delta = torch.zeros_like(count)
        attempting = active.clone()
        for attempt in range(ATTEMPTS_PER_ROUND):
            o0, o1, o2, o3 = philox_ref(
                seed, round_index * ATTEMPTS_PER_ROUND + attempt, counter_1, counter_2, TAG_MASK
            )
            area_q = (low << 32) + (high - low) * o0
            aspect_bin = o1 >> ASPECT_BIN_SHIFT
            height = (area_q[:, None] >= h_thresholds[aspect_bin]).sum(1)
            width = (area_q[:, None] >= w_thresholds[aspect_bin]).sum(1)
            fits = (height < rows) & (width < cols)
            top = (o2 * (rows - height + 1)) >> 32
            left = (o3 * (cols - width + 1)) >> 32
            inside = (
                (row_of >= top[:, None])
                & (row_of < (top + height)[:, None])
                & (col_of >= left[:, None])
                & (col_of < (left + width)[:, None])
            )
            new_cells = inside & ~mask
            new_count = new_cells.sum(1)
            accept = attempting & fits & (new_count > 0) & (new_count <= remaining)
            mask |= new_cells & accept[:, None]
            delta = torch.where(accept, new_count, delta)
            attempting &= ~accept
        count += delta
        active &= (delta > 0) & (count < target)
        round_index += 1

    key = philox_ref(seed, positions[None, :], counter_1[:, None], counter_2[:, None], TAG_PERM)[0]
    keys = torch.where(mask, (key << 31) | positions, -1)  # (key, position) packed in a non-negative int64
    # Unmasked positions sort first, in position order, in both orders; the masked ones follow, by position in
    # one and by (key, position) in the other: scattering one onto the other fixes the unmasked positions.
    by_position = torch.argsort(mask.to(torch.int8), dim=1, stable=True)
    by_key = torch.argsort(keys, dim=1, stable=True)
    perm = torch.empty_like(by_position).scatter_(1, by_position, by_key)
    return Jigsaw(mask, perm)


# ----------------------------------------------------------------------------------------------------------------
# The straightforward Python loop (BEiT's MaskingGenerator, as the paper's code uses it)
# ----------------------------------------------------------------------------------------------------------------


def block_mask_python(
    grid_size: int | tuple[int, int],
    ratio: float,
    *,
    min_block: int = 8,
    min_aspect: float = 0.3,
    rng: random.Random | None = None,
) -> np.ndarray:
    """One block-wise mask by the plain Python loop, with Python's float ``random``.

    This is the algorithm of BEiT's masking generator as docs/design.md section 1 states it, written here from that
    description: the distributional reference for our integer sampler and the baseline of the sampler
    benchmark.

    Returns:
        bool ``[rows, cols]``.
    """
    rows, cols = check_grid_size(grid_size)
    rng = rng or random.Random()
    target = _target_count(ratio, rows * cols)
    log_aspect = (math.log(min_aspect), math.log(1.0 / min_aspect))
    mask = np.zeros((rows, cols), dtype=bool)
    count = 0
    while count < target:
        remaining = target - count
        delta = 0
        for _ in range(ATTEMPTS_PER_ROUND):
            area = rng.uniform(min_block, remaining)
            aspect = math.exp(rng.uniform(*log_aspect))
            height = int(round(math.sqrt(area * aspect)))
            width = int(round(math.sqrt(area / aspect)))
            if width < cols and height < rows:
                top = rng.randint(0, rows - height)
                left = rng.randint(0, cols - width)
                block = mask[top : top + height, left : left + width]
                new = height * width - int(block.sum())
                if 0 < new <= remaining:
                    block[...] = True
                    delta = new
            if delta > 0:
                break
        if delta == 0:
            break
        count += delta
    return mask


# ----------------------------------------------------------------------------------------------------------------
# Compiled and Triton samplers, as torch.library operators (opaque to torch.compile, no graph break)
# ----------------------------------------------------------------------------------------------------------------


def _empty_jigsaw(batch_size: int, num_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(batch_size, num_positions, dtype=torch.bool, device=device),
        torch.empty(batch_size, num_positions, dtype=torch.int64, device=device),
    )


def _seed_bits(seed: int) -> int:
    """The seed's 64 bits as a signed int64, as tensors and operator schemas hold them."""
    return seed - 2**64 if seed >= 2**63 else seed


@torch.library.custom_op("mjp_fast::sample_jigsaw_extension", mutates_args=())
def _sample_jigsaw_extension(
    counter: torch.Tensor,
    h_thresholds: torch.Tensor,
    w_thresholds: torch.Tensor,
    batch_size: int,
    rows: int,
    cols: int,
    target: int,
    min_block: int,
    seed_bits: int,
    shared: bool,
    prob_threshold: int,
    counter_scale: int,
    stream_shift: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled sampler (``cpu`` or ``cuda`` backend) on the device of the tables."""
    offset = int(counter.reshape(-1)[0]) * counter_scale + stream_shift  # a host read: free on a CPU, a sync on a GPU
    return backend_module.extension().sample_jigsaw(
        batch_size, rows, cols, target, min_block, seed_bits & 0xFFFFFFFFFFFFFFFF, offset, shared, prob_threshold,
        h_thresholds, w_thresholds,
    )  # fmt: skip


@_sample_jigsaw_extension.register_fake
def _(counter, h_thresholds, w_thresholds, batch_size, rows, cols, target, min_block, seed_bits, shared, *_):
    return _empty_jigsaw(batch_size, rows * cols, h_thresholds.device)


def sampler_params(seed: int, prob: float, device: torch.device | str) -> torch.Tensor:
    """int64 ``[2]`` on ``device``: the seed's 64 bits and the prob threshold, as the Triton sampler reads them.

    Made once per (seed, prob, device) and shared: callers must not write to it.
    """
    return _sampler_params_on_device(_seed_bits(seed), _prob_threshold(prob), str(device))


@functools.lru_cache(maxsize=256)
def _sampler_params_on_device(seed_bits: int, prob_threshold: int, device: str) -> torch.Tensor:
    return torch.tensor([seed_bits, prob_threshold], dtype=torch.int64, device=device)


class SamplerPlan(NamedTuple):
    """Everything a compiled or Triton sampler needs besides the batch size and the stream position, made once.

    :class:`mjp_fast.JigsawSampler` keeps one per grid and device, so a training step only launches the sampler:
    nothing is checked, resolved or built on the host per call. Make one with :func:`make_sampler_plan`.
    """

    backend: str  # "cpu", "cuda" or "triton"
    rows: int
    cols: int
    target: int
    min_block: int
    shared: bool
    seed: int
    prob_threshold: int
    h_thresholds: torch.Tensor  # int64 [1024, rows] on the device
    w_thresholds: torch.Tensor  # int64 [1024, cols] on the device
    params: torch.Tensor | None  # int64 [2] on the device (sampler_params), for the Triton sampler

    def sample(
        self, batch_size: int, counter: torch.Tensor | int, counter_scale: int = 1, stream_shift: int = 0
    ) -> Jigsaw:
        """``batch_size`` jigsaws; sample ``i`` uses stream ``counter * counter_scale + stream_shift + i``.

        ``counter``: an int, or an int64 one-element tensor on the plan's device (what the modules pass: the
        Triton sampler reads it on the device, so no host sync, and a CUDA graph replays the right stream).
        """
        compiling = torch.compiler.is_compiling()
        if not isinstance(counter, torch.Tensor) and (self.backend == "triton" or compiling):
            # The operators and the Triton kernel read the stream position from a device tensor.
            counter = _as_offset_tensor(counter * counter_scale + stream_shift, self.h_thresholds.device)
            counter_scale, stream_shift = 1, 0
        if self.backend == "triton":
            arguments = (
                counter, self.params, self.h_thresholds, self.w_thresholds, batch_size, self.rows, self.cols,
                self.target, self.min_block, counter_scale, stream_shift, self.shared,
            )  # fmt: skip
            if compiling:
                return Jigsaw(*torch.ops.mjp_fast.sample_jigsaw_triton(*arguments))
            return Jigsaw(*_triton_sampler.sample_jigsaw_launch(*arguments))
        if compiling:
            return Jigsaw(
                *_sample_jigsaw_extension(
                    counter, self.h_thresholds, self.w_thresholds, batch_size, self.rows, self.cols, self.target,
                    self.min_block, _seed_bits(self.seed), self.shared, self.prob_threshold, counter_scale,
                    stream_shift,
                )
            )  # fmt: skip
        # Eager: the extension directly. The operator wrapper (needed only so torch.compile can trace through) costs
        # tens of microseconds a call, more than sampling a batch of 64.
        start = int(counter) if isinstance(counter, torch.Tensor) else counter  # a sync on a GPU (cuda backend)
        mask, perm = backend_module.extension().sample_jigsaw(
            batch_size, self.rows, self.cols, self.target, self.min_block, self.seed,
            start * counter_scale + stream_shift, self.shared, self.prob_threshold, self.h_thresholds,
            self.w_thresholds,
        )  # fmt: skip
        return Jigsaw(mask, perm)

    def sample_step(
        self, batch_size: int, counter: torch.Tensor, counter_scale: int = 1, stream_shift: int = 0
    ) -> Jigsaw:
        """:meth:`sample`, then ``counter += batch_size`` in place: a module's training step (``counter``: its int64
        one-element stream counter on the plan's device). On the CPU, one call of the extension does both."""
        if self.backend == "cpu" and not torch.compiler.is_compiling():
            mask, perm = backend_module.extension().sample_jigsaw_step(
                counter, counter_scale, stream_shift, batch_size, self.rows, self.cols, self.target, self.min_block,
                self.seed, self.shared, self.prob_threshold, self.h_thresholds, self.w_thresholds,
            )  # fmt: skip
            return Jigsaw(mask, perm)
        jigsaw = self.sample(batch_size, counter, counter_scale, stream_shift)
        counter.add_(batch_size)  # a buffer that needs no gradient: nothing is recorded
        return jigsaw


def make_sampler_plan(
    grid_size: tuple[int, int],
    ratio: float,
    *,
    seed: int,
    prob: float,
    shared: bool,
    min_block: int,
    min_aspect: float,
    device: torch.device,
    backend: str,
) -> SamplerPlan:
    """A :class:`SamplerPlan` for checked settings on ``device`` and a resolved compiled or Triton ``backend``."""
    rows, cols = grid_size
    h_thresholds, w_thresholds = sampler_tables(rows, cols, min_aspect, device)
    return SamplerPlan(
        backend=backend,
        rows=rows,
        cols=cols,
        target=_target_count(ratio, rows * cols),
        min_block=min_block,
        shared=shared,
        seed=seed,
        prob_threshold=_prob_threshold(prob),
        h_thresholds=h_thresholds,
        w_thresholds=w_thresholds,
        params=sampler_params(seed, prob, device) if backend == "triton" else None,
    )


def _as_offset_tensor(offset: int | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    if isinstance(offset, torch.Tensor):
        return offset.reshape(1).to(device=device, dtype=torch.int64)
    return torch.tensor([offset], dtype=torch.int64, device=device)


def _check_offset(offset: object, batch_size: int, device: torch.device) -> int | torch.Tensor:
    if isinstance(offset, torch.Tensor):
        if offset.numel() != 1 or offset.dtype.is_floating_point or offset.dtype == torch.bool:
            raise TypeError(
                f"offset must be an int or a one-element integer tensor, got {offset.dtype} {list(offset.shape)}"
            )
        if with_index(offset.device) != device:
            raise ValueError(f"offset is on {offset.device} but the jigsaw is made on {device}")
        return offset  # its value stays on the device: checking it would cost a host sync
    offset = check_int("offset", offset, minimum=0)
    if offset + batch_size > 2**63:
        raise ValueError(f"offset + batch_size must be <= 2**63, got offset={offset}, batch_size={batch_size}")
    return offset


# ----------------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------------


def sample_jigsaw(
    batch_size: int,
    grid_size: int | tuple[int, int],
    ratio: float,
    *,
    seed: int,
    offset: int | torch.Tensor = 0,
    shared: bool = False,
    prob: float = 1.0,
    min_block: int = 8,
    min_aspect: float = 0.3,
    device: torch.device | str | None = None,
    backend: str | None = None,
) -> Jigsaw:
    """Samples a block-wise jigsaw (mask and permutation) for every sample of a batch.

    Sample ``i`` is a pure function of ``(seed, offset + i)`` and the other arguments, bit-identical on every
    backend and device: a training loop passes ``offset = global index of the batch's first sample`` and gets
    fresh jigsaws each step, distinct ones on each rank, and the same ones after a resume.

    Args:
        batch_size: B >= 0.
        grid_size: the patch grid, an int (square) or ``(rows, cols)``; ``N = rows * cols``, position
            ``n = row * cols + col``.
        ratio: in [0, 1]; each mask aims at ``floor(ratio * N)`` positions and, as BEiT's, may end short of it.
        seed: an int in ``[0, 2**64)``.
        offset: the stream index of sample 0: an int >= 0, or a one-element int64 tensor on ``device`` (what
            :class:`mjp_fast.MJPPatchEmbed` passes: no recompilation under torch.compile, and on the ``triton``
            backend no host sync).
        shared: one jigsaw (that of stream ``offset``) for the whole batch, as the paper's code does.
        prob: each sample is jigsawed with this probability, else its mask is all False.
        min_block: the smallest rectangle area BEiT tries (the paper's code: 8).
        min_aspect: rectangles' aspect ratios are log-uniform in ``[min_aspect, 1 / min_aspect]``.
        device: where the result lives (default CPU).
        backend: ``torch``, ``cpu``, ``cuda`` or ``triton``; default ``MJP_FAST_BACKEND``, else the fastest for
            ``device``.

    Returns:
        ``Jigsaw(mask, perm)``: mask bool ``[B, N]``, perm int64 ``[B, N]``.
    """
    batch_size = check_int("batch_size", batch_size, minimum=0)
    rows, cols = check_grid_size(grid_size)
    if rows * cols > MAX_GRID_POSITIONS:
        raise ValueError(f"grid_size has {rows * cols} positions; at most {MAX_GRID_POSITIONS} are supported")
    ratio = check_fraction("ratio", ratio)
    seed = check_int("seed", seed, minimum=0, maximum=2**64 - 1)
    if not isinstance(shared, bool):
        raise TypeError(f"shared must be a bool, got {type(shared).__name__}")
    prob = check_fraction("prob", prob)
    min_block = check_int("min_block", min_block, minimum=1, maximum=MAX_GRID_POSITIONS)
    min_aspect = check_positive_float("min_aspect", min_aspect)
    device = to_device(device)
    offset = _check_offset(offset, batch_size, device)
    chosen = backend_module.resolve_backend(backend, device)

    if chosen == "torch":
        return sample_jigsaw_ref(
            batch_size,
            (rows, cols),
            ratio,
            seed=seed,
            offset=offset,
            shared=shared,
            prob=prob,
            min_block=min_block,
            min_aspect=min_aspect,
            device=device,
        )
    plan = make_sampler_plan(
        (rows, cols),
        ratio,
        seed=seed,
        prob=prob,
        shared=shared,
        min_block=min_block,
        min_aspect=min_aspect,
        device=device,
        backend=chosen,
    )
    return plan.sample(batch_size, offset)


if backend_module.triton_importable():
    # Defines the Triton sampler and registers its operator, torch.ops.mjp_fast.sample_jigsaw_triton.
    import mjp_fast.triton.sampler as _triton_sampler  # noqa: E402
