"""MJP for timm's ``VOLO`` (Vision Outlooker): a learned absolute position table ``pos_embed`` ``[1, H, W, D]``
(channels last), added after the outlooker stage (``x = pos_drop(x + pos_embed)`` before ``network[2]``, in
``forward_tokens`` and ``forward_intermediates`` alike), on the grid of ``network[1]``, the ``Downsample`` that halves
the outlooker's grid: 1/16 of the image for timm's models.

Where the patches are: VOLO's stem (``patch_embed``) is three convolutions (kernel 7 at stride 2 and padding 3, then
two of kernel 3) and a projection of stride 4, at 1/8 of the image; the outlooker blocks mix each token with its 3x3
neighbourhood; then ``Downsample`` (a Conv2d of kernel and stride 2) makes the table's grid. A token of the table's
grid is made from pixels well beyond its own 16x16 block, so moving tokens would leave each carrying its
neighbourhood. The images are jigsawed before the stem instead (the stem class-swapped to call ``model.mjp`` on its
input), one block per cell of the table's grid (``stem stride x Downsample stride`` pixels: 16), which is where the
sampler, the mask, ``unk_embed`` and DAL all work. Where the blocks do not tile the images, the top-left
``H * block`` by ``W * block`` pixels are jigsawed and the strip past them stays, as PiT's
(:func:`mjp_fast.timm.pit.jigsaw_top_left`). The outlooker stage in between sees the jigsawed images at 1/8: a
shuffled block is four of its tokens, which keep no position term of their own (VOLO adds its table only later).

Where MJP hooks in, without copying timm's methods: ``network[1]`` (the ``Downsample``, whose output timm adds the
table to) is class-swapped; while MJP is engaged it returns its tokens, in jigsaw order already, with ``unk_embed`` at
the masked positions and their own row elsewhere (the DAL loss attached in training), minus ``pos_embed``: timm's
``+ pos_embed`` then gives MJP's tokens (within one float rounding; the gradient is exact). DAL regresses the
table's ``H * W`` rows in row-major order (``pos_embed.reshape(1, H * W, D)``). In eval mode outside ``mjp_eval`` the
stem and ``network[1]`` are timm's: the model is timm's, exactly. The class token and its class-attention blocks
come after the table, and stay as they are.

Not fused: the stem is not one non-overlapping projection, and the table is added three modules later;
``fused_patch_embed=True`` is refused with that reason.
"""

from __future__ import annotations

import math

import torch
from timm.models.volo import VOLO, Downsample
from timm.models.volo import PatchEmbed as VoloPatchEmbed
from torch import nn

from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import KeptTableRows, TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import original_class
from mjp_fast.timm.pit import jigsaw_top_left
from mjp_fast.timm.pixel import model_input_size


class _VoloPixelStem:
    """Mixed into a VOLO's ``patch_embed`` (class swap): while ``model.mjp`` is engaged the images are jigsawed
    first, one block per cell of the table's grid, then timm's stem runs. The state is kept in ``__dict__`` (not a
    child: no second copy in the state dict); copies and pickles keep pointing at their own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the images ``[B, C, H, W]``. Returns the stem's map ``[B, D, H / 8, W / 8]`` of the (jigsawed)
        images."""
        state = self.__dict__["_mjp_state"]
        if state.engaged:
            grid, image_size = self.__dict__["_mjp_grid"], self.__dict__["_mjp_image_size"]
            x = jigsaw_top_left(state, x, grid, state.patch_size, image_size)
        return super().forward(x)


class _VoloTableStep:
    """Mixed into a VOLO's ``network[1]`` (class swap; timm's ``Downsample``): while the model's ``MJPState`` is
    engaged it returns MJP's tokens minus ``pos_embed`` ``[B, H, W, D]``, which timm's ``+ pos_embed`` turns into MJP's
    tokens; otherwise timm's own output. The model is kept in ``__dict__``, out of the module's children (no second
    copy in the state dict, no cycle in ``modules()``): copies and pickles keep pointing at themselves, and the table is
    read from the model at each call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the outlooker stage's tokens ``[B, H', W', C]``. Returns the map ``[B, H, W, D]`` that timm adds
        ``pos_embed`` to."""
        out = super().forward(x)
        model = self.__dict__["_mjp_model"]
        state, table = model.mjp, model.pos_embed
        if not state.engaged or table is None:  # MJP off (eval mode): timm's, so the model is timm's exactly
            state.record_jigsaw(None)
            return out
        grid = self.__dict__["_mjp_grid"]
        rows = table.reshape(1, grid[0] * grid[1], table.shape[-1])  # [1, N, D]: the rows MJP replaces, DAL regresses
        self.__dict__["_mjp_kept_rows"].keep(table, rows)
        # The tokens are of the images jigsawed before the stem, in jigsaw order already: unk_embed at the masked
        # positions, their own rows elsewhere.
        stepped = state(out.flatten(1, 2), rows, grid, prefix=None, prefix_positions=0, pixels_jigsawed=True)
        return (stepped - rows).unflatten(1, grid)


