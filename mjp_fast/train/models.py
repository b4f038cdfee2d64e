"""Building the model of a run, and rebuilding it from a checkpoint.

A checkpoint names its model the timm way: ``timm.create_model(model_name, pretrained=False, **model_kwargs)``
rebuilds it. MJP models are ``mjp_<base>`` (``mjp_deit_small_patch16_224`` and friends are registered by
``mjp_fast.timm``; :func:`ensure_registered` registers the same kind of entry point for any other timm base);
their ``model_kwargs`` carry ``mjp_ratio``, ``mjp_prob``, ``mjp_dal``, ``mjp_seed``, ``mjp_unk`` and
``mjp_dal_reduction`` (checkpoints written before the last two existed rebuild with their defaults: unk on, the
mean reduction). Baselines are the plain timm model. ``pos_embed=none`` adds timm's ``pos_embed="none"`` keyword
(a ViT without absolute position embeddings), for either.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

import timm
from timm.models import is_model
from torch import nn

import mjp_fast.timm as mjp_timm
from mjp_fast._model_geometry import input_size, patch_size_of
from mjp_fast.train.config import ConfigError, TrainConfig

__all__ = [
    "MJP_PREFIX",
    "VIT_SHAPE_KEYS",
    "base_name",
    "create_model",
    "ensure_registered",
    "input_size",
    "is_mjp_model",
    "keywords_taken",
    "model_spec",
    "patch_size_of",
]

MJP_PREFIX = "mjp_"

# The config keys that shape a ViT: timm's VisionTransformer (and Eva, BEiT, the relative-position ViTs) takes each
# by that name and meaning; ResNet and ConvNeXt take none of them, Swin some with other meanings (num_heads per stage).
VIT_SHAPE_KEYS = ("img_size", "patch_size", "embed_dim", "depth", "num_heads")


def base_name(name: str) -> str:
    """``mjp_deit_small_patch16_224`` -> ``deit_small_patch16_224``."""
    return name[len(MJP_PREFIX) :] if name.startswith(MJP_PREFIX) else name


def ensure_registered(name: str) -> None:
    """Makes ``timm.create_model(name)`` work for ``mjp_<any timm model>``. Raises ConfigError for an unknown name."""
    if is_model(name):
        return
    base = base_name(name)
    if name.startswith(MJP_PREFIX) and is_model(base):
        mjp_timm.register(base)
        return
    close = difflib.get_close_matches(base, timm.list_models(), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else " (timm.list_models() lists them)"
    raise ConfigError(f"model {base!r} is not a timm model{hint}")


def model_spec(config: TrainConfig, num_classes: int, *, mjp: bool | None = None) -> tuple[str, dict[str, Any]]:
    """(model_name, model_kwargs) of the run: what ``timm.create_model`` needs to build it."""
    use_mjp = config.mjp if mjp is None else mjp
    base = base_name(config.model)
    kwargs: dict[str, Any] = {"num_classes": num_classes, "drop_path_rate": config.drop_path}
    for key in VIT_SHAPE_KEYS:
        value = getattr(config, key)
        if value is not None:
            kwargs[key] = value
    if config.pos_embed == "none":
        # timm's VisionTransformer keyword; left out for "learned" (timm's default), which other models lack.
        kwargs["pos_embed"] = "none"
    if not use_mjp:
        return base, kwargs
    kwargs.update(
        mjp_ratio=config.mjp_ratio,
        mjp_prob=config.mjp_prob,
        mjp_dal=config.mjp_dal,  # "none" too: timm drops None-valued keywords
        mjp_seed=config.seed if config.mjp_seed is None else config.mjp_seed,
        mjp_unk=config.mjp_unk,
        mjp_dal_reduction=config.dal_reduction,
    )
    return MJP_PREFIX + base, kwargs


def keywords_taken(model_class: type) -> frozenset[str]:
    """The keyword arguments that ``model_class(...)`` takes by name. A constructor that passes ``**kwargs`` on
    (timm's ``VisionTransformerDistilled``) adds those of the next class up its method resolution order."""
    taken: set[str] = set()
    for cls in model_class.__mro__:
        if "__init__" not in vars(cls) or cls is object:
            continue
        parameters = inspect.signature(cls.__init__).parameters.values()
        taken.update(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    taken.discard("self")
    return frozenset(taken)


def create_model(model_name: str, model_kwargs: dict[str, Any]) -> nn.Module:
    """``timm.create_model(model_name, pretrained=False, **model_kwargs)``, with readable errors."""
    ensure_registered(model_name)
    if "mjp_dal" in model_kwargs and model_kwargs["mjp_dal"] is None:
        # Checkpoints of mjp_fast 0.1.0 wrote None for no DAL, which timm's create_model would drop.
        model_kwargs = {**model_kwargs, "mjp_dal": "none"}
    try:
        return timm.create_model(model_name, pretrained=False, **model_kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError) as error:
        settings = ", ".join(f"{key}={value}" for key, value in model_kwargs.items())
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if "pos_embed" in model_kwargs and isinstance(error, TypeError) and "pos_embed" in message:
            message = f"pos_embed=none needs a timm VisionTransformer (deit_*, vit_*), which {model_name} is not"
        raise ConfigError(f"cannot build model {model_name} with {settings}: {message}") from None


def is_mjp_model(model: nn.Module) -> bool:
    return isinstance(model, mjp_timm.MJPModel)
