"""MJP for timm's ``Visformer``: learned absolute position tables ``pos_embed1``, ``pos_embed2``, ``pos_embed3``
``[1, D_i, H_i, W_i]`` (NCHW), each added right after its stage's patch embedding (``x = pos_drop(patch_embed_i(x) +
pos_embed_i)`` in ``forward_features`` and ``forward_intermediates``); all three None with ``use_pos_embed=False``.

Where MJP acts: on ``pos_embed1``, the table of the first and finest grid, whose positions are the first patch
embedding's tokens. ``pos_embed2`` and ``pos_embed3`` stay as they are: their grids are made by the later patch
embeddings from 2x2 cells of the stage before, so a moved patch is mixed into the cell of where it lands and gets
that cell's row (the naive shuffle, as for any table after a pooling stage: PiT's, NesT's later levels'). DAL
regresses ``pos_embed1``'s ``H * W`` rows in row-major grid order (``pos_embed1.flatten(2).transpose(1, 2)``).

How the patches move: Visformer's default stem (``init_channels`` set: ``visformer_tiny``, ``visformer_small``) is a
Conv2d of kernel 7, stride 2 and padding 3 before ``patch_embed1`` (a Conv2d whose stride is its kernel): each token
sees three pixels into its neighbours' blocks, so moving tokens would leave each carrying its neighbourhood. The
images are jigsawed before the stem instead (the stem class-swapped to call ``model.mjp`` on its input), one block of
``stem stride x patch`` pixels per token (8 for timm's models), and the tokens, in jigsaw order already, get
``unk_embed`` at the masked positions (``pixels_jigsawed=True``). Where the grid's blocks do not tile the images, the
top-left ``H * block`` by ``W * block`` pixels are jigsawed and the strip past them stays, as PiT's
(:func:`mjp_fast.timm.pit.jigsaw_top_left`). Without a stem (``init_channels=None``) each token
is a function of its own patch (a non-overlapping Conv2d, then at most a BatchNorm, whose statistics a permutation
within each image leaves as they are): the tokens themselves are moved (another norm after the embedding is refused
with the reason).

Where MJP hooks in, without copying timm's methods: as for PiT, ``patch_embed1`` is class-swapped; while MJP is
engaged it returns MJP's tokens minus ``pos_embed1`` (both ``[B, D, H, W]``), which timm's ``+ pos_embed1`` turns into
MJP's tokens (within one float rounding; the gradient is exact). In eval mode outside ``mjp_eval`` the stem and the
embedding are timm's: the model is timm's, exactly.

A Visformer without tables (``use_pos_embed=False``) is not this front end's: :func:`mjp_fast.timm.convert` gives it
the pixel jigsaw, as every model without a table. Not fused: ``patch_embed1`` writes an NCHW map (``flatten=False``)
behind a convolutional stem or before a BatchNorm, which the fused op (flattened tokens of one projection plus their
table rows) does not compute; ``fused_patch_embed=True`` is refused with that reason.
"""

from __future__ import annotations

import math

import torch
from timm.layers import PatchEmbed
from timm.models.visformer import Visformer
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import KeptTableRows, TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import original_class
from mjp_fast.timm.pit import jigsaw_top_left


class _VisformerPixelStem:
    """Mixed into a Visformer's stem (class swap; timm's is an ``nn.Sequential``): while ``model.mjp`` is engaged the
    images are jigsawed first, then timm's stem runs. The state is kept in ``__dict__`` (not a child: no second copy in
    the state dict); copies and pickles keep pointing at their own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the images ``[B, C, H, W]``. Returns the stem's map of the (jigsawed) images."""
        state = self.__dict__["_mjp_state"]
        if state.engaged:
            grid, image_size = self.__dict__["_mjp_grid"], self.__dict__["_mjp_image_size"]
            x = jigsaw_top_left(state, x, grid, state.patch_size, image_size)
        return super().forward(x)


