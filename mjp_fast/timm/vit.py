"""MJP for timm's ``VisionTransformer`` and its subclasses (a distilled DeiT too): the jigsaw and the unknown
embedding on the absolute position table, fused with the patch embedding where it is timm's standard one.

Where each token is a function of its own patch alone (timm's ``PatchEmbed``: one linear map, an optional per-token
norm), moving the embedded tokens is moving the patches, and the jigsaw moves tokens. A hybrid ViT's tokens come
from a CNN stem (timm's ``HybridEmbed``) whose receptive fields cross the patches' borders: moved after it, a token
would still carry its neighbourhood, hence its place. There MJP jigsaws the input images, as the paper's code does
for every model, one block of pixels per token, and the masked positions get ``unk_embed`` with the tokens left in
the order the stem gives them."""

from __future__ import annotations

import torch
from timm.layers import HybridEmbed, resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from mjp_fast.timm.base import MJPModel
from mjp_fast.timm.fused import fused_pos_embed, is_fused, prefix_positions_of, prefix_tokens_of


class _PixelJigsawEmbed:
    """Mixed into a hybrid ViT's patch embedding (class swap): the model's ``MJPState`` jigsaws the images first (one
    FX node; nothing while the sampler is inactive). The state is kept out of the module's children (no second copy
    in the state dict), in ``__dict__``, which copies and pickles of the model keep pointing at ``model.mjp``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.__dict__["_mjp_state"](x))


_PIXEL_JIGSAW_EMBEDS: dict[type, type] = {}


def jigsaw_pixels_before(patch_embed: nn.Module, state: nn.Module) -> None:
    """Makes ``patch_embed`` (a ``HybridEmbed``) jigsaw its input images through ``state``."""
    embed_class = type(patch_embed)
    if embed_class not in _PIXEL_JIGSAW_EMBEDS:
        _PIXEL_JIGSAW_EMBEDS[embed_class] = type(
            f"PixelJigsaw{embed_class.__name__}", (_PixelJigsawEmbed, embed_class), {"__module__": __name__}
        )
    patch_embed.__class__ = _PIXEL_JIGSAW_EMBEDS[embed_class]
    patch_embed.__dict__["_mjp_state"] = state


def hybrid_pixel_block(patch_embed: nn.Module) -> int | None:
    """The side in pixels of one token's block of a hybrid ViT's input (its image size over its token grid), or None
    where the tokens are each a function of their own patch (the jigsaw moves tokens there).

    Raises:
        ValueError: a hybrid embedding whose image size is not a multiple of its token grid.
    """
    if not isinstance(patch_embed, HybridEmbed):
        return None
    (height, width), (rows, cols) = patch_embed.img_size, patch_embed.grid_size
    if height % rows or width % cols or height // rows != width // cols:
        raise ValueError(
            f"model: its hybrid patch embedding maps {height}x{width} pixels to a {rows}x{cols} grid of tokens, not "
            "square blocks of whole pixels, which the pixel-space jigsaw needs"
        )
    return height // rows


class MJPVisionTransformer(MJPModel, VisionTransformer):
    """A timm ``VisionTransformer`` with MJP position embeddings (made by :func:`convert`)."""

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        state, patch_embed, pos_embed = self.mjp, self.patch_embed, self.pos_embed
        if is_fused(patch_embed):  # x: the images, passed through by patch_embed
            return fused_pos_embed(self, x, state)
        if pos_embed is None or not state.engaged:
            state.record_jigsaw(None)
            return super()._pos_embed(x)
        grid = patch_embed.grid_size  # the model's (set_input_size may have changed it since the sampler was made)
        dal_table = dal_grid = None  # DAL regresses the stored table, not one resampled for another input size
        if self.dynamic_img_size:
            batch, rows, cols, dim = x.shape
            grid = (rows, cols)
            pos_embed = resample_abs_pos_embed(
                pos_embed, new_size=grid, old_size=patch_embed.grid_size, num_prefix_tokens=prefix_positions_of(self)
            )
            x = x.reshape(batch, rows * cols, dim)
            dal_table, dal_grid = self.pos_embed, patch_embed.grid_size
        # The whole table and the prefix tokens go in: the kernels write [B, P + N, D] at once (no slice, no cat).
        prefix, prefix_positions = prefix_tokens_of(self), prefix_positions_of(self)
        x = state(
            x, pos_embed, grid, prefix=prefix, prefix_positions=prefix_positions, dal_table=dal_table,
            dal_grid=dal_grid, pixels_jigsawed=isinstance(patch_embed, _PixelJigsawEmbed),
        )  # fmt: skip
        return self.pos_drop(x)

    def mjp_aux_loss(self) -> torch.Tensor:
        state, pos_embed = self.mjp, self.pos_embed
        regressor = state.dal_regressor
        if regressor is None or pos_embed is None:
            anchor = pos_embed if pos_embed is not None else state.unk_embed
            return anchor.new_zeros((), dtype=torch.float32)
        # The loss the last forward attached (counted at the loop's weight), else computed: one path, the state's.
        return state.aux_loss(pos_embed, self.patch_embed.grid_size, prefix_positions_of(self))

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra
