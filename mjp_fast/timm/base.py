"""What every converted model has (``mjp_eval``, ``mjp_aux_loss``), and the MJP class of a timm class."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from mjp_fast.timm.state import MJPState

_SUBCLASSES: dict[tuple[type, type], type] = {}


def _mjp_class(model_class: type, timm_class: type | None, mjp_class: type) -> type:
    """The MJP class of ``model_class``: ``mjp_class`` for timm's own class, else a generated subclass of both
    (timm subclasses, and the feature wrappers, whose ``mjp_class`` is a mixin: ``timm_class`` None)."""
    if model_class is timm_class:
        return mjp_class
    key = (model_class, mjp_class)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"MJP{model_class.__name__}", (mjp_class, model_class), {"__module__": __name__})
    return _SUBCLASSES[key]


class _MJPMixin:
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
        """The DAL loss of the last forward, unweighted (the training loop applies its weight); zero when DAL is
        off. No host sync."""
        raise NotImplementedError


class _MJPNoDALMixin(_MJPMixin):
    """MJP without position embeddings to regress: the DAL loss is always zero."""

    def mjp_aux_loss(self) -> torch.Tensor:
        reference = next(self.parameters())
        return reference.new_zeros((), dtype=torch.float32)
