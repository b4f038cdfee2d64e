"""``MJPCore``: the state MJP adds to a model, and the pieces of the step that apply it.

Every front end is a subclass: :class:`mjp_fast.MJPPatchEmbed` (an nn module that embeds images) and
:class:`mjp_fast.timm.MJPState` (``model.mjp`` of the timm models: ViT, distilled DeiT, Eva/RoPE, pixel-space). The
core holds, under the same names in each (so their state dict keys are what they were):

- ``sampler``: the :class:`mjp_fast.JigsawSampler` (its counter is the only state dict entry it adds);
- ``unk_embed`` ``[D]``: the learned embedding of a position the model must not know, or None with ``unk=False``
  (the paper's naive shuffle: then ``unused_unk_row``, a zero row no mask bit selects, never saved);
- ``dal_regressor``: the :class:`mjp_fast.DALRegressor`, or None; ``dal_normalize``, ``dal_scale`` (the reduction's
  factor) and the grid coordinates it regresses (``dal_coordinates``, not saved);
- the backend: ``sampler.backend``, resolved once per device (:meth:`backend_for`) for the sampler, the embedding
  and the DAL loss together;
- ``last_jigsaw``, and the DAL loss a step attached to its output (kept for ``mjp_aux_loss``; see
  :class:`mjp_fast.timm.MJPState`).

The step: sample (``sampler``), the position term's jigsaw and masked row (:meth:`position_jigsaw`: the naive
shuffle masks nothing), the embedding operation on :meth:`backend_for`'s backend, and the DAL loss of a table
(:meth:`dal_loss_of`) over the positions the sampled jigsaw left unmasked.
"""

from __future__ import annotations

from typing import TypedDict

import torch
from torch import nn

from mjp_fast.backend import KNOWN_BACKENDS
from mjp_fast.ops.dal_loss import DAL_REDUCTIONS, cached_grid_coordinates, dal_loss_unchecked, grid_coordinates
from mjp_fast.ops.dal_regressor import DAL_KINDS, DALRegressor
from mjp_fast.sampler.jigsaw import Jigsaw
from mjp_fast.sampler.module import JigsawSampler


def check_dal_kind(dal: str | None) -> str | None:
    """None for no DAL regressor (``None`` or ``"none"``, since timm's ``create_model`` drops keywords whose value
    is None), else a checked :class:`mjp_fast.DALRegressor` kind."""
    if dal is None or (isinstance(dal, str) and dal.lower() == "none"):
        return None
    if dal not in DAL_KINDS:
        raise ValueError(f"dal must be None, 'none' or one of {', '.join(DAL_KINDS)}, got {dal!r}")
    return dal


def check_dal_reduction(dal_reduction: str) -> float:
    """The DAL loss's factor for ``dal_reduction`` (``"mean"``: 0.5, ``"sum"``: 1; see :func:`mjp_fast.dal_loss`)."""
    if not isinstance(dal_reduction, str):  # a list would reach the dict lookup as "unhashable type"
        raise TypeError(
            f"dal_reduction must be a str, one of {', '.join(DAL_REDUCTIONS)}; got {type(dal_reduction).__name__}"
        )
    if dal_reduction not in DAL_REDUCTIONS:
        raise ValueError(f"dal_reduction must be one of {', '.join(DAL_REDUCTIONS)}, got {dal_reduction!r}")
    return DAL_REDUCTIONS[dal_reduction]


def check_unk(unk: bool) -> bool:
    if not isinstance(unk, bool):
        raise TypeError(f"unk must be a bool, got {type(unk).__name__}")
    return unk


def check_backend(backend: str | None) -> str | None:
    if backend is not None and backend not in KNOWN_BACKENDS:
        raise ValueError(f"backend must be None or one of {', '.join(KNOWN_BACKENDS)}, got {backend!r}")
    return backend


class MJPSettings(TypedDict, total=False):
    """The core's settings after ``grid_size`` and ``dim`` (:meth:`MJPCore._init_core`), for front ends that take them
    as keywords (``ratio``, ``prob``, ``seed`` and ``dal`` are required there)."""

    ratio: float
    prob: float
    seed: int
    dal: str | None
    min_block: int
    min_aspect: float
    shared: bool
    backend: str | None
    dal_normalize: bool
    dal_reduction: str
    unk: bool


