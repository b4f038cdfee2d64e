"""The contract of a token-path front end for a family of timm models that add a learned absolute position table
somewhere :func:`mjp_fast.timm.convert` cannot reach through the ViT's ``_pos_embed`` hook (CaiT and ConViT, Hiera,
PiT, TNT, CrossViT, NaFlexViT, ...): one ``TokenFrontEnd`` per family module, listed in
``convert.TOKEN_FRONT_ENDS``; and :class:`KeptTableRows`, which the front ends that hand the MJP step a view of
their table (PiT, NesT, Visformer, VOLO) keep it in for ``mjp_aux_loss``."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.fx
from torch import nn


class TokenLayout(NamedTuple):
    """What a front end makes of a model: its MJP class, the grid and token width of ``model.mjp`` (the
    :class:`mjp_fast.timm.MJPState`), the jigsaw's patch size in pixels, whether the embedding runs fused, and the
    pixels per token of a stem that is jigsawed in pixel space before it (None where tokens are moved)."""

    new_class: type
    grid: tuple[int, int]
    dim: int
    patch_size: int
    fuse: bool
    pixel_block: int | None


class TokenFrontEnd(NamedTuple):
    """A token-path front end.

    Attributes:
        covers: whether a (not yet converted) model is this front end's.
        layout: ``(model, fused_patch_embed)`` -> :class:`TokenLayout`; raises ValueError/TypeError (naming the
            argument) before anything changes, e.g. ``fused_patch_embed=True`` where the embedding cannot be fused.
        install: ``(model, layout)``: called once the model is its MJP class and holds ``model.mjp``; wires MJP in
            (class swaps of submodules, extra states), on the model's device and dtype.
        runs_fused: whether a converted model of this front end runs its embedding fused (for the coverage sweep).
        names: the timm classes it covers, for messages.
    """

    covers: Callable[[nn.Module], bool]
    layout: Callable[[nn.Module, bool | None], TokenLayout]
    install: Callable[[nn.Module, TokenLayout], None]
    runs_fused: Callable[[nn.Module], bool]
    names: tuple[str, ...] = ()


class KeptTableRows:
    """Holds the ``[1, N, D]`` rows of a position table that the last training forward handed to the MJP step (a view
    or reshape of the model's parameter: PiT's and Visformer's NCHW table flattened, NesT's blockified one mapped to
    the grid, VOLO's NHWC one reshaped), so that ``mjp_aux_loss`` hands the state that very tensor: the state gives
    out the DAL loss a forward attached only for the table it was attached for, by identity. The rows belong to their
    forward's graph: copies and pickles of the model get an empty holder."""

    __slots__ = ("table", "rows")

    def __init__(self) -> None:
        self.table: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None

    def __reduce__(self) -> tuple:
        return (type(self), ())

    def rows_of(self, table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The rows kept for ``table`` if the last forward's were of it, else ``rows`` (the same values, afresh)."""
        return self.rows if self.table is table and self.rows is not None else rows

    def keep(self, table: torch.Tensor, rows: torch.Tensor) -> None:
        """Keeps ``rows``, the view of ``table`` a forward handed to the MJP step (nothing while FX traces)."""
        if isinstance(rows, torch.fx.Proxy):  # traced, not run: there is no tensor to keep
            return
        self.table, self.rows = table, rows
