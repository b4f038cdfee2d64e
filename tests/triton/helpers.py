"""Torch reference formulas of the Triton kernels' row layout, for their tests.

Each sample's output has ``P + N`` rows: the ``P`` prefix rows (class and register tokens), ``prefix[t] + (pos[t]
if t < Q else 0)``, then the ``N`` patch rows, ``token[b, perm[b, n]] + (unk if mask[b, n] else pos[Q + n])``, where
``pos`` is the model's full table ``[Q + N, D]`` (``Q``: 0 or ``P``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# (P, Q): no prefix; a class token with its row in the table (timm's default) or without (no_embed_class); three
# prefix tokens (class and registers), with and without rows.
PREFIXES = [(0, 0), (1, 1), (1, 0), (3, 3), (3, 0)]


def random_jigsaw(
    batch: int, num_positions: int, masked: str, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, perm)``: ``masked`` "none", "some" or "all" positions, the masked ones permuted among themselves."""
    if masked == "some":
        mask = torch.rand(batch, num_positions, generator=generator) < 0.5
    else:
        mask = torch.full((batch, num_positions), masked == "all")
    perm = torch.arange(num_positions).repeat(batch, 1)
    for sample in range(batch):
        where = mask[sample].nonzero().flatten()
        perm[sample, where] = where[torch.randperm(len(where), generator=generator)]
    return mask, perm


def with_prefix_rows(
    patch_rows: torch.Tensor, pos_embed: torch.Tensor, prefix: torch.Tensor | None, prefix_positions: int
) -> torch.Tensor:
    """``patch_rows [B, N, D]`` after the prefix rows ``prefix[t] + (pos[t] if t < Q else 0)``: ``[B, P + N, D]``."""
    if prefix is None:
        return patch_rows
    batch, _, dim = patch_rows.shape
    rows = prefix.reshape(-1, dim)
    if prefix_positions:
        rows = rows + pos_embed.reshape(-1, dim)[:prefix_positions]
    return torch.cat((rows.expand(batch, -1, -1).to(patch_rows.dtype), patch_rows), dim=1)


def position_term(
    pos_embed: torch.Tensor, unk_embed: torch.Tensor | None, mask: torch.Tensor | None, prefix_positions: int, dim: int
) -> torch.Tensor:
    """``unk if mask[b, n] else pos[Q + n]``: ``[B, N, D]`` (``[N, D]`` without a mask)."""
    table = pos_embed.reshape(-1, dim)[prefix_positions:]
    if mask is None:
        return table
    return torch.where(mask[..., None], unk_embed, table)


def pos_embed_reference(
    tokens: torch.Tensor,
    perm: torch.Tensor,
    mask: torch.Tensor,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor,
    prefix: torch.Tensor | None = None,
    prefix_positions: int = 0,
) -> torch.Tensor:
    """``[B, P + N, D]``: the moved tokens plus their position terms, after the prefix rows. Differentiable."""
    batch, num_positions, dim = tokens.shape
    moved = tokens.gather(1, perm[..., None].expand(batch, num_positions, dim))
    patch_rows = moved + position_term(pos_embed, unk_embed, mask, prefix_positions, dim)
    return with_prefix_rows(patch_rows, pos_embed, prefix, prefix_positions)


def patch_embed_reference(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None,
    perm: torch.Tensor | None,
    mask: torch.Tensor | None,
    prefix: torch.Tensor | None = None,
    prefix_positions: int = 0,
) -> torch.Tensor:
    """``[B, P + N, D]``: the Conv2d patch embedding (moved by ``perm``) plus the position terms, after the prefix
    rows. Differentiable."""
    dim, patch = weight.shape[0], weight.shape[-1]
    tokens = F.conv2d(images, weight, bias, stride=patch).flatten(2).transpose(1, 2)
    if perm is not None:
        tokens = tokens.gather(1, perm[..., None].expand(*perm.shape, dim))
    patch_rows = tokens + position_term(pos_embed, unk_embed, mask, prefix_positions, dim)
    return with_prefix_rows(patch_rows, pos_embed, prefix, prefix_positions)


def rounded_like_the_kernels(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``values`` rounded to ``dtype`` as the kernels store them: to nearest on a GPU; the Triton interpreter
    truncates float32 to bfloat16 (its float16 rounds to nearest)."""
    values = values.float()
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return (values.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return values.to(dtype)
