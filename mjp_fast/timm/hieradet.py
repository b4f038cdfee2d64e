"""MJP for timm's ``HieraDet`` (SAM 2's Hiera image encoder, ``sam2_hiera_*``, ``hieradet_*``): the unknown embedding
on its learned absolute position term, the images jigsawed before its overlapping stem.

The stem. HieraDet's default stem (``HieraPatchEmbed``) is a Conv2d of kernel 7, stride 4 and padding 3, giving
``[B, h, w, D]`` tokens (channels last): each token sees three pixels into its neighbours' blocks, so moving tokens
after the stem would leave each carrying its neighbourhood, hence its place. As for Hiera, the images are jigsawed
before the stem, one block of the stem's stride per token (the stem is class-swapped to call ``model.mjp`` on its
input), and the stem's tokens, in jigsaw order already, get ``unk_embed`` at the masked positions in place of their
position terms, in timm's ``_pos_embed`` hook (called by ``forward_features`` and ``forward_intermediates`` alike).
A HieraDet built with ``patch_size`` has timm's non-overlapping ``PatchEmbed`` instead (each token a function of
its own patch): its tokens are moved, as a ViT's.

The position term. HieraDet stores no table of its token grid: ``pos_embed`` ``[1, D, gh, gw]`` (``global_pos_size``,
7x7 for the released models) is resampled bicubically to the input's grid ``(h, w)`` and ``pos_embed_window``
``[1, D, u, u]`` (u: the first stage's window) tiled over it ("Window Attention is Bugged", Bolya et al. 2023), on each
call, for whatever grid the input has. MJP replaces that sum as timm computes it (timm's own ``_pos_embed`` on zeros:
``0 + p`` is ``p``, exact, and timm's resampling followed release by release), and DAL regresses the rows of the
same sum, of the input's grid, to that grid's coordinates: each position's whole position term, so both parameters
learn from it (the choice :mod:`mjp_fast.timm.hiera` made for Hiera's abswin table). The masked positions of the
jigsaw are rows of that very grid, so DAL leaves exactly them out. A consequence of regressing the term of the
input's grid: training at several input sizes regresses raw coordinates of several ranges (``dal_normalize=True``
scales each grid's coordinates to [0, 1]). ``model.mjp``'s grid is the one of the input size the model was built
for (its config's ``input_size``): the default of ``mjp_aux_loss`` before any forward.

With MJP off (eval mode outside ``mjp_eval``) the stem and ``_pos_embed`` are timm's: the model is timm's, exactly.
No fused path: the default stem overlaps, and the ``PatchEmbed`` variant pads its input to whole patches and returns
channels-last tokens of any grid, which the fused op does not compute.
"""

from __future__ import annotations

import torch
from timm.layers import PatchEmbed
from timm.models.hieradet_sam2 import HieraDet, HieraPatchEmbed
from torch import nn

from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import original_class
from mjp_fast.timm.pixel import model_input_size


class _HieraDetPixelJigsawEmbed(HieraPatchEmbed):
    """HieraDet's overlapping stem with MJP (class swap): while ``model.mjp`` is engaged it jigsaws the images first
    (one FX node). The state is kept in ``__dict__``, out of the module's children (no second copy in the state
    dict), where copies and pickles of the model keep pointing at ``model.mjp``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the images ``[B, C, H, W]``. Returns the tokens ``[B, H / 4, W / 4, D]`` (channels last)."""
        state = self.__dict__["_mjp_state"]
        if state.engaged:  # else timm's stem, and no MJP node in a graph traced in eval mode
            x = state(x)
        return super().forward(x)


