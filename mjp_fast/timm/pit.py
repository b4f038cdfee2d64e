"""MJP for timm's ``PoolingVisionTransformer`` (PiT): a spatial position table ``pos_embed`` ``[1, D, H, W]`` added in
the NCHW layout right after a convolutional patch embedding (``x = patch_embed(x); x = pos_drop(x + pos_embed)`` in
both ``forward_features`` and ``forward_intermediates``), then a pyramid of pooled stages. The class token (two, the
class and distillation tokens, in a distilled PiT) is concatenated inside each stage, after the table: the table
holds the first stage's positions only, and MJP acts on that stage's grid.

Where MJP hooks in: as for CaiT and ConViT (:mod:`mjp_fast.timm.inline_table`), the patch embedding is class-swapped
so that timm's own methods run unchanged: while MJP is engaged it returns MJP's tokens minus ``pos_embed`` (both
``[B, D, H, W]``), which timm's ``+ pos_embed`` turns into MJP's tokens (within one float rounding; the gradient is
exact). In eval mode outside ``mjp_eval`` it is timm's embedding: the model is timm's, exactly.

Why the images are jigsawed, and which pixels: PiT's ``ConvEmbedding`` is a convolution whose kernel (16) is larger
than its stride (8) and which has no padding: neighbouring tokens see overlapping pixels, so a token is not a
function of its own patch and moving tokens would not move their content. The images are jigsawed before the
embedding instead (as a hybrid ViT's), one block of ``stride`` pixels per token, and the tokens, in jigsaw order
already, get ``unk_embed`` at the masked positions and their own row elsewhere. The grid does not tile the image:
``H = (image - kernel) // stride + 1`` tokens (27 for 224 pixels, not 224 / 8 = 28), because the last kernel ends at
the image's border. Each token is given the block where its receptive field starts (token ``(i, j)``: pixels
``[i * stride, (i + 1) * stride)`` down and across, the top-left block of its kernel), so the jigsaw cuts the
top-left ``H * stride`` by ``W * stride`` pixels into the token grid's blocks and moves those; the strip of
``image - H * stride`` pixels at the bottom and right (8 for PiT's 224-pixel models) is only ever the far edge of the
last row's and column's kernels and stays where it is. The sampler, the mask, ``unk_embed`` and the DAL loss then
all work on the table's own grid. A token near a shuffled block also sees part of it, as with any stem whose
receptive fields cross the blocks' borders (the paper jigsaws the images of every model this way).

DAL regresses the table's ``H * W`` positions, in row-major order (``pos_embed.flatten(2).transpose(1, 2)``: the
``[1, N, D]`` view the MJP step reads). The embedding cannot run fused: it is not timm's ``PatchEmbed``, and its
patches overlap.
"""

from __future__ import annotations

import torch
from timm.models.pit import ConvEmbedding, PoolingVisionTransformer
from torch import nn

from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import KeptTableRows, TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import original_class
from mjp_fast.timm.state import MJPState


def jigsaw_top_left(
    state: MJPState, images: torch.Tensor, grid: tuple[int, int], block: int, image_size: tuple[int, int]
) -> torch.Tensor:
    """The images ``[B, C, H, W]`` (of the model's ``image_size``) with their top-left ``grid[0] * block`` by
    ``grid[1] * block`` pixels jigsawed by ``state``, one ``block``-pixel square per token of ``grid`` (the sampler
    draws on that grid), and the pixels right of and below that region, which no token's block holds, left where they
    are. Decided from the sizes the model was built for, so that an FX graph holds the same operations."""
    height, width = grid[0] * block, grid[1] * block
    if (height, width) == tuple(image_size):  # the grid tiles the images: TNT, a PiT whose kernel is its stride
        return state(images)
    region = images[..., :height, :width]
    jigsawed = state(region)
    if jigsawed is region:  # the sampler is inactive (training DAL only): nothing moved, no copy
        return images
    right, below = images[..., :height, width:], images[..., height:, :]
    return torch.cat((torch.cat((jigsawed, right), dim=-1), below), dim=-2)


class _PitEmbed:
    """Mixed into a PiT's ``ConvEmbedding`` (class swap): while the model's ``MJPState`` is engaged, it jigsaws the
    images (top-left blocks of ``stride`` pixels, see the module docstring), embeds them with timm's convolution and
    returns MJP's tokens minus ``pos_embed`` ``[B, D, H, W]``; otherwise timm's own embedding. The model is kept out
    of the module's children (no second copy in the state dict, no cycle in ``modules()``), in ``__dict__``: copies
    and pickles of the model keep pointing at themselves, and the table is read from the model at each call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the images ``[B, C, H, W]``. Returns the feature map ``[B, D, rows, cols]`` that timm adds
        ``pos_embed`` to."""
        model = self.__dict__["_mjp_model"]
        state = model.mjp
        if not state.engaged:  # MJP off (eval mode): timm's embedding, so the model is timm's exactly
            state.record_jigsaw(None)
            return super().forward(x)
        table = model.pos_embed
        grid = tuple(self.grid_size)
        features = super().forward(jigsaw_top_left(state, x, grid, state.patch_size, tuple(self.img_size)))
        rows = table.flatten(2).transpose(1, 2)  # [1, N, D], row-major: the rows DAL regresses
        self.__dict__["_mjp_kept_rows"].keep(table, rows)
        # The tokens are in jigsaw order already (the images were jigsawed): unk_embed at the masked positions.
        tokens = state(
            features.flatten(2).transpose(1, 2), rows, grid, prefix=None, prefix_positions=0, pixels_jigsawed=True
        )
        return tokens.transpose(1, 2).unflatten(2, grid) - table


