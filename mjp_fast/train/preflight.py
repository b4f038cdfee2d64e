"""What ``mjp train`` checks before its first training step, for every model the run will build.

A comparison (``compare=true``) trains a baseline, then an MJP model. A mistake that only the MJP model's build
meets would otherwise surface after the baseline has trained for minutes, and a missing data folder behind a bad
value. :func:`check_run` checks the values, the data folder, the output folder and the device, builds each model
of the run on PyTorch's meta device and discards it, and reports every problem in one :class:`ConfigError`, one
a line. The meta device gives timm's and MJP's constructors their checks without memory or initialization: a
ViT-B builds in about 0.3 s there against 2.7 s on the CPU (a ResNet-18: 0.05 s against 0.3 s; measured on two
shared CPU cores); a model whose constructor needs real tensors is built on the CPU instead.

It also fits to the model the keys that the user did not set (:attr:`TrainConfig.explicit_keys`):

- ViT shape keys (``img_size``, ``patch_size``, ``embed_dim``, ``depth``, ``num_heads``) are passed only to a
  model that takes all five (a timm VisionTransformer, Eva, BEiT): the ``digits`` preset's small ViT shape is not
  passed to a ResNet, which builds with its own defaults (a note says so). Such a key that the user set and the
  model does not take is an error that names it.
- The recipe's DAL (``mjp_dal=nonlinear``) is turned off for a model without an absolute position table (a
  ResNet, a Swin: the pixel-space jigsaw; a RoPE ViT), instead of a warning that the regressor is ignored. A DAL
  the user asked for (``mjp_dal=nonlinear`` given) cannot be honoured there: it is an error, before training,
  rather than a run without the DAL that was asked for.

    config = check_run(load_config("digits", ["model=resnet18"]))   # img_size & co. none, mjp_dal none
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from mjp_fast.train.config import ConfigError, TrainConfig
from mjp_fast.train.data import resolve_split
from mjp_fast.train.device import amp_dtype, resolve_device
from mjp_fast.train.models import (
    VIT_SHAPE_KEYS,
    base_name,
    create_model,
    ensure_registered,
    input_size,
    keywords_taken,
    model_spec,
)
from mjp_fast.train.outcome import LAST_CHECKPOINT, RUNS
from mjp_fast.train.readers import parse_source


def check_run(config: TrainConfig, *, resume: bool | str | Path = False, environment: bool = True) -> TrainConfig:
    """Every check of a run of ``config`` that needs no training; returns ``config`` fitted to its models (see the
    module docstring; the fits' lines join :attr:`TrainConfig.notes`).

    Args:
        resume: as :func:`mjp_fast.train.loop.train`'s (a new run must not go into a folder that holds one).
        environment: also check the data folder, the output folder and the device. False: the values and the models
            alone, for a config that is printed to run elsewhere (``mjp train --print-config``).

    Raises:
        ConfigError: every problem, one a line (``error.problems``): the folders first, then the values, the device
        and the models (the last two only once the values are valid).
    """
    problems = folder_problems(config, resume=resume) if environment else []
    value_problems = config.problems()
    problems += value_problems
    if not value_problems:
        if environment:
            problems += device_problems(config)
        config, model_problems = fit_models(config)
        problems += model_problems
    if problems:
        raise ConfigError(*problems, config=config)
    return config


def with_folder_problems(error: ConfigError, *, resume: bool | str | Path = False) -> ConfigError:
    """``error`` (raised by :meth:`TrainConfig.validate`) with the problems of the config's data and output folders
    in front, so that one try shows every mistake; ``error`` itself where it has no config or the folders are fine."""
    if error.config is None:
        return error
    problems = folder_problems(error.config, resume=resume)
    return ConfigError(*problems, *error.problems, config=error.config) if problems else error


def folder_problems(config: TrainConfig, *, resume: bool | str | Path = False) -> list[str]:
    """The data folder's problems (it and its training split must exist; the rest of it is checked when the datasets
    are built, before the first step too), and an output folder that holds a run already when this is a new one."""
    problems = []
    if config.dataset_kind == "folder" and isinstance(config.data, str) and config.data:
        try:
            source = parse_source(config.data)
            if not source.scheme:  # an ImageFolder tree (hfds/ and wds/ sources are checked when they are read)
                resolve_split(source.location, config.train_split)
        except ConfigError as error:
            problems += error.problems
    if not resume and isinstance(config.output, str) and config.output:
        output = Path(config.output)
        folders = [output / name for name, _ in RUNS] if config.compare else [output]
        for folder in folders:
            if (folder / LAST_CHECKPOINT).exists():
                problems.append(
                    f"output folder {str(folder)!r} already holds a run ({LAST_CHECKPOINT}); pass --resume to "
                    "continue it or choose another --output"
                )
    return problems


def device_problems(config: TrainConfig) -> list[str]:
    """A device that torch cannot use, and an autocast dtype that the device lacks."""
    try:
        device = resolve_device(config.device, int(os.environ.get("LOCAL_RANK", "0")))
        amp_dtype(config, device)
    except ConfigError as error:
        return error.problems
    return []


def fit_models(config: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """Builds each model of the run (a comparison's baseline and MJP model) on the meta device; returns the config
    fitted to them (see the module docstring) and the problems met, one a line.

    The MJP model is the baseline with MJP added: where the baseline fails, it is not built (it would fail alike).
    """
    try:
        ensure_registered(base_name(config.model))
        plain = build_for_checks(base_name(config.model), {})
    except ConfigError as error:
        return config, error.problems
    config, problems = fit_shape_keys(config, plain)
    if problems:
        return config, problems
    for use_mjp in (False, True) if config.compare else (config.mjp,):
        model_name, model_kwargs = model_spec(config, config.num_classes or 1, mjp=use_mjp)
        if config.num_classes is None:
            # The dataset's class count, which the head's width changes no check of: the model's default head stands
            # in, and an error names no count that the run will not use.
            del model_kwargs["num_classes"]
        wants_dal = use_mjp and config.mjp_dal != "none"
        try:
            if wants_dal:
                # convert's warning that the DAL is ignored: a DAL the user did not ask for is fitted below, one
                # they asked for is an error (neither should train on with only a warning).
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=_DAL_IGNORED_WARNING, category=UserWarning)
                    model = build_for_checks(model_name, model_kwargs)
            else:
                model = build_for_checks(model_name, model_kwargs)
        except ConfigError as error:
            return config, error.problems
        if wants_dal and getattr(getattr(model, "mjp", None), "dal_regressor", None) is None:
            if not config.is_explicit("mjp_dal"):
                config = config.fitted(mjp_dal="none")
            else:
                return config, [
                    f"mjp_dal={config.mjp_dal}: {config.model} ({_base_class_name(model)}) has no absolute position "
                    "table for DAL to regress; set mjp_dal=none (or choose a ViT with a learned position table)"
                ]
    return config, []


# The start of the warning of mjp_fast.timm.convert for a model without a table that was asked for DAL.
_DAL_IGNORED_WARNING = r"model: .* has no absolute position table"


def _base_class_name(model: nn.Module) -> str:
    """The class name of the timm model inside an MJP model (its MJP class wraps or subclasses it)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("timm."):
            return cls.__name__
    return type(model).__name__


def fit_shape_keys(config: TrainConfig, plain: nn.Module) -> tuple[TrainConfig, list[str]]:
    """The ViT shape keys of ``config`` fitted to its timm model (``plain``, built with the model's defaults): those
    the user did not set are dropped unless the model takes all five; one the user set that the model does not
    take is a problem, except an ``img_size`` equal to the model's own (a saved config's resolved size)."""
    model_class = type(plain)
    taken = keywords_taken(model_class)
    takes_vit_shape = set(VIT_SHAPE_KEYS) <= taken
    refused, dropped, same = [], {}, {}
    for key in VIT_SHAPE_KEYS:
        value = getattr(config, key)
        if value is None:
            continue
        if not config.is_explicit(key):
            if not takes_vit_shape:
                dropped[key] = value
        elif key not in taken:
            if key == "img_size" and value == input_size(plain):
                same[key] = None
            else:
                refused.append(f"{key}={value}")
    if refused:
        them = "it" if len(refused) == 1 else "them"
        return config, [f"{config.model} ({model_class.__name__}) does not take {', '.join(refused)}: drop {them}"]
    if same:
        config = config.fitted(**same)
    if dropped:
        settings = ", ".join(f"{key}={value}" for key, value in dropped.items())
        note = (
            f"{settings} (a ViT's shape, not set here) are not passed to {config.model} ({model_class.__name__}), "
            f"which builds with its own defaults: {input_size(plain)} px images"
        )
        config = config.fitted(note, **dict.fromkeys(dropped))
    return config, []


def build_for_checks(model_name: str, model_kwargs: dict) -> nn.Module:
    """:func:`mjp_fast.train.models.create_model` on the meta device, which raises the same errors without the
    memory or the initialization; on the CPU where the meta build fails, since a constructor may need real tensors
    (``.item()``): that build's error, if any, is the model's own. Raises ConfigError."""
    try:
        with torch.device("meta"):
            return create_model(model_name, model_kwargs)
    except Exception:  # noqa: BLE001 - the CPU build below raises the model's own error, or shows it was the meta device
        pass
    return create_model(model_name, model_kwargs)


def say_notes(config: TrainConfig) -> None:
    """Prints :attr:`TrainConfig.notes` to stderr, one line each, on the main process (``RANK`` 0 under torchrun)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    for note in config.notes:
        print(f"mjp train: note: {note}", file=sys.stderr, flush=True)
