"""What every converted model has (``mjp_eval``, ``mjp_aux_loss``, ``mjp_dal_weight``), and the MJP class of a timm
class."""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterator

import torch
from torch import nn

from mjp_fast.timm.schedule import check_dal_weight
from mjp_fast.timm.state import MJPState

_SUBCLASSES: dict[tuple[type, type], type] = {}


def mjp_class_of(model_class: type, timm_class: type | None, mjp_class: type) -> type:
    """The MJP class of ``model_class``: ``mjp_class`` for timm's own class, else a generated subclass of both
    (timm subclasses, the pixel-space models of every other timm class, and the feature wrappers, whose
    ``mjp_class`` is a mixin: ``timm_class`` None).

    A generated class is named ``MJP<model class>``; its ``__qualname__`` names both classes by their modules (see
    :func:`__getattr__`), so that pickle (``torch.save(model)``) finds it again, in this process or a fresh one.
    """
    if model_class is timm_class:
        return mjp_class
    key = (model_class, mjp_class)
    if key not in _SUBCLASSES:
        generated = type(f"MJP{model_class.__name__}", (mjp_class, model_class), {"__module__": __name__})
        generated.__qualname__ = _PICKLE_NAME.format(_dotless(mjp_class), _dotless(model_class))
        _SUBCLASSES[key] = generated
    return _SUBCLASSES[key]


# A generated class's __qualname__: pickle looks it up as one attribute of this module (no dots: protocol 2, as
# torch.save writes, would split a dotted name into nested lookups).
_PICKLE_NAME = "MJP[{}|{}]"
_PICKLE_NAME_PATTERN = re.compile(r"^MJP\[([\w/]+):([\w/]+)\|([\w/]+):([\w/]+)\]$")


def _dotless(cls: type) -> str:
    """``module:qualname`` of ``cls`` with every dot written as ``/``."""
    return f"{cls.__module__}:{cls.__qualname__}".replace(".", "/")


def _class_at(module: str, qualname: str) -> type:
    found: object = importlib.import_module(module.replace("/", "."))
    for part in qualname.split("/"):
        found = getattr(found, part)
    if not isinstance(found, type):
        raise AttributeError(f"{module.replace('/', '.')}.{qualname.replace('/', '.')} is not a class")
    return found


def __getattr__(name: str) -> type:
    """A generated MJP class by its ``__qualname__`` (PEP 562: called for names this module does not have): how a
    pickled model of a generated class is loaded. The class is made again from the two classes its name gives."""
    match = _PICKLE_NAME_PATTERN.match(name)
    if match is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    mjp_class = _class_at(match[1], match[2])
    model_class = _class_at(match[3], match[4])
    return mjp_class_of(model_class, None, mjp_class)


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
