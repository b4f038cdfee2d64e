"""MJP for timm's ``Cait`` and ``ConVit``: models that add their learned absolute position table inline, right after
the patch embedding (``x = patch_embed(x); x = x + pos_embed; x = pos_drop(x)`` in both ``forward_features`` and
``forward_intermediates``; a table ``[1, N, D]`` of the patch positions only: the class token joins later, CaiT's in
its class-attention blocks, ConViT's after its ``local_up_to_layer`` GPSA blocks).

Where MJP hooks in: timm gives these models no ``_pos_embed`` method (the ViT front end's hook), and the add is
inline in two long methods. Rather than copy both methods (and follow their changes across timm releases), the
patch embedding is class-swapped: in training (or inside ``mjp_eval``) it returns ``state(tokens) - pos_embed``,
where ``state(tokens)`` is :class:`mjp_fast.timm.MJPState`'s step on the table (the jigsawed tokens, ``unk_embed``
at the shuffled positions, the other positions' rows, the DAL loss attached), so that timm's own ``+ pos_embed``
gives MJP's tokens back. timm's ``forward_features``, ``forward_intermediates``, ``features_only`` wrapper,
``prune_intermediate_layers`` and FX tracing then run unchanged. The price: in training the tokens equal MJP's step
within one float rounding of the add (``(y - p) + p``); the gradient is exact (the table's ``-g`` and ``+g`` cancel,
leaving the step's). In eval mode, outside ``mjp_eval``, the patch embedding is timm's own: the model is timm's,
exactly.

MJP acts on the absolute table only. ConViT's gated positional self-attention (GPSA) blocks have positional terms of
their own (relative offsets, gated per head): a shuffled token keeps the relative positions of where it lands, as
in the pixel-space jigsaw of a relative-position model. A ConViT built with ``use_pos_embed=False`` has no table:
:func:`mjp_fast.timm.convert` gives it the pixel-space jigsaw, as every relative-position model (BEiT, the relpos
ViTs), for there is no row to replace and no table for DAL to regress.

Where the patch embedding is timm's standard ``PatchEmbed`` (a square Conv2d with stride equal to its kernel, no
norm, flattened output at a fixed size), the embedding, jigsaw and position term of a training step run fused
(``MJPState`` given the projection's ``weight`` and ``bias``, as the ViT's fused path). A ConViT with a CNN stem
(``HybridEmbed``: receptive fields across the patches' borders) gets its images jigsawed before the stem, one block of
pixels per token, and the masked positions ``unk_embed``, as a hybrid ViT.
"""

from __future__ import annotations

import torch
from timm.layers import HybridEmbed, PatchEmbed
from timm.models.cait import Cait
from timm.models.convit import ConVit
from torch import nn

from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import checked_images, original_class, projection_reason
from mjp_fast.timm.vit import hybrid_pixel_block

INLINE_TABLE_CLASSES: tuple[type, ...] = (Cait, ConVit)
"""timm classes whose ``forward_features`` and ``forward_intermediates`` add ``pos_embed`` right after
``patch_embed`` (the front end of this module)."""


class _InlineTableEmbed:
    """Mixed into a CaiT's or ConViT's patch embedding (class swap): while the model's ``MJPState`` is engaged it
    returns MJP's tokens minus ``pos_embed`` ``[B, N, D]``, which timm's inline ``+ pos_embed`` turns into MJP's tokens;
    otherwise timm's own embedding. The model is kept out of the module's children (no second copy in the state
    dict, no cycle in ``modules()``), in ``__dict__``: copies and pickles of the model keep pointing at themselves,
    and the table is read from the model at each call (``load_state_dict(assign=True)`` may replace it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the images ``[B, C, H, W]``. Returns the tokens ``[B, N, D]`` that timm adds ``pos_embed`` to."""
        model = self.__dict__["_mjp_model"]
        state = model.mjp
        if not state.engaged:  # MJP off (eval mode): timm's embedding, so the model is timm's exactly
            state.record_jigsaw(None)
            return super().forward(x)
        table, grid = model.pos_embed, tuple(self.grid_size)
        if self.__dict__.get("_mjp_fused", False):
            x = checked_images(self, x)  # a fixed size here (unfusable_embed_reason): timm's check of it
            proj = self.proj
            tokens = state(x, table, grid, proj.weight, proj.bias, prefix=None, prefix_positions=0)
        elif isinstance(self, HybridEmbed):
            # The stem sees across the patches' borders: the images are jigsawed before it (one FX node), and the
            # tokens, in jigsaw order already, get unk_embed at the masked positions.
            tokens = super().forward(state(x))
            tokens = state(tokens, table, grid, prefix=None, prefix_positions=0, pixels_jigsawed=True)
        else:  # each token a function of its own patch: moving the tokens is moving the patches
            tokens = state(super().forward(x), table, grid, prefix=None, prefix_positions=0)
        return tokens - table


class InlineTablePatchEmbed(_InlineTableEmbed, PatchEmbed):
    """timm's ``PatchEmbed`` of a CaiT or ConViT with MJP on its inline position table."""