class _VisformerEmbed:
    """Mixed into a Visformer's ``patch_embed1`` (class swap): while the model's ``MJPState`` is engaged it returns
    MJP's tokens minus ``pos_embed1`` ``[B, D, H, W]``, which timm's ``+ pos_embed1`` turns into MJP's tokens; otherwise
    timm's own embedding. The model is kept in ``__dict__``, out of the module's children (no second copy in the state
    dict, no cycle in ``modules()``): copies and pickles keep pointing at themselves, and the table is read from the
    model at each call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the stem's map (of the jigsawed images), or the images where there is no stem, ``[B, C, H', W']``.
        Returns the map ``[B, D, H, W]`` that timm adds ``pos_embed1`` to."""
        model = self.__dict__["_mjp_model"]
        state = model.mjp
        if not state.engaged:  # MJP off (eval mode): timm's embedding, so the model is timm's exactly
            state.record_jigsaw(None)
            return super().forward(x)
        grid, moves_tokens = self.__dict__["_mjp_grid"], self.__dict__["_mjp_moves_tokens"]
        features = super().forward(x)
        table = model.pos_embed1
        rows = table.flatten(2).transpose(1, 2)  # [1, N, D], row-major: the rows MJP replaces and DAL regresses
        self.__dict__["_mjp_kept_rows"].keep(table, rows)
        tokens = features.flatten(2).transpose(1, 2)
        # Without a stem each token is its own patch's: moving the tokens moves the patches. Behind a stem the images
        # were jigsawed before it, so the tokens are in jigsaw order already: unk_embed at the masked ones.
        stepped = state(tokens, rows, grid, prefix=None, prefix_positions=0, pixels_jigsawed=not moves_tokens)
        return stepped.transpose(1, 2).unflatten(2, grid) - table


class VisformerPatchEmbed(_VisformerEmbed, PatchEmbed):
    """timm's ``PatchEmbed`` as a Visformer's ``patch_embed1``, with MJP on ``pos_embed1``."""


class MJPVisformer(MJPModel, Visformer):
    """A timm ``Visformer`` with MJP on its first stage's position table (made by :func:`mjp_fast.timm.convert`):
    ``mjp_aux_loss`` (the DAL loss of ``pos_embed1``'s ``H * W`` rows) and ``mjp.unk_embed`` among the parameters
    without weight decay. ``forward``, ``forward_features`` and ``forward_intermediates`` are timm's (the stem and the
    first patch embedding apply MJP)."""

    def mjp_aux_loss(self) -> torch.Tensor:
        state, table = self.mjp, self.pos_embed1
        if state.dal_regressor is None:
            return table.new_zeros((), dtype=torch.float32)
        embed = self.patch_embed1
        rows = embed.__dict__["_mjp_kept_rows"].rows_of(table, table.flatten(2).transpose(1, 2))
        return state.aux_loss(rows, embed.__dict__["_mjp_grid"], 0)

    def no_weight_decay(self) -> set[str]:
        # timm's Visformer names none (its optimizer factory then decays the tables): only MJP's own is added.
        timm_names = getattr(super(), "no_weight_decay", None)
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return (set(timm_names()) if timm_names is not None else set()) | extra


def covers(model: nn.Module) -> bool:
    """Whether ``model`` is this front end's: a timm ``Visformer`` with its tables (``use_pos_embed``)."""
    return isinstance(model, Visformer) and getattr(model, "pos_embed1", None) is not None


def _stem_stride(stem: nn.Module | None) -> int | None:
    """The stride of a Visformer's stem (the product of its convolutions' and pools' square strides), 1 without a
    stem; None where a stride is not square."""
    if stem is None:
        return 1
    strides = []
    for module in stem.modules():
        stride = getattr(module, "stride", 1) if isinstance(module, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)) else 1
        stride = tuple(stride) if isinstance(stride, (tuple, list)) else (stride, stride)
        if stride[0] != stride[1]:
            return None
        strides.append(int(stride[0]))
    return math.prod(strides)


def _unfit_reason(model: nn.Module) -> str | None:
    """None where ``pos_embed1`` is over ``patch_embed1``'s grid and a token's block of pixels is whole (the stem's
    stride times the embedding's), else why not."""
    embed = model.patch_embed1
    proj = getattr(embed, "proj", None)
    if not isinstance(proj, nn.Conv2d):
        return f"patch_embed1's proj is a {type(proj).__name__}, not an nn.Conv2d"
    if tuple(proj.stride) != tuple(proj.kernel_size) or proj.stride[0] != proj.stride[1]:
        return (
            f"patch_embed1's kernel {tuple(proj.kernel_size)} and stride {tuple(proj.stride)}: a token per square "
            "block needs the stride equal to a square kernel"
        )
    if proj.padding not in ("valid", (0, 0)) or embed.dynamic_img_pad:
        return f"patch_embed1 pads its input (padding {proj.padding}): its tokens do not start at whole blocks"
    if _stem_stride(model.stem) is None:
        return "its stem's stride is not square (the jigsaw cuts square blocks)"
    if model.stem is None and not isinstance(embed.norm, (nn.Identity, _BatchNorm)):
        return (
            f"patch_embed1's norm is a {type(embed.norm).__name__}: without a stem MJP moves patch_embed1's tokens, "
            "which needs each a function of its own patch (no norm, or a BatchNorm)"
        )
    grid = tuple(embed.grid_size)
    if tuple(model.pos_embed1.shape[-2:]) != grid:
        return f"pos_embed1's grid {tuple(model.pos_embed1.shape[-2:])} is not patch_embed1's {grid}"
    return None


def visformer_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a Visformer with tables: ``pos_embed1``'s grid and width, a token's
    block of pixels (the stem's stride times ``patch_embed1``'s), never fused; the pixel block is that block where the
    images are jigsawed, None where the tokens are moved.

    Raises:
        ValueError: ``fused_patch_embed=True``, or a first stage whose tokens are not whole blocks of the images (the
            message says why).
    """
    if fused_patch_embed:
        raise ValueError(
            "fused_patch_embed=True: Visformer's patch_embed1 writes an NCHW map behind a convolutional stem or "
            "before a BatchNorm, which the fused op (flattened tokens of one projection plus their table rows) does "
            "not compute"
        )
    reason = _unfit_reason(model)
    if reason is not None:
        raise ValueError(f"model: {type(model).__name__}: {reason}")
    block = _stem_stride(model.stem) * int(model.patch_embed1.proj.stride[0])
    new_class = mjp_class_of(original_class(type(model)), Visformer, MJPVisformer)
    pixel_block = block if model.stem is not None else None
    grid, dim = tuple(model.patch_embed1.grid_size), int(model.pos_embed1.shape[1])
    return TokenLayout(new_class, grid, dim, block, False, pixel_block)


def install_visformer(model: nn.Module, layout: TokenLayout) -> None:
    """Swaps ``patch_embed1`` (and the stem, where the images are jigsawed before it) of a converted Visformer (holding
    ``model.mjp`` already) to apply MJP on ``pos_embed1``."""
    embed = model.patch_embed1
    embed_class = original_class(type(embed))
    named = embed_class is PatchEmbed
    embed.__class__ = VisformerPatchEmbed if named else mjp_class_of(embed_class, None, _VisformerEmbed)
    moves_tokens = layout.pixel_block is None
    embed.__dict__.update(
        _mjp_model=model, _mjp_grid=layout.grid, _mjp_moves_tokens=moves_tokens, _mjp_kept_rows=KeptTableRows()
    )
    if not moves_tokens:
        stem = model.stem
        stem.__class__ = mjp_class_of(original_class(type(stem)), None, _VisformerPixelStem)
        image_size = tuple(int(side) for side in model.img_size)
        stem.__dict__.update(_mjp_state=model.mjp, _mjp_grid=layout.grid, _mjp_image_size=image_size)


def runs_fused(model: nn.Module) -> bool:
    """A Visformer's embedding never runs fused."""
    return False


FRONT_END = TokenFrontEnd(covers, visformer_layout, install_visformer, runs_fused, names=("Visformer",))
"""Visformer (with its tables), for :func:`mjp_fast.timm.convert`."""
