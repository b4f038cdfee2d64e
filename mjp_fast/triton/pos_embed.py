"""Triton kernels of ``mjp_pos_embed``: the jigsaw's move of embedded tokens plus the position term.

Forward: one pass. Each program owns a block of token rows and of channels, loads each row's source token
(``perm``) and its position term (``unk_embed`` where masked, else ``pos_embed[n]``), and stores the sum, computed
in float32 and rounded once, as torch's own add of the two terms does.

Backward: one pass over the incoming gradient by the position-gradient kernel of the patch embedding, which sums
it per position over the unmasked samples (``pos_embed``) and the masked ones (``unk_embed``) and, from the same
loads, writes the inverse move (the tokens' gradient): no atomics, deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mjp_fast.triton import operator as _operator
from mjp_fast.triton.patch_embed import _grad_position_kernel, _interpreting


@triton.jit
def _forward_kernel(
    tokens_ptr,
    perm_ptr,
    mask_ptr,
    pos_ptr,
    unk_ptr,
    out_ptr,
    total,
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


@_operator("mjp_fast::pos_embed_triton", mutates_args=())
def pos_embed_forward_triton(
    tokens: torch.Tensor, perm: torch.Tensor, mask: torch.Tensor, pos_embed: torch.Tensor, unk_embed: torch.Tensor
) -> torch.Tensor:
    """``[B, N, D]`` in the dtype of ``pos_embed``.

    tokens ``[B, N, D]``, perm int64 and mask bool ``[B, N]``, contiguous; pos_embed ``[N, D]`` and unk_embed ``[D]``
    already in the output dtype (the caller rounds them, as the oracle does).
    """
    batch, num_positions, dim = tokens.shape
    out = torch.empty(batch, num_positions, dim, dtype=pos_embed.dtype, device=tokens.device)
    total = batch * num_positions
    if total == 0 or dim == 0:
        return out
    block_r = 16 if _interpreting() else 32
    block_d = 16 if _interpreting() else min(128, triton.next_power_of_2(dim))
    torch.library.wrap_triton(_forward_kernel)[(triton.cdiv(total, block_r), triton.cdiv(dim, block_d))](
        tokens, perm, mask, pos_embed, unk_embed, out, total, num_positions, dim, BLOCK_R=block_r, BLOCK_D=block_d
    )
    return out


@_operator("mjp_fast::pos_embed_triton_backward", mutates_args=())
def pos_embed_backward_triton(
    grad_out: torch.Tensor, perm: torch.Tensor, mask: torch.Tensor, tokens_dtype: torch.dtype
) -> list[torch.Tensor]:
    """``[grad_tokens [B, N, D] (tokens_dtype), grad_pos [N, D], grad_unk [D]]``, the last two in grad_out's dtype.

    grad_out ``[B, N, D]``, perm and mask ``[B, N]``, contiguous.
    """
    batch, num_positions, dim = grad_out.shape
    grad_tokens = torch.empty(batch, num_positions, dim, dtype=tokens_dtype, device=grad_out.device)
    block_n = 16 if _interpreting() else 32
    block_d = 16 if _interpreting() else 64
    position_blocks = triton.cdiv(num_positions, block_n)
    grad_pos = torch.zeros(num_positions, dim, dtype=torch.float32, device=grad_out.device)
    unk_partial = torch.zeros(position_blocks, dim, dtype=torch.float32, device=grad_out.device)
    if batch * num_positions and dim:
        torch.library.wrap_triton(_grad_position_kernel)[(position_blocks, triton.cdiv(dim, block_d))](
            grad_out,
            mask,
            grad_pos,
            unk_partial,
            perm,
            grad_tokens,
            batch,
            num_positions,
            dim,
            HAS_MASK=True,
            SCATTER=True,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
        )
    return [grad_tokens, grad_pos.to(grad_out.dtype), unk_partial.sum(0).to(grad_out.dtype)]
