"""The ``mjp_<base>`` models registered with timm: ``register(base)`` for any timm model name."""

from __future__ import annotations

from collections import deque

import timm
from timm.models import DefaultCfg, get_arch_pretrained_cfgs, register_model
from torch import nn

from mjp_fast.timm.convert import convert
from mjp_fast.timm.schedule import DEFAULT_DAL_WEIGHT

REGISTERED_BASES = (
    "deit_tiny_patch16_224",
    "deit_small_patch16_224",
    "deit_base_patch16_224",
    "vit_small_patch16_224",
    "vit_base_patch16_224",
)


def _make_entrypoint(base: str):
    name = f"mjp_{base}"

    def entrypoint(
        pretrained: bool = False,
        mjp_ratio: float = 0.1,
        mjp_prob: float = 0.5,
        mjp_dal: str | None = None,
        mjp_seed: int = 0,
        mjp_fused_patch_embed: bool | None = None,
        mjp_unk: bool = True,
        mjp_dal_reduction: str = "mean",
        mjp_dal_weight: float = DEFAULT_DAL_WEIGHT,
        **kwargs,
    ) -> nn.Module:
        # The base's own entry point builds the model (and, with features_only, timm's feature wrapper around it)
        # and loads the pretrained weights named by pretrained_cfg/pretrained_cfg_overlay: this name shares the
        # base's pretrained configs. Then MJP's own parameters are added, freshly initialized.
        model = timm.create_model(base, pretrained=pretrained, **kwargs)
        if mjp_dal is None:  # not given (timm drops None-valued keywords, so "none" is how to turn DAL off)
            mjp_dal = "auto"  # convert's: nonlinear where the model has an absolute position table, else none
        model = convert(
            model,
            ratio=mjp_ratio,
            prob=mjp_prob,
            dal=mjp_dal,
            seed=mjp_seed,
            fused_patch_embed=mjp_fused_patch_embed,
            unk=mjp_unk,
            dal_reduction=mjp_dal_reduction,
            dal_weight=mjp_dal_weight,
        )
        config = getattr(model, "pretrained_cfg", None)
        if isinstance(config, dict):
            # Name the architecture that was built, as timm does for its own models.
            model.pretrained_cfg = model.default_cfg = {**config, "architecture": name}
        return model

    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = (
        f"timm's {base} with MJP (see mjp_fast.timm.convert). mjp_dal: 'nonlinear', 'linear', 'pca' or 'none'; "
        "by default the paper's nonlinear DAL where the model has absolute position embeddings, else none. "
        "mjp_fused_patch_embed: as convert's fused_patch_embed (default: fused where the patch embedding is standard). "
        "mjp_unk, mjp_dal_reduction: as convert's unk (False: shuffled patches keep the position embeddings of where "
        "they land; no mjp.unk_embed) and dal_reduction ('mean' or 'sum'). mjp_dal_weight: as convert's dal_weight "
        "(default 0.01): the weight at which a training forward attaches the DAL loss to the output."
    )
    return entrypoint


# What timm's register_model reads to list mjp_<base> with the base's pretrained tags (timm.list_pretrained).
default_cfgs: dict[str, DefaultCfg] = {}


def register(base: str) -> str:
    """Registers ``mjp_<base>`` with timm for any timm model ``base``; returns that name.

    ``timm.create_model("mjp_<base>", mjp_ratio=..., mjp_prob=..., mjp_dal=..., mjp_seed=..., mjp_unk=...,
    mjp_dal_reduction=..., mjp_dal_weight=..., mjp_fused_patch_embed=..., **timm_kwargs)`` then builds ``base``
    (``pretrained``, ``pretrained_cfg_overlay``, ``features_only`` and the other keywords go to timm) and converts it
    with :func:`convert`. ``mjp_<base>`` carries the base's pretrained configs (its tags in
    ``timm.list_pretrained``), so ``pretrained=True`` loads the base's weights; MJP's own parameters start fresh.
    Registering a name twice is a no-op.

    Raises:
        ValueError: ``base`` is not a timm model name.
    """
    if not isinstance(base, str):
        raise TypeError(f"base must be a timm model name (str), got {type(base).__name__}")
    name = f"mjp_{base}"
    if timm.is_model(name):
        return name
    if not timm.is_model(base):
        raise ValueError(f"base must be a timm model name, got {base!r} (timm.list_models() lists them)")
    base_cfgs = get_arch_pretrained_cfgs(base)  # "base.tag" -> PretrainedCfg, the default tag first
    if base_cfgs:
        tags = [key.partition(".")[2] for key in base_cfgs]
        default_cfgs[name] = DefaultCfg(tags=deque(tags), cfgs=dict(zip(tags, base_cfgs.values())))
    entrypoint = _make_entrypoint(base)
    globals()[entrypoint.__name__] = register_model(entrypoint)
    return name


for _base in REGISTERED_BASES:
    register(_base)
