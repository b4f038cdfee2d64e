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

- weight: ``dW = dY^T @ A``, re-gathering ``A`` from the images (nothing of size ``B*N*K`` is saved); the reduction
  over the ``B*N`` patch tokens (the rows ``P..T-1`` of each sample) is split across programs into float32
  partials, summed in a fixed order afterwards. Its order is free: with a perm known to be a permutation, ``A`` is
  read in the patches' natural order and ``dY``'s rows are gathered by the inverse permutation (which the position
  gradient's pass writes), rather than the patches gathered by ``perm``.
- pos_embed, unk_embed, bias, prefix: the position gradient of ``mjp_fast/triton/common.py``
  (:func:`~mjp_fast.triton.common.launch_position_gradient`, which ``mjp_pos_embed``'s backward uses too): one
  pass over ``dY`` split over positions (all ``T`` rows: a prefix row is a position that is never masked nor
  moved), channels and batch chunks, float32 partial sums that only their program owns, then a small kernel that
  adds them in a fixed order and writes the gradients in their final dtypes and shapes: no atomics, deterministic.
- images: ``dA = dY @ W`` over the patch rows, stored back to the permuted patch locations; ``perm`` permutes
  each sample's positions, so every pixel is written exactly once.

The forward and image-gradient GEMMs are autotuned once per power-of-two bucket of ``B * N`` (:func:`tuning_bucket`),
not once per batch size; the weight gradient's tiles follow from ``D`` and ``K``.

Each launcher is a plain function (``*_launch``) that eager callers use directly, and a torch operator over it
that launches through ``torch.library.wrap_triton``, for torch.compile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mjp_fast.triton.common import (
    INTERPRETER_TILE,
    INTERPRETER_WARPS,
    MAX_CHANNEL_TILE,
    cdiv,
    check_row_layout,
    define_operator,
    dot_precision,
    dot_upcast,
    interpreting,
    launch_position_gradient,
    launcher,
    multiprocessors,
    next_power_of_2,
    power_of_two_tile,
    prefix_rows,
    prefix_rows_tile,
    scratch,
    shared_memory_optin,
    tile_size,
)

# How _dot multiplies its two tiles (from :func:`_mixing`): UPCAST, after the rounding.
SAME_DTYPE, UPCAST_BOTH = 0, 1
# ROUND: the dtype _dot rounds both tiles to first (autocast's dtype, or the half-precision operand's). The
# interpreter's own conversion to bfloat16 rounds wrongly (a carry out of the mantissa is lost; triton 3.8), so there
# the tiles are rounded to bfloat16 values by their bits and kept in float32 (BFLOAT16_IN_FLOAT32).
KEEP, TO_BFLOAT16, TO_FLOAT16, BFLOAT16_IN_FLOAT32 = 0, 1, 2, 3
_ROUNDING = {torch.bfloat16: TO_BFLOAT16, torch.float16: TO_FLOAT16}


@triton.jit
def _bfloat16_in_float32(x):
    """``x`` rounded to the nearest bfloat16 (ties to even), as float32; NaN stays NaN."""
    x = x.to(tl.float32)
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND: tl.constexpr):
    # Both tiles rounded first (ROUND): autocast's cast of the convolution's operands, done as they are loaded.
    if ROUND == 1:  # TO_BFLOAT16
        a = a.to(tl.bfloat16)
        b = b.to(tl.bfloat16)
    elif ROUND == 2:  # TO_FLOAT16
        a = a.to(tl.float16)
        b = b.to(tl.float16)
    elif ROUND == 3:  # BFLOAT16_IN_FLOAT32 (the interpreter's)
        a = _bfloat16_in_float32(a)
        b = _bfloat16_in_float32(b)
    # One return after the branches: the compiler builds every statement that follows a constexpr `if` whose body
    # returns, so `return` inside the `if` would still compile tl.dot on the raw (possibly mixed-dtype) tiles.
    if UPCAST == 1:  # UPCAST_BOTH: mixed operand dtypes, or bfloat16 in the interpreter (which multiplies it wrongly)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


def _mixing(
    first: torch.dtype, second: torch.dtype, *, gradient: bool = False, compute: torch.dtype | None = None
) -> tuple[int, int]:
    """How a kernel multiplies a tile of ``first`` by one of ``second``: :func:`_dot`'s ``(UPCAST, ROUND)``.
    ``gradient``: ``first`` is the output's gradient (the backward's kernels); ``compute``: the dtype the op
    multiplies in, when the caller names one (autocast's).

    With ``compute`` bfloat16 or float16, both tiles are rounded to it as they are loaded and multiplied on the
    tensor cores: under autocast the op takes the float32 images and weight as they are, and does in its loads what
    autocast's casts of timm's convolution do (no cast of the images before the op, none of the weight's gradient
    after it). Without ``compute``, a float32 gradient against bfloat16 or float16 images or weight (the output is
    float32: the position terms are the float32 table's) is rounded to their dtype, as timm's convolution gets its
    gradient (the add of the float32 table hands it back in the convolution's dtype). Multiplying in float32
    instead ("ieee": no tensor cores) made the weight's gradient of DeiT-S at batch 256 take 9.7 ms (14 ms with the
    jigsaw's gather) of GPU time on an H100 (2026-11-27), most of a 54 ms step. The interpreter rounds as a GPU
    does but multiplies rounded bfloat16 tiles in float32 (it multiplies bfloat16 wrongly: the products are the
    same, the sums' order differs); other mixed pairs multiply in float32."""
    if compute is None and gradient and first == torch.float32 and second in _ROUNDING:
        compute = second
    if compute == torch.bfloat16 and interpreting():
        return UPCAST_BOTH, BFLOAT16_IN_FLOAT32
    if compute in _ROUNDING:
        return SAME_DTYPE, _ROUNDING[compute]
    return (UPCAST_BOTH if dot_upcast(first, second) else SAME_DTYPE), KEEP


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
    position) indices, of ``B * N``), and where they are valid. A perm entry outside ``[0, N)`` (only with
    ``validate=False``) shows no patch: its pixels are masked off (a zero patch, no gradient), its address clamped
    to the sample's own first patch, so no load or store leaves the images (see ``mjp_fast/_validate.py``)."""
    token_ok = tokens < total_tokens
    sample = tokens // num_positions
    position = tokens % num_positions
    if HAS_PERM:
        source = tl.load(perm_ptr + tokens, mask=token_ok, other=0)
        source_ok = (source >= 0) & (source < num_positions)
        token_ok = token_ok & source_ok
        source = tl.where(source_ok, source, 0)
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