class MJPCore(nn.Module):
    """The state MJP adds to a model (module docstring); front ends subclass it and call :meth:`_init_core`.

    Its settings, as the front ends take them:
        grid_size: the patch grid of the model's input size.
        dim: the token width D, or None for a model without position embeddings (pixel-space: no ``unk_embed``,
            no DAL).
        ratio, prob, seed, min_block, min_aspect, shared, backend: as :class:`mjp_fast.JigsawSampler`.
        dal: None (or ``"none"``) or a :class:`mjp_fast.DALRegressor` kind.
        dal_normalize: regress coordinates scaled to [0, 1] instead of raw integers.
        dal_reduction: ``"mean"`` (the paper's code) or ``"sum"`` (its formula, twice the mean); held as
            ``dal_scale``, a plain attribute (not in the state dict).
        unk: masked positions get ``unk_embed`` (MJP). False: the naive shuffle (module docstring).
    """

    # Class-level defaults: an object pickled before these attributes existed reads them here.
    use_unk: bool = True
    dal_scale: float = DAL_REDUCTIONS["mean"]
    dal_normalize: bool = False

    def _init_core(
        self,
        grid_size: tuple[int, int],
        dim: int | None,
        *,
        ratio: float,
        prob: float,
        seed: int,
        dal: str | None,
        min_block: int = 8,
        min_aspect: float = 0.3,
        shared: bool = False,
        backend: str | None = None,
        dal_normalize: bool = False,
        dal_reduction: str = "mean",
        unk: bool = True,
    ) -> None:
        """Checks the settings and makes the state. Called by the front end's ``__init__`` after its own parameters
        (``MJPPatchEmbed``'s ``proj`` and ``pos_embed``), so that the order of the parameters, which optimizer
        checkpoints index, is what it was."""
        dal = check_dal_kind(dal)
        if dal is not None and dim is None:
            raise ValueError("dal needs a model with absolute position embeddings; pass dal=None for this model")
        self.dal_scale = check_dal_reduction(dal_reduction)
        self.use_unk = check_unk(unk)
        check_backend(backend)
        self.sampler = JigsawSampler(
            grid_size, ratio, prob, seed, min_block=min_block, min_aspect=min_aspect, shared=shared, backend=backend
        )
        self.dal_normalize = bool(dal_normalize)
        if dim is not None and unk:
            self.unk_embed = nn.Parameter(torch.empty(dim))
            nn.init.trunc_normal_(self.unk_embed, std=0.02)
        else:
            self.unk_embed = None
        if dim is not None and not unk:
            # The position kernels take a [D] row for the masked positions even when no mask bit is set (they load
            # it unconditionally): a zero row made once, moved and cast with the model, never saved.
            self.register_buffer("unused_unk_row", torch.zeros(dim), persistent=False)
        self.dal_regressor = DALRegressor(dim, dal) if dal is not None else None
        # The DAL loss a training step attached to its output (see MJPState); a plain dict, so that storing it costs
        # no nn.Module.__setattr__ per step. "loss": the loss; "unclaimed": (its table, the step's jigsaw) until
        # mjp_aux_loss hands the loss out. Its keys never change: a compiled forward guards on them.
        self._dal_stash: dict[str, object] = {"loss": None, "unclaimed": None}
        self.last_jigsaw = None
        # The DAL loss's targets, made once for the grid (not saved: they follow from it).
        self.coordinates_grid = tuple(self.sampler.grid_size)
        self.register_buffer(
            "dal_coordinates", grid_coordinates(grid_size, normalize=self.dal_normalize), persistent=False
        )

    def __getstate__(self) -> dict:
        """The state that copies and pickles take (``copy.deepcopy`` of a model mid-training, ``torch.save(model)``):
        without the kept DAL loss, which belongs to this model's last graph (and a tensor with a graph cannot be
        deep-copied)."""
        state = super().__getstate__()  # a copy of __dict__
        state["_dal_stash"] = {"loss": None, "unclaimed": None}
        return state

    def __setstate__(self, state: dict) -> None:
        # An MJPPatchEmbed pickled before the core kept dal_reduction only: its factor follows from it.
        if "dal_scale" not in state and state.get("dal_reduction") in DAL_REDUCTIONS:
            state["dal_scale"] = DAL_REDUCTIONS[state["dal_reduction"]]
        super().__setstate__(state)

    @property
    def backend(self) -> str | None:
        """The backend asked for (None: ``MJP_FAST_BACKEND``, else automatic), held by ``sampler``: the one place.
        Setting it moves the sampler, the embedding and the DAL loss together."""
        return self.sampler.backend

    @backend.setter
    def backend(self, backend: str | None) -> None:
        self.sampler.backend = check_backend(backend)

    def backend_for(self, device: torch.device) -> str:
        """The backend of every part of the step on ``device``: :meth:`JigsawSampler.backend_for`, resolved once."""
        return self.sampler.backend_for(device)

    @property
    def last_jigsaw(self) -> Jigsaw | None:
        """The jigsaw the last forward sampled (with or without unk: the DAL loss and evaluation read its mask), or
        None. A front end that skips the step sets it to None, which also forgets the DAL loss kept for
        ``mjp_aux_loss`` (that loss is not of the last forward any more)."""
        return self.__dict__.get("_last_jigsaw")

    @last_jigsaw.setter
    def last_jigsaw(self, jigsaw: Jigsaw | None) -> None:
        self.record_jigsaw(jigsaw)

    def record_jigsaw(self, jigsaw: Jigsaw | None, grid: tuple[int, int] | None = None) -> None:
        """Sets :attr:`last_jigsaw` and forgets the DAL loss kept for ``mjp_aux_loss``: what the forwards call.

        A method, not the property's setter, inside a forward: torch 2.11's dynamo (the lent GPU machines') replays
        a property set on a module after the compiled graph, so the setter's forgetting came after the forward had
        kept its new loss, and ``mjp_aux_loss()`` then computed a second loss: DAL counted twice in compiled
        training (the H200's Inductor failure of 2026-11-27, found again on the CPU in the GPU image's versions).
        A method is traced in order.

        ``grid``: the grid ``jigsaw`` was drawn on, where a forward knows it (an input of another size than the
        table's: the DAL loss then leaves no position out, whatever the number of positions; see
        :meth:`dal_loss_of`)."""
        self.__dict__["_last_jigsaw"] = jigsaw
        self.__dict__["_last_grid"] = (int(grid[0]), int(grid[1])) if grid is not None and jigsaw is not None else None
        stash = self.__dict__.get("_dal_stash")
        if stash is not None:
            stash["loss"] = stash["unclaimed"] = None

    def position_jigsaw(self, jigsaw: Jigsaw | None) -> tuple[Jigsaw | None, torch.Tensor | None]:
        """The jigsaw and the ``[D]`` row of the position term for a sampled ``jigsaw``: itself and ``unk_embed``;
        with ``unk=False`` (the naive shuffle) the same moves with no position masked, so each one keeps its own
        ``pos_embed[n]``, and ``unused_unk_row``. ``(None, unk_embed)`` without a jigsaw."""
        unk_embed = self.unk_embed
        if jigsaw is None or unk_embed is not None:
            return jigsaw, unk_embed
        return Jigsaw(torch.zeros_like(jigsaw.mask), jigsaw.perm), self.unused_unk_row

    def dal_coordinates_for(self, grid: tuple[int, int] | None, device: torch.device) -> torch.Tensor:
        """The DAL loss's targets float32 ``[N, 2]`` for ``grid`` (None: the core's own): the buffer (on the module's
        device) for the grid the core was made for, else made once per grid on ``device`` (a model whose input size
        changed: ``set_input_size``)."""
        coords = self._buffers.get("dal_coordinates")  # None: an object pickled before the buffer existed
        own_grid = getattr(self, "coordinates_grid", None)
        if coords is not None and (grid is None or tuple(grid) == own_grid):
            return coords
        rows, cols = grid if grid is not None else self.sampler.grid_size
        return cached_grid_coordinates(int(rows), int(cols), self.dal_normalize, str(device))

    def dal_loss_of(
        self, table: torch.Tensor, grid: tuple[int, int] | None, jigsaw: Jigsaw | None, prefix_positions: int
    ) -> torch.Tensor:
        """The DAL loss (0-d float32) of ``table`` ``[1, Q + N, D]`` (its first Q = ``prefix_positions`` rows
        skipped), whose positions form ``grid`` (None: the core's), over the positions ``jigsaw`` left unmasked
        (every one without a jigsaw, or when its mask is of another grid: an input of another size)."""
        coords = self.dal_coordinates_for(grid, table.device)
        mask = jigsaw.mask if jigsaw is not None else None
        drawn_on = self.__dict__.get("_last_grid") if jigsaw is self.last_jigsaw else None
        table_grid = tuple(grid) if grid is not None else tuple(self.sampler.grid_size)
        if mask is not None and (mask.shape[1] != coords.shape[0] or (drawn_on is not None and drawn_on != table_grid)):
            # The input had another grid (dynamic size): regress every stored position. Told by the grid the jigsaw
            # was drawn on where the forward recorded it (a 2x8 input of a 4x4 table has as many positions).
            mask = None
        # The whole table: its prefix rows are skipped by the kernels, so nothing is sliced here.
        backend = self.backend_for(coords.device)
        return dal_loss_unchecked(table, self.dal_regressor, coords, mask, backend, prefix_positions, self.dal_scale)
