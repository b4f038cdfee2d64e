"""What every converted model has (``mjp_eval``, ``mjp_aux_loss``, ``mjp_dal_weight``), and the MJP class of a timm
class."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from mjp_fast.timm.schedule import check_dal_weight
from mjp_fast.timm.state import MJPState

_SUBCLASSES: dict[tuple[type, type], type] = {}


def mjp_class_of(model_class: type, timm_class: type | None, mjp_class: type) -> type:
    """The MJP class of ``model_class``: ``mjp_class`` for timm's own class, else a generated subclass of both
    (timm subclasses, and the feature wrappers, whose ``mjp_class`` is a mixin: ``timm_class`` None)."""
    if model_class is timm_class:
        return mjp_class
    key = (model_class, mjp_class)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"MJP{model_class.__name__}", (mjp_class, model_class), {"__module__": __name__})
    return _SUBCLASSES[key]


class MJPModel:
    """Methods every converted model has."""

    mjp: MJPState

    @contextlib.contextmanager
    def mjp_eval(self, ratio: float = 0.5, seed: int = 0, prob: float = 1.0, start: int = 0) -> Iterator[nn.Module]:
        """Eval mode on jigsawed input (with the UNK embedding), the same jigsaws for the same seed.

        The paper's consistency protocol: compare ``model(x)`` in eval mode with the output inside this context.
        The model's training mode is restored on exit. ``start``: samples of the stream this rank drew before, for
        a pass that enters once per batch (see :meth:`mjp_fast.JigsawSampler.jigsaw_eval`).
        """
        was_training = self.training
        self.eval()
        try:
            with self.mjp.sampler.jigsaw_eval(ratio=ratio, seed=seed, prob=prob, start=start):
                yield self
        finally:
            self.train(was_training)

    def mjp_aux_loss(self) -> torch.Tensor:
        """The DAL loss of the last forward, unweighted, for a loop that adds ``w * loss`` to its total itself; zero
        when DAL is off. No host sync.

        Optional: a training forward already attaches the DAL loss to the model's output at ``mjp_dal_weight`` (the
        output's backward trains DAL). Where that forward attached it, the first call after it returns that loss,
        made so that a backward through it counts it at the loop's weight ``w`` in place of ``mjp_dal_weight``
        (never both); later calls, and calls after a forward that attached nothing, compute it again (a loss of its
        own, counted at ``w`` on top of what is attached). A call whose result is never back-propagated (logging)
        changes nothing: ``model.mjp.last_dal_loss`` reads the attached loss without a graph.
        """
        raise NotImplementedError

    @property
    def mjp_dal_weight(self) -> float:
        """The weight at which a training forward attaches the DAL loss to the output (``model.mjp.dal_weight``, a 0-d
        float32 buffer, not in the state dict).

        Set it to a finite float >= 0 (0: DAL off, the plain gradients) between steps, before the forward that should
        apply it, or let :class:`mjp_fast.timm.DALWeightSchedule` decay it; the buffer is filled in place (the same
        tensor: compiled graphs and CUDA graphs keep reading it). Reading it reads the buffer back (a host sync on a
        GPU).
        """
        return self.mjp.get_dal_weight()

    @mjp_dal_weight.setter
    def mjp_dal_weight(self, value: float) -> None:
        self.mjp.set_dal_weight(check_dal_weight("mjp_dal_weight", value))


class MJPNoDALModel(MJPModel):
    """MJP without position embeddings to regress: the DAL loss is always zero."""

    def mjp_aux_loss(self) -> torch.Tensor:
        reference = next(self.parameters())
        return reference.new_zeros((), dtype=torch.float32)
