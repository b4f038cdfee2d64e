"""The Triton sampler: docs/sampler.md with one program per sample, bit-identical to the oracle and the C++ sampler.

The mask lives in registers as a ``[BLOCK_N]`` vector over the grid; each rectangle is a vector comparison. The
permutation is two sorts: the masked positions in increasing order (``m_i``) and by packed random key
(``s_i``), then one scatter ``perm[m_i] = s_i``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mjp_fast.sampler import reference as _spec
from mjp_fast.sampler.jigsaw import empty_jigsaw
from mjp_fast.triton import launcher, next_power_of_2, warp_count

# The sampler's constants as the compiler takes globals inside a kernel: constexpr. (The interpreter also reads
# plain Python ints; compiling for a GPU refuses them, as tests/triton/compile_for_gpu.py found.)
ASPECT_BIN_SHIFT = tl.constexpr(_spec.ASPECT_BIN_SHIFT)
ATTEMPTS_PER_ROUND = tl.constexpr(_spec.ATTEMPTS_PER_ROUND)
TAG_COIN = tl.constexpr(_spec.TAG_COIN)
TAG_MASK = tl.constexpr(_spec.TAG_MASK)
TAG_PERM = tl.constexpr(_spec.TAG_PERM)

# Warps per sample's program: Triton's default. Each round of a sample reduces its mask vector across the warps
# (through shared memory, with barriers) while the rounds run one after another; bench/bench_kernels.py times one
# warp, whose reductions are shuffles within the warp (as the cuda backend's sampler runs a sample on one warp).
SAMPLER_WARPS = 4


@triton.jit
def _philox_words(seed, c0, c1, c2, c3):
    # Counters as uint32 vectors or scalars; tl.philox splits the 64-bit seed into its two key words.
    return tl.philox(seed, c0.to(tl.uint32), c1.to(tl.uint32), c2.to(tl.uint32), c3.to(tl.uint32))


@triton.jit
def _sample_jigsaw_kernel(
    mask_ptr,  # bool [B, N], written
    perm_ptr,  # int64 [B, N], written
    h_thresholds_ptr,  # int64 [1024, rows]
    w_thresholds_ptr,  # int64 [1024, cols]
    counter_ptr,  # int64, one element: with counter_scale and stream_shift, the stream index of sample 0
    params_ptr,  # int64 [2]: the seed's 64 bits, then the prob threshold in [0, 2**32]
    counter_scale,
    stream_shift,
    rows,
    cols,
    target,
    min_block,
    SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,  # power of two >= max(rows, cols)
):
    sample = tl.program_id(0).to(tl.int64)
    num_positions = rows * cols
    # Read on the device: no host sync, nothing recompiled per step, and a CUDA graph replays the right stream.
    # The seed and the threshold come from memory too: as kernel arguments they may pass 2**31, and Inductor (torch
    # 2.11) fails to compile a call of a user Triton kernel with such an int argument.
    stream = tl.load(counter_ptr).to(tl.int64) * counter_scale + stream_shift
    seed = tl.load(params_ptr)
    prob_threshold = tl.load(params_ptr + 1)
    if not SHARED:
        stream = stream + sample
    counter_1 = stream & 0xFFFFFFFF
    counter_2 = (stream >> 32) & 0xFFFFFFFF
    zero = stream * 0

    coin, _, _, _ = _philox_words(seed, zero, counter_1, counter_2, zero + TAG_COIN)
    active = (coin.to(tl.int64) < prob_threshold) & (target > 0)

    positions = tl.arange(0, BLOCK_N)
    in_grid = positions < num_positions
    row_of = positions // cols
    col_of = positions % cols
    steps = tl.arange(0, BLOCK_G)
    mask = positions < 0  # all False

    count = target * 0
    round_index = target * 0
    while active:
        remaining = target - count
        low = tl.minimum(remaining, min_block).to(tl.int64)
        high = tl.maximum(remaining, min_block).to(tl.int64)
        delta = count * 0
        for attempt in range(ATTEMPTS_PER_ROUND):
            if delta == 0:
                draw = zero + round_index * ATTEMPTS_PER_ROUND + attempt
                o0, o1, o2, o3 = _philox_words(seed, draw, counter_1, counter_2, zero + TAG_MASK)
                area_q = (low << 32) + (high - low) * o0.to(tl.int64)
                aspect_bin = (o1 >> ASPECT_BIN_SHIFT).to(tl.int64)
                h_row = tl.load(h_thresholds_ptr + aspect_bin * rows + steps, mask=steps < rows, other=1 << 62)
                w_row = tl.load(w_thresholds_ptr + aspect_bin * cols + steps, mask=steps < cols, other=1 << 62)
                height = tl.sum((area_q >= h_row).to(tl.int32), axis=0)
                width = tl.sum((area_q >= w_row).to(tl.int32), axis=0)
                fits = (height < rows) & (width < cols)
                top = ((o2.to(tl.int64) * (rows - height + 1).to(tl.int64)) >> 32).to(tl.int32)
                left = ((o3.to(tl.int64) * (cols - width + 1)).to(tl.int64) >> 32).to(tl.int32)
                inside = (row_of >= top) & (row_of < top + height) & (col_of >= left) & (col_of < left + width)
                new_cells = inside & in_grid & (~mask)
                new_count = tl.sum(new_cells.to(tl.int32), axis=0)
                accept = fits & (new_count > 0) & (new_count <= remaining)
                mask = mask | (new_cells & accept)
                delta = tl.where(accept, new_count, 0)
        count += delta
        active = (delta > 0) & (count < target)
        round_index += 1

    row_offset = sample * num_positions
    tl.store(mask_ptr + row_offset + positions, mask, mask=in_grid)
    tl.store(perm_ptr + row_offset + positions, positions.to(tl.int64), mask=in_grid & (~mask))
    key, _, _, _ = _philox_words(seed, positions, zero + counter_1, zero + counter_2, zero + TAG_PERM)
    sort_key = (key.to(tl.int64) << 31) | positions.to(tl.int64)
    largest = 0x7FFFFFFFFFFFFFFF
    by_key = tl.sort(tl.where(mask, sort_key, largest), dim=0)
    by_position = tl.sort(tl.where(mask, positions, BLOCK_N), dim=0)
    masked_count = tl.sum(mask.to(tl.int32), axis=0)
    slots = tl.arange(0, BLOCK_N)
    tl.store(perm_ptr + row_offset + by_position, by_key & 0x7FFFFFFF, mask=slots < masked_count)


def sample_jigsaw_launch(
    counter: torch.Tensor,
    params: torch.Tensor,
    h_thresholds: torch.Tensor,
    w_thresholds: torch.Tensor,
    batch_size: int,
    rows: int,
    cols: int,
    target: int,
    min_block: int,
    counter_scale: int,
    stream_shift: int,
    shared: bool,
    *,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``batch_size`` jigsaws on the device of the tables: one launch, one program per sample.

    Args:
        counter: int64, one element, on the tables' device; sample ``i`` uses stream ``counter * counter_scale +
            stream_shift + i`` (``+ i`` unless ``shared``).
        params: int64 ``[2]``: the seed's 64 bits as a signed int64, and the prob threshold (see ``sampler_params``).
        traced: launch through ``torch.library.wrap_triton`` (inside the operator, for torch.compile); eager calls
            launch the kernel directly, which costs less host time.

    Returns:
        mask bool ``[B, N]`` and perm int64 ``[B, N]``.
    """
    mask, perm = empty_jigsaw(batch_size, rows * cols, h_thresholds.device)
    if batch_size == 0:
        return mask, perm
    launcher(_sample_jigsaw_kernel, (batch_size,), traced)(
        mask, perm, h_thresholds, w_thresholds, counter, params, counter_scale, stream_shift, rows, cols, target,
        min_block,
        SHARED=shared,
        BLOCK_N=next_power_of_2(rows * cols),
        BLOCK_G=next_power_of_2(max(rows, cols)),
        num_warps=warp_count(SAMPLER_WARPS),
    )  # fmt: skip
    return mask, perm