class MJPHieraDet(MJPModel, HieraDet):
    """A timm ``HieraDet`` with MJP on its position term (made by :func:`mjp_fast.timm.convert`)."""

    def _position_term(self, grid: tuple[int, int]) -> torch.Tensor:
        """timm's position term of a ``grid`` ``(h, w)`` of tokens, ``[1, h * w, D]`` in the grid's row-major order:
        ``pos_embed`` resampled to the grid plus ``pos_embed_window`` tiled (timm's ``_pos_embed`` on zeros)."""
        rows, cols = grid
        zeros = self.pos_embed.new_zeros((1, rows, cols, self.pos_embed.shape[1]))
        return super()._pos_embed(zeros).reshape(1, rows * cols, self.pos_embed.shape[1])

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the stem's tokens ``[B, h, w, D]`` (of the jigsawed images in training, for the overlapping stem).
        Returns them plus their position terms, ``unk_embed`` at the masked positions, ``[B, h, w, D]``."""
        state = self.mjp
        if not state.engaged:  # eval mode outside mjp_eval: timm's, exactly
            state.record_jigsaw(None)
            self.__dict__.pop("_mjp_table", None)
            return super()._pos_embed(x)
        batch, rows, cols, dim = x.shape
        grid = (rows, cols)
        table = self._position_term(grid)
        if not isinstance(table, torch.fx.Proxy):  # traced, not run: no tensor to keep
            # mjp_aux_loss claims the loss attached for this very table (computed afresh on each call)
            self.__dict__["_mjp_table"] = table
            self.__dict__["_mjp_grid"] = (int(rows), int(cols))
        pixels_jigsawed = isinstance(self.patch_embed, _HieraDetPixelJigsawEmbed)
        tokens = x.reshape(batch, rows * cols, dim)
        out = state(tokens, table, grid, prefix=None, prefix_positions=0, pixels_jigsawed=pixels_jigsawed)
        return out.reshape(batch, rows, cols, dim)

    def mjp_aux_loss(self) -> torch.Tensor:
        state = self.mjp
        if state.dal_regressor is None:
            return self.pos_embed.new_zeros((), dtype=torch.float32)
        # The loss the last training forward attached is handed out for the table it was computed on (once): that
        # table, not a new sum of the same parameters.
        last_table = self.__dict__.pop("_mjp_table", None)
        if last_table is not None:
            attached = state.claim_dal(last_table)
            if attached is not None:
                return attached
        grid = self.__dict__.get("_mjp_grid") or tuple(state.sampler.grid_size)
        return state.aux_loss(self._position_term(grid), grid, 0)

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra

    def __getstate__(self) -> dict:
        # The last table is a non-leaf tensor of the last forward's graph: not pickled (deepcopy and torch.save).
        state = dict(super().__getstate__())
        state.pop("_mjp_table", None)
        return state


def covers(model: nn.Module) -> bool:
    """Whether ``model`` is a timm ``HieraDet`` (every one has ``pos_embed`` and ``pos_embed_window``)."""
    return isinstance(model, HieraDet)


def _square(value: int | tuple[int, ...] | list[int], what: str) -> int:
    """The side of a square ``value`` (an int or a pair), else a ValueError naming ``what``."""
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2 or pair[0] != pair[1]:
        raise ValueError(f"model: HieraDet's {what} {pair} is not square: the jigsaw moves square blocks")
    return int(pair[0])


def hieradet_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a HieraDet: the token grid of its configured input size, its first
    width, one block of the stem's stride per token (the overlapping stem, jigsawed in pixels) or the patch size
    (timm's ``PatchEmbed``, tokens moved), never fused.

    Raises:
        ValueError: ``fused_patch_embed=True`` (the message says why), or a stride or patch that is not square.
        TypeError: a stem that is neither timm's ``HieraPatchEmbed`` nor its ``PatchEmbed``.
    """
    embed = model.patch_embed
    if isinstance(embed, HieraPatchEmbed):
        reason = (
            f"HieraDet's stem is a Conv2d whose kernel {tuple(embed.proj.kernel_size)} is larger than its stride "
            f"{tuple(embed.proj.stride)}: its tokens overlap, which the fused op (one patch per token) cannot compute"
        )
        patch = _square(embed.proj.stride, "stem stride")
        pixel_block: int | None = patch
    elif isinstance(embed, PatchEmbed):
        reason = (
            "HieraDet's PatchEmbed pads its input to whole patches and returns channels-last tokens of the input's "
            "grid, which the fused op does not compute"
        )
        patch = _square(embed.patch_size, "patch size")
        pixel_block = None
    else:
        raise TypeError(
            f"model: HieraDet's patch_embed is {type(embed).__name__}, not timm's HieraPatchEmbed or PatchEmbed"
        )
    if fused_patch_embed:
        raise ValueError(f"fused_patch_embed=True: {reason}")
    size = model_input_size(model) or (224, 224)
    grid = (max(1, size[0] // patch), max(1, size[1] // patch))
    new_class = mjp_class_of(original_class(type(model)), HieraDet, MJPHieraDet)
    return TokenLayout(new_class, grid, int(model.pos_embed.shape[1]), patch, False, pixel_block)


def install_hieradet(model: nn.Module, layout: TokenLayout) -> None:
    """Makes a converted HieraDet's overlapping stem jigsaw its images through ``model.mjp`` (timm's ``PatchEmbed``
    is left as it is: its tokens are moved in ``_pos_embed``)."""
    embed = model.patch_embed
    if layout.pixel_block is None:
        return
    if not isinstance(embed, _HieraDetPixelJigsawEmbed):
        embed.__class__ = _HieraDetPixelJigsawEmbed
    embed.__dict__["_mjp_state"] = model.mjp


def runs_fused(model: nn.Module) -> bool:
    """A HieraDet never runs fused."""
    return False


FRONT_END = TokenFrontEnd(covers, hieradet_layout, install_hieradet, runs_fused, names=("HieraDet",))
"""HieraDet (SAM 2's Hiera), for :func:`mjp_fast.timm.convert`."""
