"""MJP for timm's ``Nest`` (NesT, "Aggregating Nested Transformers"): a learned absolute position table per level,
``levels.i.pos_embed`` ``[1, T, S, D]``, added inside each level after ``blockify`` (the level's ``[B, H, W, D]`` map
cut into ``T`` square blocks of ``S = b * b`` tokens, ``b`` the level's ``block_size``), then attention within each
block, then ``deblockify`` and (from level 1 on) a convolution and a 3x3 max pool that halve the grid.

Where MJP acts: on level 0's table, whose grid is the patch embedding's (level 0 has no pool): the finest grid,
whose positions are the patches. Row ``(t, s)`` of that table is grid position ``(i, j)`` with block
``t = (i // b) * (W // b) + j // b`` and ``s = (i % b) * b + j % b``; MJP and DAL see the table as ``[1, H * W, D]`` in
row-major grid order (:func:`table_rows`, the inverse of ``blockify``). The later levels' tables stay as they are:
their grids are pooled from level 0's output, so a moved patch is mixed into the cell of where it lands and gets
that cell's row (the naive shuffle, as for any table after a pooling stage: PiT's, Visformer's).

Where MJP hooks in, without copying timm's ``NestLevel.forward``: as for CaiT and PiT, the patch embedding is
class-swapped. NesT's is timm's ``PatchEmbed`` (a Conv2d whose stride is its kernel, ``flatten=False``: an NCHW
map), so each token is a function of its own patch and moving the tokens is moving the patches. While MJP is engaged
the embedding returns MJP's tokens (moved, ``unk_embed`` at the masked positions, their own row elsewhere, the DAL
loss attached in training) minus level 0's table on the grid, ``[B, D, H, W]``; level 0's ``blockify`` and
``+ pos_embed`` then give MJP's tokens, blockified (within one float rounding; the gradient is exact). In eval mode
outside ``mjp_eval`` the embedding is timm's: the model is timm's, exactly.

``features_only``: timm's wrapper of a NesT is a ``FeatureListNet`` of the model's modules (``patch_embed``,
``levels_0``, ...), not of the model; :func:`mjp_fast.timm.convert` puts ``mjp`` first among them, so the images are
jigsawed there in blocks of the patch size (the same jigsaw as moving the tokens: the patch embedding does not
overlap), and the embedding gives the tokens, in jigsaw order already, ``unk_embed`` at the masked positions.

Not fused: the fused op writes flattened ``[B, N, D]`` tokens plus their table rows, while NesT's embedding writes an
NCHW map that level 0 blockifies before it adds its table; ``fused_patch_embed=True`` is refused with that reason.
"""

from __future__ import annotations

import torch
from timm.layers import PatchEmbed
from timm.models._features import FeatureDictNet
from timm.models.nest import Nest, NestLevel
from torch import nn

from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import KeptTableRows, TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import original_class


