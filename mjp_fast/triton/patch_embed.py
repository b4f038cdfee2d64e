"""Triton kernels of the MJP patch embedding, forward and backward.

Tokens are the rows of a GEMM ``[B*N, K] @ [K, D]`` with ``K = C*P*P``. The left operand is never made: each
tile loads its patches straight from the NCHW images at the permuted source positions (the im2col and the
jigsaw happen in the load), and the epilogue adds the bias and ``unk_embed``-or-``pos_embed[n]``.

Backward, only what is asked for:

- weight: ``dW = dY^T @ A``, re-gathering ``A`` the same way (nothing of size ``B*N*K`` is saved); the reduction
  over the ``B*N`` tokens is split across programs into float32 partials, summed in a fixed order afterwards.
- pos_embed, unk_embed, bias: one pass over ``dY``, each program owning a block of positions and of channels
  and looping over the batch, so no two programs add into one place: no atomics, deterministic.
- images: ``dA = dY @ W``, stored back to the permuted patch locations; ``perm`` permutes each sample's
  positions, so every pixel is written exactly once.
"""

from __future__ import annotations

import os

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
def _grad_position_kernel(
    grad_ptr,
    mask_ptr,
    grad_pos_ptr,
    unk_partial_ptr,
    perm_ptr,
    grad_tokens_ptr,
    batch,
    num_positions,
    D,
    HAS_MASK: tl.constexpr,
    SCATTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # SCATTER (mjp_pos_embed's backward): also grad_tokens[b, perm[b, n]] = grad[b, n], the inverse move, from
    # the same loads. perm[b] permutes the positions, so every row of grad_tokens is written exactly once.
    positions = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (positions[:, None] < num_positions) & (channels[None, :] < D)
    kept = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    shuffled = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    wide_positions = positions.to(tl.int64)
    for sample in range(0, batch):
        row = (wide_positions * 0 + sample) * num_positions + wide_positions  # int64: B*N may pass 2**31
        grad = tl.load(grad_ptr + row[:, None] * D + channels[None, :], mask=ok, other=0.0).to(tl.float32)
        if SCATTER:
            source = tl.load(perm_ptr + row, mask=positions < num_positions, other=0)
            target = row - wide_positions + source
            tl.store(
                grad_tokens_ptr + target[:, None] * D + channels[None, :],
                grad.to(grad_tokens_ptr.dtype.element_ty),
                mask=ok,
            )
        if HAS_MASK:
            masked = tl.load(mask_ptr + row, mask=positions < num_positions, other=0).to(tl.int1)
            kept += tl.where(masked[:, None], 0.0, grad)
            shuffled += tl.where(masked[:, None], grad, 0.0)
        else:
            kept += grad
    tl.store(grad_pos_ptr + positions[:, None].to(tl.int64) * D + channels[None, :], kept, mask=ok)
    tl.store(
        unk_partial_ptr + tl.program_id(0).to(tl.int64) * D + channels,
        tl.sum(shuffled, axis=0),
        mask=channels < D,
    )


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
        block_n = 16 if _interpreting() else 32
        block_dd = 16 if _interpreting() else 64
        position_blocks = triton.cdiv(num_positions, block_n)
        grad_pos = torch.empty(num_positions, dim, dtype=torch.float32, device=images.device)
        unk_partial = torch.empty(position_blocks, dim, dtype=torch.float32, device=images.device)
        torch.library.wrap_triton(_grad_position_kernel)[(position_blocks, triton.cdiv(dim, block_dd))](
            grad_out,
            mask if mask is not None else dummy,
            grad_pos,
            unk_partial,
            dummy,
            dummy,
            batch,
            num_positions,
            dim,
            HAS_MASK=mask is not None,
            SCATTER=False,
            BLOCK_N=block_n,
            BLOCK_D=block_dd,
        )
        grad_unk = unk_partial.sum(0)
        if need_bias:
            grads[2] = (grad_pos.sum(0) + grad_unk).to(weight.dtype)
        if need_pos:
            grads[3] = grad_pos.to(weight.dtype)
        if need_unk:
            grads[4] = grad_unk.to(weight.dtype)
    return grads


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
