"""Triton kernels of the MJP patch embedding, forward and backward.

Tokens are the rows of a GEMM ``[B*N, K] @ [K, D]`` with ``K = C*P*P``. The left operand is never made: each
tile loads its patches straight from the NCHW images at the permuted source positions (the im2col and the
jigsaw happen in the load), and the epilogue adds the bias and ``unk_embed``-or-``pos_embed[n]``.

Backward, only what is asked for:

- weight: ``dW = dY^T @ A``, re-gathering ``A`` the same way (nothing of size ``B*N*K`` is saved); the reduction
  over the ``B*N`` tokens is split across programs into float32 partials, summed in a fixed order afterwards.
- pos_embed, unk_embed, bias: one pass over ``dY`` split over positions, channels and batch chunks (enough
  programs to fill the GPU), each program writing float32 partial sums that only it owns, then a small kernel
  that adds them in a fixed order and writes the gradients in their final dtypes: no atomics, deterministic.
  :func:`position_gradient_plan` says how (grids, tiles, chunks, bytes moved); ``mjp_pos_embed``'s backward uses
  the same kernels, with the inverse move of the gradient written from the same loads.
- images: ``dA = dY @ W``, stored back to the permuted patch locations; ``perm`` permutes each sample's
  positions, so every pixel is written exactly once.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mjp_fast.triton import operator as _operator


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter multiplies bfloat16 tiles wrongly; float32 products of them are exact anyway
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


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
    """Addresses ``[BLOCK_M, BLOCK_K]`` of the pixels of the (permuted) patches of ``tokens``."""
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


@triton.autotune(configs=_gemm_configs(), key=["total_tokens", "D", "K"])
@triton.jit
def _forward_kernel(
    images_ptr,
    weight_ptr,
    bias_ptr,
    pos_ptr,
    unk_ptr,
    perm_ptr,
    mask_ptr,
    out_ptr,
    total_tokens,
    num_positions,
    cols,
    K,
    D,
    stride_b,
    stride_c,
    stride_h,
    stride_w,
    PATCH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_index = k_start + tl.arange(0, BLOCK_K)
        address, valid = _patch_addresses(
            images_ptr,
            perm_ptr,
            tokens,
            k_index,
            num_positions,
            cols,
            PATCH,
            stride_b,
            stride_c,
            stride_h,
            stride_w,
            total_tokens,
            K,
            HAS_PERM,
        )
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
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)[None, :]
    pos = tl.load(
        pos_ptr + position[:, None].to(tl.int64) * D + channels[None, :],
        mask=token_ok[:, None] & channel_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    if HAS_MASK:
        masked = tl.load(mask_ptr + tokens, mask=token_ok, other=0).to(tl.int1)
        unk = tl.load(unk_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)
        pos = tl.where(masked[:, None], unk[None, :], pos)
    acc += pos
    tl.store(
        out_ptr + tokens[:, None].to(tl.int64) * D + channels[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=token_ok[:, None] & channel_ok[None, :],
    )


@triton.jit
def _grad_weight_kernel(
    grad_ptr,
    images_ptr,
    perm_ptr,
    partial_ptr,
    total_tokens,
    num_positions,
    cols,
    K,
    D,
    tokens_per_split,
    stride_b,
    stride_c,
    stride_h,
    stride_w,
    PATCH: tl.constexpr,
    HAS_PERM: tl.constexpr,
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
        grad_t = tl.load(
            grad_ptr + tokens[None, :].to(tl.int64) * D + channels[:, None],
            mask=token_ok[None, :] & (channels[:, None] < D),
            other=0.0,
        )
        address, valid = _patch_addresses(
            images_ptr,
            perm_ptr,
            tokens,
            k_index,
            num_positions,
            cols,
            PATCH,
            stride_b,
            stride_c,
            stride_h,
            stride_w,
            last,
            K,
            HAS_PERM,
        )
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
    grad_ptr,
    weight_ptr,
    perm_ptr,
    grad_images_ptr,
    total_tokens,
    num_positions,
    cols,
    K,
    D,
    stride_b,
    stride_c,
    stride_h,
    stride_w,
    PATCH: tl.constexpr,
    HAS_PERM: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_index = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    token_ok = tokens < total_tokens
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for d_start in range(0, D, BLOCK_D):
        channels = d_start + tl.arange(0, BLOCK_D)
        grad = tl.load(
            grad_ptr + tokens[:, None].to(tl.int64) * D + channels[None, :],
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
        grad_images_ptr,
        perm_ptr,
        tokens,
        k_index,
        num_positions,
        cols,
        PATCH,
        stride_b,
        stride_c,
        stride_h,
        stride_w,
        total_tokens,
        K,
        HAS_PERM,
    )
    tl.store(address, acc.to(grad_images_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _position_partials_kernel(
    grad_ptr,  # [B, N, D], contiguous: the incoming gradient
    mask_ptr,  # [B, N] bool (HAS_MASK)
    perm_ptr,  # [B, N] int64 (SCATTER)
    grad_tokens_ptr,  # [B, N, D] (SCATTER): the inverse move of grad
    partial_ptr,  # float32 [chunks * N + (1 + HAS_BIAS) * chunks * position_blocks, D]: rows as stored below
    batch,
    num_positions,
    D,
    samples_per_chunk,
    HAS_MASK: tl.constexpr,
    SCATTER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program (position block, channel block, batch chunk) sums grad over its chunk's samples into float32
    # partials that only it writes: no atomics, and the reduction kernel adds the chunks in a fixed order.
    # SCATTER (mjp_pos_embed's backward): also grad_tokens[b, perm[b, n]] = grad[b, n], the inverse move, from the
    # same loads. perm[b] permutes the positions, so every row of grad_tokens is written exactly once.
    chunk = tl.program_id(2)
    positions = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    position_ok = positions < num_positions
    channel_ok = channels < D
    # BLOCK_B samples per step as a third tile axis: more bytes in flight per load. That axis lies within each
    # thread's registers (sm_90 TTGIR: no layout conversion in the loop), so summing it every step costs no
    # shuffles, and 2D accumulators keep registers low (72 at bfloat16): every program of the plan is resident.
    kept = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    shuffled = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    first = chunk * samples_per_chunk
    last = tl.minimum(first + samples_per_chunk, batch)
    for start in range(first, last, BLOCK_B):
        samples = start + tl.arange(0, BLOCK_B)
        rows = samples[:, None].to(tl.int64) * num_positions + positions[None, :]  # int64: B*N*D may pass 2**31
        row_ok = (samples[:, None] < last) & position_ok[None, :]
        ok = row_ok[:, :, None] & channel_ok[None, None, :]
        grad = tl.load(grad_ptr + rows[:, :, None] * D + channels[None, None, :], mask=ok, other=0.0)
        if SCATTER:
            source = tl.load(perm_ptr + rows, mask=row_ok, other=0)
            target = rows - positions[None, :] + source
            tl.store(
                grad_tokens_ptr + target[:, :, None] * D + channels[None, None, :],
                grad.to(grad_tokens_ptr.dtype.element_ty),
                mask=ok,
            )
        grad = grad.to(tl.float32)
        if HAS_MASK:
            masked = tl.load(mask_ptr + rows, mask=row_ok, other=0).to(tl.int1)[:, :, None]
            kept += tl.sum(tl.where(masked, 0.0, grad), axis=0)
            shuffled += tl.sum(tl.where(masked, grad, 0.0), axis=0)
        else:
            kept += tl.sum(grad, axis=0)
    # Rows of partial: chunk-major pos_embed partials [chunks, N], then unk_embed's [chunks, position blocks]
    # (masked grad summed over the block's positions), then (HAS_BIAS) the same sums of the unmasked grad.
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
        tl.store(partial_ptr + (unk_row + small_rows) * D + channels, tl.sum(kept, axis=0), mask=channel_ok)


@triton.jit
def _position_reduce_kernel(
    partial_ptr,  # float32, as _position_partials_kernel wrote it
    grad_pos_ptr,  # [N, D]
    grad_unk_ptr,  # [D]
    grad_bias_ptr,  # [D] (HAS_BIAS)
    chunks,
    num_positions,
    D,
    small_rows,  # chunks * position blocks of the partials kernel
    HAS_BIAS: tl.constexpr,
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
    tl.store(grad_pos_ptr + positions[:, None] * D + channels[None, :], acc.to(grad_pos_ptr.dtype.element_ty), mask=ok)
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
            # bias: every token's gradient, i.e. grad_pos summed over the positions plus grad_unk
            grad_bias = tl.sum(kept, axis=0) + grad_unk
            tl.store(grad_bias_ptr + channels, grad_bias.to(grad_bias_ptr.dtype.element_ty), mask=channel_ok)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    # float32 stays IEEE float32 (torch's default for matmul); half types use the tensor cores natively.
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    return _interpreting() and dtype == torch.bfloat16


def _grad_weight_tiles(dim: int, k: int) -> tuple[int, int, int]:
    """Tiles of the weight-gradient kernel (its token axis is split across programs, so no autotuning)."""
    if _interpreting():
        return 16, 16, 16
    block_d = 128 if dim >= 128 else max(16, triton.next_power_of_2(dim))
    return 64, block_d, 64 if k >= 64 else max(16, triton.next_power_of_2(k))


def _image_strides(images: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(images.stride())  # type: ignore[return-value]


@_operator("mjp_fast::patch_embed_triton", mutates_args=())
def patch_embed_forward_triton(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None,
    perm: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """tokens ``[B, N, D]``; images ``[B, C, H, W]`` (any strides), weight ``[D, C, P, P]``, pos ``[N, D]``."""
    batch, channels, height, width = images.shape
    dim, _, patch, _ = weight.shape
    rows, cols = height // patch, width // patch
    num_positions = rows * cols
    k = channels * patch * patch
    total = batch * num_positions
    out = torch.empty(batch, num_positions, dim, dtype=images.dtype, device=images.device)
    if total == 0:
        return out
    weight = weight.contiguous()
    pos_embed = pos_embed.contiguous()
    dummy = pos_embed

    def grid(meta):
        return (triton.cdiv(total, meta["BLOCK_M"]), triton.cdiv(dim, meta["BLOCK_D"]))

    torch.library.wrap_triton(_forward_kernel)[grid](
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
        PATCH=patch,
        HAS_BIAS=bias is not None,
        HAS_PERM=perm is not None,
        HAS_MASK=mask is not None,
        PRECISION=_precision(images.dtype),
        UPCAST=_upcast(images.dtype),
    )
    return out


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
) -> list[torch.Tensor]:
    """Returns ``[grad_images, grad_weight, grad_bias, grad_pos, grad_unk]``, an empty tensor where not asked for."""
    batch, channels, height, width = images.shape
    dim, _, patch, _ = weight.shape
    rows, cols = height // patch, width // patch
    num_positions = rows * cols
    k = channels * patch * patch
    total = batch * num_positions
    grad_out = grad_out.contiguous()
    weight = weight.contiguous()
    block_m, block_d, block_k = _grad_weight_tiles(dim, k)
    precision = _precision(images.dtype)
    dummy = grad_out
    grads = [grad_out.new_empty(0) for _ in range(5)]

    if need_images:
        grad_images = torch.empty(batch, channels, height, width, dtype=images.dtype, device=images.device)
        if total:

            def grid(meta):
                return (triton.cdiv(total, meta["BLOCK_M"]), triton.cdiv(k, meta["BLOCK_K"]))

            torch.library.wrap_triton(_grad_images_kernel)[grid](
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
                PATCH=patch,
                HAS_PERM=perm is not None,
                PRECISION=precision,
                UPCAST=_upcast(images.dtype),
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
            torch.library.wrap_triton(_grad_weight_kernel)[
                (triton.cdiv(dim, block_d), triton.cdiv(k, block_k), splits)
            ](
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
                PATCH=patch,
                HAS_PERM=perm is not None,
                PRECISION=precision,
                UPCAST=_upcast(images.dtype),
                BLOCK_M=block_m,
                BLOCK_D=block_d,
                BLOCK_K=block_k,
            )
        else:
            partial.zero_()
        grads[1] = partial.sum(0).to(weight.dtype).reshape(weight.shape)

    if need_bias or need_pos or need_unk:
        _, grad_pos, grad_unk, grad_bias = launch_position_gradient(
            grad_out,
            mask,
            None,
            tokens_dtype=None,
            pos_dtype=weight.dtype,
            unk_dtype=weight.dtype,
            bias_dtype=weight.dtype if need_bias else None,
            traced=True,
        )
        if need_bias:
            grads[2] = grad_bias
        if need_pos:
            grads[3] = grad_pos
        if need_unk:
            grads[4] = grad_unk
    return grads


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

    The partials kernel's grid is ``(position_blocks, channel_blocks, chunks)``: each program sums the gradient
    over ``samples_per_chunk`` samples of its batch chunk, ``block_b`` samples of ``block_n`` positions x
    ``block_d`` channels per step. Traffic in bytes: ``bytes_grad_read`` and ``bytes_tokens_write`` (the inverse
    move, with SCATTER) are unavoidable; ``bytes_partials`` is the float32 partials written and read back;
    ``bytes_small`` counts perm and mask (read once per channel block) and the outputs.
    """

    batch: int
    num_positions: int
    dim: int
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
) -> PositionGradientPlan:
    """The launch plan of the position gradient of a ``[batch, num_positions, dim]`` gradient of ``dtype``.

    Pure (cached for plain ints). ``multiprocessors``: the GPU's SM count; the batch is split into chunks so that
    the partials kernel has about ``PROGRAMS_PER_SM`` programs per SM, as long as the partials stay within
    ``MAX_PARTIAL_SHARE`` of the unavoidable traffic. ``interpreting``: small tiles and one chunk (the Triton
    interpreter runs programs one after another). ``scatter``: the inverse move is written too, in
    ``tokens_dtype`` (default ``dtype``). ``chunks`` forces the number of batch chunks (tests).
    """
    arguments = (batch, num_positions, dim, dtype, multiprocessors, interpreting, scatter, has_mask, has_bias)
    arguments += (tokens_dtype, chunks)
    if all(type(value) is int for value in (batch, num_positions, dim, multiprocessors)):
        return _cached_plan(*arguments)
    return _position_gradient_plan(*arguments)  # symbolic sizes under torch.compile: not hashable