def table_rows(table: torch.Tensor, grid: tuple[int, int], block_size: int) -> torch.Tensor:
    """NesT's blockified table ``[1, T, S, D]`` as rows in row-major grid order ``[1, H * W, D]`` (``grid`` is
    ``(H, W)``, ``T = (H // b) * (W // b)`` blocks of ``S = b * b`` positions, ``b = block_size``): the inverse of
    timm's ``blockify``, so that ``blockify`` of the rows on the grid is the table again, exactly."""
    rows, cols = grid
    dim = table.shape[-1]
    blocks = table.reshape(1, rows // block_size, cols // block_size, block_size, block_size, dim)
    return blocks.transpose(2, 3).reshape(1, rows * cols, dim)


class _NestEmbed:
    """Mixed into a NesT's ``PatchEmbed`` (class swap): while ``model.mjp`` is engaged it returns MJP's tokens minus
    level 0's table on the grid, ``[B, D, H, W]``, which level 0's ``blockify`` and ``+ pos_embed`` turn into MJP's
    tokens; otherwise timm's own embedding. Level 0 and the state are kept in ``__dict__``, out of the module's
    children (no second copy in the state dict, no cycle in ``modules()``): copies and pickles of the model keep
    pointing at their own, and the table is read from level 0 at each call (``load_state_dict(assign=True)`` may
    replace it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the images ``[B, C, H', W']`` (jigsawed already in a ``features_only`` wrapper). Returns the map
        ``[B, D, H, W]`` that level 0 blockifies and adds its table to."""
        state = self.__dict__["_mjp_state"]
        if not state.engaged:  # MJP off (eval mode): timm's embedding, so the model is timm's exactly
            state.record_jigsaw(None)
            return super().forward(x)
        level = self.__dict__["_mjp_level"]
        grid = tuple(self.grid_size)
        table = level.pos_embed
        rows = table_rows(table, grid, level.block_size)  # [1, N, D], row-major: the rows MJP replaces, DAL regresses
        self.__dict__["_mjp_kept_rows"].keep(table, rows)
        tokens = super().forward(x).flatten(2).transpose(1, 2)
        # In a features_only wrapper the wrapper's `mjp` entry jigsawed the images (in blocks of the patch: the same
        # jigsaw), so the tokens are in jigsaw order already; else each token is its own patch's, and moving the
        # tokens moves the patches.
        pixels_jigsawed = self.__dict__["_mjp_images_jigsawed"]
        stepped = state(tokens, rows, grid, prefix=None, prefix_positions=0, pixels_jigsawed=pixels_jigsawed)
        return (stepped - rows).transpose(1, 2).unflatten(2, grid)


class NestPatchEmbed(_NestEmbed, PatchEmbed):
    """timm's ``PatchEmbed`` of a NesT with MJP on level 0's position table."""


def _level_zero_aux_loss(model: nn.Module, embed: nn.Module, level: nn.Module) -> torch.Tensor:
    """The DAL loss of level 0's table: the one the last forward attached (once), else computed."""
    state, table = model.mjp, level.pos_embed
    if state.dal_regressor is None:
        return table.new_zeros((), dtype=torch.float32)
    grid = tuple(embed.grid_size)
    rows = embed.__dict__["_mjp_kept_rows"].rows_of(table, table_rows(table, grid, level.block_size))
    return state.aux_loss(rows, grid, 0)


class MJPNest(MJPModel, Nest):
    """A timm ``Nest`` with MJP on level 0's position table (made by :func:`mjp_fast.timm.convert`): ``mjp_aux_loss``
    (the DAL loss of that table's ``H * W`` rows) and ``mjp.unk_embed`` among the parameters without weight decay.
    ``forward``, ``forward_features`` and ``forward_intermediates`` are timm's (the patch embedding applies MJP)."""

    def mjp_aux_loss(self) -> torch.Tensor:
        return _level_zero_aux_loss(self, self.patch_embed, self.levels[0])

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra


class MJPNestFeaturesMixin(MJPModel):
    """timm's ``FeatureListNet`` of a NesT (``features_only=True``) with MJP: its ``mjp`` entry, first, jigsaws the
    images; its ``patch_embed`` gives the masked positions ``unk_embed`` on ``levels_0``'s table, whose DAL loss
    ``mjp_aux_loss`` returns."""

    def mjp_aux_loss(self) -> torch.Tensor:
        return _level_zero_aux_loss(self, self["patch_embed"], self["levels_0"])


def _features_of_a_nest(model: nn.Module) -> bool:
    """Whether ``model`` is timm's ``features_only`` wrapper of a NesT: a module dict whose first entries are a
    ``PatchEmbed`` and a ``NestLevel`` (``patch_embed``, ``levels_0``: the model's modules, flattened)."""
    if not isinstance(model, FeatureDictNet):
        return False
    entries = list(model.items())[:2]
    return (
        [name for name, _ in entries] == ["patch_embed", "levels_0"]
        and isinstance(entries[0][1], PatchEmbed)
        and isinstance(entries[1][1], NestLevel)
    )


def covers(model: nn.Module) -> bool:
    """Whether ``model`` is this front end's: a timm ``Nest``, or timm's ``features_only`` wrapper of one."""
    return isinstance(model, Nest) or _features_of_a_nest(model)


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The patch embedding and level 0 of a NesT or of its ``features_only`` wrapper."""
    if isinstance(model, Nest):
        return model.patch_embed, model.levels[0]
    return model["patch_embed"], model["levels_0"]


def _unfit_reason(embed: nn.Module, level: nn.Module) -> str | None:
    """None where level 0's table is over the patch embedding's grid in square blocks, and the embedding's tokens are
    each of their own patch (MJP moves them), else why not."""
    proj = getattr(embed, "proj", None)
    if not isinstance(proj, nn.Conv2d):
        return f"its patch embedding's proj is a {type(proj).__name__}, not an nn.Conv2d"
    if tuple(proj.stride) != tuple(proj.kernel_size) or proj.padding not in ("valid", (0, 0)):
        return (
            f"its patch embedding's kernel {tuple(proj.kernel_size)}, stride {tuple(proj.stride)} and padding "
            f"{proj.padding} overlap the patches (a token per patch needs the stride equal to the kernel, no padding)"
        )
    if embed.flatten or not isinstance(embed.norm, nn.Identity):
        return "its patch embedding flattens its output or normalizes it (NesT's writes a plain NCHW map)"
    if not isinstance(level.pool, nn.Identity):
        return f"level 0 pools its input ({type(level.pool).__name__}): its table is not over the patch grid"
    rows, cols = embed.grid_size
    block = level.block_size
    blocks, seq = level.pos_embed.shape[1:3]
    if rows % block or cols % block or (rows // block) * (cols // block) != blocks or block * block != seq:
        return (
            f"level 0's table {tuple(level.pos_embed.shape)} is not the {rows}x{cols} patch grid in blocks of "
            f"{block}x{block}"
        )
    return None


def nest_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a NesT (or of its ``features_only`` wrapper): the patch grid, level
    0's width, the patch size; never fused; the pixel block is the patch in a wrapper (whose ``mjp`` entry jigsaws the
    images), else None (the tokens are moved).

    Raises:
        ValueError: ``fused_patch_embed=True``, or a model whose level 0 table is not over its patch grid (the message
            says why).
    """
    if fused_patch_embed:
        raise ValueError(
            "fused_patch_embed=True: NesT's patch embedding writes an NCHW map that level 0 blockifies before it adds "
            "its table ([1, blocks, tokens per block, D]); the fused op writes flattened tokens plus their table rows"
        )
    embed, level = _parts(model)
    reason = _unfit_reason(embed, level)
    if reason is not None:
        raise ValueError(f"model: {type(model).__name__}: {reason}")
    patch = int(embed.patch_size[0])
    if isinstance(model, Nest):
        new_class, pixel_block = mjp_class_of(original_class(type(model)), Nest, MJPNest), None
    else:
        new_class, pixel_block = mjp_class_of(type(model), None, MJPNestFeaturesMixin), patch
    dim = int(level.pos_embed.shape[-1])
    return TokenLayout(new_class, tuple(embed.grid_size), dim, patch, False, pixel_block)


def install_nest(model: nn.Module, layout: TokenLayout) -> None:
    """Swaps the patch embedding of a converted NesT, or of its ``features_only`` wrapper (holding ``model.mjp``
    already), to apply MJP on level 0's table."""
    embed, level = _parts(model)
    embed_class = original_class(type(embed))
    embed.__class__ = NestPatchEmbed if embed_class is PatchEmbed else mjp_class_of(embed_class, None, _NestEmbed)
    embed.__dict__["_mjp_state"] = model.mjp
    embed.__dict__["_mjp_level"] = level
    embed.__dict__["_mjp_images_jigsawed"] = layout.pixel_block is not None
    embed.__dict__["_mjp_kept_rows"] = KeptTableRows()


def runs_fused(model: nn.Module) -> bool:
    """A NesT's embedding never runs fused."""
    return False


FRONT_END = TokenFrontEnd(covers, nest_layout, install_nest, runs_fused, names=("Nest",))
"""NesT (``Nest``, and its ``features_only`` wrapper), for :func:`mjp_fast.timm.convert`."""