class InlineTableHybridEmbed(_InlineTableEmbed, HybridEmbed):
    """timm's ``HybridEmbed`` (a ConViT's CNN stem) with MJP: images jigsawed before the stem."""


_NAMED_EMBEDS = {PatchEmbed: InlineTablePatchEmbed, HybridEmbed: InlineTableHybridEmbed}


class _MJPInlineTableModel(MJPModel):
    """What a CaiT or ConViT with MJP adds to timm's class: ``mjp_aux_loss`` (the DAL loss of ``pos_embed``, whose
    rows are all patch positions: no prefix rows) and ``mjp.unk_embed`` among the parameters without weight decay.
    ``forward``, ``forward_features`` and ``forward_intermediates`` are timm's (the patch embedding applies MJP)."""

    def mjp_aux_loss(self) -> torch.Tensor:
        state, table = self.mjp, self.pos_embed
        if state.dal_regressor is None:
            return table.new_zeros((), dtype=torch.float32)
        return state.aux_loss(table, tuple(self.patch_embed.grid_size), 0)

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra


class MJPCait(_MJPInlineTableModel, Cait):
    """A timm ``Cait`` with MJP position embeddings (made by :func:`mjp_fast.timm.convert`)."""


class MJPConVit(_MJPInlineTableModel, ConVit):
    """A timm ``ConVit`` with MJP on its absolute position table (made by :func:`mjp_fast.timm.convert`); its GPSA
    blocks' own positional terms are left as they are."""


_MJP_CLASSES = {Cait: MJPCait, ConVit: MJPConVit}


def has_inline_table(model: nn.Module) -> bool:
    """Whether ``model`` is this front end's: a ``Cait``, or a ``ConVit`` with a table (``use_pos_embed``)."""
    return isinstance(model, INLINE_TABLE_CLASSES) and getattr(model, "pos_embed", None) is not None


def unfusable_embed_reason(model: nn.Module) -> str | None:
    """None where the patch embedding of a CaiT or ConViT can run fused with the position term, else why not: timm's
    ``PatchEmbed`` itself (``forward`` not overridden), a square Conv2d with stride equal to its kernel, no padding,
    dilation or groups, no norm, flattened ``[B, N, D]`` output at the fixed size of its table's grid."""
    embed = model.patch_embed
    reason = projection_reason(embed)
    if reason is not None:
        return reason
    if not embed.flatten or not embed.strict_img_size or embed.dynamic_img_pad:
        return "patch_embed does not output flattened tokens at one fixed image size (the table has one grid)"
    if model.pos_embed.shape[1] != embed.num_patches:
        return f"pos_embed has {model.pos_embed.shape[1]} positions, not the {embed.num_patches} patches"
    return None


def inline_table_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a CaiT or ConViT with a table (the pixel block: a hybrid ConViT's
    pixels per token, else None).

    Raises:
        ValueError: ``fused_patch_embed=True`` where the patch embedding cannot run fused (the message says why), or a
            hybrid stem whose image size is not square blocks of its grid.
        TypeError: a patch embedding without timm's ``grid_size`` (the table's grid).
    """
    embed = model.patch_embed
    if not hasattr(embed, "grid_size"):
        raise TypeError(f"model: its patch embedding ({type(embed).__name__}) has no grid_size (the table's grid)")
    reason = unfusable_embed_reason(model) if fused_patch_embed is not False else None
    if fused_patch_embed and reason is not None:
        raise ValueError(f"fused_patch_embed=True: {reason}")
    pixel_block = hybrid_pixel_block(embed)
    patch = embed.patch_size if pixel_block is None else pixel_block
    patch = patch[0] if isinstance(patch, (tuple, list)) else patch
    timm_class = next(base for base in INLINE_TABLE_CLASSES if isinstance(model, base))
    new_class = mjp_class_of(original_class(type(model)), timm_class, _MJP_CLASSES[timm_class])
    fuse = fused_patch_embed is not False and reason is None
    return TokenLayout(new_class, tuple(embed.grid_size), model.embed_dim, int(patch), fuse, pixel_block)


def runs_fused(model: nn.Module) -> bool:
    """Whether a converted CaiT's or ConViT's MJP embedding was installed fused with its position term."""
    embed = model.patch_embed
    return isinstance(embed, _InlineTableEmbed) and bool(embed.__dict__.get("_mjp_fused", False))


def install_inline_table(model: nn.Module, layout: TokenLayout) -> None:
    """Swaps the patch embedding of a converted CaiT or ConViT (holding ``model.mjp`` already) to apply MJP: fused
    with the position term where ``layout.fuse`` (checked by :func:`inline_table_layout`)."""
    fuse = layout.fuse
    embed = model.patch_embed
    embed_class = original_class(type(embed))
    named = _NAMED_EMBEDS.get(embed_class)
    embed.__class__ = named if named is not None else mjp_class_of(embed_class, None, _InlineTableEmbed)
    embed.__dict__["_mjp_model"] = model
    embed.__dict__["_mjp_fused"] = fuse


FRONT_END = TokenFrontEnd(
    has_inline_table, inline_table_layout, install_inline_table, runs_fused, names=("Cait", "ConVit")
)
"""CaiT and ConViT (with a table), for :func:`mjp_fast.timm.convert`."""