def _position_gradient_plan(
    batch, num_positions, dim, dtype, multiprocessors, interpreting, scatter, has_mask, has_bias, tokens_dtype, chunks
) -> PositionGradientPlan:
    element = dtype.itemsize
    tokens_element = (tokens_dtype or dtype).itemsize if scatter else 0
    if interpreting:
        block_d, tiles_per_step, target_programs = 16, ((2, 8),), 1
    else:
        # (block_b, block_n): 32 rows of the gradient per step; fewer positions per block when more tiles are
        # needed to fill the GPU without more chunks
        block_d, tiles_per_step = _channel_tile(dim), ((1, 32), (2, 16), (4, 8))
        target_programs = PROGRAMS_PER_SM * max(1, multiprocessors)
    # Each chunk adds float32 partials (N*D, plus D per position block for each vector) written and read back;
    # no more chunks than keep them within MAX_PARTIAL_SHARE of the bytes that must move anyway.
    unavoidable = batch * num_positions * dim * (element + tokens_element)
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
    elements = batch * num_positions * dim
    index_bytes = (8 if scatter else 0) + (1 if has_mask else 0)
    outputs = num_positions * dim * element + dim * element * (2 if has_bias else 1)
    return PositionGradientPlan(
        batch=batch,
        num_positions=num_positions,
        dim=dim,
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
        bytes_grad_read=elements * element,
        bytes_tokens_write=elements * tokens_element,
        bytes_partials=PARTIAL_BYTES * partial_rows * dim,
        bytes_small=batch * num_positions * channel_blocks * index_bytes + outputs,
    )


