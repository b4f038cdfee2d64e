"""Triton kernels of the MJP patch embedding, forward and backward.

Row layout (the C++ operators' too): each sample's output has ``T = P + N`` rows of ``D`` channels. The first
``P`` (0 to 8) are the prefix tokens (class and register tokens), ``out[b, t] = prefix[t] + (pos[t] if t < Q
else 0)``, with ``Q`` (0 or ``P``) the rows of the position table that belong to them; then the ``N`` patch
tokens, ``out[b, P + n] = patch(b, perm[b, n]) @ W^T + bias + (unk if mask[b, n] else pos[Q + n])``. ``pos`` is
the model's full table ``[Q + N, D]`` (any leading dims of 1), read in place. Sums in float32, rounded once.

The patch tokens are the rows of a GEMM ``[B*N, K] @ [K, D]`` with ``K = C * patch * patch``. The left operand is
never made: each tile loads its patches straight from the NCHW images at the permuted source positions (the
im2col and the jigsaw happen in the load), and the epilogue adds the bias and ``unk``-or-``pos[Q + n]`` and stores
row ``b * T + P + n``. The same launch writes the prefix rows too, in programs of their own after the GEMM's (no
GEMM there: ``prefix`` + ``pos``), so the kernel writes the whole ``[B, T, D]`` output. Without prefix rows
(``HAS_PREFIX`` off, the prefix arguments last) the kernels compile exactly as they did before prefix rows.

Backward, only what is asked for:

- weight: ``dW = dY^T @ A``, re-gathering ``A`` the same way (nothing of size ``B*N*K`` is saved); the reduction
  over the ``B*N`` patch tokens (the rows ``P..T-1`` of each sample) is split across programs into float32
  partials, summed in a fixed order afterwards.
- pos_embed, unk_embed, bias, prefix: one pass over ``dY`` split over positions (all ``T`` rows: a prefix row is
  a position that is never masked nor moved), channels and batch chunks (enough programs to fill the GPU), each
  program writing float32 partial sums that only it owns, then a small kernel that adds them in a fixed order and
  writes the gradients in their final dtypes and shapes: no atomics, deterministic.
  :func:`position_gradient_plan` says how (grids, tiles, chunks, bytes moved); ``mjp_pos_embed``'s backward uses
  the same kernels, with the inverse move of the gradient written from the same loads.
- images: ``dA = dY @ W`` over the patch rows, stored back to the permuted patch locations; ``perm`` permutes
  each sample's positions, so every pixel is written exactly once.

Each launcher is a plain function (``*_launch``) that eager callers use directly, and a torch operator over it
that launches through ``torch.library.wrap_triton``, for torch.compile.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mjp_fast.triton import interpreting as _interpreting
from mjp_fast.triton import launcher
from mjp_fast.triton import operator as _operator


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # One return after the branches: the compiler builds every statement that follows a constexpr `if` whose body
    # returns, so `return` inside the `if` would still compile tl.dot on the raw (possibly mixed-dtype) tiles.
    if UPCAST:  # mixed operand dtypes, or bfloat16 in the interpreter (which multiplies it wrongly)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _patch_addresses(
    images_ptr,
    perm_ptr,
    tokens,
    k_index,
    num_positions,
    cols,
    PATCH: tl.constexpr,
    stride_b,
    stride_c,
    stride_h,
    stride_w,
    total_tokens,
    K,
    HAS_PERM: tl.constexpr,
):
    """Addresses ``[BLOCK_M, BLOCK_K]`` of the pixels of the (permuted) patches of ``tokens`` (flat (sample, patch
    position) indices, of ``B * N``)."""
    token_ok = tokens < total_tokens
    sample = tokens // num_positions
    position = tokens % num_positions
    if HAS_PERM:
        source = tl.load(perm_ptr + tokens, mask=token_ok, other=0)
    else:
        source = position
    source_row = source // cols
    source_col = source % cols
    channel = k_index // (PATCH * PATCH)
    inside = k_index % (PATCH * PATCH)
    pixel_y = inside // PATCH
    pixel_x = inside % PATCH
    address = (
        images_ptr
        + sample[:, None].to(tl.int64) * stride_b
        + channel[None, :].to(tl.int64) * stride_c
        + (source_row[:, None] * PATCH + pixel_y[None, :]).to(tl.int64) * stride_h
        + (source_col[:, None] * PATCH + pixel_x[None, :]).to(tl.int64) * stride_w
    )
    valid = token_ok[:, None] & (k_index[None, :] < K)
    return address, valid


@triton.jit
def _patch_rows(tokens, num_positions, prefix_count, HAS_PREFIX: tl.constexpr):
    """The rows of ``[B, P + N, D]`` of the patch tokens ``tokens`` (flat indices of ``B * N``): ``b * (P + N) + P +
    n``."""
    if HAS_PREFIX:
        rows = tokens + (tokens // num_positions + 1) * prefix_count
    else:
        rows = tokens
    return rows


# (BLOCK_M, BLOCK_D, BLOCK_K, num_warps, num_stages) of the GEMM kernels' autotuning on a GPU.
GPU_GEMM_SHAPES = (
    (128, 128, 64, 8, 3),
    (128, 128, 32, 4, 4),
    (128, 64, 32, 4, 4),
    (64, 128, 32, 4, 4),
    (64, 64, 32, 4, 3),
)


def _gemm_configs() -> list[triton.Config]:
    """Tiles tried on the GPU: large ones for Hopper and Ampere tensor cores, small ones as a safe default."""
    if _interpreting():
        # the interpreter's cost grows with the tile; tl.dot needs at least 16
        return [triton.Config({"BLOCK_M": 16, "BLOCK_D": 16, "BLOCK_K": 16}, num_warps=1, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_D": d, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
        for m, d, k, warps, stages in GPU_GEMM_SHAPES
    ]


@triton.jit
def _prefix_rows_tile(
    prefix_ptr,  # [P, D]
    pos_ptr,  # [Q + N, D]
    out_ptr,  # [B, P + N, D]
    rows,  # [BLOCK] flat (sample, prefix token) indices, of B * P
    channels,  # [BLOCK_D]
    total_prefix,  # B * P
    num_positions,  # N
    prefix_count,  # P
    prefix_positions,  # Q: 0 or P
    D,
):
    """Stores ``out[b, t] = prefix[t] + (pos[t] if t < Q else 0)`` for the prefix rows ``rows``: a sum in float32,
    rounded once."""
    token = rows % prefix_count
    sample = rows // prefix_count
    ok = (rows < total_prefix)[:, None] & (channels[None, :] < D)
    offsets = token[:, None].to(tl.int64) * D + channels[None, :]
    value = tl.load(prefix_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    value += tl.load(pos_ptr + offsets, mask=ok & (token < prefix_positions)[:, None], other=0.0).to(tl.float32)
    out_rows = sample * (prefix_count + num_positions) + token
    tl.store(
        out_ptr + out_rows[:, None].to(tl.int64) * D + channels[None, :], value.to(out_ptr.dtype.element_ty), mask=ok
    )


@triton.jit
def _forward_patch_tile(
    images_ptr,
    weight_ptr,
    bias_ptr,
    pos_ptr,
    unk_ptr,
    perm_ptr,
    mask_ptr,
    out_ptr,
    program,
    total_tokens,
    num_positions,
    cols,
    K,
    D,
    stride_b,
    stride_c,
    stride_h,
    stride_w,
    prefix_count,
    prefix_positions,
    PATCH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A tile of patch tokens: the GEMM of their patches, then bias and ``unk`` or ``pos[Q + n]``."""
    tokens = program * BLOCK_M + tl.arange(0, BLOCK_M)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_index = k_start + tl.arange(0, BLOCK_K)
        address, valid = _patch_addresses(
            images_ptr, perm_ptr, tokens, k_index, num_positions, cols, PATCH, stride_b, stride_c, stride_h,
            stride_w, total_tokens, K, HAS_PERM,
        )  # fmt: skip
        patches = tl.load(address, mask=valid, other=0.0)
        # weight is [D, K] row-major: this tile is its transpose [BLOCK_K, BLOCK_D]
        w_tile = tl.load(
            weight_ptr + channels[None, :].to(tl.int64) * K + k_index[:, None],
            mask=(k_index[:, None] < K) & (channels[None, :] < D),
            other=0.0,
        )
        acc = _dot(patches, w_tile, acc, PRECISION, UPCAST)
    token_ok = tokens < total_tokens
    channel_ok = channels < D
    position = tokens % num_positions
    if HAS_PREFIX:
        table_rows = position + prefix_positions  # Q + n
    else:
        table_rows = position  # Q = 0
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)[None, :]
    pos = tl.load(
        pos_ptr + table_rows[:, None].to(tl.int64) * D + channels[None, :],
        mask=token_ok[:, None] & channel_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    if HAS_MASK:
        masked = tl.load(mask_ptr + tokens, mask=token_ok, other=0).to(tl.int1)
        unk = tl.load(unk_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)
        pos = tl.where(masked[:, None], unk[None, :], pos)
    acc += pos
    tl.store(
        out_ptr
        + _patch_rows(tokens, num_positions, prefix_count, HAS_PREFIX)[:, None].to(tl.int64) * D
        + channels[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=token_ok[:, None] & channel_ok[None, :],
    )


@triton.autotune(configs=_gemm_configs(), key=["total_tokens", "D", "K"])
@triton.jit
def _forward_kernel(
    images_ptr,  # [B, C, H, W], any strides
    weight_ptr,  # [D, K] (the Conv2d weight [D, C, patch, patch], contiguous)
    bias_ptr,  # [D] (HAS_BIAS)
    pos_ptr,  # [Q + N, D]: the model's full table
    unk_ptr,  # [D] (HAS_MASK)
    perm_ptr,  # int64 [B, N] (HAS_PERM)
    mask_ptr,  # bool [B, N] (HAS_MASK)
    out_ptr,  # [B, P + N, D]
    total_tokens,  # B * N: the patch tokens
    num_positions,  # N
    cols,
    K,
    D,
    stride_b,
    stride_c,
    stride_h,
    stride_w,
    prefix_ptr,  # [P, D]: class and register tokens (HAS_PREFIX)
    total_prefix,  # B * P: the prefix rows (HAS_PREFIX)
    prefix_count,  # P (HAS_PREFIX)
    prefix_positions,  # Q: 0 or P (HAS_PREFIX)
    PATCH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Programs along axis 0: first the patch tokens' tiles (GEMM and epilogue), then (HAS_PREFIX) the prefix rows'
    # (no GEMM: prefix + pos). One kind per program, so neither pays the other's registers; the prefix arguments
    # come last, so that without a prefix the kernel compiles as it did before prefix rows.
    if HAS_PREFIX:
        patch_programs = tl.cdiv(total_tokens, BLOCK_M)
        if tl.program_id(0) < patch_programs:
            _forward_patch_tile(
                images_ptr, weight_ptr, bias_ptr, pos_ptr, unk_ptr, perm_ptr, mask_ptr, out_ptr, tl.program_id(0),
                total_tokens, num_positions, cols, K, D, stride_b, stride_c, stride_h, stride_w, prefix_count,
                prefix_positions, PATCH, HAS_BIAS, HAS_PERM, HAS_MASK, HAS_PREFIX, PRECISION, UPCAST, BLOCK_M,
                BLOCK_D, BLOCK_K,
            )  # fmt: skip
        else:
            _prefix_rows_tile(
                prefix_ptr, pos_ptr, out_ptr, (tl.program_id(0) - patch_programs) * BLOCK_M + tl.arange(0, BLOCK_M),
                tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D), total_prefix, num_positions, prefix_count,
                prefix_positions, D,
            )  # fmt: skip
    else:
        _forward_patch_tile(
            images_ptr, weight_ptr, bias_ptr, pos_ptr, unk_ptr, perm_ptr, mask_ptr, out_ptr, tl.program_id(0),
            total_tokens, num_positions, cols, K, D, stride_b, stride_c, stride_h, stride_w, prefix_count,
            prefix_positions, PATCH, HAS_BIAS, HAS_PERM, HAS_MASK, HAS_PREFIX, PRECISION, UPCAST, BLOCK_M, BLOCK_D,
            BLOCK_K,
        )  # fmt: skip


@triton.jit
def _grad_weight_kernel(
    grad_ptr,  # [B, P + N, D]: the output's gradient; only its patch rows are read
    images_ptr,  # [B, C, H, W], any strides
    perm_ptr,  # int64 [B, N] (HAS_PERM)
    partial_ptr,  # float32 [splits, D, K], written
    total_tokens,  # B * N: the patch tokens
    num_positions,  # N
    cols,
    K,
    D,
    tokens_per_split,
    stride_b,
    stride_c,
    stride_h,
    stride_w,
    prefix_count,  # P (HAS_PREFIX): rows of each sample of grad before its patch rows
    PATCH: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    channels = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    k_index = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    split = tl.program_id(2)
    acc = tl.zeros((BLOCK_D, BLOCK_K), dtype=tl.float32)
    first = split * tokens_per_split
    last = tl.minimum(first + tokens_per_split, total_tokens)
    for m_start in range(first, last, BLOCK_M):
        tokens = m_start + tl.arange(0, BLOCK_M)
        token_ok = tokens < last
        grad_rows = _patch_rows(tokens, num_positions, prefix_count, HAS_PREFIX)
        grad_t = tl.load(
            grad_ptr + grad_rows[None, :].to(tl.int64) * D + channels[:, None],
            mask=token_ok[None, :] & (channels[:, None] < D),
            other=0.0,
        )
        address, valid = _patch_addresses(
            images_ptr, perm_ptr, tokens, k_index, num_positions, cols, PATCH, stride_b, stride_c, stride_h,
            stride_w, last, K, HAS_PERM,
        )  # fmt: skip
        patches = tl.load(address, mask=valid, other=0.0)
        acc = _dot(grad_t, patches, acc, PRECISION, UPCAST)
    tl.store(
        partial_ptr + split.to(tl.int64) * D * K + channels[:, None].to(tl.int64) * K + k_index[None, :],
        acc,
        mask=(channels[:, None] < D) & (k_index[None, :] < K),
    )


@triton.autotune(configs=_gemm_configs(), key=["total_tokens", "D", "K"])
@triton.jit
def _grad_images_kernel(
    grad_ptr,  # [B, P + N, D]: the output's gradient; only its patch rows are read
    weight_ptr,  # [D, K]
    perm_ptr,  # int64 [B, N] (HAS_PERM)
    grad_images_ptr,  # [B, C, H, W], written
    total_tokens,  # B * N: the patch tokens
    num_positions,  # N
    cols,
    K,
    D,
    stride_b,
    stride_c,
    stride_h,
    stride_w,
    prefix_count,  # P (HAS_PREFIX): rows of each sample of grad before its patch rows
    PATCH: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_index = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    token_ok = tokens < total_tokens
    grad_rows = _patch_rows(tokens, num_positions, prefix_count, HAS_PREFIX)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for d_start in range(0, D, BLOCK_D):
        channels = d_start + tl.arange(0, BLOCK_D)
        grad = tl.load(
            grad_ptr + grad_rows[:, None].to(tl.int64) * D + channels[None, :],
            mask=token_ok[:, None] & (channels[None, :] < D),
            other=0.0,
        )
        w_tile = tl.load(
            weight_ptr + channels[:, None].to(tl.int64) * K + k_index[None, :],
            mask=(channels[:, None] < D) & (k_index[None, :] < K),
            other=0.0,
        )
        acc = _dot(grad, w_tile, acc, PRECISION, UPCAST)
    # The token shows the patch at perm: its gradient goes back there. A permutation: no collisions.
    address, valid = _patch_addresses(
        grad_images_ptr, perm_ptr, tokens, k_index, num_positions, cols, PATCH, stride_b, stride_c, stride_h,
        stride_w, total_tokens, K, HAS_PERM,
    )  # fmt: skip
    tl.store(address, acc.to(grad_images_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _position_partials_kernel(
    grad_ptr,  # [B, P + N, D], contiguous: the incoming gradient
    mask_ptr,  # [B, N] bool (HAS_MASK)
    perm_ptr,  # [B, N] int64 (SCATTER)
    grad_tokens_ptr,  # [B, N, D] (SCATTER): the inverse move of grad's patch rows
    partial_ptr,  # float32 [chunks * (P + N) + (1 + HAS_BIAS) * chunks * position_blocks, D]: rows as stored below
    batch,
    num_positions,  # P + N: the rows of each sample, prefix rows first
    D,
    samples_per_chunk,
    prefix_count,  # P (HAS_PREFIX); last, so that without a prefix the kernel compiles as before prefix rows
    HAS_MASK: tl.constexpr,
    SCATTER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program (position block, channel block, batch chunk) sums grad over its chunk's samples into float32
    # partials that only it writes: no atomics, and the reduction kernel adds the chunks in a fixed order.
    # SCATTER (mjp_pos_embed's backward): also grad_tokens[b, perm[b, n]] = grad[b, P + n], the inverse move, from
    # the same loads. perm[b] permutes the positions, so every row of grad_tokens is written exactly once.
    # A prefix row (t < P) is a position that is never masked and never moved: it only adds to its own sum.
    chunk = tl.program_id(2)
    positions = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    position_ok = positions < num_positions
    channel_ok = channels < D
    if HAS_PREFIX:
        patches = positions - prefix_count  # the patch position n of each row; negative on prefix rows
        is_patch = position_ok & (patches >= 0)
        num_patches = num_positions - prefix_count
    else:
        patches = positions
    # BLOCK_B samples per step as a third tile axis: more bytes in flight per load. That axis lies within each
    # thread's registers (sm_90 TTGIR: no layout conversion in the loop), so summing it every step costs no
    # shuffles, and 2D accumulators keep registers low (72 at bfloat16): every program of the plan is resident.
    kept = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    shuffled = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    first = chunk * samples_per_chunk
    last = tl.minimum(first + samples_per_chunk, batch)
    for start in range(first, last, BLOCK_B):
        samples = start + tl.arange(0, BLOCK_B)
        rows = samples[:, None].to(tl.int64) * num_positions + positions[None, :]  # int64: B*T*D may pass 2**31
        row_ok = (samples[:, None] < last) & position_ok[None, :]
        ok = row_ok[:, :, None] & channel_ok[None, None, :]
        grad = tl.load(grad_ptr + rows[:, :, None] * D + channels[None, None, :], mask=ok, other=0.0)
        if HAS_PREFIX:
            patch_rows = samples[:, None] * num_patches + patches[None, :]  # rows of mask and perm: int32 is enough
            patch_ok = (samples[:, None] < last) & is_patch[None, :]
            patch_tile_ok = patch_ok[:, :, None] & channel_ok[None, None, :]
        else:
            patch_rows = rows
            patch_ok = row_ok
            patch_tile_ok = ok
        if SCATTER:
            source = tl.load(perm_ptr + patch_rows, mask=patch_ok, other=0)
            target = patch_rows - patches[None, :] + source
            tl.store(
                grad_tokens_ptr + target[:, :, None] * D + channels[None, None, :],
                grad.to(grad_tokens_ptr.dtype.element_ty),
                mask=patch_tile_ok,
            )
        grad = grad.to(tl.float32)
        if HAS_MASK:
            masked = tl.load(mask_ptr + patch_rows, mask=patch_ok, other=0).to(tl.int1)[:, :, None]
            kept += tl.sum(tl.where(masked, 0.0, grad), axis=0)
            shuffled += tl.sum(tl.where(masked, grad, 0.0), axis=0)
        else:
            kept += tl.sum(grad, axis=0)
    # Rows of partial: chunk-major position partials [chunks, P + N], then unk_embed's [chunks, position blocks]
    # (masked grad summed over the block's positions), then (HAS_BIAS) the same sums of the unmasked grad of the
    # patch rows (the bias is added to patch tokens only).
    pos_rows = (chunk * num_positions + positions).to(tl.int64)
    tl.store(
        partial_ptr + pos_rows[:, None] * D + channels[None, :],
        kept,
        mask=position_ok[:, None] & channel_ok[None, :],
    )
    small_rows = tl.num_programs(2) * tl.num_programs(0)
    unk_row = (tl.num_programs(2) * num_positions + chunk * tl.num_programs(0) + tl.program_id(0)).to(tl.int64)
    tl.store(partial_ptr + unk_row * D + channels, tl.sum(shuffled, axis=0), mask=channel_ok)
    if HAS_BIAS:
        if HAS_PREFIX:
            kept = tl.where(is_patch[:, None], kept, 0.0)
        tl.store(partial_ptr + (unk_row + small_rows) * D + channels, tl.sum(kept, axis=0), mask=channel_ok)


@triton.jit
def _position_reduce_kernel(
    partial_ptr,  # float32, as _position_partials_kernel wrote it
    grad_pos_ptr,  # [Q + N, D]: the full table's gradient
    grad_unk_ptr,  # [D]
    grad_bias_ptr,  # [D] (HAS_BIAS)
    grad_prefix_ptr,  # [P, D] (WRITE_PREFIX)
    chunks,
    num_positions,  # P + N
    prefix_count,  # P
    prefix_positions,  # Q: 0 or P
    D,
    small_rows,  # chunks * position blocks of the partials kernel
    HAS_BIAS: tl.constexpr,
    WRITE_PREFIX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # Sums the partials in a fixed order (chunk by chunk; tl.sum's tree), so equal inputs give equal bits, and
    # writes each result once, in its final dtype.
    positions = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel_ok = channels < D
    ok = (positions[:, None] < num_positions) & channel_ok[None, :]
    offsets = positions[:, None].to(tl.int64) * D + channels[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for _ in range(0, chunks):
        acc += tl.load(partial_ptr + offsets, mask=ok, other=0.0)
        offsets += num_positions * D
    # Row t of the output is row t - P + Q of the table: the patch rows, and the prefix rows when Q = P.
    table_rows = positions - prefix_count + prefix_positions
    tl.store(
        grad_pos_ptr + table_rows[:, None].to(tl.int64) * D + channels[None, :],
        acc.to(grad_pos_ptr.dtype.element_ty),
        mask=ok & (table_rows[:, None] >= 0),
    )
    if WRITE_PREFIX:
        tl.store(
            grad_prefix_ptr + positions[:, None].to(tl.int64) * D + channels[None, :],
            acc.to(grad_prefix_ptr.dtype.element_ty),
            mask=ok & (positions[:, None] < prefix_count),
        )
    if tl.program_id(0) == 0:  # the first program of each channel block also reduces the vectors
        unk = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
        kept = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
        base = partial_ptr + chunks * num_positions * D
        for start in range(0, small_rows, BLOCK_S):
            rows = start + tl.arange(0, BLOCK_S)
            row_ok = (rows[:, None] < small_rows) & channel_ok[None, :]
            address = base + rows[:, None].to(tl.int64) * D + channels[None, :]
            unk += tl.load(address, mask=row_ok, other=0.0)
            if HAS_BIAS:
                kept += tl.load(address + small_rows * D, mask=row_ok, other=0.0)
        grad_unk = tl.sum(unk, axis=0)
        tl.store(grad_unk_ptr + channels, grad_unk.to(grad_unk_ptr.dtype.element_ty), mask=channel_ok)
        if HAS_BIAS:
            # bias: every patch token's gradient, i.e. grad_pos summed over the patch positions plus grad_unk
            grad_bias = tl.sum(kept, axis=0) + grad_unk
            tl.store(grad_bias_ptr + channels, grad_bias.to(grad_bias_ptr.dtype.element_ty), mask=channel_ok)


# ----------------------------------------------------------------------------------------------------------------
# The row layout's checks (shared with mjp_fast/triton/pos_embed.py)
# ----------------------------------------------------------------------------------------------------------------


def prefix_rows(prefix: torch.Tensor | None, dim: int) -> int:
    """``P``: the rows of ``prefix`` (any contiguous shape ``[..., D]``, e.g. ``[1, P, D]``); 0 for None."""
    if prefix is None:
        return 0
    if prefix.dim() == 0 or prefix.shape[-1] != dim:
        raise ValueError(f"prefix must be [P, D] or [1, P, D] with D = {dim}, got shape {list(prefix.shape)}")
    if not prefix.is_contiguous():
        raise ValueError(f"prefix must be contiguous, got strides {list(prefix.stride())}")
    return math.prod(prefix.shape[:-1])


def check_row_layout(
    prefix_count: int, prefix_positions: int, table_shape: Sequence[int], num_positions: int, dim: int
) -> None:
    """``prefix_positions`` is 0 or ``prefix_count``, and ``table_shape`` is the full table ``[Q + N, D]`` (any
    leading dims of 1: one table)."""
    if prefix_positions not in (0, prefix_count):
        raise ValueError(f"prefix_positions must be 0 or the prefix count P = {prefix_count}, got {prefix_positions}")
    rows = prefix_positions + num_positions
    if len(table_shape) < 2 or tuple(table_shape[-2:]) != (rows, dim) or math.prod(table_shape[:-2]) != 1:
        raise ValueError(
            f"pos_embed must be the full table [Q + N, D] = [{rows}, {dim}] (or [1, Q + N, D]) with "
            f"Q = prefix_positions = {prefix_positions}, N = {num_positions}, got shape {list(table_shape)}"
        )


def check_prefix_shape(prefix_shape: Sequence[int], prefix_count: int, dim: int) -> None:
    """``prefix_shape`` holds ``prefix_count`` rows of ``dim`` channels (``[P, D]``, ``[1, P, D]``, ...)."""
    if len(prefix_shape) == 0 or prefix_shape[-1] != dim or math.prod(prefix_shape[:-1]) != prefix_count:
        raise ValueError(
            f"prefix_shape must hold P = {prefix_count} rows of D = {dim} ([P, D] or [1, P, D]), "
            f"got {list(prefix_shape)}"
        )


def _check_contiguous(**tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous, got shape {list(tensor.shape)} strides {list(tensor.stride())}"
            )


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``. Triton reads it for float32 operands only:
    "ieee" keeps their products exact, as torch's matmul does by default (no TF32 rounding). For float16 and
    bfloat16 it is ignored (their products are exact in the float32 accumulator on the tensor cores), so the "tf32"
    returned for them rounds nothing; it is kept so that the compiled kernels stay the ones measured."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(first: torch.dtype, second: torch.dtype) -> bool:
    """Multiply in float32: operands of two dtypes (tl.dot takes one), or bfloat16 in the interpreter."""
    return first != second or (_interpreting() and torch.bfloat16 in (first, second))


def _grad_weight_tiles(dim: int, k: int) -> tuple[int, int, int]:
    """Tiles of the weight-gradient kernel (its token axis is split across programs, so no autotuning)."""
    if _interpreting():
        return 16, 16, 16
    block_d = 128 if dim >= 128 else max(16, triton.next_power_of_2(dim))
    return 64, block_d, 64 if k >= 64 else max(16, triton.next_power_of_2(k))


def _image_strides(images: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(images.stride())  # type: ignore[return-value]


def patch_embed_forward_launch(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None,
    perm: torch.Tensor | None,
    mask: torch.Tensor | None,
    prefix: torch.Tensor | None = None,
    prefix_positions: int = 0,
    out_dtype: torch.dtype | None = None,
    *,
    traced: bool = False,
) -> torch.Tensor:
    """The whole token sequence ``[B, P + N, D]`` in ``out_dtype`` (default the images'), prefix rows included: one
    launch. The position terms, bias and prefix may have their own dtype (they are added in float32): under autocast,
    bfloat16 images and weight with the float32 table give timm's float32 sum without a cast of the output.

    Args:
        images: ``[B, C, H, W]``, any strides; ``H`` and ``W`` multiples of the patch size.
        weight: the Conv2d weight ``[D, C, patch, patch]``.
        bias: ``[D]`` or None.
        pos_embed: the model's full table, contiguous, ``[Q + N, D]`` or ``[1, Q + N, D]``.
        unk_embed: ``[D]``; read where ``mask`` is True (None without a mask).
        perm, mask: int64 and bool ``[B, N]``, contiguous, or None (no move, no masking).
        prefix: the prefix tokens (class, registers), contiguous, ``P * D`` elements (``[1, P, D]``, ``[P, D]``);
            None when ``P = 0``.
        prefix_positions: ``Q``, 0 or ``P``: the leading rows of ``pos_embed`` that belong to the prefix tokens.
        traced: launch through ``torch.library.wrap_triton`` (inside the torch operator).

    ``out[b, t] = prefix[t] + (pos[t] if t < Q else 0)`` for ``t < P``; ``out[b, P + n] = patch(b, perm[b, n]) @
    W^T + bias + (unk if mask[b, n] else pos[Q + n])``, summed in float32 and rounded once.
    """
    batch, channels, height, width = images.shape
    dim, _, patch, _ = weight.shape
    num_positions = (height // patch) * (width // patch)
    cols = width // patch
    k = channels * patch * patch
    prefix_count = prefix_rows(prefix, dim)
    check_row_layout(prefix_count, prefix_positions, pos_embed.shape, num_positions, dim)
    total, total_prefix = batch * num_positions, batch * prefix_count
    out_dtype = out_dtype or images.dtype
    out = torch.empty(batch, prefix_count + num_positions, dim, dtype=out_dtype, device=images.device)
    if total + total_prefix == 0:
        return out
    weight = weight.contiguous()
    pos_embed = pos_embed.contiguous()
    dummy = pos_embed  # for absent inputs: read-only, never read

    def grid(meta):
        rows = triton.cdiv(total, meta["BLOCK_M"]) + triton.cdiv(total_prefix, meta["BLOCK_M"])
        return (rows, triton.cdiv(dim, meta["BLOCK_D"]))

    launcher(_forward_kernel, grid, traced)(
        images,
        weight,
        bias if bias is not None else dummy,
        pos_embed,
        unk_embed if unk_embed is not None else dummy,
        perm if perm is not None else dummy,
        mask if mask is not None else dummy,
        out,
        total,
        num_positions,
        cols,
        k,
        dim,
        *_image_strides(images),
        prefix if prefix is not None else dummy,
        total_prefix,
        prefix_count,
        prefix_positions,
        PATCH=patch,
        HAS_BIAS=bias is not None,
        HAS_PERM=perm is not None,
        HAS_MASK=mask is not None,
        HAS_PREFIX=prefix_count > 0,
        PRECISION=_precision(images.dtype),
        UPCAST=_upcast(images.dtype, weight.dtype),
    )
    return out


def patch_embed_backward_launch(
    grad_out: torch.Tensor,
    images: torch.Tensor,
    weight: torch.Tensor,
    perm: torch.Tensor | None,
    mask: torch.Tensor | None,
    need_images: bool,
    need_weight: bool,
    need_bias: bool,
    need_pos: bool,
    need_unk: bool,
    need_prefix: bool,
    prefix_count: int,
    prefix_positions: int,
    pos_shape: Sequence[int],
    prefix_shape: Sequence[int],
    pos_dtype: torch.dtype | None = None,
    unk_dtype: torch.dtype | None = None,
    prefix_dtype: torch.dtype | None = None,
    *,
    traced: bool = False,
) -> list[torch.Tensor]:
    """``[grad_images, grad_weight, grad_bias, grad_pos, grad_unk, grad_prefix]``: an empty ``[0]`` tensor where
    not asked for; else in the shape of the input (``pos_shape``, ``prefix_shape``: the forward's table and prefix)
    and in the dtype of images (grad_images), of weight (grad_weight, grad_bias), or ``pos_dtype``, ``unk_dtype``,
    ``prefix_dtype`` (default weight's): a float32 table under autocast gets its float32 gradient, no cast after.

    grad_out ``[B, P + N, D]``. The weight, bias and image gradients come from the patch rows only; grad_pos's
    rows and grad_prefix from the same one pass over grad_out (:func:`launch_position_gradient`).
    """
    batch, channels, height, width = images.shape
    dim, _, patch, _ = weight.shape
    num_positions = (height // patch) * (width // patch)
    cols = width // patch
    k = channels * patch * patch
    total = batch * num_positions  # the patch tokens
    if tuple(grad_out.shape) != (batch, prefix_count + num_positions, dim):
        raise ValueError(
            f"grad_out must be [B, P + N, D] = {[batch, prefix_count + num_positions, dim]}, got {list(grad_out.shape)}"
        )
    grad_out = grad_out.contiguous()
    weight = weight.contiguous()
    block_m, block_d, block_k = _grad_weight_tiles(dim, k)
    dummy = grad_out
    grads = [grad_out.new_empty(0) for _ in range(6)]

    if need_images:
        grad_images = torch.empty(batch, channels, height, width, dtype=images.dtype, device=images.device)
        if total:

            def grid(meta):
                return (triton.cdiv(total, meta["BLOCK_M"]), triton.cdiv(k, meta["BLOCK_K"]))

            launcher(_grad_images_kernel, grid, traced)(
                grad_out,
                weight,
                perm if perm is not None else dummy,
                grad_images,
                total,
                num_positions,
                cols,
                k,
                dim,
                *_image_strides(grad_images),
                prefix_count,
                PATCH=patch,
                HAS_PERM=perm is not None,
                HAS_PREFIX=prefix_count > 0,
                PRECISION=_precision(images.dtype),
                UPCAST=_upcast(grad_out.dtype, weight.dtype),
            )
        else:
            grad_images.zero_()
        grads[0] = grad_images

    if need_weight:
        tiles = triton.cdiv(dim, block_d) * triton.cdiv(k, block_k)
        # Enough splits of the token axis to fill the GPU about four times over, in whole tiles of tokens.
        programs_wanted = 1 if _interpreting() else 4 * _multiprocessors(images.device)
        splits = max(1, min(triton.cdiv(total, block_m), programs_wanted // max(tiles, 1)))
        tokens_per_split = triton.cdiv(triton.cdiv(total, splits), block_m) * block_m
        splits = max(1, triton.cdiv(total, tokens_per_split))
        partial = torch.empty(splits, dim, k, dtype=torch.float32, device=images.device)
        if total:
            launcher(_grad_weight_kernel, (triton.cdiv(dim, block_d), triton.cdiv(k, block_k), splits), traced)(
                grad_out,
                images,
                perm if perm is not None else dummy,
                partial,
                total,
                num_positions,
                cols,
                k,
                dim,
                tokens_per_split,
                *_image_strides(images),
                prefix_count,
                PATCH=patch,
                HAS_PERM=perm is not None,
                HAS_PREFIX=prefix_count > 0,
                PRECISION=_precision(images.dtype),
                UPCAST=_upcast(grad_out.dtype, images.dtype),
                BLOCK_M=block_m,
                BLOCK_D=block_d,
                BLOCK_K=block_k,
            )
        else:
            partial.zero_()
        grads[1] = partial.sum(0).to(weight.dtype).reshape(weight.shape)

    if need_bias or need_pos or need_unk or need_prefix:
        _, grad_pos, grad_unk, grad_bias, grad_prefix = launch_position_gradient(
            grad_out,
            mask,
            None,
            tokens_dtype=None,
            pos_dtype=pos_dtype or weight.dtype,
            unk_dtype=unk_dtype or weight.dtype,
            bias_dtype=weight.dtype if need_bias else None,
            prefix_count=prefix_count,
            prefix_positions=prefix_positions,
            pos_shape=pos_shape,
            prefix_dtype=(prefix_dtype or weight.dtype) if need_prefix else None,
            prefix_shape=prefix_shape,
            traced=traced,
        )
        for index, (need, grad) in enumerate(
            ((need_bias, grad_bias), (need_pos, grad_pos), (need_unk, grad_unk), (need_prefix, grad_prefix)), 2
        ):
            if need:
                grads[index] = grad
    return grads


# ----------------------------------------------------------------------------------------------------------------
# Operators
# ----------------------------------------------------------------------------------------------------------------


@_operator("mjp_fast::patch_embed_triton", mutates_args=())
def patch_embed_forward_triton(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None,
    perm: torch.Tensor | None,
    mask: torch.Tensor | None,
    prefix: torch.Tensor | None,
    prefix_positions: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The torch operator over :func:`patch_embed_forward_launch`: tokens ``[B, P + N, D]``."""
    return patch_embed_forward_launch(
        images, weight, bias, pos_embed, unk_embed, perm, mask, prefix, prefix_positions, out_dtype, traced=True
    )


@patch_embed_forward_triton.register_fake
def _patch_embed_forward_fake(
    images, weight, bias, pos_embed, unk_embed, perm, mask, prefix, prefix_positions, out_dtype=None
):
    batch, _, height, width = images.shape
    dim, _, patch, _ = weight.shape
    rows = prefix_rows(prefix, dim) + (height // patch) * (width // patch)
    return images.new_empty(batch, rows, dim, dtype=out_dtype or images.dtype)


@_operator("mjp_fast::patch_embed_triton_backward", mutates_args=())
def patch_embed_backward_triton(
    grad_out: torch.Tensor,
    images: torch.Tensor,
    weight: torch.Tensor,
    perm: torch.Tensor | None,
    mask: torch.Tensor | None,
    need_images: bool,
    need_weight: bool,
    need_bias: bool,
    need_pos: bool,
    need_unk: bool,
    need_prefix: bool,
    prefix_count: int,
    prefix_positions: int,
    pos_shape: list[int],
    prefix_shape: list[int],
    pos_dtype: torch.dtype | None = None,
    unk_dtype: torch.dtype | None = None,
    prefix_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """The torch operator over :func:`patch_embed_backward_launch`:
    ``[grad_images, grad_weight, grad_bias, grad_pos, grad_unk, grad_prefix]``."""
    return patch_embed_backward_launch(
        grad_out, images, weight, perm, mask, need_images, need_weight, need_bias, need_pos, need_unk, need_prefix,
        prefix_count, prefix_positions, pos_shape, prefix_shape, pos_dtype, unk_dtype, prefix_dtype, traced=True,
    )  # fmt: skip


@patch_embed_backward_triton.register_fake
def _patch_embed_backward_fake(
    grad_out, images, weight, perm, mask, need_images, need_weight, need_bias, need_pos, need_unk, need_prefix,
    prefix_count, prefix_positions, pos_shape, prefix_shape, pos_dtype=None, unk_dtype=None, prefix_dtype=None,
):  # fmt: skip
    dim = weight.shape[0]
    outputs = (
        (need_images, images.shape, images.dtype),
        (need_weight, weight.shape, weight.dtype),
        (need_bias, (dim,), weight.dtype),
        (need_pos, tuple(pos_shape), pos_dtype or weight.dtype),
        (need_unk, (dim,), unk_dtype or weight.dtype),
        (need_prefix, tuple(prefix_shape) if prefix_count else (0,), prefix_dtype or weight.dtype),
    )
    return [grad_out.new_empty(shape, dtype=dtype) if need else grad_out.new_empty(0) for need, shape, dtype in outputs]


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device (asked once per device: the query costs host time on every backward); 1 otherwise."""
    if device.type != "cuda":
        return 1
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


# ----------------------------------------------------------------------------------------------------------------
# Position gradient: the launch plan (one source of truth for the launcher and the tests) and the launcher
# ----------------------------------------------------------------------------------------------------------------

PROGRAMS_PER_SM = 4  # programs of the partials kernel wanted per SM: enough loads in flight to keep HBM busy
MAX_PARTIAL_SHARE = 0.1  # the float32 partials' traffic, at most this share of the unavoidable traffic
PARTIAL_BYTES = 8  # per float32 partial: written once, read once


def _channel_tile(dim: int) -> int:
    """The widest channel tile (coalesced rows) that loads at most 1/8 of padding columns, 16 at least."""
    for width in (128, 64, 32):
        if math.ceil(dim / width) * width * 8 <= dim * 9:
            return width
    return 16


@dataclass(frozen=True)
class PositionGradientPlan:
    """How the position gradient is launched: the partials kernel, then the reduction kernel.

    The gradient is ``[batch, num_positions, dim]`` with ``num_positions = P + N``: its first ``prefix_count``
    (``P``) rows per sample are the prefix tokens', positions that are never masked nor moved. The partials
    kernel's grid is ``(position_blocks, channel_blocks, chunks)``: each program sums the gradient over
    ``samples_per_chunk`` samples of its batch chunk, ``block_b`` samples of ``block_n`` positions x ``block_d``
    channels per step. Traffic in bytes: ``bytes_grad_read`` and ``bytes_tokens_write`` (the inverse move of the
    patch rows, with SCATTER) are unavoidable; ``bytes_partials`` is the float32 partials written and read back;
    ``bytes_small`` counts perm and mask (read once per channel block) and the outputs.
    """

    batch: int
    num_positions: int  # P + N: rows per sample of the gradient, prefix rows included
    dim: int
    prefix_count: int  # P
    prefix_positions: int  # Q: rows of the position table that belong to the prefix tokens (0 or P)
    chunks: int
    samples_per_chunk: int
    block_b: int
    block_n: int
    block_d: int
    position_blocks: int
    channel_blocks: int
    small_rows: int  # rows of each vector partial (unk_embed's, bias's): chunks * position_blocks
    partial_rows: int  # rows of D float32 partials in all
    reduce_block_n: int
    reduce_block_d: int
    reduce_block_s: int
    bytes_grad_read: int
    bytes_tokens_write: int
    bytes_partials: int
    bytes_small: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.position_blocks, self.channel_blocks, self.chunks)

    @property
    def reduce_grid(self) -> tuple[int, int]:
        # at least one row of programs: they write grad_unk (zeros) even when there are no positions
        return (max(1, math.ceil(self.num_positions / self.reduce_block_n)), math.ceil(self.dim / self.reduce_block_d))

    @property
    def programs(self) -> int:
        return self.position_blocks * self.channel_blocks * self.chunks

    @property
    def unavoidable_bytes(self) -> int:
        return self.bytes_grad_read + self.bytes_tokens_write

    @property
    def total_bytes(self) -> int:
        return self.unavoidable_bytes + self.bytes_partials + self.bytes_small


@functools.lru_cache(maxsize=256)
def _cached_plan(*arguments) -> PositionGradientPlan:
    return _position_gradient_plan(*arguments)


def position_gradient_plan(
    batch: int,
    num_positions: int,
    dim: int,
    dtype: torch.dtype,
    multiprocessors: int,
    interpreting: bool,
    *,
    scatter: bool = True,
    has_mask: bool = True,
    has_bias: bool = False,
    tokens_dtype: torch.dtype | None = None,
    chunks: int | None = None,
    prefix_count: int = 0,
    prefix_positions: int = 0,
) -> PositionGradientPlan:
    """The launch plan of the position gradient of a ``[batch, num_positions, dim]`` gradient of ``dtype``.

    Pure (cached for plain ints). ``num_positions``: the gradient's rows per sample, ``P + N`` with the
    ``prefix_count`` (``P``) prefix rows first; ``prefix_positions``: ``Q``, 0 or ``P``. ``multiprocessors``: the
    GPU's SM count; the batch is split into chunks so that the partials kernel has about ``PROGRAMS_PER_SM``
    programs per SM, as long as the partials stay within ``MAX_PARTIAL_SHARE`` of the unavoidable traffic.
    ``interpreting``: small tiles and one chunk (the Triton interpreter runs programs one after another).
    ``scatter``: the inverse move of the patch rows is written too, in ``tokens_dtype`` (default ``dtype``).
    ``chunks`` forces the number of batch chunks (tests).
    """
    if not 0 <= prefix_count <= num_positions or prefix_positions not in (0, prefix_count):
        raise ValueError(
            f"prefix_count must be in [0, num_positions = {num_positions}] and prefix_positions 0 or prefix_count, "
            f"got {prefix_count} and {prefix_positions}"
        )
    arguments = (batch, num_positions, dim, dtype, multiprocessors, interpreting, scatter, has_mask, has_bias)
    arguments += (tokens_dtype, chunks, prefix_count, prefix_positions)
    sizes = (batch, num_positions, dim, multiprocessors, prefix_count, prefix_positions)
    if all(type(value) is int for value in sizes):
        return _cached_plan(*arguments)
    return _position_gradient_plan(*arguments)  # symbolic sizes under torch.compile: not hashable


def _position_gradient_plan(
    batch,
    num_positions,
    dim,
    dtype,
    multiprocessors,
    interpreting,
    scatter,
    has_mask,
    has_bias,
    tokens_dtype,
    chunks,
    prefix_count,
    prefix_positions,
) -> PositionGradientPlan:
    element = dtype.itemsize
    tokens_element = (tokens_dtype or dtype).itemsize if scatter else 0
    patch_positions = num_positions - prefix_count
    if interpreting:
        block_d, tiles_per_step, target_programs = 16, ((2, 8),), 1
    else:
        # (block_b, block_n): 32 rows of the gradient per step; fewer positions per block when more tiles are
        # needed to fill the GPU without more chunks
        block_d, tiles_per_step = _channel_tile(dim), ((1, 32), (2, 16), (4, 8))
        target_programs = PROGRAMS_PER_SM * max(1, multiprocessors)
    # Each chunk adds float32 partials (one row of D per position, plus D per position block for each vector)
    # written and read back; no more chunks than keep them within MAX_PARTIAL_SHARE of the bytes that must move
    # anyway.
    unavoidable = batch * dim * (num_positions * element + patch_positions * tokens_element)
    vectors = 2 if has_bias else 1
    channel_blocks = math.ceil(dim / block_d)
    for step_tile in tiles_per_step:
        position_blocks = max(1, math.ceil(num_positions / step_tile[1]))
        chunk_bytes = PARTIAL_BYTES * dim * (num_positions + vectors * position_blocks)
        max_chunks = max(1, unavoidable // max(1, round(chunk_bytes / MAX_PARTIAL_SHARE)))
        wanted = math.ceil(target_programs / max(1, position_blocks * channel_blocks))
        if wanted <= max_chunks:
            break
    block_b, block_n = step_tile
    wanted = min(wanted, max_chunks) if chunks is None else chunks
    wanted = max(1, min(wanted, batch))
    # whole steps of block_b samples per chunk; the last chunk takes what is left
    samples_per_chunk = math.ceil(math.ceil(max(batch, 1) / wanted) / block_b) * block_b
    chunks = max(1, math.ceil(batch / samples_per_chunk))
    small_rows = chunks * position_blocks
    partial_rows = chunks * num_positions + vectors * small_rows
    index_bytes = (8 if scatter else 0) + (1 if has_mask else 0)
    # grad_pos (Q + N rows), grad_prefix (P rows), then grad_unk and grad_bias
    outputs = (prefix_positions + patch_positions + prefix_count) * dim * element + dim * element * vectors
    return PositionGradientPlan(
        batch=batch,
        num_positions=num_positions,
        dim=dim,
        prefix_count=prefix_count,
        prefix_positions=prefix_positions,
        chunks=chunks,
        samples_per_chunk=samples_per_chunk,
        block_b=block_b,
        block_n=block_n,
        block_d=block_d,
        position_blocks=position_blocks,
        channel_blocks=channel_blocks,
        small_rows=small_rows,
        partial_rows=partial_rows,
        reduce_block_n=8 if interpreting else 16,
        reduce_block_d=16 if interpreting else min(64, block_d),
        reduce_block_s=4 if interpreting else 16,
        bytes_grad_read=batch * num_positions * dim * element,
        bytes_tokens_write=batch * patch_positions * dim * tokens_element,
        bytes_partials=PARTIAL_BYTES * partial_rows * dim,
        bytes_small=batch * patch_positions * channel_blocks * index_bytes + outputs,
    )


def _position_plan(
    grad: torch.Tensor,
    *,
    scatter: bool,
    has_mask: bool,
    has_bias: bool,
    tokens_dtype: torch.dtype | None,
    prefix_count: int = 0,
    prefix_positions: int = 0,
) -> PositionGradientPlan:
    """The plan for ``grad`` on its device (tests replace this to force several chunks under the interpreter)."""
    batch, num_positions, dim = grad.shape
    return position_gradient_plan(
        batch,
        num_positions,
        dim,
        grad.dtype,
        _multiprocessors(grad.device),
        _interpreting() or grad.device.type != "cuda",  # programs run one after another: one chunk
        scatter=scatter,
        has_mask=has_mask,
        has_bias=has_bias,
        tokens_dtype=tokens_dtype,
        prefix_count=prefix_count,
        prefix_positions=prefix_positions,
    )


def launch_position_gradient(
    grad: torch.Tensor,
    mask: torch.Tensor | None,
    perm: torch.Tensor | None,
    *,
    tokens_dtype: torch.dtype | None,
    pos_dtype: torch.dtype,
    unk_dtype: torch.dtype,
    bias_dtype: torch.dtype | None = None,
    prefix_count: int = 0,
    prefix_positions: int = 0,
    pos_shape: Sequence[int] | None = None,
    prefix_dtype: torch.dtype | None = None,
    prefix_shape: Sequence[int] | None = None,
    plan: PositionGradientPlan | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The gradients that one pass over ``grad`` gives: two kernel launches, outputs made with ``torch.empty``.

    Args:
        grad: ``[B, P + N, D]``, contiguous: the gradient of ``out[b, t] = prefix[t] + (pos[t] if t < Q else 0)``
            (``t < P``) and ``out[b, P + n] = token[b, n] + (unk if mask[b, n] else pos[Q + n])``.
        mask: bool ``[B, N]``, contiguous, or None (no position is masked).
        perm: int64 ``[B, N]``, contiguous; read only with ``tokens_dtype``.
        tokens_dtype: the dtype of ``grad_tokens``, the inverse move ``grad_tokens[b, perm[b, n]] = grad[b, P + n]``;
            None: no inverse move (``perm`` is not read).
        pos_dtype, unk_dtype, bias_dtype: the dtypes of ``grad_pos``, ``grad_unk`` and ``grad_bias`` (None: no
            bias gradient).
        prefix_count: ``P``, the prefix rows of ``grad`` (0 to P + N).
        prefix_positions: ``Q``, 0 or ``P``: the leading rows of the position table that belong to the prefix.
        pos_shape: the table's shape, ``[Q + N, D]`` or ``[1, Q + N, D]``; default ``[Q + N, D]``.
        prefix_dtype: the dtype of ``grad_prefix``; None: not computed.
        prefix_shape: the prefix's shape (``P * D`` elements); default ``[P, D]``.
        plan: from :func:`position_gradient_plan` for these sizes; default the device's.
        traced: launch through ``torch.library.wrap_triton`` (inside a torch operator).

    Returns:
        ``grad_tokens [B, N, D]`` (or None); ``grad_pos`` (``pos_shape``: rows ``t < Q`` the prefix rows summed
        over the batch, rows ``Q + n`` grad summed over the samples where position n is unmasked); ``grad_unk [D]``
        (over the masked ones); ``grad_bias [D]`` (over all patch rows, or None); ``grad_prefix`` (``prefix_shape``,
        the prefix rows summed over the batch; an empty ``[0]`` tensor when ``P = 0``; None without
        ``prefix_dtype``).
    """
    batch, num_positions, dim = grad.shape
    if not 0 <= prefix_count <= num_positions:
        raise ValueError(f"prefix_count must be in [0, {num_positions}] (grad's rows per sample), got {prefix_count}")
    patch_positions = num_positions - prefix_count
    table_rows = prefix_positions + patch_positions
    pos_shape = (table_rows, dim) if pos_shape is None else tuple(pos_shape)
    check_row_layout(prefix_count, prefix_positions, pos_shape, patch_positions, dim)
    scatter, has_mask, has_bias = tokens_dtype is not None, mask is not None, bias_dtype is not None
    for name, index in (("mask", mask), ("perm", perm if scatter else None)):
        if index is not None and tuple(index.shape) != (batch, patch_positions):
            raise ValueError(f"{name} must be [B, N] = {[batch, patch_positions]}, got {list(index.shape)}")
    device = grad.device
    grad_prefix = None
    if prefix_dtype is not None:
        if prefix_count and prefix_shape is not None:
            check_prefix_shape(prefix_shape, prefix_count, dim)
        shape = ((prefix_count, dim) if prefix_shape is None else tuple(prefix_shape)) if prefix_count else (0,)
        grad_prefix = torch.empty(shape, dtype=prefix_dtype, device=device)
    grad_tokens = torch.empty((batch, patch_positions, dim), dtype=tokens_dtype, device=device) if scatter else None
    grad_pos = torch.empty(pos_shape, dtype=pos_dtype, device=device)
    grad_unk = torch.empty((dim,), dtype=unk_dtype, device=device)
    grad_bias = torch.empty((dim,), dtype=bias_dtype, device=device) if has_bias else None
    if dim == 0:
        return grad_tokens, grad_pos, grad_unk, grad_bias, grad_prefix
    if plan is None:
        plan = _position_plan(
            grad,
            scatter=scatter,
            has_mask=has_mask,
            has_bias=has_bias,
            tokens_dtype=tokens_dtype,
            prefix_count=prefix_count,
            prefix_positions=prefix_positions,
        )
    elif (plan.batch, plan.num_positions, plan.dim, plan.prefix_count) != (batch, num_positions, dim, prefix_count):
        raise ValueError(
            f"plan: made for [B, P + N, D] = {[plan.batch, plan.num_positions, plan.dim]} with "
            f"P = {plan.prefix_count}, got grad {list(grad.shape)} with P = {prefix_count}"
        )
    write_prefix = grad_prefix is not None and prefix_count > 0
    partials = torch.empty((plan.partial_rows, dim), dtype=torch.float32, device=device)
    launcher(_position_partials_kernel, plan.grid, traced)(
        grad,
        mask if has_mask else grad,
        perm if scatter else grad,
        grad_tokens if scatter else grad,
        partials,
        batch,
        num_positions,
        dim,
        plan.samples_per_chunk,
        prefix_count,
        HAS_MASK=has_mask,
        SCATTER=scatter,
        HAS_BIAS=has_bias,
        HAS_PREFIX=prefix_count > 0,
        BLOCK_B=plan.block_b,
        BLOCK_N=plan.block_n,
        BLOCK_D=plan.block_d,
    )
    launcher(_position_reduce_kernel, plan.reduce_grid, traced)(
        partials,
        grad_pos,
        grad_unk,
        grad_bias if has_bias else grad_unk,
        grad_prefix if write_prefix else grad_unk,
        plan.chunks,
        num_positions,
        prefix_count,
        prefix_positions,
        dim,
        plan.small_rows,
        HAS_BIAS=has_bias,
        WRITE_PREFIX=write_prefix,
        BLOCK_N=plan.reduce_block_n,
        BLOCK_D=plan.reduce_block_d,
        BLOCK_S=plan.reduce_block_s,
    )
    return grad_tokens, grad_pos, grad_unk, grad_bias, grad_prefix