def tuning_bucket(total_tokens: int | torch.SymInt) -> int | torch.SymInt:
    """The GEMM kernels' autotuning key for ``total_tokens`` (``B * N``) patch tokens: the power of two that covers
    it, so that one tuning serves every batch size in a factor of two.

    Keyed on the exact count, the autotuner would run every config again, under a host sync, for each new batch
    size: an epoch's last batch, each evaluation batch size. What decides the best tile and warps is how many
    programs there are for the SMs, which changes little within a factor of two. Symbolic sizes (torch.compile with
    a dynamic batch) pass through unchanged: Inductor tunes the configs itself and never reads the key, and the bit
    arithmetic of a power of two would only add nodes to the graph.
    """
    if isinstance(total_tokens, int):
        return next_power_of_2(max(total_tokens, 1))
    return total_tokens


# The GEMM kernels' autotuning key: the token count's bucket (see tuning_bucket), the GEMM's other sides, and (added
# by the autotuner) the dtype of every tensor argument. token_bucket is a kernel argument that the kernels never
# read, only because triton.autotune keys on arguments by name; it is not specialized (do_not_specialize), so it
# adds no compiled variants.
GEMM_AUTOTUNE_KEY = ["token_bucket", "D", "K"]


def _gemm_configs() -> list[triton.Config]:
    """Tiles tried on the GPU: large ones for Hopper and Ampere tensor cores, small ones as a safe default."""
    if interpreting():
        tiles = dict.fromkeys(("BLOCK_M", "BLOCK_D", "BLOCK_K"), INTERPRETER_TILE)
        return [triton.Config(tiles, num_warps=INTERPRETER_WARPS, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_D": d, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
        for m, d, k, warps, stages in GPU_GEMM_SHAPES
    ]


@triton.jit
def _forward_patch_tile(
    images_ptr, weight_ptr, bias_ptr, pos_ptr, unk_ptr, perm_ptr, mask_ptr, out_ptr, program, total_tokens,
    num_positions, cols, K, D, stride_b, stride_c, stride_h, stride_w, prefix_count, prefix_positions,
    PATCH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_PREFIX: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """A tile of patch tokens: the GEMM of their patches, then bias and ``unk`` or ``pos[Q + n]``. The arguments
    are :func:`_forward_kernel`'s; ``program``: the tile's index along axis 0."""
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
        acc = _dot(patches, w_tile, acc, PRECISION, UPCAST, ROUND)
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


@triton.autotune(configs=_gemm_configs(), key=GEMM_AUTOTUNE_KEY)
@triton.jit(do_not_specialize=["token_bucket"])
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
    cols, K, D,  # patch columns (W / patch), C * patch * patch, channels
    stride_b, stride_c, stride_h, stride_w,  # images'
    prefix_ptr,  # [P, D]: class and register tokens (HAS_PREFIX)
    total_prefix,  # B * P: the prefix rows (HAS_PREFIX)
    prefix_count,  # P (HAS_PREFIX)
    prefix_positions,  # Q: 0 or P (HAS_PREFIX)
    token_bucket,  # tuning_bucket(B * N): the autotuning key, never read
    PATCH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_PREFIX: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Programs along axis 0: first the patch tokens' tiles (GEMM and epilogue), then (HAS_PREFIX) the prefix rows'
    # (no GEMM: prefix + pos). One kind per program, so neither pays the other's registers; the prefix arguments
    # come last, so that without a prefix the kernel compiles as it did before prefix rows.
    if HAS_PREFIX:
        patch_programs = tl.cdiv(total_tokens, BLOCK_M)
        if tl.program_id(0) < patch_programs:
            _forward_patch_tile(
                images_ptr, weight_ptr, bias_ptr, pos_ptr, unk_ptr, perm_ptr, mask_ptr, out_ptr, tl.program_id(0),
                total_tokens, num_positions, cols, K, D, stride_b, stride_c, stride_h, stride_w, prefix_count,
                prefix_positions, PATCH, HAS_BIAS, HAS_PERM, HAS_MASK, HAS_PREFIX, PRECISION, UPCAST, ROUND,
                BLOCK_M, BLOCK_D, BLOCK_K,
            )  # fmt: skip
        else:
            prefix_rows_tile(
                prefix_ptr, pos_ptr, out_ptr, (tl.program_id(0) - patch_programs) * BLOCK_M + tl.arange(0, BLOCK_M),
                tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D), total_prefix, num_positions, prefix_count,
                prefix_positions, D,
            )  # fmt: skip
    else:
        _forward_patch_tile(
            images_ptr, weight_ptr, bias_ptr, pos_ptr, unk_ptr, perm_ptr, mask_ptr, out_ptr, tl.program_id(0),
            total_tokens, num_positions, cols, K, D, stride_b, stride_c, stride_h, stride_w, prefix_count,
            prefix_positions, PATCH, HAS_BIAS, HAS_PERM, HAS_MASK, HAS_PREFIX, PRECISION, UPCAST, ROUND, BLOCK_M,
            BLOCK_D, BLOCK_K,
        )  # fmt: skip


@triton.jit
def _grad_weight_kernel(
    grad_ptr,  # [B, P + N, D]: the output's gradient; only its patch rows are read
    images_ptr,  # [B, C, H, W], any strides
    perm_ptr,  # int64 [B, N] (HAS_PERM)
    inverse_ptr,  # int32 [B, N] (INVERSE): inverse[b, perm[b, n]] = n, the token that shows each patch
    partial_ptr,  # float32 [splits, D, K], written
    total_tokens,  # B * N: the patch tokens
    num_positions,  # N
    cols, K, D,  # patch columns (W / patch), C * patch * patch, channels
    tokens_per_split,
    stride_b, stride_c, stride_h, stride_w,  # images'
    prefix_count,  # P (HAS_PREFIX): rows of each sample of grad before its patch rows
    PATCH: tl.constexpr, HAS_PERM: tl.constexpr, HAS_PREFIX: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    INVERSE: tl.constexpr = False,
):  # fmt: skip
    # dW = sum over tokens t of dY[t]^T A[perm[t]]. The sum's order is free, so with a permutation (INVERSE, HAS_PERM
    # off) the step's index runs over the patches s in their natural order and takes the gradient row of the token
    # that shows s, inverse[s]: the patches' pixels load as without a jigsaw (runs of PATCH pixels of neighbouring
    # patches side by side), and the gather moves to the gradient's rows, D contiguous values each. HAS_PERM instead
    # gathers the patches (any perm, validate=False's included).
    channels = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    k_index = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    split = tl.program_id(2)
    acc = tl.zeros((BLOCK_D, BLOCK_K), dtype=tl.float32)
    first = split * tokens_per_split
    last = tl.minimum(first + tokens_per_split, total_tokens)
    for m_start in range(first, last, BLOCK_M):
        tokens = m_start + tl.arange(0, BLOCK_M)
        token_ok = tokens < last
        if INVERSE:
            shown_by = tl.load(inverse_ptr + tokens, mask=token_ok, other=0)
            # an entry out of range (only a perm that is not a permutation leaves one) reads no gradient row
            grad_ok = token_ok & (shown_by >= 0) & (shown_by < num_positions)
            grad_tokens = tokens - tokens % num_positions + tl.where(grad_ok, shown_by, 0)
        else:
            grad_ok = token_ok
            grad_tokens = tokens
        grad_rows = _patch_rows(grad_tokens, num_positions, prefix_count, HAS_PREFIX)
        grad_t = tl.load(
            grad_ptr + grad_rows[None, :].to(tl.int64) * D + channels[:, None],
            mask=grad_ok[None, :] & (channels[:, None] < D),
            other=0.0,
        )
        address, valid = _patch_addresses(
            images_ptr, perm_ptr, tokens, k_index, num_positions, cols, PATCH, stride_b, stride_c, stride_h,
            stride_w, last, K, HAS_PERM,
        )  # fmt: skip
        patches = tl.load(address, mask=valid, other=0.0)
        acc = _dot(grad_t, patches, acc, PRECISION, UPCAST, ROUND)
    tl.store(
        partial_ptr + split.to(tl.int64) * D * K + channels[:, None].to(tl.int64) * K + k_index[None, :],
        acc,
        mask=(channels[:, None] < D) & (k_index[None, :] < K),
    )


@triton.autotune(configs=_gemm_configs(), key=GEMM_AUTOTUNE_KEY)
@triton.jit(do_not_specialize=["token_bucket"])
def _grad_images_kernel(
    grad_ptr,  # [B, P + N, D]: the output's gradient; only its patch rows are read
    weight_ptr,  # [D, K]
    perm_ptr,  # int64 [B, N] (HAS_PERM)
    grad_images_ptr,  # [B, C, H, W], written
    total_tokens,  # B * N: the patch tokens
    num_positions,  # N
    cols, K, D,  # patch columns (W / patch), C * patch * patch, channels
    stride_b, stride_c, stride_h, stride_w,  # grad_images'
    prefix_count,  # P (HAS_PREFIX): rows of each sample of grad before its patch rows
    token_bucket,  # tuning_bucket(B * N): the autotuning key, never read
    PATCH: tl.constexpr, HAS_PERM: tl.constexpr, HAS_PREFIX: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
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
        acc = _dot(grad, w_tile, acc, PRECISION, UPCAST, ROUND)
    # The token shows the patch at perm: its gradient goes back there. A permutation: no collisions (any other perm:
    # one of the tokens that show a patch wins, see mjp_fast/_validate.py).
    address, valid = _patch_addresses(
        grad_images_ptr, perm_ptr, tokens, k_index, num_positions, cols, PATCH, stride_b, stride_c, stride_h,
        stride_w, total_tokens, K, HAS_PERM,
    )  # fmt: skip
    tl.store(address, acc.to(grad_images_ptr.dtype.element_ty), mask=valid)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


# The weight gradient's software pipelining. With a jigsaw the kernel loads each token's perm entry, then its patch, so
# the pipeliner puts the index load a stage ahead of the patch: at Triton's default 3 stages the gradient tile then
# gets one buffer (no prefetch) and the patches two, against two and three without a perm (sm_90 TTGIR,
# tests/triton/compile_for_gpu.py checks it). On an H100 the perm path took 430 us against 260 us at DeiT-S's batch
# of 256. Five stages give it the same depth: 89 KiB of shared memory at DeiT's tiles with bfloat16 images (about
# 110 KiB with float32 ones), so only where a block may use LARGE_SHARED_MEMORY (the A100's 163 KiB, the H100's 227).
GRAD_WEIGHT_STAGES = 3
GRAD_WEIGHT_PERM_STAGES = 5
LARGE_SHARED_MEMORY = 160 * 1024

# With a perm known to be a permutation, the weight gradient gathers the gradient's rows by the inverse permutation
# and reads the patches in order (issue 39: the H200 timed the patch gather at 454 us against 258 us without a
# jigsaw, DeiT-S at batch 256). False: the patches gathered by perm, as for any perm (bench/bench_kernels.py times
# both in one run).
WEIGHT_GRADIENT_BY_INVERSE = True


def grad_weight_stages(has_perm: bool, device: torch.device) -> int:
    """``num_stages`` of the weight-gradient launch: more with a perm or its inverse (an index loaded before the
    tile it addresses, either way), where the device's shared memory allows."""
    if has_perm and shared_memory_optin(device) >= LARGE_SHARED_MEMORY:
        return GRAD_WEIGHT_PERM_STAGES
    return GRAD_WEIGHT_STAGES


def _grad_weight_tiles(dim: int, k: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_D, BLOCK_K)`` of the weight-gradient kernel (its token axis is split across programs, so
    no autotuning); tl.dot takes no side under 16."""
    block_d = power_of_two_tile(dim, 16, MAX_CHANNEL_TILE)
    return tile_size(64), tile_size(block_d), tile_size(power_of_two_tile(k, 16, 64))


# The images' and weight's dtypes the GEMMs multiply (their tiles accumulate in float32).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_kernel_dtypes(images: torch.Tensor, weight: torch.Tensor) -> None:
    """Refuses images or a weight the GEMM kernels cannot multiply: float64, or no float dtype (uint8 images would be
    multiplied as floats, then the sums truncated to uint8 tokens). tl.dot of two float64 tiles (the forward's, or
    the weight gradient's of float64 images) returns float64, which the float32 accumulator does not hold: the
    interpreter stored each float32 sum in the low half of a float64 slot, the high half left as ``torch.empty``
    found it (issue 42). The timm models send float64 to the ``torch`` backend before this
    (:func:`mjp_fast.ops.patch_embed.patch_embed_step`); this guards the operators themselves. Dtypes only: no sync.
    """
    for name, tensor in (("images", images), ("weight", weight)):
        if tensor.dtype not in KERNEL_DTYPES:
            hint = "; float64 runs on the 'torch' backend (or 'cpu' / 'cuda', the compiled extension's)"
            raise TypeError(
                f"{name}: the triton patch embedding takes float32, float16 or bfloat16, got {tensor.dtype}"
                + (hint if tensor.dtype == torch.float64 else "")
            )


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
    compute_dtype: torch.dtype | None = None,
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
        out_dtype: the output's dtype (default the images').
        compute_dtype: the dtype the GEMM multiplies in (default: the images' and weight's, see :func:`_mixing`).
            bfloat16 or float16 under autocast: the images and weight may be float32, each tile is rounded to it as
            it is loaded (autocast's casts, fused into the loads).
        traced: launch through ``torch.library.wrap_triton`` (inside the torch operator).

    ``out[b, t] = prefix[t] + (pos[t] if t < Q else 0)`` for ``t < P``; ``out[b, P + n] = patch(b, perm[b, n]) @
    W^T + bias + (unk if mask[b, n] else pos[Q + n])``, summed in float32 and rounded once.
    """
    check_kernel_dtypes(images, weight)
    batch, patch = images.shape[0], weight.shape[2]
    num_positions, cols, k, dim = _patch_sizes(images, weight)
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
        rows = cdiv(total, meta["BLOCK_M"]) + cdiv(total_prefix, meta["BLOCK_M"])
        return (rows, cdiv(dim, meta["BLOCK_D"]))

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
        tuning_bucket(total),
        PATCH=patch,
        HAS_BIAS=bias is not None,
        HAS_PERM=perm is not None,
        HAS_MASK=mask is not None,
        HAS_PREFIX=prefix_count > 0,
        PRECISION=dot_precision(compute_dtype or images.dtype),
        **_dot_flags(images.dtype, weight.dtype, compute=compute_dtype),
    )
    return out


def _dot_flags(first: torch.dtype, second: torch.dtype, **mixing) -> dict[str, int]:
    """:func:`_dot`'s ``UPCAST`` and ``ROUND`` for a launch (:func:`_mixing`'s arguments)."""
    upcast, rounding = _mixing(first, second, **mixing)
    return {"UPCAST": upcast, "ROUND": rounding}


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
    pos_shape: list[int],
    prefix_shape: list[int],
    pos_dtype: torch.dtype | None = None,
    unk_dtype: torch.dtype | None = None,
    prefix_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
    permutation: bool = False,
    *,
    traced: bool = False,
) -> list[torch.Tensor]:  # the operator's schema (its outputs are all tensors); an eager call's may hold None
    """``[grad_images, grad_weight, grad_bias, grad_pos, grad_unk, grad_prefix]``: where not asked for, None (an
    eager call) or an empty ``[0]`` tensor (the operator's, ``traced``); else in the shape of the input
    (``pos_shape``, ``prefix_shape``: the forward's table and prefix) and in the dtype of images (grad_images), of
    weight (grad_weight, grad_bias), or ``pos_dtype``, ``unk_dtype``, ``prefix_dtype`` (default weight's): a
    float32 table under autocast gets its float32 gradient, no cast after. ``compute_dtype``: the forward's (the
    GEMMs round their tiles to it, see :func:`_mixing`). ``permutation``: each row of ``perm`` is known to be a
    permutation (a validated jigsaw, or a sampler's): then the weight gradient reads the patches in their natural
    order and gathers the gradient's rows by the inverse permutation, which the position gradient's pass writes
    (see :func:`_grad_weight_kernel`); that needs the pass (a position, unk, bias or prefix gradient asked for),
    else the weight gradient gathers the patches as for any perm.

    grad_out ``[B, P + N, D]``. The weight, bias and image gradients come from the patch rows only; grad_pos's
    rows and grad_prefix from the same one pass over grad_out (:func:`launch_position_gradient`).
    """
    check_kernel_dtypes(images, weight)
    batch = images.shape[0]
    num_positions, _, _, dim = _patch_sizes(images, weight)
    if tuple(grad_out.shape) != (batch, prefix_count + num_positions, dim):
        raise ValueError(
            f"grad_out must be [B, P + N, D] = {[batch, prefix_count + num_positions, dim]}, got {list(grad_out.shape)}"
        )
    grad_out = grad_out.contiguous()
    weight = weight.contiguous()
    grads: list[torch.Tensor | None] = [None] * 6
    if need_images:
        grads[0] = _grad_images_launch(grad_out, weight, perm, images, prefix_count, compute_dtype, traced)
    position_pass = need_bias or need_pos or need_unk or need_prefix
    inverse = None
    if WEIGHT_GRADIENT_BY_INVERSE and permutation and perm is not None and need_weight and position_pass and dim > 0:
        # a scratch buffer: no allocation per step (its contract, every element written before it is read, holds for
        # a permutation: the pass writes every entry)
        inverse = scratch("inverse permutation", tuple(perm.shape), images.device, traced, torch.int32)
    if position_pass:  # first: its pass writes the inverse that the weight gradient reads
        _, grad_pos, grad_unk, grad_bias, grad_prefix = launch_position_gradient(
            grad_out,
            mask,
            perm if inverse is not None else None,
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
            inverse=inverse,
        )
        for index, (need, grad) in enumerate(
            ((need_bias, grad_bias), (need_pos, grad_pos), (need_unk, grad_unk), (need_prefix, grad_prefix)), 2
        ):
            if need:
                grads[index] = grad
    if need_weight:
        grads[1] = _grad_weight_launch(
            grad_out, images, perm, weight, prefix_count, compute_dtype, traced, inverse=inverse
        )
    if not traced:  # an eager call (the training step's): no allocation for the images' gradient, not asked for
        return grads
    # the operator's: an empty tensor of its own for each gradient not asked for (its outputs may not alias)
    return [grad if grad is not None else grad_out.new_empty(0) for grad in grads]


def _patch_sizes(images: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int, int]:
    """``(N, cols, K, D)`` of a patch embedding of ``images [B, C, H, W]`` with ``weight [D, C, patch, patch]``:
    patches per image, per row, and values per patch."""
    _, channels, height, width = images.shape
    dim, _, patch, _ = weight.shape
    return (height // patch) * (width // patch), width // patch, channels * patch * patch, dim


def _grad_images_launch(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    perm: torch.Tensor | None,
    images: torch.Tensor,
    prefix_count: int,
    compute_dtype: torch.dtype | None,
    traced: bool,
) -> torch.Tensor:
    """``grad_images [B, C, H, W]`` in images' dtype: ``grad_out``'s patch rows ``@ weight``, each moved back to its
    patch (one launch; zeros without a patch). ``grad_out`` ``[B, P + N, D]`` and ``weight`` contiguous."""
    num_positions, cols, k, dim = _patch_sizes(images, weight)
    total = images.shape[0] * num_positions
    # With a perm, zeros first: a perm that is not a permutation (validate=False) may leave a patch that no token
    # shows. (The image gradient is off the training path: images need no gradient there.)
    make = torch.zeros if perm is not None else torch.empty
    grad_images = make(images.shape, dtype=images.dtype, device=images.device)
    if total:

        def grid(meta):
            return (cdiv(total, meta["BLOCK_M"]), cdiv(k, meta["BLOCK_K"]))

        launcher(_grad_images_kernel, grid, traced)(
            grad_out,
            weight,
            perm if perm is not None else grad_out,  # absent: never read
            grad_images,
            total,
            num_positions,
            cols,
            k,
            dim,
            *_image_strides(grad_images),
            prefix_count,
            tuning_bucket(total),
            PATCH=weight.shape[2],
            HAS_PERM=perm is not None,
            HAS_PREFIX=prefix_count > 0,
            PRECISION=dot_precision(compute_dtype or images.dtype),
            **_dot_flags(grad_out.dtype, weight.dtype, gradient=True, compute=compute_dtype),
        )
    elif perm is None:
        grad_images.zero_()  # no patch: nothing to launch
    return grad_images


def _grad_weight_launch(
    grad_out: torch.Tensor,
    images: torch.Tensor,
    perm: torch.Tensor | None,
    weight: torch.Tensor,
    prefix_count: int,
    compute_dtype: torch.dtype | None,
    traced: bool,
    inverse: torch.Tensor | None = None,
) -> torch.Tensor:
    """``grad_weight`` in weight's shape and dtype: the patches ``^T @`` grad_out's patch rows, one launch whose
    token axis is split across programs into float32 partials, summed after (zeros without a patch). ``inverse``:
    int32 ``[B, N]``, ``perm``'s inverse (``perm`` a permutation): the patches read in order, the gradient's rows
    gathered (see :func:`_grad_weight_kernel`); None: the patches gathered by ``perm``."""
    num_positions, cols, k, dim = _patch_sizes(images, weight)
    total = images.shape[0] * num_positions
    block_m, block_d, block_k = _grad_weight_tiles(dim, k)
    tiles = cdiv(dim, block_d) * cdiv(k, block_k)
    # Enough splits of the token axis to fill the GPU about four times over, in whole tiles of tokens.
    programs_wanted = 1 if interpreting() else 4 * multiprocessors(images.device)
    splits = max(1, min(cdiv(total, block_m), programs_wanted // max(tiles, 1)))
    # At least one tile of tokens per split: an empty batch (B = 0) has no tokens at all.
    tokens_per_split = max(block_m, cdiv(cdiv(total, splits), block_m) * block_m)
    splits = max(1, cdiv(total, tokens_per_split))
    # [splits, D, C, p, p]: the kernel writes [splits, D, K], and the sum over splits has weight's shape (no view)
    partial = scratch("weight gradient partials", (splits, *weight.shape), images.device, traced)
    if total:
        launcher(_grad_weight_kernel, (cdiv(dim, block_d), cdiv(k, block_k), splits), traced)(
            grad_out,
            images,
            perm if perm is not None and inverse is None else grad_out,  # absent: never read
            inverse if inverse is not None else grad_out,
            partial,
            total,
            num_positions,
            cols,
            k,
            dim,
            tokens_per_split,
            *_image_strides(images),
            prefix_count,
            PATCH=weight.shape[2],
            HAS_PERM=perm is not None and inverse is None,
            HAS_PREFIX=prefix_count > 0,
            PRECISION=dot_precision(compute_dtype or images.dtype),
            **_dot_flags(grad_out.dtype, images.dtype, gradient=True, compute=compute_dtype),
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            BLOCK_K=block_k,
            INVERSE=inverse is not None,
            num_stages=grad_weight_stages(perm is not None, images.device),
        )
    else:
        partial.zero_()
    return partial.sum(0).to(weight.dtype)  # no cast for a float32 weight (autocast's)


# ----------------------------------------------------------------------------------------------------------------
# Operators
# ----------------------------------------------------------------------------------------------------------------


def _patch_embed_forward_fake(images, weight, prefix, out_dtype, **_):
    batch, _, height, width = images.shape
    dim, _, patch, _ = weight.shape
    rows = prefix_rows(prefix, dim) + (height // patch) * (width // patch)
    return images.new_empty(batch, rows, dim, dtype=out_dtype or images.dtype)


def _patch_embed_backward_fake(
    grad_out, images, weight, need_images, need_weight, need_bias, need_pos, need_unk, need_prefix, prefix_count,
    pos_shape, prefix_shape, pos_dtype, unk_dtype, prefix_dtype, **_,
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


# The operators over the launchers (their schemas come from the launchers' signatures): tokens ``[B, P + N, D]``;
# ``[grad_images, grad_weight, grad_bias, grad_pos, grad_unk, grad_prefix]``. The forward's callers pass the prefix
# and Q always: no defaults for them in the operator.
patch_embed_forward_triton = define_operator(
    "mjp_fast::patch_embed_triton",
    patch_embed_forward_launch,
    fake=_patch_embed_forward_fake,
    required=("prefix", "prefix_positions"),
)
patch_embed_backward_triton = define_operator(
    "mjp_fast::patch_embed_triton_backward", patch_embed_backward_launch, fake=_patch_embed_backward_fake
)