def _position_plan(
    grad: torch.Tensor, *, scatter: bool, has_mask: bool, has_bias: bool, tokens_dtype: torch.dtype | None
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
    )


def _launcher(kernel, grid, traced: bool):
    """``kernel[grid]``; through ``torch.library.wrap_triton`` only when a torch operator traces the launch (so
    torch.compile sees the kernel): in eager mode that wrapper is host time for nothing."""
    if traced:
        return torch.library.wrap_triton(kernel)[grid]
    return kernel[grid]


def launch_position_gradient(
    grad: torch.Tensor,
    mask: torch.Tensor | None,
    perm: torch.Tensor | None,
    *,
    tokens_dtype: torch.dtype | None,
    pos_dtype: torch.dtype,
    unk_dtype: torch.dtype,
    bias_dtype: torch.dtype | None = None,
    plan: PositionGradientPlan | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gradients that one pass over ``grad`` gives: two kernel launches, outputs made with ``torch.empty``.

    Args:
        grad: ``[B, N, D]``, contiguous: the gradient of ``out[b, n] = token[b, n] + position term``.
        mask: bool ``[B, N]``, contiguous, or None (no position is masked).
        perm: int64 ``[B, N]``, contiguous; read only with ``tokens_dtype``.
        tokens_dtype: the dtype of ``grad_tokens``, the inverse move ``grad_tokens[b, perm[b, n]] = grad[b, n]``;
            None: no inverse move (``perm`` is not read).
        pos_dtype, unk_dtype, bias_dtype: the dtypes of ``grad_pos``, ``grad_unk`` and ``grad_bias`` (None: no
            bias gradient).
        plan: from :func:`position_gradient_plan` for these sizes; default the device's.
        traced: launch through ``torch.library.wrap_triton`` (inside a torch operator).

    Returns:
        ``grad_tokens [B, N, D]`` (or None), ``grad_pos [N, D]`` (grad summed over the samples where the position
        is unmasked), ``grad_unk [D]`` (over the masked ones), ``grad_bias [D]`` (over all, or None).
    """
    batch, num_positions, dim = grad.shape
    scatter, has_mask, has_bias = tokens_dtype is not None, mask is not None, bias_dtype is not None
    device = grad.device
    grad_tokens = torch.empty((batch, num_positions, dim), dtype=tokens_dtype, device=device) if scatter else None
    grad_pos = torch.empty((num_positions, dim), dtype=pos_dtype, device=device)
    grad_unk = torch.empty((dim,), dtype=unk_dtype, device=device)
    grad_bias = torch.empty((dim,), dtype=bias_dtype, device=device) if has_bias else None
    if dim == 0:
        return grad_tokens, grad_pos, grad_unk, grad_bias
    if plan is None:
        plan = _position_plan(grad, scatter=scatter, has_mask=has_mask, has_bias=has_bias, tokens_dtype=tokens_dtype)
    elif (plan.batch, plan.num_positions, plan.dim) != (batch, num_positions, dim):
        raise ValueError(
            f"plan: made for [B, N, D] = {[plan.batch, plan.num_positions, plan.dim]}, got grad {list(grad.shape)}"
        )
    partials = torch.empty((plan.partial_rows, dim), dtype=torch.float32, device=device)
    _launcher(_position_partials_kernel, plan.grid, traced)(
        grad,
        mask if has_mask else grad,
        perm if scatter else grad,
        grad_tokens if scatter else grad,
        partials,
        batch,
        num_positions,
        dim,
        plan.samples_per_chunk,
        HAS_MASK=has_mask,
        SCATTER=scatter,
        HAS_BIAS=has_bias,
        BLOCK_B=plan.block_b,
        BLOCK_N=plan.block_n,
        BLOCK_D=plan.block_d,
    )
    _launcher(_position_reduce_kernel, plan.reduce_grid, traced)(
        partials,
        grad_pos,
        grad_unk,
        grad_bias if has_bias else grad_unk,
        plan.chunks,
        num_positions,
        dim,
        plan.small_rows,
        HAS_BIAS=has_bias,
        BLOCK_N=plan.reduce_block_n,
        BLOCK_D=plan.reduce_block_d,
        BLOCK_S=plan.reduce_block_s,
    )
    return grad_tokens, grad_pos, grad_unk, grad_bias
