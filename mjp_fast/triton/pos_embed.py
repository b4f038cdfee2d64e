"""Triton kernels of ``mjp_pos_embed``: the jigsaw's move of embedded tokens plus the position term.

Forward: one pass. Each program owns a block of token rows and of channels, loads each row's source token
(``perm``) and its position term (``unk_embed`` where masked, else ``pos_embed[n]``), and stores the sum, computed
in float32 and rounded once, as torch's own add of the two terms does.

Backward: the position gradient of the patch embedding (:func:`launch_position_gradient`). One pass over the
incoming gradient, split over positions, channels and batch chunks, sums it per position over the unmasked samples
(``pos_embed``) and the masked ones (``unk_embed``) into float32 partials and, from the same loads, writes the
inverse move (the tokens' gradient); a second small kernel adds the partials in a fixed order and writes the
gradients in their final dtypes: no atomics, deterministic, two launches.

Each launcher is a plain function (``*_launch``) that eager callers use directly, and a torch operator over it
that launches through ``torch.library.wrap_triton``, for torch.compile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mjp_fast.triton import operator as _operator
from mjp_fast.triton.patch_embed import (
    PositionGradientPlan,
    _interpreting,
    _launcher,
    launch_position_gradient,
)


@triton.jit
def _forward_kernel(
    tokens_ptr,  # [B, N, D]
    perm_ptr,  # [B, N] int64
    mask_ptr,  # [B, N] bool
    pos_ptr,  # [N, D], the output dtype
    unk_ptr,  # [D], the output dtype
    out_ptr,  # [B, N, D]
    total,  # B * N
    num_positions,
    D,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat (sample, position) rows
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < total
    ok = row_ok[:, None] & (channels[None, :] < D)
    position = rows % num_positions
    source = rows - position + tl.load(perm_ptr + rows, mask=row_ok, other=0)
    masked = tl.load(mask_ptr + rows, mask=row_ok, other=0).to(tl.int1)
    moved = tl.load(tokens_ptr + source[:, None] * D + channels[None, :], mask=ok, other=0.0)
    pos = tl.load(pos_ptr + position[:, None] * D + channels[None, :], mask=ok & ~masked[:, None], other=0.0)
    unk = tl.load(unk_ptr + channels, mask=channels < D, other=0.0)
    term = tl.where(masked[:, None], unk[None, :].to(tl.float32), pos.to(tl.float32))
    out = moved.to(tl.float32) + term
    tl.store(out_ptr + rows[:, None] * D + channels[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def pos_embed_forward_launch(
    tokens: torch.Tensor,
    perm: torch.Tensor,
    mask: torch.Tensor,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor,
    *,
    traced: bool = False,
) -> torch.Tensor:
    """``out [B, N, D]`` in the dtype of ``pos_embed``: ``tokens[b, perm[b, n]] + (unk if mask[b, n] else pos[n])``.

    tokens ``[B, N, D]``, perm int64 and mask bool ``[B, N]``, contiguous; pos_embed ``[N, D]`` and unk_embed ``[D]``
    already in the output dtype (the caller rounds them, as the oracle does). The sum is taken in float32 and
    rounded once. One kernel launch, through ``torch.library.wrap_triton`` only when ``traced`` (inside the torch
    operator); the output is the only allocation.
    """
    batch, num_positions, dim = tokens.shape
    out = torch.empty((batch, num_positions, dim), dtype=pos_embed.dtype, device=tokens.device)
    total = batch * num_positions
    if total == 0 or dim == 0:
        return out
    # 32 rows x up to 128 channels: 8 KB of bfloat16 per load, coalesced rows, thousands of programs at ViT sizes
    block_r = 16 if _interpreting() else 32
    block_d = 16 if _interpreting() else min(128, triton.next_power_of_2(dim))
    _launcher(_forward_kernel, (triton.cdiv(total, block_r), triton.cdiv(dim, block_d)), traced)(
        tokens, perm, mask, pos_embed, unk_embed, out, total, num_positions, dim, BLOCK_R=block_r, BLOCK_D=block_d
    )
    return out


def pos_embed_backward_launch(
    grad_out: torch.Tensor,
    perm: torch.Tensor,
    mask: torch.Tensor,
    tokens_dtype: torch.dtype,
    pos_dtype: torch.dtype,
    unk_dtype: torch.dtype,
    *,
    traced: bool = False,
    plan: PositionGradientPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_tokens [B, N, D] tokens_dtype, grad_pos [N, D] pos_dtype, grad_unk [D] unk_dtype)``.

    grad_out ``[B, N, D]``, perm int64 and mask bool ``[B, N]``, contiguous. Two kernel launches (the partial sums
    with the inverse move, then their reduction) and ``torch.empty`` allocations, nothing else. ``plan``: from
    :func:`position_gradient_plan` for these sizes; default the device's. ``traced``: launch through
    ``torch.library.wrap_triton`` (inside the torch operator).
    """
    grad_tokens, grad_pos, grad_unk, _ = launch_position_gradient(
        grad_out,
        mask,
        perm,
        tokens_dtype=tokens_dtype,
        pos_dtype=pos_dtype,
        unk_dtype=unk_dtype,
        plan=plan,
        traced=traced,
    )
    return grad_tokens, grad_pos, grad_unk


@_operator("mjp_fast::pos_embed_triton", mutates_args=())
def pos_embed_forward_triton(
    tokens: torch.Tensor, perm: torch.Tensor, mask: torch.Tensor, pos_embed: torch.Tensor, unk_embed: torch.Tensor
) -> torch.Tensor:
    """The torch operator over :func:`pos_embed_forward_launch` (torch.compile sees its kernel)."""
    return pos_embed_forward_launch(tokens, perm, mask, pos_embed, unk_embed, traced=True)


@_operator("mjp_fast::pos_embed_triton_backward", mutates_args=())
def pos_embed_backward_triton(
    grad_out: torch.Tensor,
    perm: torch.Tensor,
    mask: torch.Tensor,
    tokens_dtype: torch.dtype,
    pos_dtype: torch.dtype,
    unk_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The torch operator over :func:`pos_embed_backward_launch`: ``[grad_tokens, grad_pos, grad_unk]``."""
    return list(pos_embed_backward_launch(grad_out, perm, mask, tokens_dtype, pos_dtype, unk_dtype, traced=True))
