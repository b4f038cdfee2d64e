"""Triton kernels of ``mjp_pos_embed``: the jigsaw's move of embedded tokens plus the position term, prefix rows
(class and register tokens) included.

Row layout (the C++ operators' too): each sample's output has ``T = P + N`` rows. For ``t < P``: ``out[b, t] =
prefix[t] + (pos[t] if t < Q else 0)``, with ``Q`` (0 or ``P``) the rows of the position table that belong to the
prefix tokens; for ``t = P + n``: ``out[b, t] = tokens[b, perm[b, n]] + (unk if mask[b, n] else pos[Q + n])``.
``pos`` is the model's full table ``[Q + N, D]`` (any leading dims of 1), read in place: no concatenation, no
slices, one copy of the output.

Forward: one pass, one launch. Each program owns a block of rows and of channels: patch rows (the first programs:
the source token and its position term) or prefix rows (the last ones: the prefix token and its table row), and
stores the sum, computed in float32 and rounded once, as torch's own add of the two terms does. Without prefix rows
(``HAS_PREFIX`` off, the prefix arguments last) the kernel compiles exactly as it did before prefix rows.

Backward: the position gradient that the patch embedding uses too (:func:`launch_position_gradient`, in
``mjp_fast/triton/common.py``). One pass over the incoming gradient, split over positions (a prefix row is a
position that is never masked nor moved), channels and batch chunks, sums it per position over the unmasked samples
(``pos_embed``, ``prefix``) and the masked ones (``unk_embed``) into float32 partials and, from the same loads,
writes the inverse move (the tokens' gradient); a second small kernel adds the partials in a fixed order and
writes the gradients in their final dtypes and in the shapes of their inputs: no atomics, deterministic, two
launches.

Each launcher is a plain function (``*_launch``) that eager callers use directly, and a torch operator over it
that launches through ``torch.library.wrap_triton``, for torch.compile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mjp_fast.triton.common import (
    MAX_CHANNEL_TILE,
    ROW_TILE,
    PositionGradientPlan,
    cdiv,
    check_contiguous,
    check_row_layout,
    define_operator,
    launch_position_gradient,
    launcher,
    power_of_two_tile,
    prefix_rows,
    prefix_rows_tile,
    tile_size,
)


@triton.jit
def _forward_patch_rows(
    tokens_ptr,
    perm_ptr,
    mask_ptr,
    pos_ptr,
    unk_ptr,
    out_ptr,
    program,
    total,
    num_positions,
    D,
    prefix_count,
    prefix_positions,
    witness_ptr,
    HAS_PREFIX: tl.constexpr,
    HAS_WITNESS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``out[b, P + n] = tokens[b, perm[b, n]] + (unk if mask[b, n] else pos[Q + n])`` for a block of patch rows.

    A perm entry outside ``[0, N)`` (only with ``validate=False``) moves a zero token: the load is masked off and its
    address clamped into the sample's own rows (``mjp_fast/_validate.py``). HAS_WITNESS: also ``witness[b, perm[b,
    n]] = n`` (int32), which the backward reads to find the rows no token was moved from."""
    rows = program.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat (sample, position) rows of B * N
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < total
    ok = row_ok[:, None] & (channels[None, :] < D)
    position = rows % num_positions
    entry = tl.load(perm_ptr + rows, mask=row_ok, other=0)
    entry_ok = (entry >= 0) & (entry < num_positions)
    source = rows - position + tl.where(entry_ok, entry, 0)
    if HAS_WITNESS:
        tl.store(witness_ptr + source, position.to(tl.int32), mask=row_ok & entry_ok & (tl.program_id(1) == 0))
    masked = tl.load(mask_ptr + rows, mask=row_ok, other=0).to(tl.int1)
    moved = tl.load(tokens_ptr + source[:, None] * D + channels[None, :], mask=ok & entry_ok[:, None], other=0.0)
    if HAS_PREFIX:
        table_rows = position + prefix_positions  # Q + n
        out_rows = rows + (rows // num_positions + 1) * prefix_count  # b * (P + N) + P + n
    else:
        table_rows = position  # Q = 0
        out_rows = rows
    pos = tl.load(pos_ptr + table_rows[:, None] * D + channels[None, :], mask=ok & ~masked[:, None], other=0.0)
    unk = tl.load(unk_ptr + channels, mask=channels < D, other=0.0)
    term = tl.where(masked[:, None], unk[None, :].to(tl.float32), pos.to(tl.float32))
    out = moved.to(tl.float32) + term
    tl.store(out_ptr + out_rows[:, None] * D + channels[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _forward_kernel(
    tokens_ptr,  # [B, N, D]
    perm_ptr,  # [B, N] int64
    mask_ptr,  # [B, N] bool
    pos_ptr,  # [Q + N, D]: the model's full table, in the output dtype
    unk_ptr,  # [D], the output dtype
    out_ptr,  # [B, P + N, D]
    total,  # B * N: the patch rows
    num_positions,  # N
    D,
    prefix_ptr,  # [P, D] (HAS_PREFIX)
    total_prefix,  # B * P: the prefix rows (HAS_PREFIX)
    prefix_count,  # P (HAS_PREFIX)
    prefix_positions,  # Q: 0 or P (HAS_PREFIX)
    witness_ptr,  # int32 [B, N] (HAS_WITNESS): witness[b, perm[b, n]] = n, written
    HAS_PREFIX: tl.constexpr,
    HAS_WITNESS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Programs along axis 0: first the patch rows' blocks, then (HAS_PREFIX) the prefix rows'. One kind per
    # program, so neither pays the other's registers; the prefix arguments come last, so that without a prefix the
    # kernel compiles as it did before prefix rows.
    if HAS_PREFIX:
        patch_programs = tl.cdiv(total, BLOCK_R)
        if tl.program_id(0) < patch_programs:
            _forward_patch_rows(
                tokens_ptr, perm_ptr, mask_ptr, pos_ptr, unk_ptr, out_ptr, tl.program_id(0), total, num_positions, D,
                prefix_count, prefix_positions, witness_ptr, HAS_PREFIX, HAS_WITNESS, BLOCK_R, BLOCK_D,
            )  # fmt: skip
        else:
            prefix_rows_tile(
                prefix_ptr, pos_ptr, out_ptr, (tl.program_id(0) - patch_programs) * BLOCK_R + tl.arange(0, BLOCK_R),
                tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D), total_prefix, num_positions, prefix_count,
                prefix_positions, D,
            )  # fmt: skip
    else:
        _forward_patch_rows(
            tokens_ptr, perm_ptr, mask_ptr, pos_ptr, unk_ptr, out_ptr, tl.program_id(0), total, num_positions, D,
            prefix_count, prefix_positions, witness_ptr, HAS_PREFIX, HAS_WITNESS, BLOCK_R, BLOCK_D,
        )  # fmt: skip


def _forward_tiles(dim: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_D)`` of the forward kernel: ``ROW_TILE`` rows of up to ``MAX_CHANNEL_TILE`` channels."""
    return tile_size(ROW_TILE), tile_size(power_of_two_tile(dim, 1, MAX_CHANNEL_TILE))


def pos_embed_forward_launch(
    tokens: torch.Tensor,
    perm: torch.Tensor,
    mask: torch.Tensor,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor,
    prefix: torch.Tensor | None = None,
    prefix_positions: int = 0,
    *,
    traced: bool = False,
    witness: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out [B, P + N, D]`` in the dtype of ``pos_embed``: the prefix rows, then the moved tokens.

    ``out[b, t] = prefix[t] + (pos[t] if t < Q else 0)`` for ``t < P``; ``out[b, P + n] = tokens[b, perm[b, n]] +
    (unk if mask[b, n] else pos[Q + n])``. Each sum is taken in float32 and rounded once.

    Args:
        tokens: ``[B, N, D]``, contiguous.
        perm, mask: int64 and bool ``[B, N]``, contiguous.
        pos_embed: the model's full table, contiguous, ``[Q + N, D]`` or ``[1, Q + N, D]``, already in the output
            dtype (the caller rounds it, as the oracle does).
        unk_embed: ``[D]``, in the output dtype.
        prefix: the prefix tokens (class, registers), contiguous, ``P * D`` elements (``[1, P, D]``, ``[P, D]``);
            None when ``P = 0``.
        prefix_positions: ``Q``, 0 or ``P``: the leading rows of ``pos_embed`` that belong to the prefix tokens.
        traced: launch through ``torch.library.wrap_triton`` (inside the torch operator).
        witness: int32 ``[B, N]`` (uninitialised), or None: the launch also writes ``witness[b, perm[b, n]] = n``
            for :func:`pos_embed_backward_launch`, which then finds, in its one pass, the rows of the tokens'
            gradient that no token was moved from (only a perm that is not a permutation, ``validate=False``, has
            any) and writes zeros there without a fill of its own.

    One kernel launch; the output is the only allocation.
    """
    batch, num_positions, dim = tokens.shape
    prefix_count = prefix_rows(prefix, dim)
    check_row_layout(prefix_count, prefix_positions, pos_embed.shape, num_positions, dim)
    check_contiguous(tokens=tokens, perm=perm, mask=mask, pos_embed=pos_embed, unk_embed=unk_embed)
    out = torch.empty((batch, prefix_count + num_positions, dim), dtype=pos_embed.dtype, device=tokens.device)
    total, total_prefix = batch * num_positions, batch * prefix_count
    if total + total_prefix == 0 or dim == 0:
        return out
    block_r, block_d = _forward_tiles(dim)
    grid = (cdiv(total, block_r) + cdiv(total_prefix, block_r), cdiv(dim, block_d))
    launcher(_forward_kernel, grid, traced)(
        tokens,
        perm,
        mask,
        pos_embed,
        unk_embed,
        out,
        total,
        num_positions,
        dim,
        prefix if prefix is not None else pos_embed,  # never read without a prefix
        total_prefix,
        prefix_count,
        prefix_positions,
        witness if witness is not None else perm,  # never written without a witness
        HAS_PREFIX=prefix_count > 0,
        HAS_WITNESS=witness is not None,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    return out


def pos_embed_backward_launch(
    grad_out: torch.Tensor,
    perm: torch.Tensor,
    mask: torch.Tensor,
    prefix_count: int,
    prefix_positions: int,
    pos_shape: list[int],
    prefix_shape: list[int],
    tokens_dtype: torch.dtype,
    pos_dtype: torch.dtype,
    unk_dtype: torch.dtype,
    prefix_dtype: torch.dtype,
    *,
    traced: bool = False,
    plan: PositionGradientPlan | None = None,
    witness: torch.Tensor | None = None,
    permutation: bool = False,
) -> list[torch.Tensor]:
    """``[grad_tokens, grad_pos, grad_unk, grad_prefix]``, each in the shape and dtype of its input.

    Args:
        grad_out: ``[B, P + N, D]``, contiguous.
        perm, mask: int64 and bool ``[B, N]``, contiguous.
        prefix_count, prefix_positions: ``P`` and ``Q`` of the forward.
        pos_shape, prefix_shape: the forward's table and prefix shapes (``prefix_shape`` unused when ``P = 0``).
        tokens_dtype, pos_dtype, unk_dtype, prefix_dtype: the dtypes of the gradients.
        traced: launch through ``torch.library.wrap_triton`` (inside the torch operator).
        plan: from :func:`position_gradient_plan` for these sizes; default the device's.
        witness: what :func:`pos_embed_forward_launch` wrote for this perm, or None (the tokens' gradient then
            starts from zeros, one fill more, unless ``permutation``).
        permutation: each row of ``perm`` is a permutation (validated, or sampled): every row of the tokens'
            gradient is written by the inverse move, with neither a witness nor a fill.

    Returns:
        ``grad_tokens [B, N, D]`` (the inverse move of the patch rows), ``grad_pos`` (``pos_shape``), ``grad_unk
        [D]``, ``grad_prefix`` (``prefix_shape``; an empty ``[0]`` tensor when ``P = 0``). Two kernel launches (the
        partial sums with the inverse move, then their reduction), ``torch.empty`` allocations of the outputs and
        the partials' scratch buffer (``common.scratch``), nothing else.
    """
    grad_tokens, grad_pos, grad_unk, _, grad_prefix = launch_position_gradient(
        grad_out,
        mask,
        perm,
        tokens_dtype=tokens_dtype,
        pos_dtype=pos_dtype,
        unk_dtype=unk_dtype,
        prefix_count=prefix_count,
        prefix_positions=prefix_positions,
        pos_shape=pos_shape,
        prefix_dtype=prefix_dtype,
        prefix_shape=prefix_shape,
        plan=plan,
        traced=traced,
        witness=witness,
        permutation=permutation,
    )
    return [grad_tokens, grad_pos, grad_unk, grad_prefix]


def _pos_embed_forward_fake(tokens, pos_embed, prefix, **_):
    batch, num_positions, dim = tokens.shape
    return tokens.new_empty((batch, prefix_rows(prefix, dim) + num_positions, dim), dtype=pos_embed.dtype)


def _pos_embed_backward_fake(
    grad_out, prefix_count, pos_shape, prefix_shape, tokens_dtype, pos_dtype, unk_dtype, prefix_dtype, **_
):
    batch, rows_per_sample, dim = grad_out.shape
    return [
        grad_out.new_empty((batch, rows_per_sample - prefix_count, dim), dtype=tokens_dtype),
        grad_out.new_empty(tuple(pos_shape), dtype=pos_dtype),
        grad_out.new_empty((dim,), dtype=unk_dtype),
        grad_out.new_empty(tuple(prefix_shape) if prefix_count else (0,), dtype=prefix_dtype),
    ]


# The operators over the launchers (torch.compile sees their kernels; their schemas come from the launchers'
# signatures, ``plan`` left out): ``out [B, P + N, D]``; ``[grad_tokens, grad_pos, grad_unk, grad_prefix]``. The
# forward's callers pass the prefix and Q always: no defaults for them in the operator.
pos_embed_forward_triton = define_operator(
    "mjp_fast::pos_embed_triton",
    pos_embed_forward_launch,
    fake=_pos_embed_forward_fake,
    required=("prefix", "prefix_positions"),
)
pos_embed_backward_triton = define_operator(
    "mjp_fast::pos_embed_triton_backward", pos_embed_backward_launch, fake=_pos_embed_backward_fake
)
