"""docs/sampler.md in plain PyTorch: the sampler's constants, Philox, the integer tables, and the oracle.

Every kernel of the sampler (``csrc/sampler.h`` for the CPU and CUDA, ``triton_kernel.py``) implements the same
integer arithmetic, so a jigsaw is a pure function of ``(seed, stream index)`` and the settings, bit-identical on
every backend and device. :func:`sample_from_tables` is what the tests hold each of them to.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from mjp_fast._validate import check_grid_size, to_device
from mjp_fast.sampler.jigsaw import Jigsaw, empty_jigsaw

ASPECT_BINS = 1024
ASPECT_BIN_SHIFT = 22  # 32 - log2(ASPECT_BINS): the aspect bin is the top 10 bits of a uint32
ATTEMPTS_PER_ROUND = 10  # BEiT's number of tries per rectangle
TAG_MASK, TAG_PERM, TAG_COIN = 0, 1, 2
MAX_GRID_POSITIONS = 1 << 30  # keeps every Q32 area and threshold inside int64
# The threshold tables hold 1024 int64 per row and per column of the grid (8 KiB each): at most 2**14 per side keeps
# them under 128 MiB each, where N = 2**30 alone would allow a (1, 2**30) grid and 8 TiB of tables.
MAX_GRID_SIDE = 1 << 14

_UINT32 = 0xFFFFFFFF
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57


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


def check_sampler_grid(grid_size: object, name: str = "grid_size") -> tuple[int, int]:
    """``grid_size`` as :func:`mjp_fast._validate.check_grid_size`, within the sampler's limits: at most
    :data:`MAX_GRID_SIDE` rows and columns and :data:`MAX_GRID_POSITIONS` positions."""
    rows, cols = check_grid_size(grid_size, name)
    if max(rows, cols) > MAX_GRID_SIDE:
        raise ValueError(f"{name} must have at most {MAX_GRID_SIDE} rows and columns, got {(rows, cols)}")
    if rows * cols > MAX_GRID_POSITIONS:
        raise ValueError(f"{name} has {rows * cols} positions; at most {MAX_GRID_POSITIONS} are supported")
    return rows, cols


def target_count(ratio: float, num_positions: int) -> int:
    """How many cells a mask aims at: ``floor(ratio * N)``."""
    return math.floor(ratio * num_positions)


def prob_threshold(prob: float) -> int:
    """The coin's threshold in ``[0, 2**32]``: a sample is jigsawed when its uint32 coin is below it."""
    return math.floor(prob * 2**32)


def seed_bits(seed: int) -> int:
    """The seed's 64 bits as a signed int64, as tensors and operator schemas hold them."""
    return seed - 2**64 if seed >= 2**63 else seed


def sample_from_tables(
    batch_size: int,
    rows: int,
    cols: int,
    target: int,
    min_block: int,
    seed: int,
    prob_threshold: int,
    h_thresholds: torch.Tensor,
    w_thresholds: torch.Tensor,
    offset: int | torch.Tensor,
    shared: bool,
) -> Jigsaw:
    """The oracle: docs/sampler.md run for all samples in lockstep, on the integers every kernel takes (what the
    ``torch`` backend runs; :func:`mjp_fast.sampler.sample_jigsaw_ref` takes the settings as
    :func:`mjp_fast.sample_jigsaw` does).

    Args:
        target, prob_threshold: from :func:`target_count` and :func:`prob_threshold`.
        seed: in ``[0, 2**64)``, or its signed int64 bits (:func:`seed_bits`).
        h_thresholds, w_thresholds: :func:`sampler_tables` on the device the jigsaw is made on.
        offset: the stream index of sample 0, an int or a one-element int64 tensor; taken mod 2**64 (an int64's
            bits as unsigned), as every kernel does.

    Returns:
        ``Jigsaw(mask [B, N] bool, perm [B, N] int64)`` on the tables' device (on the meta device: shapes only).
    """
    device = h_thresholds.device
    num_positions = rows * cols
    if device.type == "meta":  # shapes and dtypes only (what a FakeTensor trace or a meta-device model needs)
        return Jigsaw(*empty_jigsaw(batch_size, num_positions, device))
    seed &= 0xFFFFFFFFFFFFFFFF
    if isinstance(offset, torch.Tensor):
        stream = offset.reshape(1).to(device=device, dtype=torch.int64).expand(batch_size).clone()
    else:
        stream = torch.full((batch_size,), seed_bits(offset & 0xFFFFFFFFFFFFFFFF), dtype=torch.int64, device=device)
    if not shared:
        stream += torch.arange(batch_size, dtype=torch.int64, device=device)
    # int64 arithmetic wraps as the kernels' uint64: the high word is masked, since >> shifts the sign in.
    counter_1, counter_2 = stream & _UINT32, (stream >> 32) & _UINT32

    coin = philox_ref(seed, 0, counter_1, counter_2, TAG_COIN)[0]
    active = coin < prob_threshold
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
