"""``JigsawSampler``: the per-step source of jigsaws that modules own (MJPPatchEmbed, the timm models).

It keeps the sampler's settings, the stream position (a buffer, so checkpoints carry it and a resumed run draws
the masks it would have drawn), the sampler's integer tables for its grid, and the eval-mode jigsaw context of
the paper's consistency protocol.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mjp_fast._distributed import rank_and_world
from mjp_fast._validate import check_fraction, check_int, check_positive_float, to_device
from mjp_fast.backend import resolve_once
from mjp_fast.sampler.dispatch import SamplerPlan, check_device, make_sampler_plan, sampler_params
from mjp_fast.sampler.jigsaw import Jigsaw
from mjp_fast.sampler.reference import MAX_GRID_POSITIONS, check_sampler_grid, sampler_tables


def _check_shared(shared: object) -> bool:
    if not isinstance(shared, bool):
        raise TypeError(f"shared must be a bool, got {type(shared).__name__}")
    return shared


# The settings a loop may assign (prob per epoch), each checked on assignment as sample_jigsaw checks it: a step then
# checks nothing, and a mistake is refused where it is made, by name.
_SETTING_CHECKS = {
    "ratio": lambda value: check_fraction("ratio", value),
    "prob": lambda value: check_fraction("prob", value),
    "seed": lambda value: check_int("seed", value, minimum=0, maximum=2**64 - 1),
    "min_block": lambda value: check_int("min_block", value, minimum=1, maximum=MAX_GRID_POSITIONS),
    "min_aspect": lambda value: check_positive_float("min_aspect", value),
    "shared": _check_shared,
}


def _check_batch(batch: object) -> None:
    """``batch``: an int >= 0 (a SymInt under torch.compile goes unchecked: comparing it would add a guard)."""
    if type(batch) is int and batch >= 0:
        return
    if torch.compiler.is_compiling() and isinstance(batch, torch.SymInt):
        return
    check_int("batch", batch, minimum=0)


class JigsawSampler(nn.Module):
    """Draws one batch of jigsaws per call, from the stream ``(seed, global sample index)``.

    Args:
        grid_size: the patch grid the tables are made for (other grids work too, with tables made on the fly).
        ratio, prob, seed, min_block, min_aspect, shared: as :func:`mjp_fast.sample_jigsaw`.
        backend: forced backend, default automatic for the device.

    In training mode each call jigsaws (per sample, with probability ``prob``) and advances the stream; in eval
    mode it returns None, unless inside :meth:`jigsaw_eval`.
    """

    # The training path's plan and the settings it was made for (see forward); class-level, so a sampler pickled
    # before they existed reads None and makes its plan.
    _plan: SamplerPlan | None = None
    _plan_key: tuple | None = None
    _tables_min_aspect: float | None = None  # the min_aspect the table buffers hold (None: before this existed)

    def __init__(
        self,
        grid_size: int | tuple[int, int],
        ratio: float = 0.1,
        prob: float = 0.5,
        seed: int = 0,
        *,
        min_block: int = 8,
        min_aspect: float = 0.3,
        shared: bool = False,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.grid_size = check_sampler_grid(grid_size)
        # Checked by __setattr__, as any later assignment.
        self.ratio, self.prob, self.seed, self.min_block, self.min_aspect, self.shared = (
            ratio,
            prob,
            seed,
            min_block,
            min_aspect,
            shared,
        )
        self.backend = backend
        # Training samples drawn so far on this rank. A tensor on the module's device, so the sampler reads it
        # without a host sync and torch.compile does not recompile per step; a buffer, so it is checkpointed.
        self.register_buffer("sample_counter", torch.zeros((), dtype=torch.int64))
        # The sampler's integer tables for grid_size (not saved: they follow from grid_size and min_aspect).
        h_thresholds, w_thresholds = sampler_tables(*self.grid_size, self.min_aspect)
        self.register_buffer("h_thresholds", h_thresholds.clone(), persistent=False)
        self.register_buffer("w_thresholds", w_thresholds.clone(), persistent=False)
        self._tables_min_aspect = self.min_aspect
        # The Triton sampler reads the seed and the prob threshold from memory (see triton_kernel.py); refreshed in
        # place when seed or prob change (the training loop sets prob per epoch), not rebuilt per call.
        self.register_buffer("params", sampler_params(self.seed, self.prob, "cpu").clone(), persistent=False)
        self._params_key = (self.seed, self.prob)
        self._eval_settings: dict[str, Any] | None = None
        self._eval_counter: torch.Tensor | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        check = _SETTING_CHECKS.get(name)
        super().__setattr__(name, value if check is None else check(value))

    @property
    def samples_seen(self) -> int:
        """How many training samples this rank has drawn (reads the counter: a host sync on a GPU)."""
        return int(self.sample_counter)

    @property
    def active(self) -> bool:
        """Whether the next call draws jigsaws (training with ratio and prob > 0, or inside jigsaw_eval)."""
        if self.training:
            return self.ratio > 0.0 and self.prob > 0.0
        settings = self._eval_settings
        return settings is not None and settings["ratio"] > 0.0 and settings["prob"] > 0.0

    def backend_for(self, device: torch.device) -> str:
        """The backend on ``device``: ``backend`` resolved once per device (``MJP_FAST_BACKEND`` read then), and again
        only when ``backend`` is set. The model that owns this sampler runs its embedding and DAL loss on the same
        choice (:meth:`mjp_fast.core.MJPCore.backend_for`), so a change of the environment mid-run moves no part of
        it."""
        cache = self.__dict__.get("_resolved_backends")
        if cache is None:  # made here: a sampler pickled before this cache existed has none
            cache = self.__dict__["_resolved_backends"] = {}
        return resolve_once(cache, self.backend, device)

    def forward(self, batch: int, device: torch.device, grid_size: tuple[int, int] | None = None) -> Jigsaw | None:
        """The next ``batch`` jigsaws for ``grid_size`` (default the module's), or None when inactive.

        The per-step path of the modules: in training, the sampler's plan (settings, tables, resolved backend) is
        made on the first call and kept while the settings, the device and the grid stay the same, so a step only
        launches the sampler. The sampler reads the stream position from ``sample_counter`` on the device, then the
        counter advances on the device: no host sync on the triton and cuda backends; on the CPU, one call of the
        extension does both. (The backend is resolved once per device, :meth:`backend_for`: set ``MJP_FAST_BACKEND``
        before the first step.)

        ``batch`` (an int >= 0), ``device`` and ``grid_size`` are checked as :func:`mjp_fast.sample_jigsaw` checks
        them (the device and grid once per plan, not per step); the settings (``ratio``, ``prob``, ``seed``,
        ``min_block``, ``min_aspect``, ``shared``) when assigned. ``device="meta"`` gives the shapes only.
        """
        _check_batch(batch)
        if not self.active:
            return None
        if not self.training:
            return self._sample_eval(batch, check_device(to_device(device)), grid_size)
        if torch.compiler.is_compiling():
            # Traced once into the graph: nothing to keep (storing it would change the module's state, on which the
            # compiled graph's guards depend: a recompile on the next step).
            plan = self._make_plan(device, grid_size)
        else:
            key = (
                device, grid_size, self.backend, self.ratio, self.prob, self.seed, self.min_block, self.min_aspect,
                self.shared,
            )  # fmt: skip
            if key != self._plan_key:
                self._plan, self._plan_key = self._make_plan(device, grid_size), key
            plan = self._plan
        return self._draw(plan, batch, self.sample_counter)

    def _make_plan(
        self, device: torch.device, grid_size: tuple[int, int] | None, settings: dict[str, Any] | None = None
    ) -> SamplerPlan:
        """The plan for ``device`` and ``grid_size``. Training (no ``settings``): the module's ratio, prob and seed,
        whose Triton parameters live in the ``params`` buffer; :meth:`jigsaw_eval`: its ``settings``'. The module's
        tables serve its own grid on their device; another grid or device gets the shared cached ones."""
        # "cuda" and "cuda:0" must compare equal below; a device where no tensor can be made is a ValueError
        device = check_device(to_device(device))
        grid = self.grid_size if grid_size is None else check_sampler_grid(grid_size)
        tables = params = None  # None: make_sampler_plan's shared cached ones
        if grid == self.grid_size and self.h_thresholds.device == device:
            if self.min_aspect != self._tables_min_aspect:  # refreshed in place, as params below
                for buffer, table in zip(
                    (self.h_thresholds, self.w_thresholds), sampler_tables(*grid, self.min_aspect)
                ):
                    buffer.copy_(table)
                self._tables_min_aspect = self.min_aspect
            tables = (self.h_thresholds, self.w_thresholds)
        if settings is None:
            ratio, prob, seed = self.ratio, self.prob, self.seed
            if self.params.device == device:
                if (seed, prob) != self._params_key:  # refreshed in place: a captured CUDA graph keeps reading it
                    self.params.copy_(sampler_params(seed, prob, "cpu"))
                    self._params_key = (seed, prob)
                params = self.params
        else:
            ratio, prob, seed = settings["ratio"], settings["prob"], settings["seed"]
        return make_sampler_plan(
            grid, ratio, seed=seed, prob=prob, shared=self.shared, min_block=self.min_block,
            min_aspect=self.min_aspect, device=device, backend=self.backend_for(device), tables=tables,
            params=params,
        )  # fmt: skip

    def _draw(self, plan: SamplerPlan, batch: int, counter: torch.Tensor) -> Jigsaw:
        """The next ``batch`` jigsaws of the stream whose position ``counter`` holds, which then advances by
        ``batch``."""
        rank, world = rank_and_world()
        # Sample i of this call has the global stream index counter * world + rank * batch + i: with a constant
        # per-rank batch, distinct on every rank and the same after a resume.
        if counter.device == plan.h_thresholds.device:
            return plan.sample_step(batch, counter, world, rank * batch)
        # Asked for another device than the module's: the kernels read the stream position where they run.
        jigsaw = plan.sample(batch, counter.to(plan.h_thresholds.device), world, rank * batch)
        counter.add_(batch)  # a buffer that needs no gradient: nothing is recorded
        return jigsaw

    def _sample_eval(self, batch: int, device: torch.device, grid_size: tuple[int, int] | None) -> Jigsaw:
        """Inside :meth:`jigsaw_eval`: the next jigsaws of the context's own stream."""
        settings = self._eval_settings
        if self._eval_counter is None or self._eval_counter.device != device:
            self._eval_counter = torch.full((), settings["start"], dtype=torch.int64, device=device)
        return self._draw(self._make_plan(device, grid_size, settings), batch, self._eval_counter)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's signature
        # .to(), .cuda(), .half(), ...: the buffers the plan holds are replaced, so the plan is made again.
        self._plan_key = self._plan = None
        return super()._apply(fn, recurse)

    @contextlib.contextmanager
    def jigsaw_eval(
        self, ratio: float = 0.5, seed: int = 0, prob: float = 1.0, start: int = 0
    ) -> Iterator[JigsawSampler]:
        """Within this context, eval mode jigsaws too, from the stream of ``seed``: the same jigsaws for the same
        seed.

        ``start``: how many samples of that stream this rank has drawn before. A pass that enters the context once
        per batch (its plain forward outside) passes the count of samples so far and gets one uninterrupted
        stream, the same jigsaws as a single entry would give.
        """
        settings = {
            "ratio": check_fraction("ratio", ratio),
            "seed": check_int("seed", seed, minimum=0, maximum=2**64 - 1),
            "prob": check_fraction("prob", prob),
            "start": check_int("start", start, minimum=0, maximum=2**62),
        }
        previous = (self._eval_settings, self._eval_counter)
        self._eval_settings, self._eval_counter = settings, None
        try:
            yield self
        finally:
            self._eval_settings, self._eval_counter = previous

    def extra_repr(self) -> str:
        return (
            f"grid_size={self.grid_size}, ratio={self.ratio}, prob={self.prob}, seed={self.seed}, "
            f"shared={self.shared}, min_block={self.min_block}, min_aspect={self.min_aspect}"
        )