class MJPVOLO(MJPModel, VOLO):
    """A timm ``VOLO`` with MJP on its position table (made by :func:`mjp_fast.timm.convert`): ``mjp_aux_loss`` (the
    DAL loss of ``pos_embed``'s ``H * W`` rows) and ``mjp.unk_embed`` among the parameters without weight decay.
    ``forward``, ``forward_features``, ``forward_train`` and ``forward_intermediates`` are timm's (the stem and
    ``network[1]`` apply MJP)."""

    def mjp_aux_loss(self) -> torch.Tensor:
        state, table = self.mjp, self.pos_embed
        if state.dal_regressor is None or table is None:
            reference = table if table is not None else self.mjp.dal_coordinates
            return reference.new_zeros((), dtype=torch.float32)
        step = self.network[1]
        grid = step.__dict__["_mjp_grid"]
        rows = step.__dict__["_mjp_kept_rows"].rows_of(table, table.reshape(1, grid[0] * grid[1], table.shape[-1]))
        return state.aux_loss(rows, grid, 0)

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra


def covers(model: nn.Module) -> bool:
    """Whether ``model`` is this front end's: a timm ``VOLO`` with its table (``prune_intermediate_layers`` drops the
    table of a VOLO cut before it is added)."""
    return isinstance(model, VOLO) and getattr(model, "pos_embed", None) is not None


def _stride(module: nn.Module) -> int | None:
    """The product of the square strides of ``module``'s convolutions; None where one is not square."""
    strides = []
    for conv in module.modules():
        if isinstance(conv, nn.Conv2d):
            if conv.stride[0] != conv.stride[1]:
                return None
            strides.append(int(conv.stride[0]))
    return math.prod(strides)


def _unfit_reason(model: nn.Module) -> str | None:
    """None where the table is added after a timm ``Downsample`` as ``network[1]`` and a cell of its grid is a whole
    square block of pixels, else why not."""
    if len(model.network) < 3:
        return "its network stops before network[2], before which the table is added (pruned): the table is unused"
    step = model.network[1]
    if not isinstance(step, Downsample):
        return (
            f"its network[1] is a {type(step).__name__}, not timm's VOLO Downsample: the table's grid is not the "
            "outlooker's halved"
        )
    if not isinstance(model.patch_embed, VoloPatchEmbed) or _stride(model.patch_embed) is None or _stride(step) is None:
        return "its stem or Downsample has a stride that is not square (the jigsaw cuts square blocks)"
    return None


def _image_size(model: nn.Module, grid: tuple[int, int], block: int) -> tuple[int, int]:
    """The image size VOLO was built for, for :func:`mjp_fast.timm.pit.jigsaw_top_left`, where timm says it and it
    agrees with the table's grid; else ``(0, 0)``, which no images have, so that the jigsaw takes its general path (the
    blocks' region jigsawed, whatever lies past it kept: nothing where the blocks tile the images). timm 1.0.29 keeps
    no image size for VOLO, and its pretrained config's 224 px is another model's."""
    size = model_input_size(model)
    if size is not None and (size[0] // block, size[1] // block) == tuple(grid):
        return size
    return 0, 0


def volo_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a VOLO with its table: the table's grid and width, one block of
    ``stem stride x Downsample stride`` pixels per cell (also the pixel block), never fused.

    Raises:
        ValueError: ``fused_patch_embed=True``, or a VOLO whose table is not after a ``Downsample`` of square strides
            (the message says why).
    """
    if fused_patch_embed:
        raise ValueError(
            "fused_patch_embed=True: VOLO's stem is three overlapping convolutions and a projection, and its table is "
            "added after the outlooker stage and a Downsample: the fused op (one projection plus the table) does not "
            "compute it"
        )
    reason = _unfit_reason(model)
    if reason is not None:
        raise ValueError(f"model: {type(model).__name__}: {reason}")
    block = _stride(model.patch_embed) * _stride(model.network[1])
    grid, dim = tuple(int(side) for side in model.pos_embed.shape[1:3]), int(model.pos_embed.shape[-1])
    new_class = mjp_class_of(original_class(type(model)), VOLO, MJPVOLO)
    return TokenLayout(new_class, grid, dim, block, False, block)


def install_volo(model: nn.Module, layout: TokenLayout) -> None:
    """Swaps the stem and ``network[1]`` of a converted VOLO (holding ``model.mjp`` already) to apply MJP."""
    grid = layout.grid
    stem, step = model.patch_embed, model.network[1]
    stem.__class__ = mjp_class_of(original_class(type(stem)), None, _VoloPixelStem)
    stem.__dict__.update(
        _mjp_state=model.mjp, _mjp_grid=grid, _mjp_image_size=_image_size(model, grid, layout.patch_size)
    )
    step.__class__ = mjp_class_of(original_class(type(step)), None, _VoloTableStep)
    step.__dict__.update(_mjp_model=model, _mjp_grid=grid, _mjp_kept_rows=KeptTableRows())


def runs_fused(model: nn.Module) -> bool:
    """A VOLO's embedding never runs fused."""
    return False


FRONT_END = TokenFrontEnd(covers, volo_layout, install_volo, runs_fused, names=("VOLO",))
"""VOLO (with its table), for :func:`mjp_fast.timm.convert`."""
