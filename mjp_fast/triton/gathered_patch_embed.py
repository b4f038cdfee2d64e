"""Triton kernels of the gathered patch embedding (pre-patchified input, NaFlex's), forward and backward.

Row layout: each sample's output has ``T = P + N`` rows of ``D`` channels. The first ``P`` are the prefix tokens
(class and register tokens), ``out[b, t] = prefix[t]`` with no position term (NaFlex adds none there); then the ``N``
patch tokens, ``out[b, P + n] = W @ patches[b, perm[b, n]] + bias + (unk if mask[b, n] else pos[b, n])``. ``pos``
is ``[B, N, D]`` (a position term of each sample's own) or ``[N, D]`` shared by the batch (read with a batch stride
of 0). Sums in float32, rounded once.

The patch tokens are the rows of a GEMM ``[B*N, K] @ [K, D]``. The left operand's rows are gathered as they are
loaded (``patches[b, perm[b, n]]``: ``K`` contiguous values each, so a gather costs no more than the plain load), and
the epilogue adds the bias and ``unk``-or-``pos[b, n]``. The same launch writes the prefix rows in programs of their
own after the GEMM's, so the kernel writes the whole ``[B, T, D]`` output (no ``cat`` after it).

Backward, only what is asked for:

- patches: ``dA = dY @ W`` over the patch rows, each row stored to the row it was gathered from. ``perm`` permutes
  each sample's rows, so every row is written exactly once: no atomics, no inverse needed (a perm that is not known
  to be a permutation gets its gradient zero-filled first, and a row that several tokens show one token's gradient).
- weight: ``dW = dY^T @ A``, ``A`` re-gathered from ``patches`` (nothing of size ``B*N*K`` is saved); the token axis
  split across programs into float32 partials, summed in a fixed order after. The gather is by rows here (``K``
  contiguous values), so reading ``A`` through ``perm`` is as cheap as reading it in order: unlike the image
  embedding's (whose patches are ``P``-pixel runs), the inverse permutation would buy nothing.
- pos, unk, bias: for a shared ``[N, D]`` term, the position gradient of ``mjp_fast/triton/common.py`` (one pass over
  ``dY``, partial sums per batch chunk); for a per-sample ``[B, N, D]`` term, :func:`_sample_position_kernel`: one pass
  that writes ``grad_pos = where(mask, 0, dY)`` and float32 partial sums of ``unk`` (masked rows) and ``bias`` (all
  patch rows) per program, summed after in a fixed order. Deterministic either way. The prefix's gradient is the sum
  of its ``B * P`` rows over the batch (torch: a few rows).

Each launcher is a plain function (``*_launch``) that eager callers use directly, and a torch operator over it that
launches through ``torch.library.wrap_triton`` (torch.compile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mjp_fast.triton.common import (
    INTERPRETER_TILE,
    INTERPRETER_WARPS,
    MAX_CHANNEL_TILE,
    ROW_TILE,
    cdiv,
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
    scratch,
    tile_size,
)

# The dtypes the GEMMs multiply (tiles accumulate in float32); float64 runs on the torch backend.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# (BLOCK_M, BLOCK_D, BLOCK_K, num_warps, num_stages) tried by the forward's and the patches' gradient's autotuning on
# a GPU: the image embedding's tiles (mjp_fast/triton/patch_embed.py), whose GEMM has the same sides.
GPU_GEMM_SHAPES = (
    (128, 128, 64, 8, 3),
    (128, 128, 32, 4, 4),
    (128, 64, 32, 4, 4),
    (64, 128, 32, 4, 4),
    (64, 64, 32, 4, 3),
)

# Autotuning key: the token count's power-of-two bucket (one tuning per factor of two of B * N, not per batch size),
# and the GEMM's other sides; token_bucket is never read by the kernels.
GEMM_AUTOTUNE_KEY = ["token_bucket", "D", "K"]

# Patch rows per program of the per-sample position gradient on a GPU: its float32 partials (two rows of D per
# program) then cost 2 * 4 / (ROWS * itemsize) of the gradient's read, under 2% for bfloat16.
SAMPLE_POSITION_ROWS = 256


def _gemm_configs() -> list[triton.Config]:
    if interpreting():
        tiles = dict.fromkeys(("BLOCK_M", "BLOCK_D", "BLOCK_K"), INTERPRETER_TILE)
        return [triton.Config(tiles, num_warps=INTERPRETER_WARPS, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_D": d, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
        for m, d, k, warps, stages in GPU_GEMM_SHAPES
    ]


def tuning_bucket(total_tokens: int | torch.SymInt) -> int | torch.SymInt:
    """The autotuning key of ``total_tokens`` (``B * N``): the power of two that covers it (symbolic sizes pass
    through: Inductor tunes on its own)."""
    if isinstance(total_tokens, int):
        return next_power_of_2(max(total_tokens, 1))
    return total_tokens


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # One return after the branch: a return inside a constexpr `if` still compiles the statements after it.
    if UPCAST:  # mixed operand dtypes, or bfloat16 in the interpreter (which multiplies it wrongly)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _source_rows(perm_ptr, tokens, total_tokens, num_positions, HAS_PERM: tl.constexpr):
    """``(sample, position, source, ok)`` of the flat patch tokens ``tokens`` (of ``B * N``): the row of ``patches``
    each shows (``perm[b, n]``, or ``n``). A perm entry outside ``[0, N)`` (only with ``validate=False``) shows no row:
    ``ok`` is False there (a zero patch, no gradient) and its source clamped to 0, so no access leaves the sample."""
    token_ok = tokens < total_tokens
    sample = tokens // num_positions
    position = tokens % num_positions
    if HAS_PERM:
        source = tl.load(perm_ptr + tokens, mask=token_ok, other=0)
        source_ok = (source >= 0) & (source < num_positions)
        ok = token_ok & source_ok
        source = tl.where(source_ok, source, 0)
    else:
        source = position
        ok = token_ok
    return sample, position, source, ok


@triton.jit
def _output_rows(tokens, num_positions, prefix_count, HAS_PREFIX: tl.constexpr):
    """The rows of ``[B, P + N, D]`` of the flat patch tokens ``tokens``: ``b * (P + N) + P + n``."""
    if HAS_PREFIX:
        rows = tokens + (tokens // num_positions + 1) * prefix_count
    else:
        rows = tokens
    return rows


@triton.jit
def _forward_patch_tile(
    patches_ptr, weight_ptr, bias_ptr, pos_ptr, unk_ptr, perm_ptr, mask_ptr, out_ptr, program, total_tokens,
    num_positions, K, D, stride_pb, stride_pn, stride_pk, stride_pos_b, prefix_count,
    HAS_BIAS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    tokens = program * BLOCK_M + tl.arange(0, BLOCK_M)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    sample, position, source, row_ok = _source_rows(perm_ptr, tokens, total_tokens, num_positions, HAS_PERM)
    row_start = patches_ptr + sample.to(tl.int64) * stride_pb + source.to(tl.int64) * stride_pn
    channel_ok = channels < D
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_index = k_start + tl.arange(0, BLOCK_K)
        k_ok = k_index < K
        rows = tl.load(
            row_start[:, None] + k_index[None, :].to(tl.int64) * stride_pk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        # weight is [D, K] row-major: this tile is its transpose [BLOCK_K, BLOCK_D]
        w_tile = tl.load(
            weight_ptr + channels[None, :].to(tl.int64) * K + k_index[:, None],
            mask=k_ok[:, None] & channel_ok[None, :],
            other=0.0,
        )
        acc = _dot(rows, w_tile, acc, PRECISION, UPCAST)
    token_ok = tokens < total_tokens
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)[None, :]
    pos = tl.load(
        pos_ptr + (sample.to(tl.int64) * stride_pos_b + position.to(tl.int64) * D)[:, None] + channels[None, :],
        mask=token_ok[:, None] & channel_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    if HAS_MASK:
        masked = tl.load(mask_ptr + tokens, mask=token_ok, other=0).to(tl.int1)
        unk = tl.load(unk_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)
        pos = tl.where(masked[:, None], unk[None, :], pos)
    acc += pos
    out_rows = _output_rows(tokens, num_positions, prefix_count, HAS_PREFIX)
    tl.store(
        out_ptr + out_rows[:, None].to(tl.int64) * D + channels[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=token_ok[:, None] & channel_ok[None, :],
    )


@triton.jit
def _prefix_tile(prefix_ptr, out_ptr, program, total_prefix, num_positions, prefix_count, D, BLOCK_M: tl.constexpr,
                 BLOCK_D: tl.constexpr):  # fmt: skip
    """Prefix rows ``out[b, t] = prefix[t]`` for flat indices of ``B * P``."""
    rows = program * BLOCK_M + tl.arange(0, BLOCK_M)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (rows < total_prefix)[:, None] & (channels < D)[None, :]
    token = rows % prefix_count
    values = tl.load(prefix_ptr + token[:, None].to(tl.int64) * D + channels[None, :], mask=ok, other=0.0)
    out_rows = (rows // prefix_count) * (prefix_count + num_positions) + token
    tl.store(
        out_ptr + out_rows[:, None].to(tl.int64) * D + channels[None, :], values.to(out_ptr.dtype.element_ty), mask=ok
    )


@triton.autotune(configs=_gemm_configs(), key=GEMM_AUTOTUNE_KEY)
@triton.jit(do_not_specialize=["token_bucket"])
def _forward_kernel(
    patches_ptr,  # [B, N, K], any strides
    weight_ptr,  # [D, K], contiguous
    bias_ptr,  # [D] (HAS_BIAS)
    pos_ptr,  # [B, N, D] (stride_pos_b = N * D) or [N, D] (stride_pos_b = 0), last two dims contiguous
    unk_ptr,  # [D] (HAS_MASK)
    perm_ptr,  # int64 [B, N] (HAS_PERM)
    mask_ptr,  # bool [B, N] (HAS_MASK)
    out_ptr,  # [B, P + N, D]
    total_tokens,  # B * N
    num_positions,  # N
    K, D,
    stride_pb, stride_pn, stride_pk,  # patches'
    stride_pos_b,  # pos's batch stride: N * D, or 0 for a shared term
    prefix_ptr,  # [P, D] (HAS_PREFIX)
    total_prefix,  # B * P (HAS_PREFIX)
    prefix_count,  # P (HAS_PREFIX)
    token_bucket,  # tuning_bucket(B * N): the autotuning key, never read
    HAS_BIAS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Programs along axis 0: the patch tokens' tiles (GEMM and epilogue), then (HAS_PREFIX) the prefix rows' (a copy):
    # one kind per program, so the copy pays nothing of the GEMM's registers.
    if HAS_PREFIX:
        patch_programs = tl.cdiv(total_tokens, BLOCK_M)
        if tl.program_id(0) < patch_programs:
            _forward_patch_tile(
                patches_ptr, weight_ptr, bias_ptr, pos_ptr, unk_ptr, perm_ptr, mask_ptr, out_ptr, tl.program_id(0),
                total_tokens, num_positions, K, D, stride_pb, stride_pn, stride_pk, stride_pos_b, prefix_count,
                HAS_BIAS, HAS_PERM, HAS_MASK, HAS_PREFIX, PRECISION, UPCAST, BLOCK_M, BLOCK_D, BLOCK_K,
            )  # fmt: skip
        else:
            _prefix_tile(
                prefix_ptr, out_ptr, tl.program_id(0) - patch_programs, total_prefix, num_positions, prefix_count, D,
                BLOCK_M, BLOCK_D,
            )  # fmt: skip
    else:
        _forward_patch_tile(
            patches_ptr, weight_ptr, bias_ptr, pos_ptr, unk_ptr, perm_ptr, mask_ptr, out_ptr, tl.program_id(0),
            total_tokens, num_positions, K, D, stride_pb, stride_pn, stride_pk, stride_pos_b, prefix_count, HAS_BIAS,
            HAS_PERM, HAS_MASK, HAS_PREFIX, PRECISION, UPCAST, BLOCK_M, BLOCK_D, BLOCK_K,
        )  # fmt: skip


@triton.autotune(configs=_gemm_configs(), key=GEMM_AUTOTUNE_KEY)
@triton.jit(do_not_specialize=["token_bucket"])
def _grad_patches_kernel(
    grad_ptr,  # [B, P + N, D], contiguous: only its patch rows are read
    weight_ptr,  # [D, K], contiguous
    perm_ptr,  # int64 [B, N] (HAS_PERM)
    grad_patches_ptr,  # [B, N, K], contiguous, written
    total_tokens,  # B * N
    num_positions,  # N
    K, D,
    prefix_count,  # P (HAS_PREFIX)
    token_bucket,  # the autotuning key, never read
    HAS_PERM: tl.constexpr, HAS_PREFIX: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_index = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    token_ok = tokens < total_tokens
    grad_rows = _output_rows(tokens, num_positions, prefix_count, HAS_PREFIX)
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
    # The token shows row perm[b, n]: its gradient goes back there (a permutation: each row written once).
    sample, _, source, row_ok = _source_rows(perm_ptr, tokens, total_tokens, num_positions, HAS_PERM)
    target = (sample.to(tl.int64) * num_positions + source) * K
    tl.store(
        grad_patches_ptr + target[:, None] + k_index[None, :],
        acc.to(grad_patches_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (k_index[None, :] < K),
    )


@triton.jit
def _grad_weight_kernel(
    grad_ptr,  # [B, P + N, D], contiguous: only its patch rows are read
    patches_ptr,  # [B, N, K], any strides
    perm_ptr,  # int64 [B, N] (HAS_PERM)
    partial_ptr,  # float32 [splits, D, K], written
    total_tokens,  # B * N
    num_positions,  # N
    K, D,
    tokens_per_split,
    stride_pb, stride_pn, stride_pk,  # patches'
    prefix_count,  # P (HAS_PREFIX)
    HAS_PERM: tl.constexpr, HAS_PREFIX: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # dW = sum over tokens t of dY[t]^T A[perm[t]]: this program's split of the tokens, into its own partial.
    channels = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    k_index = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    split = tl.program_id(2)
    acc = tl.zeros((BLOCK_D, BLOCK_K), dtype=tl.float32)
    first = split * tokens_per_split
    last = tl.minimum(first + tokens_per_split, total_tokens)
    for m_start in range(first, last, BLOCK_M):
        tokens = m_start + tl.arange(0, BLOCK_M)
        token_ok = tokens < last
        grad_rows = _output_rows(tokens, num_positions, prefix_count, HAS_PREFIX)
        grad_t = tl.load(
            grad_ptr + grad_rows[None, :].to(tl.int64) * D + channels[:, None],
            mask=token_ok[None, :] & (channels[:, None] < D),
            other=0.0,
        )
        sample, _, source, row_ok = _source_rows(perm_ptr, tokens, last, num_positions, HAS_PERM)
        rows = tl.load(
            patches_ptr
            + (sample.to(tl.int64) * stride_pb + source.to(tl.int64) * stride_pn)[:, None]
            + k_index[None, :].to(tl.int64) * stride_pk,
            mask=row_ok[:, None] & (k_index[None, :] < K),
            other=0.0,
        )
        acc = _dot(grad_t, rows, acc, PRECISION, UPCAST)
    tl.store(
        partial_ptr + split.to(tl.int64) * D * K + channels[:, None].to(tl.int64) * K + k_index[None, :],
        acc,
        mask=(channels[:, None] < D) & (k_index[None, :] < K),
    )


@triton.jit
def _sample_position_kernel(
    grad_ptr,  # [B, P + N, D], contiguous: only its patch rows are read
    mask_ptr,  # bool [B, N] (HAS_MASK)
    grad_pos_ptr,  # [B, N, D], written (WRITE_POS)
    partial_ptr,  # float32 [2, programs, D]: row 0 the masked rows' sums (unk), row 1 all rows' (bias)
    total_tokens,  # B * N
    num_positions,  # N
    D,
    rows_per_program,  # a multiple of BLOCK_R
    prefix_count,  # P (HAS_PREFIX)
    HAS_MASK: tl.constexpr, HAS_PREFIX: tl.constexpr, WRITE_POS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One pass over the patch rows of dY: grad_pos = where(mask, 0, dY) (a per-sample term: no sum over the batch),
    # and this program's float32 sums of dY over its masked rows and over all its rows, written to its own partial.
    program = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel_ok = channels < D
    masked_sum = tl.zeros((BLOCK_D,), dtype=tl.float32)
    all_sum = tl.zeros((BLOCK_D,), dtype=tl.float32)
    first = program * rows_per_program
    last = tl.minimum(first + rows_per_program, total_tokens)
    for start in range(first, last, BLOCK_R):
        tokens = start + tl.arange(0, BLOCK_R)
        token_ok = tokens < last
        ok = token_ok[:, None] & channel_ok[None, :]
        grad_rows = _output_rows(tokens, num_positions, prefix_count, HAS_PREFIX)
        grad = tl.load(grad_ptr + grad_rows[:, None].to(tl.int64) * D + channels[None, :], mask=ok, other=0.0)
        values = grad.to(tl.float32)
        all_sum += tl.sum(values, axis=0)
        if HAS_MASK:
            masked = tl.load(mask_ptr + tokens, mask=token_ok, other=0).to(tl.int1)
            masked_sum += tl.sum(tl.where(masked[:, None], values, 0.0), axis=0)
            kept = tl.where(masked[:, None], 0.0, values)
        else:
            kept = values
        if WRITE_POS:
            tl.store(
                grad_pos_ptr + tokens[:, None].to(tl.int64) * D + channels[None, :],
                kept.to(grad_pos_ptr.dtype.element_ty),
                mask=ok,
            )
    programs = tl.num_programs(0)
    tl.store(partial_ptr + program.to(tl.int64) * D + channels, masked_sum, mask=channel_ok)
    tl.store(partial_ptr + (programs + program).to(tl.int64) * D + channels, all_sum, mask=channel_ok)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def check_kernel_dtypes(patches: torch.Tensor, weight: torch.Tensor) -> None:
    """Refuses patches or a weight the GEMM kernels cannot multiply (float64: tl.dot's float32 accumulator does not
    hold it; no float dtype). Dtypes only: no sync."""
    for name, tensor in (("patches", patches), ("weight", weight)):
        if tensor.dtype not in KERNEL_DTYPES:
            hint = "; float64 runs on the 'torch' backend" if tensor.dtype == torch.float64 else ""
            raise TypeError(
                f"{name}: the triton gathered patch embedding takes float32, float16 or bfloat16, got {tensor.dtype}"
                + hint
            )


def _dot_flags(first: torch.dtype, second: torch.dtype) -> dict[str, object]:
    return {"PRECISION": dot_precision(second), "UPCAST": dot_upcast(first, second)}


def _position_batch_stride(pos: torch.Tensor, batch: int, num_positions: int, dim: int) -> int:
    """``pos``'s batch stride for the kernel: ``N * D`` for a per-sample ``[B, N, D]`` term, 0 for a shared ``[N, D]``
    (or ``[1, N, D]``) one."""
    if pos.dim() == 3 and pos.shape[0] == batch and batch > 1:
        return num_positions * dim
    return 0


def gathered_patch_embed_forward_launch(
    patches: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos: torch.Tensor,
    unk_embed: torch.Tensor | None,
    perm: torch.Tensor | None,
    mask: torch.Tensor | None,
    prefix: torch.Tensor | None = None,
    *,
    traced: bool = False,
) -> torch.Tensor:
    """The token sequence ``[B, P + N, D]`` in ``patches``' dtype, prefix rows included: one launch.

    Args:
        patches: ``[B, N, K]``, any strides.
        weight: ``[D, K]`` (``nn.Linear``'s).
        bias: ``[D]`` or None.
        pos: ``[B, N, D]`` (each sample's) or ``[N, D]`` / ``[1, N, D]`` (the batch's), contiguous.
        unk_embed: ``[D]``, read where ``mask`` is True (None without a mask).
        perm, mask: int64 and bool ``[B, N]``, contiguous, or None (no move, no masking).
        prefix: ``P * D`` elements (``[1, P, D]``), contiguous, or None.
        traced: launch through ``torch.library.wrap_triton`` (inside the torch operator).

    The position terms, bias, unk and prefix may have their own dtypes: they are added in float32.
    """
    check_kernel_dtypes(patches, weight)
    batch, num_positions, k = patches.shape
    dim = weight.shape[0]
    prefix_count = prefix_rows(prefix, dim)
    total, total_prefix = batch * num_positions, batch * prefix_count
    out = torch.empty(batch, prefix_count + num_positions, dim, dtype=patches.dtype, device=patches.device)
    if total + total_prefix == 0 or dim == 0:
        return out
    weight = weight.contiguous()
    dummy = pos  # for absent inputs: never read

    def grid(meta):
        rows = cdiv(total, meta["BLOCK_M"]) + cdiv(total_prefix, meta["BLOCK_M"])
        return (rows, cdiv(dim, meta["BLOCK_D"]))

    launcher(_forward_kernel, grid, traced)(
        patches,
        weight,
        bias if bias is not None else dummy,
        pos,
        unk_embed if unk_embed is not None else dummy,
        perm if perm is not None else dummy,
        mask if mask is not None else dummy,
        out,
        total,
        num_positions,
        k,
        dim,
        *patches.stride(),
        _position_batch_stride(pos, batch, num_positions, dim),
        prefix if prefix is not None else dummy,
        total_prefix,
        prefix_count,
        tuning_bucket(total),
        HAS_BIAS=bias is not None,
        HAS_PERM=perm is not None,
        HAS_MASK=mask is not None,
        HAS_PREFIX=prefix_count > 0,
        **_dot_flags(patches.dtype, weight.dtype),
    )
    return out


def gathered_patch_embed_backward_launch(
    grad_out: torch.Tensor,
    patches: torch.Tensor,
    weight: torch.Tensor,
    perm: torch.Tensor | None,
    mask: torch.Tensor | None,
    need_patches: bool,
    need_weight: bool,
    need_bias: bool,
    need_pos: bool,
    need_unk: bool,
    need_prefix: bool,
    prefix_count: int,
    pos_shape: list[int],
    prefix_shape: list[int],
    pos_dtype: torch.dtype | None = None,
    unk_dtype: torch.dtype | None = None,
    prefix_dtype: torch.dtype | None = None,
    permutation: bool = False,
    *,
    traced: bool = False,
) -> list[torch.Tensor]:  # the operator's schema (all tensors); an eager call's may hold None
    """``[grad_patches, grad_weight, grad_bias, grad_pos, grad_unk, grad_prefix]``: where not asked for, None (an
    eager call) or an empty ``[0]`` tensor (the operator's, ``traced``); else in their inputs' shapes (``pos_shape``,
    ``prefix_shape``: the forward's term and prefix) and dtypes (``patches``' for grad_patches, ``weight``'s for
    grad_weight and grad_bias, ``pos_dtype``, ``unk_dtype``, ``prefix_dtype``, default weight's).

    ``grad_out`` ``[B, P + N, D]``. ``permutation``: each row of ``perm`` is known to be a permutation, so the
    patches' gradient writes every row once and needs no zero fill first.
    """
    check_kernel_dtypes(patches, weight)
    batch, num_positions, k = patches.shape
    dim = weight.shape[0]
    if tuple(grad_out.shape) != (batch, prefix_count + num_positions, dim):
        raise ValueError(
            f"grad_out must be [B, P + N, D] = {[batch, prefix_count + num_positions, dim]}, got {list(grad_out.shape)}"
        )
    grad_out = grad_out.contiguous()
    weight = weight.contiguous()
    grads: list[torch.Tensor | None] = [None] * 6
    if need_patches:
        grads[0] = _grad_patches_launch(grad_out, weight, perm, patches, prefix_count, permutation, traced)
    if need_weight:
        grads[1] = _grad_weight_launch(grad_out, patches, perm, weight, prefix_count, traced)
    pos_dtype, unk_dtype = pos_dtype or weight.dtype, unk_dtype or weight.dtype
    if need_bias or need_pos or need_unk:
        per_sample = len(pos_shape) == 3 and pos_shape[0] == batch and batch > 1
        if per_sample:
            grad_pos, grad_unk, grad_bias = _sample_position_launch(
                grad_out, mask, prefix_count, pos_shape, pos_dtype if need_pos else None, unk_dtype, weight.dtype,
                traced,
            )  # fmt: skip
        else:
            _, grad_pos, grad_unk, grad_bias, _ = launch_position_gradient(
                grad_out,
                mask,
                None,
                tokens_dtype=None,
                pos_dtype=pos_dtype,
                unk_dtype=unk_dtype,
                bias_dtype=weight.dtype if need_bias else None,
                prefix_count=prefix_count,
                prefix_positions=0,  # NaFlex: no position row for the prefix tokens
                pos_shape=pos_shape,
                traced=traced,
            )
        grads[2] = grad_bias if need_bias else None
        grads[3] = grad_pos if need_pos else None
        grads[4] = grad_unk if need_unk else None
    if need_prefix and prefix_count:
        prefix_grad = grad_out[:, :prefix_count].sum(0, dtype=torch.float32)
        grads[5] = prefix_grad.to(prefix_dtype or weight.dtype).reshape(prefix_shape)
    if not traced:
        return grads
    return [grad if grad is not None else grad_out.new_empty(0) for grad in grads]


def _grad_patches_launch(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    perm: torch.Tensor | None,
    patches: torch.Tensor,
    prefix_count: int,
    permutation: bool,
    traced: bool,
) -> torch.Tensor:
    """``grad_patches [B, N, K]`` (contiguous, patches' dtype): each patch row's ``dY @ W`` stored to the row it was
    gathered from. Zero-filled first where ``perm`` is not known to be a permutation (a row no token shows)."""
    batch, num_positions, k = patches.shape
    dim = weight.shape[0]
    total = batch * num_positions
    make = torch.zeros if (perm is not None and not permutation) or dim == 0 else torch.empty
    grad_patches = make((batch, num_positions, k), dtype=patches.dtype, device=patches.device)
    if total and k and dim:

        def grid(meta):
            return (cdiv(total, meta["BLOCK_M"]), cdiv(k, meta["BLOCK_K"]))

        launcher(_grad_patches_kernel, grid, traced)(
            grad_out,
            weight,
            perm if perm is not None else grad_out,  # absent: never read
            grad_patches,
            total,
            num_positions,
            k,
            dim,
            prefix_count,
            tuning_bucket(total),
            HAS_PERM=perm is not None,
            HAS_PREFIX=prefix_count > 0,
            **_dot_flags(grad_out.dtype, weight.dtype),
        )
    return grad_patches


def _grad_weight_tiles(dim: int, k: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_D, BLOCK_K)`` of the weight gradient (its token axis split across programs: no autotuning);
    tl.dot takes no side under 16."""
    block_d = power_of_two_tile(dim, 16, MAX_CHANNEL_TILE)
    return tile_size(64), tile_size(block_d), tile_size(power_of_two_tile(k, 16, 64))


def _grad_weight_launch(
    grad_out: torch.Tensor,
    patches: torch.Tensor,
    perm: torch.Tensor | None,
    weight: torch.Tensor,
    prefix_count: int,
    traced: bool,
) -> torch.Tensor:
    """``grad_weight [D, K]`` in weight's dtype: the gathered patch rows ``^T @`` grad_out's patch rows, the token
    axis split across programs into float32 partials, summed after in a fixed order."""
    batch, num_positions, k = patches.shape
    dim = weight.shape[0]
    total = batch * num_positions
    block_m, block_d, block_k = _grad_weight_tiles(dim, k)
    tiles = cdiv(dim, block_d) * cdiv(k, block_k)
    # Enough splits of the token axis to fill the GPU about four times over, in whole tiles of tokens.
    programs_wanted = 1 if interpreting() else 4 * multiprocessors(patches.device)
    splits = max(1, min(cdiv(total, block_m), programs_wanted // max(tiles, 1)))
    tokens_per_split = max(block_m, cdiv(cdiv(total, splits), block_m) * block_m)
    splits = max(1, cdiv(total, tokens_per_split))
    partial = scratch("gathered weight gradient partials", (splits, dim, k), patches.device, traced)
    if total and dim and k:
        launcher(_grad_weight_kernel, (cdiv(dim, block_d), cdiv(k, block_k), splits), traced)(
            grad_out,
            patches,
            perm if perm is not None else grad_out,  # absent: never read
            partial,
            total,
            num_positions,
            k,
            dim,
            tokens_per_split,
            *patches.stride(),
            prefix_count,
            HAS_PERM=perm is not None,
            HAS_PREFIX=prefix_count > 0,
            **_dot_flags(grad_out.dtype, patches.dtype),
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            BLOCK_K=block_k,
        )
    else:
        partial.zero_()
    return partial.sum(0).to(weight.dtype)


def _sample_position_tiles(dim: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_D, rows per program)`` of :func:`_sample_position_kernel`."""
    if interpreting():
        return INTERPRETER_TILE, INTERPRETER_TILE, 2 * INTERPRETER_TILE
    return ROW_TILE, power_of_two_tile(dim, 16, MAX_CHANNEL_TILE), SAMPLE_POSITION_ROWS


def _sample_position_launch(
    grad_out: torch.Tensor,
    mask: torch.Tensor | None,
    prefix_count: int,
    pos_shape: list[int],
    pos_dtype: torch.dtype | None,
    unk_dtype: torch.dtype,
    bias_dtype: torch.dtype,
    traced: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(grad_pos, grad_unk, grad_bias)`` of a per-sample position term: ``grad_pos`` ``pos_shape`` in ``pos_dtype``
    (None: not written), the sums over the masked and over all patch rows in ``unk_dtype`` and ``bias_dtype``."""
    batch, rows, dim = grad_out.shape
    num_positions = rows - prefix_count
    total = batch * num_positions
    block_r, block_d, rows_per_program = _sample_position_tiles(dim)
    programs = max(1, cdiv(total, rows_per_program))
    grad_pos = torch.empty(pos_shape, dtype=pos_dtype, device=grad_out.device) if pos_dtype is not None else None
    partial = scratch("sample position partials", (2, programs, dim), grad_out.device, traced)
    if total and dim:
        launcher(_sample_position_kernel, (programs, cdiv(dim, block_d)), traced)(
            grad_out,
            mask if mask is not None else grad_out,  # absent: never read
            grad_pos if grad_pos is not None else grad_out,  # absent: never written
            partial,
            total,
            num_positions,
            dim,
            rows_per_program,
            prefix_count,
            HAS_MASK=mask is not None,
            HAS_PREFIX=prefix_count > 0,
            WRITE_POS=grad_pos is not None,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
        )
    else:
        partial.zero_()
    sums = partial.sum(1)  # [2, D], a fixed order
    # copies: two views of one tensor would alias the operator's outputs
    return grad_pos, sums[0].to(unk_dtype, copy=True), sums[1].to(bias_dtype, copy=True)


# ----------------------------------------------------------------------------------------------------------------
# Operators
# ----------------------------------------------------------------------------------------------------------------


def _forward_fake(patches, weight, prefix, **_):
    batch, num_positions, _ = patches.shape
    dim = weight.shape[0]
    return patches.new_empty(batch, prefix_rows(prefix, dim) + num_positions, dim)


def _backward_fake(
    grad_out, patches, weight, need_patches, need_weight, need_bias, need_pos, need_unk, need_prefix, prefix_count,
    pos_shape, prefix_shape, pos_dtype, unk_dtype, prefix_dtype, **_,
):  # fmt: skip
    dim = weight.shape[0]
    outputs = (
        (need_patches, patches.shape, patches.dtype),
        (need_weight, weight.shape, weight.dtype),
        (need_bias, (dim,), weight.dtype),
        (need_pos, tuple(pos_shape), pos_dtype or weight.dtype),
        (need_unk, (dim,), unk_dtype or weight.dtype),
        (need_prefix and prefix_count > 0, tuple(prefix_shape), prefix_dtype or weight.dtype),
    )
    return [grad_out.new_empty(shape, dtype=dtype) if need else grad_out.new_empty(0) for need, shape, dtype in outputs]


# The operators over the launchers (schemas from the launchers' signatures): tokens ``[B, P + N, D]``;
# ``[grad_patches, grad_weight, grad_bias, grad_pos, grad_unk, grad_prefix]``.
gathered_patch_embed_forward_triton = define_operator(
    "mjp_fast::gathered_patch_embed_triton",
    gathered_patch_embed_forward_launch,
    fake=_forward_fake,
    required=("prefix",),
)
gathered_patch_embed_backward_triton = define_operator(
    "mjp_fast::gathered_patch_embed_triton_backward", gathered_patch_embed_backward_launch, fake=_backward_fake
)
