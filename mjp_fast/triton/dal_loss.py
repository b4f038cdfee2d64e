"""Triton kernels of the DAL loss: the regressor, the weighted L1 loss and all their gradients, in float32.

The regressor maps each position embedding ``pos[n]`` (``[N, D]``) to grid coordinates ``pred[n]`` (``[N, 2]``):
``pred = relu(pos @ w1^T + b1) @ w2^T + b2`` (nonlinear, hidden width H) or ``pred = pos @ w2^T + b2`` (linear).
With ``u[n]`` the number of samples that keep position n unmasked (1 without a mask) and
``weights = u / max(sum(u), 1)``: ``loss = scale * sum_n weights[n] * |pred[n] - coords[n]|_1``.

Forward, two launches:

1. ``_forward_partial_kernel``, grid ``(position blocks, splits)``: the reduction axis of the last Linear (H, or D
   for the linear regressor) is cut into ``splits`` ranges of tiles, as many as it takes to give the GPU about two
   programs per multiprocessor. Each program computes its hidden tile (``tl.dot`` over D, then bias and ReLU),
   stores it, and multiplies it by its columns of ``w2`` (the 2-wide coordinate axis padded to 16 by masked loads)
   into a float32 partial prediction. The same program counts, for its positions, the unmasked samples of its
   share of the batch. Both go to one buffer ``[splits, N, 3]`` (row, col, count): one allocation.
2. ``_forward_finish_kernel``, one program: sums the partials over the splits in a fixed order, adds ``b2``, writes
   ``pred`` and ``weights``, and reduces the loss in a fixed order.

What the backward needs of each position, its prediction, weight and hidden layer, is one buffer ``saved [N, 3 +
H]`` (the first kernel writes the hidden layer in columns 3.., the second the rest): one allocation a step.

``pos`` may be the model's full table ``[skip_rows + N, D]`` (any leading dims of 1, e.g. ``[1, 1 + N, D]`` with a
class token's row first): the kernels read its rows ``skip_rows..``, and the backward writes ``grad_pos`` in the
table's full shape, zeros in the skipped rows, so nothing is sliced before nor padded after.

Backward, one launch (``_backward_kernel``), each gradient element owned by exactly one program, so no atomics
and no partials: the first programs own a tile of ``(H, D)``, loop over all positions and accumulate ``grad_w1``
(and, in the tiles of the first D block, ``grad_b1`` and ``grad_w2``; ``grad_b2`` in program 0); the others own a
tile of ``(skip_rows + N, D)`` of ``grad_pos`` (zeros in the skipped rows) and loop over H. Both recompute
``d_pred`` (cheap: it is elementwise in the saved ``pred``) and ``dh = (d_pred @ w2) * (hidden > 0)`` where they need
it, so nothing passes between programs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mjp_fast.triton.common import (
    cdiv,
    define_operator,
    dot_precision,
    dot_upcast,
    interpreting,
    launcher,
    multiprocessors,
    power_of_two_tile,
    scratch,
    tile_size,
    warp_count,
)

# The coordinate axis (2 wide) padded to the smallest side that tl.dot takes.
COORD_PAD = tl.constexpr(16)


@triton.jit
def _forward_partial_kernel(
    pos_ptr,  # [skip_rows + N, D], pos's dtype: rows skip_rows.. are read
    w1_ptr,  # [H, D] (NONLINEAR)
    b1_ptr,  # [H] (NONLINEAR and HAS_B1)
    w2_ptr,  # [2, K]
    mask_ptr,  # bool [B, N] (HAS_MASK)
    saved_ptr,  # float32 [N, 3 + H]: the hidden layer written at columns 3.. (NONLINEAR)
    partials_ptr,  # float32 [splits, N, 3], written: per position the partial (row, col), and its kept count (HAS_MASK)
    N,
    skip_rows,  # rows of pos before the N positions' (a class token's)
    D,
    K,  # the reduction axis of the last Linear: H (NONLINEAR) or D
    B,
    tiles_per_split,  # tiles of BLOCK_K of the K axis in each split
    samples_per_split,  # samples of the mask counted by each split
    NONLINEAR: tl.constexpr,
    HAS_B1: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pos_ptr += skip_rows * D
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_ok = rows < N
    wide_rows = rows.to(tl.int64)
    coord = tl.arange(0, COORD_PAD)
    part = tl.zeros((BLOCK_N, COORD_PAD), dtype=tl.float32)
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for tile in range(first_tile, last_tile):
        cols = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        if NONLINEAR:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for d_start in range(0, D, BLOCK_D):
                channels = d_start + tl.arange(0, BLOCK_D)
                channel_ok = channels < D
                pos = tl.load(
                    pos_ptr + wide_rows[:, None] * D + channels[None, :],
                    mask=row_ok[:, None] & channel_ok[None, :],
                    other=0.0,
                )
                # w1 is [H, D] row-major: this tile is its transpose [BLOCK_D, BLOCK_K]
                w1 = tl.load(
                    w1_ptr + cols[None, :].to(tl.int64) * D + channels[:, None],
                    mask=channel_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
                if UPCAST:  # mixed dtypes, or bfloat16 in the interpreter (which multiplies it wrongly)
                    pos = pos.to(tl.float32)
                    w1 = w1.to(tl.float32)
                acc = tl.dot(pos, w1, acc, input_precision=PRECISION)
            if HAS_B1:
                acc += tl.load(b1_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            # relu as torch's: a NaN stays NaN (tl.maximum's default returns the other operand)
            features = tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL)
            # Zero past H: an inf in pos times w1's zero padding is NaN there, and the next dot would spread it.
            features = tl.where(col_ok[None, :], features, 0.0)
            tl.store(
                saved_ptr + wide_rows[:, None] * (K + 3) + 3 + cols[None, :],
                features,
                mask=row_ok[:, None] & col_ok[None, :],
            )
        else:
            features = tl.load(
                pos_ptr + wide_rows[:, None] * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
            ).to(tl.float32)
        # w2 is [2, K]: this tile is its transpose [BLOCK_K, 16], zero past the two coordinates
        w2 = tl.load(
            w2_ptr + coord[None, :] * K + cols[:, None], mask=col_ok[:, None] & (coord[None, :] < 2), other=0.0
        ).to(tl.float32)
        part = tl.dot(features, w2, part, input_precision="ieee")
    partial_rows = (split * N + wide_rows) * 3
    tl.store(partials_ptr + partial_rows[:, None] + coord[None, :], part, mask=row_ok[:, None] & (coord[None, :] < 2))
    if HAS_MASK:
        kept = tl.zeros((BLOCK_N,), dtype=tl.int32)
        first_sample = split * samples_per_split
        last_sample = tl.minimum(first_sample + samples_per_split, B)
        for sample_start in range(first_sample, last_sample, BLOCK_B):
            samples = sample_start + tl.arange(0, BLOCK_B)
            masked = tl.load(
                mask_ptr + samples[:, None].to(tl.int64) * N + rows[None, :],
                mask=(samples[:, None] < last_sample) & row_ok[None, :],
                other=1,
            ).to(tl.int1)
            kept += tl.sum(tl.where(masked, 0, 1), axis=0)
        # a count below 2^24 (the batch), exact in float32: one buffer holds the partials and the counts
        tl.store(partials_ptr + partial_rows + 2, kept.to(tl.float32), mask=row_ok)


@triton.jit
def _forward_finish_kernel(
    partials_ptr,  # float32 [splits, N, 3]: the partial (row, col), and the kept count (HAS_MASK)
    b2_ptr,  # [2] (HAS_B2)
    coords_ptr,  # float32 [N, 2]
    saved_ptr,  # float32 [N, 3 + H]: each position's prediction (row, col) and weight written at columns 0..2
    loss_ptr,  # float32 [], written
    N,
    H,  # the hidden layer's width (0 for the linear regressor): saved's rows are 3 + H wide
    splits,
    scale,  # float
    HAS_B2: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.arange(0, BLOCK)
    # The weights' denominator first: every position's count, over the splits in order.
    kept_total = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, N, BLOCK):
        rows = start + offsets
        if HAS_MASK:
            for split in range(0, splits):
                kept_total += tl.load(partials_ptr + (split * N + rows) * 3 + 2, mask=rows < N, other=0.0).to(tl.int32)
        else:
            kept_total += tl.where(rows < N, 1, 0)
    denominator = tl.maximum(tl.sum(kept_total, axis=0), 1).to(tl.float32)
    if HAS_B2:
        bias_row = tl.load(b2_ptr).to(tl.float32)
        bias_col = tl.load(b2_ptr + 1).to(tl.float32)
    else:
        bias_row = 0.0
        bias_col = 0.0
    loss = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        rows = start + offsets
        ok = rows < N
        pred_row = tl.zeros((BLOCK,), dtype=tl.float32)
        pred_col = tl.zeros((BLOCK,), dtype=tl.float32)
        kept = tl.zeros((BLOCK,), dtype=tl.int32)
        for split in range(0, splits):
            partial = partials_ptr + (split * N + rows) * 3
            pred_row += tl.load(partial, mask=ok, other=0.0)
            pred_col += tl.load(partial + 1, mask=ok, other=0.0)
            if HAS_MASK:
                kept += tl.load(partial + 2, mask=ok, other=0.0).to(tl.int32)
        if not HAS_MASK:
            kept = tl.where(ok, 1, 0)
        pred_row += bias_row
        pred_col += bias_col
        saved_rows = saved_ptr + rows.to(tl.int64) * (H + 3)
        tl.store(saved_rows, pred_row, mask=ok)
        tl.store(saved_rows + 1, pred_col, mask=ok)
        weights = kept.to(tl.float32) / denominator
        tl.store(saved_rows + 2, weights, mask=ok)
        error = tl.abs(pred_row - tl.load(coords_ptr + rows * 2, mask=ok, other=0.0)) + tl.abs(
            pred_col - tl.load(coords_ptr + rows * 2 + 1, mask=ok, other=0.0)
        )
        # A position of weight 0 (every sample masks it) is out of the loss: its error, even inf or NaN, is not added.
        loss += tl.where(ok & (kept > 0), weights * error, 0.0)
    tl.store(loss_ptr, (tl.cast(scale, tl.float32) * tl.sum(loss, axis=0)).to(loss_ptr.dtype.element_ty))


@triton.jit
def _grad_prediction(grad_ptr, saved_ptr, coords_ptr, rows, N, H, scale, COORDS: tl.constexpr):
    """``grad * scale * weights[n] * sign(pred - coords)``, ``[BLOCK_N, COORDS]``, zero past the 2 coordinates and
    on rows outside ``[0, N)``; ``saved`` ``[N, 3 + H]``: each position's prediction (row, col) and weight first."""
    coord = tl.arange(0, COORDS)
    row_ok = (rows >= 0) & (rows < N)
    ok = row_ok[:, None] & (coord[None, :] < 2)
    wide_rows = rows.to(tl.int64)[:, None]
    prediction = tl.load(saved_ptr + wide_rows * (H + 3) + coord[None, :], mask=ok, other=0.0)
    difference = prediction - tl.load(coords_ptr + wide_rows * 2 + coord[None, :], mask=ok, other=0.0)
    sign = tl.where(difference > 0, 1.0, tl.where(difference < 0, -1.0, 0.0))
    # scale is a Python float: float32 in an eager launch, float64 where inductor launches the kernel (torch's
    # triton_utils gives Python floats fp64), and tl.dot takes no float64 operand next to a float32 one. tl.cast,
    # not scale.to: the interpreter passes scale as a Python float, which has no .to
    factor = tl.load(grad_ptr).to(tl.float32) * tl.cast(scale, tl.float32)
    factor *= tl.load(saved_ptr + rows.to(tl.int64) * (H + 3) + 2, mask=row_ok, other=0.0)
    return sign * factor[:, None]


