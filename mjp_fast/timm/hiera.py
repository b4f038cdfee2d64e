"""MJP for timm's ``Hiera`` (image models: a 2-D token grid): the unknown embedding on its learned absolute position
table, the images jigsawed before its overlapping stem.

Hiera's stem is a Conv2d of kernel 7, stride 4 and padding 3: each token sees three pixels into its neighbours'
blocks, so moving tokens after the stem would leave each carrying its neighbourhood, hence its place. As for a hybrid
ViT, the images are jigsawed before the stem, one block of ``patch_stride`` pixels per token (the patch embedding is
class-swapped to call ``model.mjp`` on its input), and the stem's tokens, in jigsaw order already, get ``unk_embed`` at
the masked positions in place of their table rows, in timm's ``_pos_embed`` hook (called by ``forward_features`` and
``forward_intermediates`` alike, before the tokens are unrolled into mask units). The tokens stay a 2-D raster of the
grid ``tokens_spatial_shape`` until then: Hiera's unroll, mask-unit attention and pooling see a grid like any other.

The table: ``pos_embed`` ``[1, N, D]`` (the ``hiera_*`` models), or the "absolute window" table of the ``*_abswin_*``
models (``pos_embed`` ``[1, D, h, w]`` resampled to the grid, plus ``pos_embed_win`` ``[1, D, u, v]`` tiled over the
mask units: "Window Attention is Bugged", Bolya et al. 2023). For the latter the position term MJP replaces is the sum
as timm computes it, and DAL regresses the rows of that sum (each position's whole position term) to their
coordinates: the gradient reaches both parameters. A Hiera with separate space and time tables (video,
``sep_pos_embed``) has a 3-D grid: not an image model, refused.

With MJP off (eval mode outside ``mjp_eval``) the patch embedding and ``_pos_embed`` are timm's: the model is timm's.
No fused path: the stem is not a non-overlapping projection.
"""

from __future__ import annotations

import torch
from timm.models.hiera import Hiera
from timm.models.hiera import PatchEmbed as HieraPatchEmbed
from torch import nn

from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import original_class


class _HieraPixelJigsawEmbed(HieraPatchEmbed):
    """Hiera's patch embedding with MJP (class swap): while ``model.mjp`` is engaged it jigsaws the images first (one
    FX node). The state is kept in ``__dict__``, out of the module's children (no second copy
    in the state dict), where copies and pickles of the model keep pointing at ``model.mjp``."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: the images ``[B, C, H, W]``; ``mask``: timm's keep mask. Returns the tokens ``[B, N, D]``."""
        state = self.__dict__["_mjp_state"]
        if state.engaged:  # else timm's stem, and no MJP node in a graph traced in eval mode (as the other front ends)
            x = state(x)
        return super().forward(x, mask=mask)


class MJPHiera(MJPModel, Hiera):
    """A timm ``Hiera`` with MJP position embeddings (made by :func:`mjp_fast.timm.convert`)."""

    def _position_table(self) -> torch.Tensor:
        """The position term timm adds to the stem's tokens, ``[1, N, D]`` in the grid's raster order."""
        if self.pos_embed_win is None:
            return self.pos_embed
        # timm's own computation (Hiera._pos_embed) on a zero input: the resampled global table plus the tiled
        # window table. One zero add is the price of following timm's resampling exactly, release by release.
        rows, cols = self.tokens_spatial_shape
        zeros = self.pos_embed.new_zeros((1, rows * cols, self.pos_embed.shape[1]))
        return super()._pos_embed(zeros)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the stem's tokens ``[B, N, D]`` (of the jigsawed images in training). Returns them plus their position
        terms, ``unk_embed`` at the masked positions."""
        state = self.mjp
        if not state.engaged:  # eval mode outside mjp_eval: timm's, exactly
            state.record_jigsaw(None)
            self.__dict__.pop("_mjp_table", None)
            return super()._pos_embed(x)
        table = self._position_table()
        self.__dict__["_mjp_table"] = table  # mjp_aux_loss claims the loss attached for this very table
        grid = tuple(self.tokens_spatial_shape)
        return state(x, table, grid, prefix=None, prefix_positions=0, pixels_jigsawed=True)

    def mjp_aux_loss(self) -> torch.Tensor:
        state, grid = self.mjp, tuple(self.tokens_spatial_shape)
        if state.dal_regressor is None:
            return self.pos_embed.new_zeros((), dtype=torch.float32)
        # The loss the last training forward attached is handed out for the table it was computed on (once): that
        # table, not a new sum of the same parameters (an abswin table is computed afresh on each call).
        last_table = self.__dict__.pop("_mjp_table", None)
        if last_table is not None:
            attached = state.claim_dal(last_table)
            if attached is not None:
                return attached
        return state.aux_loss(self._position_table(), grid, 0)

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra

    def __getstate__(self) -> dict:
        # The last table is a non-leaf tensor of the last forward's graph: not pickled (deepcopy and torch.save).
        state = dict(super().__getstate__())
        state.pop("_mjp_table", None)
        return state


def covers(model: nn.Module) -> bool:
    """Whether ``model`` is a timm ``Hiera`` with an absolute position table (every timm Hiera: image and video)."""
    return isinstance(model, Hiera)


def hiera_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a Hiera: its token grid, its first width, one block of
    ``patch_stride`` pixels per token, never fused.

    Raises:
        ValueError: ``fused_patch_embed=True`` (the stem overlaps its neighbours' blocks), a 3-D (video) Hiera, or a
            stride that is not square.
    """
    if fused_patch_embed:
        raise ValueError(
            "fused_patch_embed=True: Hiera's stem is a Conv2d whose kernel (7) is larger than its stride: its tokens "
            "overlap, which the fused op (one patch per token) cannot compute"
        )
    if len(model.tokens_spatial_shape) != 2 or model.pos_embed is None:
        raise ValueError(
            f"model: a Hiera with a {len(model.tokens_spatial_shape)}-D token grid and separate space and time "
            "tables (video): MJP's jigsaw is of a 2-D image grid"
        )
    stride = tuple(model.patch_stride)
    if stride[0] != stride[1]:
        raise ValueError(f"model: Hiera's patch stride {stride} is not square: the jigsaw moves square blocks")
    dim = model.pos_embed.shape[1] if model.pos_embed_win is not None else model.pos_embed.shape[-1]
    new_class = mjp_class_of(original_class(type(model)), Hiera, MJPHiera)
    return TokenLayout(new_class, tuple(model.tokens_spatial_shape), int(dim), int(stride[0]), False, int(stride[0]))


def install_hiera(model: nn.Module, layout: TokenLayout) -> None:
    """Makes a converted Hiera's patch embedding jigsaw its images through ``model.mjp``."""
    embed = model.patch_embed
    if not isinstance(embed, _HieraPixelJigsawEmbed):
        embed.__class__ = _HieraPixelJigsawEmbed
    embed.__dict__["_mjp_state"] = model.mjp


def runs_fused(model: nn.Module) -> bool:
    """A Hiera never runs fused."""
    return False


FRONT_END = TokenFrontEnd(covers, hiera_layout, install_hiera, runs_fused, names=("Hiera",))
"""Hiera (images), for :func:`mjp_fast.timm.convert`."""
