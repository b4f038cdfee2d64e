"""``rope_identity``: a rotary table per sample in which the jigsaw's shuffled positions get no rotation.

The rotary analogue of the unknown position embedding (``docs/design.md``, section 7): timm's rotary tables hold
``[sin, cos]`` concatenated on the last dim (``apply_rot_embed_cat`` splits them with ``chunk(2, -1)``), positions on
dim -2, so the identity rotation is the row ``[0, ..., 0, 1, ..., 1]`` (sin 0, cos 1) whatever the layout (interleaved
or half rotation) and whatever the rope type (``cat``, ``mixed``, ``dinov3``, ``mrope``). A masked position's row is
replaced by it, the others keep theirs:

``out[..., b, ..., n, :] = identity if mask[b, n] else rope[..., n, :]``

in the shapes timm's patch-dropout path gives a batched table (``Eva._pos_embed``): ``[N, E]`` -> ``[B, 1, N, E]``,
``[H, N, E]`` -> ``[B, H, N, E]``, and a mixed rope's ``[depth, H, N, E]`` -> ``[depth, B, H, N, E]`` (depth first:
``forward_features`` indexes it by block). One ``torch.where`` over the broadcast table: its gradient reaches a
learnable table (mixed rope's frequencies) at the rows that keep their rotation.
"""

from __future__ import annotations

import torch

from mjp_fast._validate import check_bool, check_float_dtype, check_same_device, check_tensor


def check_rope_identity_args(rope: object, mask: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Validates the arguments of :func:`rope_identity`; returns them."""
    rope = check_tensor("rope", rope, ndims=(2, 3, 4))
    check_float_dtype("rope", rope)
    width = rope.shape[-1]
    if width == 0 or width % 2:
        raise ValueError(f"rope: its last dim holds [sin, cos] and must be even and > 0, got shape {list(rope.shape)}")
    mask = check_tensor("mask", mask, ndims=(2,))
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor [B, N], got {mask.dtype}")
    if mask.shape[1] != rope.shape[-2]:
        raise ValueError(
            f"mask: [B, N] with N = the rope's positions (dim -2 of rope {list(rope.shape)}) = {rope.shape[-2]}, "
            f"got shape {list(mask.shape)}"
        )
    check_same_device(rope=rope, mask=mask)
    return rope, mask


def rope_identity_ref(rope: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Oracle: one copy of the table per sample, its masked rows overwritten one by one (sin 0, cos 1).

    Shapes as :func:`rope_identity`. Differentiable in ``rope`` (the overwritten rows get no gradient).
    """
    rope, mask = check_rope_identity_args(rope, mask)
    half = rope.shape[-1] // 2
    tables = []
    for sample in range(mask.shape[0]):
        table = rope.clone()
        for position in range(mask.shape[1]):
            if bool(mask[sample, position]):
                table[..., position, :half] = 0.0
                table[..., position, half:] = 1.0
        tables.append(table)
    out = torch.stack(tables) if tables else rope.unsqueeze(0)[:0]  # [B, *rope.shape]
    if rope.dim() == 2:
        return out.unsqueeze(1)  # [B, 1, N, E]
    if rope.dim() == 4:
        return out.transpose(0, 1)  # [depth, B, H, N, E]
    return out  # [B, H, N, E]


def identity_rotation(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The identity row of a ``[sin, cos]`` table of ``width`` columns: ``width // 2`` zeros, then ones."""
    return (torch.arange(width, device=device) >= width // 2).to(dtype)


def rope_identity(rope: torch.Tensor, mask: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """Each sample's rotary table, with no rotation (sin 0, cos 1) at the positions ``mask`` marks.

    Args:
        rope: timm's rotary table, ``[sin, cos]`` on the last dim (E even), positions on dim -2: ``[N, E]`` (``cat``,
            ``dinov3``, ``mrope``), ``[H, N, E]``, or a mixed rope's ``[depth, H, N, E]``. float32, float16, bfloat16 or
            float64.
        mask: bool ``[B, N]``, True at the shuffled positions (a jigsaw's mask).
        validate: check the arguments (the timm models skip it for their own tables and jigsaws). Without the
            checks nothing is read through an index (one ``torch.where``), so no argument can make it touch memory
            that is not the call's; shapes that do not broadcast raise torch's error. See :mod:`mjp_fast._validate`.

    Returns:
        ``[B, 1, N, E]``, ``[B, H, N, E]`` or ``[depth, B, H, N, E]`` (the batched shapes of timm's ``Eva`` after
        patch dropout) in ``rope``'s dtype; differentiable in ``rope``.

    Raises:
        TypeError/ValueError: bad arguments, named.
    """
    if check_bool("validate", validate):  # one isinstance even when the checks are off: None must not skip them
        rope, mask = check_rope_identity_args(rope, mask)
    identity = identity_rotation(rope.shape[-1], rope.dtype, rope.device)
    if rope.dim() == 4:  # [depth, H, N, E] -> [depth, B, H, N, E]
        return torch.where(mask[None, :, None, :, None], identity, rope.unsqueeze(1))
    return torch.where(mask[:, None, :, None], identity, rope)  # [B, 1, N, 1] against [N, E] or [H, N, E]