@triton.jit
def _backward_kernel(
    grad_ptr,  # float32 [], the loss's gradient
    pos_ptr,  # [skip_rows + N, D]: rows skip_rows.. are read
    w1_ptr,  # [H, D] (NONLINEAR)
    w2_ptr,  # [2, H] or [2, D]
    coords_ptr,  # float32 [N, 2]
    saved_ptr,  # float32 [N, 3 + H]: each position's prediction (row, col), weight, then its hidden layer
    grad_pos_ptr,  # [skip_rows + N, D], written: zeros in the skipped rows (ACCUMULATE: added to what it holds)
    grad_w1_ptr,  # [H, D], written (NONLINEAR)
    grad_b1_ptr,  # [H], written (NONLINEAR and HAS_B1)
    grad_w2_ptr,  # like w2, written
    grad_b2_ptr,  # [2], written (HAS_B2)
    N,
    skip_rows,
    D,
    H,
    scale,  # float
    weight_programs,  # programs below this own weight tiles, the others tiles of grad_pos
    NONLINEAR: tl.constexpr,
    HAS_B1: tl.constexpr,
    HAS_B2: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    program = tl.program_id(0)
    d_tiles = tl.cdiv(D, BLOCK_D)
    positions_ptr = pos_ptr + skip_rows * D  # row n of the positions
    coord = tl.arange(0, COORD_PAD)
    coord_ok = coord < 2
    if program < weight_programs:
        # A tile of the weights: loop over every position, in order.
        d_tile = program % d_tiles
        channels = d_tile * BLOCK_D + tl.arange(0, BLOCK_D)
        channel_ok = channels < D
        if NONLINEAR:
            h_tile = program // d_tiles
            cols = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)
            col_ok = cols < H
            w2 = tl.load(
                w2_ptr + coord[:, None] * H + cols[None, :], mask=coord_ok[:, None] & col_ok[None, :], other=0.0
            ).to(tl.float32)
            grad_w1 = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
            grad_b1 = tl.zeros((BLOCK_H,), dtype=tl.float32)
            grad_w2 = tl.zeros((COORD_PAD, BLOCK_H), dtype=tl.float32)
            grad_b2 = tl.zeros((COORD_PAD,), dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                rows = start + tl.arange(0, BLOCK_N)
                row_ok = rows < N
                d_pred = _grad_prediction(grad_ptr, saved_ptr, coords_ptr, rows, N, H, scale, COORD_PAD)
                # Rows of weight 0 are out of the loss: read as zeros, their values (even inf or NaN) stay out of the
                # weights' gradients (their d_pred is zero, and 0 * inf would be NaN).
                kept = row_ok & (tl.load(saved_ptr + rows.to(tl.int64) * (H + 3) + 2, mask=row_ok, other=0.0) > 0)
                hidden = tl.load(
                    saved_ptr + rows.to(tl.int64)[:, None] * (H + 3) + 3 + cols[None, :],
                    mask=kept[:, None] & col_ok[None, :],
                    other=0.0,
                )
                d_hidden = tl.where(hidden > 0, tl.dot(d_pred, w2, input_precision="ieee"), 0.0)
                pos = tl.load(
                    positions_ptr + rows.to(tl.int64)[:, None] * D + channels[None, :],
                    mask=kept[:, None] & channel_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                grad_w1 = tl.dot(tl.trans(d_hidden), pos, grad_w1, input_precision="ieee")
                grad_b1 += tl.sum(d_hidden, axis=0)
                grad_w2 = tl.dot(tl.trans(d_pred), hidden, grad_w2, input_precision="ieee")
                grad_b2 += tl.sum(d_pred, axis=0)
            tl.store(
                grad_w1_ptr + cols.to(tl.int64)[:, None] * D + channels[None, :],
                grad_w1.to(grad_w1_ptr.dtype.element_ty),
                mask=col_ok[:, None] & channel_ok[None, :],
            )
            if d_tile == 0:  # the programs of the other D tiles computed the same, and store nothing
                tl.store(
                    grad_w2_ptr + coord[:, None] * H + cols[None, :],
                    grad_w2.to(grad_w2_ptr.dtype.element_ty),
                    mask=coord_ok[:, None] & col_ok[None, :],
                )
                if HAS_B1:
                    tl.store(grad_b1_ptr + cols, grad_b1.to(grad_b1_ptr.dtype.element_ty), mask=col_ok)
        else:
            grad_w2 = tl.zeros((COORD_PAD, BLOCK_D), dtype=tl.float32)
            grad_b2 = tl.zeros((COORD_PAD,), dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                rows = start + tl.arange(0, BLOCK_N)
                d_pred = _grad_prediction(grad_ptr, saved_ptr, coords_ptr, rows, N, H, scale, COORD_PAD)
                weight = tl.load(saved_ptr + rows.to(tl.int64) * (H + 3) + 2, mask=rows < N, other=0.0)
                kept = (rows < N) & (weight > 0)  # as above
                pos = tl.load(
                    positions_ptr + rows.to(tl.int64)[:, None] * D + channels[None, :],
                    mask=kept[:, None] & channel_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                grad_w2 = tl.dot(tl.trans(d_pred), pos, grad_w2, input_precision="ieee")
                grad_b2 += tl.sum(d_pred, axis=0)
            tl.store(
                grad_w2_ptr + coord[:, None] * D + channels[None, :],
                grad_w2.to(grad_w2_ptr.dtype.element_ty),
                mask=coord_ok[:, None] & channel_ok[None, :],
            )
        if HAS_B2:
            if program == 0:
                tl.store(grad_b2_ptr + coord, grad_b2.to(grad_b2_ptr.dtype.element_ty), mask=coord_ok)
    else:
        # A tile of grad_pos, rows of the full table: loop over H (nonlinear), or one product (linear). In the
        # skipped rows every load is masked off (d_pred, hidden: zeros), so they come out zero.
        tile = program - weight_programs
        table_rows = (tile // d_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = table_rows - skip_rows
        channels = (tile % d_tiles) * BLOCK_D + tl.arange(0, BLOCK_D)
        row_ok = (rows >= 0) & (rows < N)
        channel_ok = channels < D
        d_pred = _grad_prediction(grad_ptr, saved_ptr, coords_ptr, rows, N, H, scale, COORD_PAD)
        if NONLINEAR:
            grad_pos = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
            for h_start in range(0, H, BLOCK_H):
                cols = h_start + tl.arange(0, BLOCK_H)
                col_ok = cols < H
                w2 = tl.load(
                    w2_ptr + coord[:, None] * H + cols[None, :], mask=coord_ok[:, None] & col_ok[None, :], other=0.0
                ).to(tl.float32)
                hidden = tl.load(
                    saved_ptr + rows.to(tl.int64)[:, None] * (H + 3) + 3 + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
                d_hidden = tl.where(hidden > 0, tl.dot(d_pred, w2, input_precision="ieee"), 0.0)
                w1 = tl.load(
                    w1_ptr + cols.to(tl.int64)[:, None] * D + channels[None, :],
                    mask=col_ok[:, None] & channel_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                grad_pos = tl.dot(d_hidden, w1, grad_pos, input_precision="ieee")
        else:
            w2 = tl.load(
                w2_ptr + coord[:, None] * D + channels[None, :], mask=coord_ok[:, None] & channel_ok[None, :], other=0.0
            ).to(tl.float32)
            grad_pos = tl.dot(d_pred, w2, input_precision="ieee")
        table_offsets = table_rows.to(tl.int64)[:, None] * D + channels[None, :]
        table_ok = (table_rows[:, None] < skip_rows + N) & channel_ok[None, :]
        if ACCUMULATE:  # the position step's gradient of the same table, written before this launch: one rounding
            grad_pos += tl.load(grad_pos_ptr + table_offsets, mask=table_ok, other=0.0).to(tl.float32)
        tl.store(grad_pos_ptr + table_offsets, grad_pos.to(grad_pos_ptr.dtype.element_ty), mask=table_ok)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------

# Tiles and warps on a GPU (the interpreter's are common.INTERPRETER_TILE and INTERPRETER_WARPS everywhere).
FORWARD_TILES = {"BLOCK_N": 16, "BLOCK_K": 32, "BLOCK_D": 64, "BLOCK_B": 32}
FORWARD_WARPS = 2
FINISH_WARPS = 4
# The backward's weight programs take 7 steps of 32 positions of 32 channels for DeiT-S's [196, 384] table (144
# programs), not 13 of 16 of 64 (72): the H200 timed 20.0 us against 26.8 us (2026-11-28, the kernels case's "DAL
# wider steps", gradients within 1.1e-7 of the earlier tiles'); 96 registers, no spill on sm_90. Its forward at 128
# channels and 4 warps was slower (31.6 us against 20.3 us): the forward keeps its tiles.
BACKWARD_TILES = {"BLOCK_N": 32, "BLOCK_H": 32, "BLOCK_D": 32}
BACKWARD_WARPS = 4


def _programs_wanted(device: torch.device) -> int:
    """About two programs per multiprocessor; a handful in the interpreter, so tests cover splits both ways."""
    if interpreting() or device.type != "cuda":
        return 4
    return 2 * multiprocessors(device)


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")


def _table_sizes(pos: torch.Tensor, skip_rows: int, coords: torch.Tensor) -> tuple[int, int]:
    """``(N, D)`` of the positions that ``pos`` holds after its ``skip_rows`` rows (``N``: coords' rows)."""
    if coords.dim() != 2 or coords.shape[1] != 2:
        raise ValueError(f"coords must have shape [N, 2], got {list(coords.shape)}")
    num_positions = coords.shape[0]
    if skip_rows < 0:
        raise ValueError(f"skip_rows must be >= 0, got {skip_rows}")
    rows = skip_rows + num_positions
    if pos.dim() < 2 or pos.shape[-2] != rows or math.prod(pos.shape[:-2]) != 1:
        raise ValueError(
            f"pos must be [skip_rows + N, D] (or [1, skip_rows + N, D]) with skip_rows + N = {skip_rows} + "
            f"{num_positions}, got shape {list(pos.shape)}"
        )
    return num_positions, pos.shape[-1]


def _check_linear(index: int, weight: torch.Tensor, bias: torch.Tensor | None, shape: tuple[int, int]) -> None:
    """The regressor's Linear ``index`` (1 or 2): ``w<index>`` of ``shape``, ``b<index>`` None or ``[shape[0]]``."""
    _check(f"w{index}", weight, shape)
    if bias is not None:
        _check(f"b{index}", bias, shape[:1])


def _mask_rows(mask: torch.Tensor | None, num_positions: int) -> int:
    """``B``, the rows of a bool ``[B, N]`` mask; 0 without one."""
    if mask is None:
        return 0
    if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[1] != num_positions:
        raise ValueError(f"mask must be bool [B, {num_positions}], got {mask.dtype} {list(mask.shape)}")
    return mask.shape[0]


def _reduction_splits(position_blocks: int, reduced_tiles: int, device: torch.device) -> tuple[int, int]:
    """``(splits, tiles_per_split)``: the forward's reduction axis (``reduced_tiles`` tiles) cut into splits of whole
    tiles, enough for about :func:`_programs_wanted` programs with ``position_blocks`` blocks of positions; no split
    is empty."""
    splits = max(1, min(reduced_tiles, _programs_wanted(device) // max(position_blocks, 1)))
    tiles_per_split = cdiv(reduced_tiles, splits)
    return max(1, cdiv(reduced_tiles, tiles_per_split)), tiles_per_split


def _forward_outputs(num_positions: int, hidden_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss [], saved [N, 3 + H])``, float32, made with ``torch.empty``. ``saved`` holds what the backward
    needs of each position side by side: its prediction (row, col), its weight, then its hidden layer (H = 0 for
    the linear regressor): one allocation, not three, each step."""
    loss = torch.empty((), dtype=torch.float32, device=device)
    saved = torch.empty(num_positions, 3 + hidden_dim, dtype=torch.float32, device=device)
    return loss, saved


def _first_layer_dot(w1: torch.Tensor | None, pos: torch.Tensor) -> tuple[bool, str]:
    """``(UPCAST, PRECISION)`` of the forward's ``pos @ w1^T`` (``w1`` None: no such product, no upcast)."""
    # Mixed dtypes, and bfloat16 in the interpreter (which multiplies it wrongly), multiply in float32.
    upcast = w1 is not None and dot_upcast(w1.dtype, pos.dtype)
    # Read by tl.dot for float32 operands only ("ieee": no TF32 rounding; float32 after the upcast too).
    return upcast, "ieee" if upcast else dot_precision(pos.dtype)


def dal_forward_launch(
    pos: torch.Tensor,
    skip_rows: int,
    w1: torch.Tensor | None,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    coords: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DAL loss and what its backward needs, in two launches.

    Args:
        pos: ``[skip_rows + N, D]`` (any leading dims of 1: the model's full table) float32, bfloat16 or float16;
            the regressor reads its rows ``skip_rows..``.
        skip_rows: the table's rows before the N positions (a class token's), not regressed.
        w1, b1: ``[H, D]`` and ``[H]`` (b1 may be None), the nonlinear regressor's first Linear; None for the linear.
        w2, b2: ``[2, H]`` (``[2, D]`` when w1 is None) and ``[2]`` or None.
        coords: float32 ``[N, 2]``, the targets.
        mask: bool ``[B, N]`` (True = masked, not counted) or None.
        scale: the loss's factor.
        traced: launch through ``torch.library.wrap_triton`` (inside the torch operator).

    Returns:
        ``(loss [], saved [N, 3 + H])``, float32: ``saved[n]`` is position n's prediction (row, col), its weight
        (the share of the batch's unmasked tokens that are n), then its hidden layer (H = 0 for the linear
        regressor).
    """
    num_positions, dim = _table_sizes(pos, skip_rows, coords)
    nonlinear = w1 is not None
    hidden_dim = w1.shape[0] if nonlinear else 0
    reduced = hidden_dim if nonlinear else dim  # the reduction axis of the last Linear
    if nonlinear:
        _check_linear(1, w1, b1, (hidden_dim, dim))
    _check_linear(2, w2, b2, (2, reduced))
    _check("coords", coords, (num_positions, 2))
    batch = _mask_rows(mask, num_positions)
    pos, w2, coords = pos.contiguous(), w2.contiguous(), coords.contiguous()
    if nonlinear:
        w1 = w1.contiguous()
    if mask is not None:
        mask = mask.contiguous()
    device = pos.device
    loss, saved = _forward_outputs(num_positions, hidden_dim, device)

    tiles = {name: tile_size(size) for name, size in FORWARD_TILES.items()}
    position_blocks = cdiv(num_positions, tiles["BLOCK_N"])
    reduced_tiles = cdiv(reduced, tiles["BLOCK_K"])
    splits, tiles_per_split = _reduction_splits(position_blocks, reduced_tiles, device)
    # per split and position: the partial prediction (row, col) and the count of samples keeping it (with a mask)
    partials = scratch("dal forward partials", (splits, num_positions, 3), device, traced)
    upcast, precision = _first_layer_dot(w1, pos)
    # Stands for absent tensors (never read nor written): a read-only input, so that no pointer a kernel stores
    # through is passed twice (torch.compile's analysis of which arguments a kernel mutates stays simple).
    dummy = coords
    if position_blocks and reduced_tiles:
        launcher(_forward_partial_kernel, (position_blocks, splits), traced)(
            pos,
            w1 if nonlinear else dummy,
            b1 if b1 is not None else dummy,
            w2,
            mask if mask is not None else dummy,
            saved,
            partials,
            num_positions,
            skip_rows,
            dim,
            reduced,
            batch,
            tiles_per_split,
            cdiv(batch, splits),
            NONLINEAR=nonlinear,
            HAS_B1=b1 is not None,
            HAS_MASK=mask is not None,
            PRECISION=precision,
            UPCAST=upcast,
            **tiles,
            num_warps=warp_count(FORWARD_WARPS),
        )
    block = tile_size(power_of_two_tile(num_positions, 32, 1024))
    launcher(_forward_finish_kernel, (1,), traced)(
        partials,
        b2 if b2 is not None else dummy,
        coords,
        saved,
        loss,
        num_positions,
        hidden_dim,
        splits if position_blocks and reduced_tiles else 0,
        float(scale),
        HAS_B2=b2 is not None,
        HAS_MASK=mask is not None,
        BLOCK=block,
        num_warps=warp_count(FINISH_WARPS),
    )
    return loss, saved


def dal_backward_launch(
    grad: torch.Tensor,
    pos: torch.Tensor,
    skip_rows: int,
    w1: torch.Tensor | None,
    w2: torch.Tensor,
    coords: torch.Tensor,
    saved: torch.Tensor,
    scale: float,
    has_b1: bool,
    has_b2: bool,
    *,
    traced: bool = False,
    grad_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every gradient of the DAL loss, in one launch.

    Args:
        grad: float32 ``[]``, the loss's gradient.
        pos, skip_rows, w1, w2, coords: the forward's inputs (w1 None for the linear regressor).
        saved: the forward's float32 ``[N, 3 + H]`` (predictions, weights and the hidden layer).
        scale: the forward's factor.
        has_b1, has_b2: whether the Linears have biases (their gradients are computed only then).
        traced: launch through ``torch.library.wrap_triton`` (inside the torch operator).
        grad_pos: a gradient of the same table (``pos``'s shape and dtype, contiguous) to add this one to, in place
            (the fused MJP step's: one tensor and no add for the table's two gradients); None: a new tensor.

    Returns:
        ``(grad_pos, grad_w1, grad_b1, grad_w2, grad_b2)``, each in the dtype of its tensor (grad_b1 in w1's,
        grad_b2 in w2's); an empty ``[0]`` tensor for each absent one (in pos's dtype when w1 is None). grad_pos
        has pos's full shape, zeros in the ``skip_rows`` rows, all written by the kernel.
    """
    num_positions, dim = _table_sizes(pos, skip_rows, coords)
    nonlinear = w1 is not None
    hidden_dim = w1.shape[0] if nonlinear else 0
    _check("w2", w2, (2, hidden_dim if nonlinear else dim))
    _check("saved", saved, (num_positions, 3 + hidden_dim))
    if nonlinear:
        _check("w1", w1, (hidden_dim, dim))
        w1 = w1.contiguous()
    pos, w2, coords, saved = (t.contiguous() for t in (pos, w2, coords, saved))
    device = pos.device
    first_dtype = w1.dtype if nonlinear else pos.dtype
    accumulate = grad_pos is not None
    if accumulate:
        _check("grad_pos", grad_pos, tuple(pos.shape))
        if grad_pos.dtype != pos.dtype or not grad_pos.is_contiguous():
            raise ValueError(f"grad_pos must be contiguous {pos.dtype}, got {grad_pos.dtype}")
    else:
        grad_pos = torch.empty(pos.shape, dtype=pos.dtype, device=device)
    grad_w1 = torch.empty((hidden_dim, dim) if nonlinear else (0,), dtype=first_dtype, device=device)
    grad_b1 = torch.empty(hidden_dim if nonlinear and has_b1 else 0, dtype=first_dtype, device=device)
    grad_w2 = torch.empty(w2.shape, dtype=w2.dtype, device=device)
    grad_b2 = torch.empty(2 if has_b2 else 0, dtype=w2.dtype, device=device)

    tiles = {name: tile_size(size) for name, size in BACKWARD_TILES.items()}
    d_tiles = cdiv(dim, tiles["BLOCK_D"])
    weight_programs = d_tiles * (cdiv(hidden_dim, tiles["BLOCK_H"]) if nonlinear else 1)
    position_programs = cdiv(skip_rows + num_positions, tiles["BLOCK_N"]) * d_tiles
    dummy = coords  # for absent tensors, as in the forward
    if weight_programs + position_programs:
        launcher(_backward_kernel, (weight_programs + position_programs,), traced)(
            grad,
            pos,
            w1 if nonlinear else dummy,
            w2,
            coords,
            saved,
            grad_pos,
            grad_w1 if nonlinear else dummy,
            grad_b1 if nonlinear and has_b1 else dummy,
            grad_w2,
            grad_b2 if has_b2 else dummy,
            num_positions,
            skip_rows,
            dim,
            hidden_dim,
            float(scale),
            weight_programs,
            NONLINEAR=nonlinear,
            HAS_B1=nonlinear and has_b1,
            HAS_B2=has_b2,
            ACCUMULATE=accumulate,
            **tiles,
            num_warps=warp_count(BACKWARD_WARPS),
        )
    return grad_pos, grad_w1, grad_b1, grad_w2, grad_b2


# ----------------------------------------------------------------------------------------------------------------
# Operators
# ----------------------------------------------------------------------------------------------------------------


def _dal_loss_triton_fake(pos, w1, coords, **_):
    num_positions = coords.shape[0]
    hidden_dim = w1.shape[0] if w1 is not None else 0
    return (
        pos.new_empty((), dtype=torch.float32),
        pos.new_empty((num_positions, 3 + hidden_dim), dtype=torch.float32),
    )


def _dal_loss_triton_backward_fake(pos, w1, w2, has_b1, has_b2, **_):
    dim = pos.shape[-1]
    first_dtype = w1.dtype if w1 is not None else pos.dtype
    hidden_dim = w1.shape[0] if w1 is not None else 0
    return (
        pos.new_empty(tuple(pos.shape)),
        pos.new_empty((hidden_dim, dim) if w1 is not None else (0,), dtype=first_dtype),
        pos.new_empty((hidden_dim,) if w1 is not None and has_b1 else (0,), dtype=first_dtype),
        pos.new_empty(tuple(w2.shape), dtype=w2.dtype),
        pos.new_empty((2,) if has_b2 else (0,), dtype=w2.dtype),
    )


# The operators over the launchers (their schemas come from the launchers' signatures): ``(loss [], saved [N, 3 +
# H])``, float32; ``(grad_pos, grad_w1, grad_b1, grad_w2, grad_b2)``.
dal_loss_triton = define_operator("mjp_fast::dal_loss_triton", dal_forward_launch, fake=_dal_loss_triton_fake)
dal_loss_triton_backward = define_operator(
    "mjp_fast::dal_loss_triton_backward", dal_backward_launch, fake=_dal_loss_triton_backward_fake
)