class PitConvEmbedding(_PitEmbed, ConvEmbedding):
    """timm's PiT ``ConvEmbedding`` with MJP on the model's spatial position table."""


class MJPPoolingVisionTransformer(MJPModel, PoolingVisionTransformer):
    """A timm ``PoolingVisionTransformer`` (PiT, distilled or not) with MJP on its first stage's position table (made
    by :func:`mjp_fast.timm.convert`): ``mjp_aux_loss`` (the DAL loss of ``pos_embed``'s ``H * W`` positions) and
    ``mjp.unk_embed`` among the parameters without weight decay. ``forward``, ``forward_features`` and
    ``forward_intermediates`` are timm's (the patch embedding applies MJP)."""

    def mjp_aux_loss(self) -> torch.Tensor:
        state, table = self.mjp, self.pos_embed
        if state.dal_regressor is None:
            return table.new_zeros((), dtype=torch.float32)
        rows = self.patch_embed.__dict__["_mjp_kept_rows"].rows_of(table, table.flatten(2).transpose(1, 2))
        return state.aux_loss(rows, tuple(self.patch_embed.grid_size), 0)

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra


def is_pit(model: nn.Module) -> bool:
    """Whether ``model`` is this front end's: a timm ``PoolingVisionTransformer``."""
    return isinstance(model, PoolingVisionTransformer)


def _unjigsawable_reason(model: nn.Module) -> str | None:
    """None where the top-left blocks of the patch embedding's stride are the table's grid (module docstring), else
    why not."""
    embed = model.patch_embed
    conv = getattr(embed, "conv", None)
    if not isinstance(conv, nn.Conv2d):
        return f"its patch embedding's conv is a {type(conv).__name__}, not an nn.Conv2d"
    stride = tuple(conv.stride)
    if stride[0] != stride[1]:
        return f"its patch embedding's stride {stride} is not square (the jigsaw cuts square blocks)"
    if conv.padding not in ("valid", (0, 0)) or tuple(conv.dilation) != (1, 1):
        return (
            f"its patch embedding has padding {conv.padding} and dilation {tuple(conv.dilation)}: a token's "
            "receptive field then does not start at a whole block of the image (0 and 1 needed)"
        )
    rows, cols = embed.grid_size
    if tuple(model.pos_embed.shape[-2:]) != (rows, cols):
        return f"pos_embed's grid {tuple(model.pos_embed.shape[-2:])} is not the patch embedding's {(rows, cols)}"
    height, width = embed.img_size
    if rows * stride[0] > height or cols * stride[1] > width:
        return (
            f"its {rows}x{cols} tokens at a stride of {stride[0]} pixels need {rows * stride[0]}x{cols * stride[1]} "
            f"pixels, more than its {height}x{width} images (a kernel smaller than the stride)"
        )
    return None


def pit_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a PiT: its first stage's grid and width, the jigsaw's block (the
    patch embedding's stride, also the pixel block), never fused.

    Raises:
        ValueError: ``fused_patch_embed=True`` (PiT's embedding is not timm's ``PatchEmbed``), or a patch embedding
            whose grid is not blocks of whole pixels at its stride (the message says why).
    """
    if fused_patch_embed:
        raise ValueError(
            f"fused_patch_embed=True: patch_embed is PiT's {type(model.patch_embed).__name__}, not timm's PatchEmbed: "
            "its kernel is larger than its stride (overlapping patches), which the fused op does not compute"
        )
    reason = _unjigsawable_reason(model)
    if reason is not None:
        raise ValueError(f"model: {type(model).__name__}: {reason}")
    block = int(model.patch_embed.conv.stride[0])
    new_class = mjp_class_of(original_class(type(model)), PoolingVisionTransformer, MJPPoolingVisionTransformer)
    dim = int(model.pos_embed.shape[1])
    return TokenLayout(new_class, tuple(model.patch_embed.grid_size), dim, block, False, block)


def runs_fused(model: nn.Module) -> bool:
    """A PiT's embedding never runs fused."""
    return False


def install_pit(model: nn.Module, layout: TokenLayout) -> None:
    """Swaps the patch embedding of a converted PiT (holding ``model.mjp`` already) to apply MJP."""
    embed = model.patch_embed
    embed_class = original_class(type(embed))
    embed.__class__ = PitConvEmbedding if embed_class is ConvEmbedding else mjp_class_of(embed_class, None, _PitEmbed)
    embed.__dict__["_mjp_model"] = model
    embed.__dict__["_mjp_kept_rows"] = KeptTableRows()


FRONT_END = TokenFrontEnd(is_pit, pit_layout, install_pit, runs_fused, names=("PoolingVisionTransformer",))
"""PiT (``PoolingVisionTransformer``, distilled or not), for :func:`mjp_fast.timm.convert`."""
