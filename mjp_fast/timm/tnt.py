"""MJP for timm's ``TNT`` (Transformer in Transformer): a patch-level position table ``patch_pos``
``[1, 1 + N, D]`` (the class token's row first) on the outer tokens, and a pixel-level table ``pixel_pos``
``[1, C, p, p]`` added to the inner (pixel) tokens of every patch alike.

How TNT forms its tokens: ``pixel_embed`` cuts the images into patches with an unfold (kernel and stride the patch
size) and runs a small convolution inside each patch (``legacy=True``: the convolution runs over the whole image
first, then its output is unfolded), adding ``pixel_pos``: the inner tokens ``[B * N, p * p, C]``. The outer tokens
are a projection of each patch's inner tokens (``norm2_proj(proj(norm1_proj(...)))``, ``[B, N, D]``); timm then puts
the class token in front and adds ``patch_pos``. Every block mixes each patch's inner tokens into its outer token
again, so inner and outer tokens must move together.

What MJP does: the jigsaw moves the patches, so the images are jigsawed before the pixel embedding, one block of
``patch_size`` pixels per patch (``MJPState(images)``): every inner token and the outer token move with their patch
(exactly, since TNT's embedding is patch-local; with ``legacy=True`` a patch's convolution also sees its neighbours'
border pixels, as a hybrid ViT's stem does). ``pixel_pos`` stays as it is: each patch keeps its inner positions. On
the outer tokens, the masked positions get ``unk_embed`` in place of their ``patch_pos`` row and the others their
own row (``MJPState(tokens, ..., pixels_jigsawed=True)``); DAL regresses ``patch_pos``'s patch rows (not the class
token's).

Where MJP hooks in, without copying timm's ``forward_features`` and ``forward_intermediates``: two class swaps.
``pixel_embed`` jigsaws the images before timm's own embedding; the model's ``norm2_proj`` (the last step of the
outer tokens, before timm's ``cat`` and ``+ patch_pos``) returns MJP's outer tokens minus their ``patch_pos``
rows, which timm's add turns back into MJP's tokens (within one float rounding; the gradient is exact). In eval mode
outside ``mjp_eval`` both are timm's own: the model is timm's, exactly. The embedding cannot run fused: it is not
timm's ``PatchEmbed``.
"""

from __future__ import annotations

import torch
from timm.models.tnt import TNT, PixelEmbed
from torch import nn

from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import original_class
from mjp_fast.timm.pit import jigsaw_top_left


class _TntPixelEmbed:
    """Mixed into a TNT's ``PixelEmbed`` (class swap): while the model's ``MJPState`` is engaged, the images are
    jigsawed first (one block of ``patch_size`` pixels per patch), then timm's pixel embedding runs. The model is kept
    in ``__dict__`` (not a child: no second copy in the state dict); copies and pickles keep pointing at themselves."""

    def forward(self, x: torch.Tensor, pixel_pos: torch.Tensor) -> torch.Tensor:
        """``x``: the images ``[B, C, H, W]``; ``pixel_pos`` ``[1, C', p, p]``. Returns timm's inner tokens
        ``[B * N, p * p, C']`` of the (jigsawed) images."""
        state = self.__dict__["_mjp_model"].mjp
        if state.engaged:
            x = jigsaw_top_left(state, x, tuple(self.grid_size), state.patch_size, tuple(self.img_size))
        return super().forward(x, pixel_pos)


class TntPixelEmbed(_TntPixelEmbed, PixelEmbed):
    """timm's TNT ``PixelEmbed`` whose images MJP jigsaws first."""


class _TntOuterTokens:
    """Mixed into a TNT's ``norm2_proj`` (class swap; a ``LayerNorm`` by default): while the model's ``MJPState`` is
    engaged, it returns the outer tokens after MJP's step (``unk_embed`` at the masked positions, their own
    ``patch_pos`` row elsewhere; the DAL loss attached in training) minus their ``patch_pos`` rows, so that timm's
    ``+ patch_pos`` after its ``cat`` with the class token gives MJP's tokens; otherwise the norm itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the outer tokens before the norm ``[B, N, D]``. Returns ``[B, N, D]``."""
        model = self.__dict__["_mjp_model"]
        state = model.mjp
        tokens = super().forward(x)
        if not state.engaged:  # MJP off (eval mode): timm's norm, so the model is timm's exactly
            state.record_jigsaw(None)
            return tokens
        table, grid = model.patch_pos, tuple(model.pixel_embed.grid_size)
        # The class token goes in as the prefix so that the step reads the table's patch rows after its row (the
        # kernels' layout); its output row is timm's to make, and is dropped here.
        stepped = state(tokens, table, grid, prefix=model.cls_token, prefix_positions=1, pixels_jigsawed=True)
        return stepped[:, 1:] - table[:, 1:]


class TntOuterTokensLayerNorm(_TntOuterTokens, nn.LayerNorm):
    """A TNT's ``norm2_proj`` (``nn.LayerNorm``) that applies MJP's step to the outer tokens."""


class MJPTNT(MJPModel, TNT):
    """A timm ``TNT`` with MJP on its patch-level position table (made by :func:`mjp_fast.timm.convert`):
    ``mjp_aux_loss`` (the DAL loss of ``patch_pos``'s patch rows) and ``mjp.unk_embed`` among the parameters without
    weight decay. ``forward``, ``forward_features`` and ``forward_intermediates`` are timm's."""

    def mjp_aux_loss(self) -> torch.Tensor:
        state, table = self.mjp, self.patch_pos
        if state.dal_regressor is None:
            return table.new_zeros((), dtype=torch.float32)
        return state.aux_loss(table, tuple(self.pixel_embed.grid_size), 1)

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra


def is_tnt(model: nn.Module) -> bool:
    """Whether ``model`` is this front end's: a timm ``TNT``."""
    return isinstance(model, TNT)


def _unjigsawable_reason(model: nn.Module) -> str | None:
    """None where the patches of TNT's pixel embedding are square blocks of whole pixels that the table's rows
    follow, else why not."""
    embed = model.pixel_embed
    if not isinstance(embed, PixelEmbed):
        return f"its pixel_embed is a {type(embed).__name__}, not timm's TNT PixelEmbed"
    patch = tuple(embed.patch_size)
    if patch[0] != patch[1]:
        return f"its patch size {patch} is not square (the jigsaw cuts square blocks)"
    if model.patch_pos.shape[1] != 1 + embed.num_patches:
        return f"patch_pos has {model.patch_pos.shape[1]} rows, not 1 + {embed.num_patches} (class, then patches)"
    stride = tuple(embed.proj.stride)
    if embed.legacy and (patch[0] % stride[0] or patch[1] % stride[1]):
        # legacy: the convolution runs over the whole image before the unfold; a patch's inner tokens are its
        # pixels only where the patch is a whole number of the convolution's steps
        return f"legacy pixel embedding: the patch size {patch} is not a multiple of its convolution's stride {stride}"
    return None


def tnt_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a TNT: its patch grid and outer width, the patch size as the jigsaw's
    block (the images are jigsawed before the pixel embedding), never fused.

    Raises:
        ValueError: ``fused_patch_embed=True`` (TNT's pixel embedding is not timm's ``PatchEmbed``), or a pixel
            embedding whose patches are not square blocks of whole pixels (the message says why).
    """
    if fused_patch_embed:
        raise ValueError(
            "fused_patch_embed=True: TNT's pixel_embed (an unfold into patches, a convolution inside each, and the "
            "outer tokens projected from them) is not timm's PatchEmbed, which the fused op computes"
        )
    reason = _unjigsawable_reason(model)
    if reason is not None:
        raise ValueError(f"model: {type(model).__name__}: {reason}")
    block = int(model.pixel_embed.patch_size[0])
    new_class = mjp_class_of(original_class(type(model)), TNT, MJPTNT)
    grid = tuple(model.pixel_embed.grid_size)
    return TokenLayout(new_class, grid, int(model.patch_pos.shape[-1]), block, False, block)


def runs_fused(model: nn.Module) -> bool:
    """A TNT's embedding never runs fused."""
    return False


def _swapped(module: nn.Module, named: dict[type, type], mixin: type) -> type:
    module_class = original_class(type(module))
    return named[module_class] if module_class in named else mjp_class_of(module_class, None, mixin)


def install_tnt(model: nn.Module, layout: TokenLayout) -> None:
    """Swaps the pixel embedding and the outer tokens' last norm of a converted TNT (holding ``model.mjp``
    already) to apply MJP."""
    for module, named, mixin in (
        (model.pixel_embed, {PixelEmbed: TntPixelEmbed}, _TntPixelEmbed),
        (model.norm2_proj, {nn.LayerNorm: TntOuterTokensLayerNorm}, _TntOuterTokens),
    ):
        module.__class__ = _swapped(module, named, mixin)
        module.__dict__["_mjp_model"] = model


FRONT_END = TokenFrontEnd(is_tnt, tnt_layout, install_tnt, runs_fused, names=("TNT",))
"""TNT (its patch-level table), for :func:`mjp_fast.timm.convert`."""
