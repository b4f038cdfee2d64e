"""The training configuration: one dataclass, and the YAML files, ``key=value`` overrides, built-in presets and
bundled recipe files read into it.

Every knob of ``mjp train`` is a field of :class:`TrainConfig`. Its defaults are the DeiT recipe of the paper's
supplementary (Table 1) with MJP's settings; the ``digits`` preset is the embedded default that needs no data; the
bundled configs (``deit_s``, ``deit_ti``, ``vit_s``, ``cifar10``: :func:`bundled_configs`) spell out the paper's
recipes with their sources.

    config = load_config("my.yaml", overrides=["epochs=30", "mjp_ratio=0.2"])
    config = load_config("deit_s", data="/data/imagenet")

Values are type-checked against the field's annotation; a wrong key or value raises :class:`ConfigError` whose
message names the key, what was expected and what was given.

Beside this file: :mod:`mjp_fast.train.config_values` (``ConfigError``, a value converted to a field's type) and
:mod:`mjp_fast.train.presets` (the presets and the bundled recipes); their names are imported from here as before.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from mjp_fast._argtypes import COMPILE_MODES
from mjp_fast.train.config_values import ConfigError, coerce_value, describe_type
from mjp_fast.train.presets import CONFIG_SUFFIX, PRESETS, bundled_configs

SECTIONS = ("model", "mjp", "data", "augmentation", "optimization", "schedule", "evaluation", "runtime")


def _field(default: Any, section: str, help: str, choices: tuple[str, ...] | None = None) -> Any:  # noqa: A002
    metadata = {"section": section, "help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class TrainConfig:
    """Everything one training run needs. Defaults: the DeiT recipe with MJP (supplementary Table 1)."""

    # model
    model: str = _field(
        "deit_small_patch16_224",
        "model",
        "timm model name: a VisionTransformer (deit_*, vit_*) gets MJP position embeddings; ResNet, Swin and "
        "ConvNeXt get the pixel-space jigsaw (and none of a preset's ViT shape keys, img_size to num_heads). An "
        "mjp_* name means the same base model",
    )
    img_size: int | None = _field(None, "model", "input side in pixels (none: the model's default)")
    patch_size: int | None = _field(None, "model", "ViT patch side in pixels (none: the model's default)")
    embed_dim: int | None = _field(None, "model", "ViT token width (none: the model's default)")
    depth: int | None = _field(None, "model", "ViT number of blocks (none: the model's default)")
    num_heads: int | None = _field(None, "model", "ViT attention heads (none: the model's default)")
    pos_embed: str = _field(
        "learned",
        "model",
        "ViT absolute position embeddings: learned (timm's), or none (no position embeddings; the class token "
        "stays; with mjp=true the jigsaw is then pixel-space only and mjp_dal must be none)",
        ("learned", "none"),
    )
    num_classes: int | None = _field(None, "model", "classifier outputs (none: the number of dataset classes)")
    drop_path: float = _field(0.1, "model", "stochastic depth rate")

    # MJP
    mjp: bool = _field(True, "mjp", "train with MJP (false: the plain baseline model)")
    mjp_ratio: float = _field(0.1, "mjp", "jigsaw mask ratio gamma in [0, 1]")
    mjp_prob: float = _field(0.5, "mjp", "probability that a sample is jigsawed, in [0, 1]")
    mjp_dal: str = _field(
        "nonlinear", "mjp", "DAL position regressor (none: no DAL loss)", ("nonlinear", "linear", "pca", "none")
    )
    dal_reduction: str = _field(
        "mean",
        "mjp",
        "DAL loss over the two coordinates: mean (the paper's code, F.l1_loss) or sum (the paper's formula, twice "
        "the mean at the same dal_weight)",
        ("mean", "sum"),
    )
    mjp_unk: bool = _field(
        True,
        "mjp",
        "jigsawed positions get the learned unknown position embedding (false: the shuffled patches keep the "
        "position embeddings of where they land, the paper's naive-shuffle ablation; no unk_embed)",
    )
    dal_weight: float = _field(0.01, "mjp", "DAL loss weight at the start of training")
    dal_weight_end: float = _field(0.005, "mjp", "DAL loss weight at the end (cosine decay from dal_weight)")
    mjp_from_epoch: int | None = _field(
        None, "mjp", "first epoch (0-based) whose batches are jigsawed (none: warmup_epochs, as the paper's code)"
    )
    mjp_seed: int | None = _field(None, "mjp", "seed of the jigsaw stream (none: seed)")
    compare: bool = _field(
        False, "mjp", "train a baseline (mjp=false) and an MJP model with this config; print them side by side"
    )

    # data
    data: str | None = _field(
        None,
        "data",
        "dataset: an ImageFolder tree <data>/<split>/<class>/<image> (ImageNet, CIFAR folders); hfds/NAME (a Hugging "
        "Face dataset, hub name or local folder); wds/DIR (WebDataset shards; set num_classes)",
    )
    dataset: str = _field(
        "auto",
        "data",
        "folder: the data value (an ImageFolder tree, hfds/ or wds/); digits: scikit-learn's 8x8 digits, no "
        "download; auto: folder when data is set, else digits",
        ("auto", "folder", "digits"),
    )
    train_split: str = _field("train", "data", "training split folder under data")
    val_split: str = _field("auto", "data", "validation split folder under data (auto: val, validation or test)")
    max_train_samples: int | None = _field(None, "data", "use only the first N training samples (a fixed subset)")
    max_val_samples: int | None = _field(None, "data", "use only the first N validation samples (a fixed subset)")
    batch_size: int = _field(128, "data", "images per process and step (the global batch is x world size)")
    eval_batch_size: int | None = _field(None, "data", "images per evaluation batch (none: 2 x batch_size)")
    workers: int | None = _field(None, "data", "data loader processes per rank (none: min(8, CPUs per rank))")
    mean: list[float] | None = _field(None, "data", "normalization mean, e.g. [0.485,0.456,0.406] (none: model's)")
    std: list[float] | None = _field(None, "data", "normalization std (none: the model's)")
    crop_pct: float | None = _field(None, "data", "center-crop fraction at evaluation (none: the model's)")
    interpolation: str = _field("bicubic", "data", "resize interpolation", ("bicubic", "bilinear", "nearest"))
    cache_images: bool = _field(
        False,
        "data",
        "decode a folder dataset's images once into memory (uint8 pixels, shared by the loader workers and by "
        "every run of the process): for datasets that fit in memory, such as CIFAR",
    )
    max_bad_images: int = _field(
        3,
        "data",
        "unreadable images (truncated, not an image) a run tolerates: each is named and replaced by the next readable "
        "one, and each epoch's skips are counted; past this many distinct files the run stops (exit code 2)",
    )
    normalize_on_device: str = _field(
        "auto",
        "data",
        "the loader gives uint8 images, normalized and randomly erased on the training device, as timm's "
        "prefetcher does (a quarter of the bytes to move, no float work in the loader processes; auto: on CUDA)",
        ("auto", "on", "off"),
    )

    # augmentation
    auto_augment: str | None = _field(
        "rand-m9-mstd0.5-inc1", "augmentation", "timm auto-augment policy (none: off); RandAugment 9/0.5"
    )
    color_jitter: float = _field(0.3, "augmentation", "color jitter strength (unused while auto_augment is on)")
    hflip: float = _field(0.5, "augmentation", "horizontal flip probability")
    scale: list[float] = _field([0.08, 1.0], "augmentation", "random-resized-crop area range [min, max]")
    reprob: float = _field(0.25, "augmentation", "random erasing probability")
    remode: str = _field("pixel", "augmentation", "random erasing fill", ("pixel", "rand", "const"))
    recount: int = _field(1, "augmentation", "random erasing count")
    mixup: float = _field(0.8, "augmentation", "mixup alpha (0: off)")
    cutmix: float = _field(1.0, "augmentation", "cutmix alpha (0: off)")
    mixup_prob: float = _field(1.0, "augmentation", "probability of applying mixup or cutmix to a batch")
    mixup_switch_prob: float = _field(0.5, "augmentation", "probability of cutmix instead of mixup when both on")
    mixup_mode: str = _field("batch", "augmentation", "mixup granularity", ("batch", "pair", "elem"))
    smoothing: float = _field(0.1, "augmentation", "label smoothing")
    repeated_aug: bool = _field(True, "augmentation", "repeated augmentation (timm RepeatAugSampler)")
    aug_repeats: int = _field(3, "augmentation", "repeats per image with repeated_aug")

    # optimization
    opt: str = _field("adamw", "optimization", "timm optimizer name (create_optimizer_v2)")
    lr: float | None = _field(None, "optimization", "peak learning rate (none: lr_base x global batch / 512)")
    lr_base: float = _field(5e-4, "optimization", "learning rate per 512 images of global batch")
    weight_decay: float = _field(0.05, "optimization", "weight decay (not on biases, norms, position embeddings)")
    opt_eps: float | None = _field(1e-8, "optimization", "optimizer epsilon (none: the optimizer's default)")
    momentum: float = _field(0.9, "optimization", "momentum of SGD-like optimizers")
    clip_grad: float | None = _field(5.0, "optimization", "gradient clipping threshold (none: off)")
    clip_mode: str = _field("norm", "optimization", "gradient clipping mode", ("norm", "value", "agc"))
    accum_steps: int = _field(1, "optimization", "gradient accumulation: micro-batches per optimizer step")

    # schedule
    epochs: int = _field(300, "schedule", "training epochs")
    sched: str = _field("cosine", "schedule", "timm learning-rate schedule (create_scheduler_v2)")
    warmup_epochs: int = _field(
        20, "schedule", "linear warm-up epochs (one not set, as long as epochs or longer: a tenth of epochs)"
    )
    warmup_lr: float = _field(1e-6, "schedule", "learning rate at the start of warm-up")
    min_lr: float = _field(1e-5, "schedule", "learning rate at the end of the schedule")
    cooldown_epochs: int = _field(0, "schedule", "epochs at min_lr after the schedule")

    # evaluation
    eval_interval: int = _field(1, "evaluation", "evaluate every N epochs (and after the last)")
    eval_ratio: float = _field(0.5, "evaluation", "jigsaw ratio of the consistency and diff-norm metrics")
    eval_seed: int = _field(0, "evaluation", "seed of the evaluation jigsaws")

    # runtime
    output: str | None = _field(None, "runtime", "output folder (none: runs/<dataset>-<date>-<time>)")
    seed: int = _field(0, "runtime", "seed of data order, augmentations, initialization (and jigsaws)")
    device: str = _field("auto", "runtime", "cpu, cuda, cuda:N, or auto (the local GPU under torchrun, else CPU)")
    amp: str = _field(
        "auto", "runtime", "autocast dtype (auto: bf16 on CUDA, none on CPU)", ("auto", "none", "bf16", "fp16")
    )
    compile: bool = _field(False, "runtime", "torch.compile the model")
    compile_mode: str = _field(
        "default",
        "runtime",
        "torch.compile's mode with compile=true (reduce-overhead: CUDA graphs, no per-kernel launches from the host)",
        COMPILE_MODES,
    )
    threads: int | None = _field(None, "runtime", "torch CPU threads per process (none: torch's default)")
    checkpoint_steps: int = _field(
        0, "runtime", "also checkpoint every N optimizer steps within an epoch (0: at the end of each epoch only)"
    )
    log_interval: int = _field(
        50,
        "runtime",
        "steps between loss read-backs: progress-bar updates on a terminal, else a log line (loss, lr, img/s, ETA)",
    )
    sync_debug: bool = _field(
        False,
        "runtime",
        "raise at any host-device synchronization inside a training step after the first (CUDA only: a check that "
        "the steps keep the GPU's queue full)",
    )
    progress: str = _field("auto", "runtime", "progress bars (auto: when stderr is a terminal)", ("auto", "on", "off"))
    tensorboard: bool = _field(
        False,
        "runtime",
        "also write each epoch's record as TensorBoard scalars to <output>/tensorboard (needs the tensorboard package)",
    )

    def __post_init__(self) -> None:
        # Not fields (not saved, compared or listed): where the values came from, for the checks that treat a value
        # the user set apart from a default (see explicit_keys), and what was fitted to the user's values (notes).
        self._explicit: frozenset[str] | None = None
        self._notes: tuple[str, ...] = ()

    @property
    def explicit_keys(self) -> frozenset[str] | None:
        """The keys the user set: a ``key=value`` override, a keyword of :func:`load_config`, a key of the user's own
        YAML file, or a key changed with :meth:`replace`; not those of the dataclass defaults, of a preset
        (``digits``) or of a bundled recipe (``deit_s``). None: not known (a ``TrainConfig(...)`` built directly),
        and every key counts as the user's."""
        return self._explicit

    def is_explicit(self, name: str) -> bool:
        """Whether the user set key ``name`` (see :attr:`explicit_keys`)."""
        return self._explicit is None or name in self._explicit

    @property
    def notes(self) -> tuple[str, ...]:
        """One line per default that was fitted to the user's values (a warm-up shortened to fit ``epochs``, the
        ViT shape keys a ResNet does not take): ``mjp train`` prints them."""
        return self._notes

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes``, which count as set by the user (:attr:`explicit_keys`); the notes stay."""
        explicit = None if self._explicit is None else self._explicit | set(changes)
        return self._copy_with(changes, explicit, ())

    def fitted(self, note: str | None = None, **changes: Any) -> TrainConfig:
        """A copy with defaults fitted to the user's values: ``changes`` do not count as set by the user, and
        ``note`` (one line) says what was changed and why."""
        return self._copy_with(changes, self._explicit, () if note is None else (note,))

    def _copy_with(
        self, changes: dict[str, Any], explicit: Iterable[str] | None, notes: tuple[str, ...]
    ) -> TrainConfig:
        copy = dataclasses.replace(self, **changes)
        copy._explicit = None if explicit is None else frozenset(explicit)
        copy._notes = self._notes + notes
        return copy

    def to_dict(self) -> dict[str, Any]:
        return {field.name: _plain(getattr(self, field.name)) for field in dataclasses.fields(self)}

    def validate(self) -> TrainConfig:
        """Checks value ranges and combinations; returns self. Raises ConfigError listing every problem, with
        ``error.config`` set to this config."""
        problems = self.problems()
        if problems:
            raise ConfigError(*problems, config=self)
        return self

    def problems(self) -> list[str]:
        """Every bad value or combination of values, one line each (empty: the config is valid). A value of the
        wrong type is reported alone: the range checks need the types."""
        problems = []
        for field in dataclasses.fields(self):
            try:
                _check_value(field, getattr(self, field.name))
            except ConfigError as error:
                problems.extend(error.problems)
        if problems:
            return problems
        fractions = ("mjp_ratio", "mjp_prob", "hflip", "reprob", "mixup_prob", "mixup_switch_prob", "eval_ratio")
        for name in fractions:
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                problems.append(f"{name} must be in [0, 1], got {value}")
        positive = ("batch_size", "epochs", "accum_steps", "eval_interval", "log_interval", "aug_repeats", "recount")
        for name in positive:
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "num_classes", "eval_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} must be >= 1 or none, got {value}")
        for name in ("max_train_samples", "max_val_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} must be >= 1 or none, got {value}")
        non_negative = (
            "drop_path", "dal_weight", "dal_weight_end", "lr_base", "weight_decay", "warmup_lr", "min_lr",
            "mixup", "cutmix", "smoothing", "momentum", "warmup_epochs", "cooldown_epochs", "checkpoint_steps",
            "color_jitter", "seed", "eval_seed", "max_bad_images",
        )  # fmt: skip
        for name in non_negative:
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "opt_eps", "clip_grad"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"{name} must be > 0 or none, got {value}")
        if self.threads is not None and self.threads < 1:
            problems.append(f"threads must be >= 1 or none, got {self.threads}")
        if self.workers is not None and self.workers < 0:
            problems.append(f"workers must be >= 0 or none, got {self.workers}")
        if self.mjp_seed is not None and not 0 <= self.mjp_seed < 2**64:
            problems.append(f"mjp_seed must be in [0, 2**64) or none, got {self.mjp_seed}")
        if self.mjp_from_epoch is not None and self.mjp_from_epoch < 0:
            problems.append(f"mjp_from_epoch must be >= 0 or none, got {self.mjp_from_epoch}")
        if self.pos_embed == "none" and (self.mjp or self.compare) and self.mjp_dal != "none":
            problems.append(
                f"mjp_dal={self.mjp_dal} regresses the position embeddings, which pos_embed=none removes; set "
                "mjp_dal=none (or train only the plain model: mjp=false compare=false)"
            )
        if self.smoothing >= 1.0:
            problems.append(f"smoothing must be < 1, got {self.smoothing}")
        if self.warmup_epochs > self.epochs:
            problems.append(f"warmup_epochs ({self.warmup_epochs}) must be <= epochs ({self.epochs})")
        if len(self.scale) != 2 or not 0.0 < self.scale[0] <= self.scale[1] <= 1.0:
            problems.append(f"scale must be [min, max] with 0 < min <= max <= 1, got {self.scale}")
        for name in ("mean", "std"):
            value = getattr(self, name)
            if value is not None and len(value) not in (1, 3):
                problems.append(f"{name} must have 1 or 3 values, got {value}")
        if self.std is not None and any(value <= 0 for value in self.std):
            problems.append(f"std values must be > 0, got {self.std}")
        if self.crop_pct is not None and not 0.0 < self.crop_pct <= 1.0:
            problems.append(f"crop_pct must be in (0, 1], got {self.crop_pct}")
        if self.mixing and self.batch_size % 2:
            problems.append(f"batch_size must be even when mixup or cutmix is on, got {self.batch_size}")
        if self.dataset == "folder" and not self.data:
            problems.append("dataset=folder needs data=DIR (or --data DIR)")
        if self.checkpoint_steps and self.checkpoint_steps % 1:
            problems.append(f"checkpoint_steps must be an integer, got {self.checkpoint_steps}")
        return problems

    @property
    def mixing(self) -> bool:
        """Whether mixup or cutmix is on."""
        return (self.mixup > 0 or self.cutmix > 0) and self.mixup_prob > 0

    @property
    def dataset_kind(self) -> str:
        if self.dataset != "auto":
            return self.dataset
        return "folder" if self.data else "digits"


FIELDS = {field.name: field for field in dataclasses.fields(TrainConfig)}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value


def _hint(name: str) -> Any:
    if not _HINTS:
        _HINTS.update(typing.get_type_hints(TrainConfig))
    return _HINTS[name]


_HINTS: dict[str, Any] = {}


def coerce(name: str, value: Any, *, from_text: bool = False) -> Any:
    """``value`` converted to the type of field ``name``; raises ConfigError for an unknown key or a bad value.

    ``from_text``: the value is the text of a ``key=value`` override (so ``true``, ``none``, ``[1,2]`` are parsed).
    """
    field = FIELDS.get(name)
    if field is None:
        close = difflib.get_close_matches(name, FIELDS, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; `mjp train --help` lists the keys"
        raise ConfigError(f"unknown config key {name!r}{hint}")
    return coerce_value(name, _hint(name), field.metadata.get("choices"), value, from_text=from_text)


def _check_value(field: dataclasses.Field, value: Any) -> None:
    coerce(field.name, value)


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """``["epochs=3", "mjp_ratio=0.2"]`` -> ``{"epochs": 3, "mjp_ratio": 0.2}``, type-checked."""
    values: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"overrides are key=value, got {item!r}")
        key, _, text = item.partition("=")
        key = key.strip().replace("-", "_")
        values[key] = coerce(key, text, from_text=True)
    return values


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file, type-checked key by key (sections as nested mappings are flattened)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {str(path)!r}: {error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values")
    flat: dict[str, Any] = {}
    for key, value in loaded.items():
        if key in SECTIONS and isinstance(value, Mapping):  # optional grouping by section
            flat.update(value)
        else:
            flat[key] = value
    return {str(key): coerce(str(key), value) for key, value in flat.items()}


def build_config(
    values: Mapping[str, Any], base: TrainConfig | None = None, *, explicit: Iterable[str] | None = None
) -> TrainConfig:
    """``base`` (default: the dataclass defaults) with ``values`` applied, the defaults fitted to them (a warm-up
    the user did not set that is as long as the run is shortened: see :attr:`TrainConfig.notes`), then validated.

    ``explicit``: the keys of ``values`` that the user set (:attr:`TrainConfig.explicit_keys`), added to those of
    ``base``; default: every key of ``values``. Raises ConfigError listing every problem.
    """
    if base is None:
        base = TrainConfig()
        base._explicit = frozenset()  # the dataclass defaults: no key is the user's
    checked = {key: coerce(key, value) for key, value in values.items()}
    chosen = set(checked) if explicit is None else set(explicit)
    known = None if base.explicit_keys is None else base.explicit_keys | chosen
    return _fit_warmup(base._copy_with(checked, known, ())).validate()


# A warm-up fitted to a run shorter than it takes a tenth of the run (rounded down): the recipes warm up for a
# fifteenth (DeiT: 20 of 300 epochs) to a tenth (the digits preset: 3 of 30).
FITTED_WARMUP_SHARE = 10


def _fit_warmup(config: TrainConfig) -> TrainConfig:
    """``config`` with a warm-up that the user did not set shortened to fit: shorter than the run, since the
    jigsaw starts when the warm-up ends (``mjp_from_epoch``). A warm-up the user set is left to :meth:`validate`."""
    if config.is_explicit("warmup_epochs") or not 1 <= config.epochs <= config.warmup_epochs:
        return config
    warmup = config.epochs // FITTED_WARMUP_SHARE
    note = (
        f"warmup_epochs={config.warmup_epochs} (not set here) does not fit in epochs={config.epochs}: the warm-up is "
        f"{warmup} epoch{'' if warmup == 1 else 's'}, a tenth of the run; set warmup_epochs to choose another"
    )
    return config.fitted(note, warmup_epochs=warmup)


def config_source_values(source: str | Path) -> dict[str, Any]:
    """The key values that a config source sets, looked up in this order: an existing file at ``source``; a preset
    name (``digits``); a bundled config name, with or without ``.yaml`` (``deit_s``, ``deit_s.yaml``).

    A file in the working folder thus wins over a bundled config of the same name. Raises ConfigError, listing the
    bundled configs and presets, when ``source`` is none of these.
    """
    return _source_values(source)[0]


def _source_values(source: str | Path) -> tuple[dict[str, Any], bool]:
    """(:func:`config_source_values`, whether ``source`` is the user's own file rather than a preset or recipe)."""
    text = str(source)
    if Path(source).exists():
        return read_config_file(source), True
    if text in PRESETS:
        return dict(PRESETS[text]), False
    bundled = bundled_configs()
    # Only a bare file name can be a bundled name: `configs/deit_s.yaml` names a path that is missing, not a recipe.
    name = text[: -len(CONFIG_SUFFIX)] if text.endswith(CONFIG_SUFFIX) else text
    if Path(text).name == text and name in bundled:
        return read_config_file(bundled[name]), False
    close = difflib.get_close_matches(name, [*bundled, *PRESETS], n=2)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise ConfigError(
        f"config file {text!r} does not exist, and it is not a bundled config "
        f"({', '.join(bundled) or 'none installed'}) or a preset ({', '.join(PRESETS)}){hint}"
    )


def load_config(
    source: str | Path | None = None,
    overrides: Iterable[str] = (),
    **values: Any,
) -> TrainConfig:
    """The config of a run: ``source`` (default: the dataclass defaults), then the ``key=value`` ``overrides``, then
    ``values``. ``source`` is a YAML file, a preset name (``digits``) or a bundled config name (``deit_s``, see
    :func:`bundled_configs`); an existing file wins over a name. Raises ConfigError.

    The keys of ``overrides`` and ``values``, and those of a YAML file of the user's, count as set by the user
    (:attr:`TrainConfig.explicit_keys`); those of a preset or a bundled recipe are defaults, which are fitted to
    the user's values where they do not fit (:attr:`TrainConfig.notes`)."""
    merged: dict[str, Any] = {}
    explicit: set[str] = set()
    if source is not None:
        source_values, users_file = _source_values(source)
        merged.update(source_values)
        if users_file:
            explicit.update(source_values)
    parsed = parse_overrides(overrides)
    merged.update(parsed)
    merged.update(values)
    explicit.update(parsed, values)
    return build_config(merged, explicit=explicit)


def save_config(config: TrainConfig, path: str | Path) -> None:
    """Writes the config as YAML, grouped by section, one commented key per line."""
    lines = ["# mjp train: the resolved configuration of this run (mjp train --config this-file reruns it)"]
    data = config.to_dict()
    for section in SECTIONS:
        lines.append(f"\n# {section}")
        for name, field in FIELDS.items():
            if field.metadata["section"] != section:
                continue
            dumped = yaml.safe_dump({name: data[name]}, default_flow_style=True, width=10_000).strip()
            lines.append(dumped[1:-1] if dumped.startswith("{") else dumped)
    Path(path).write_text("\n".join(lines) + "\n")


def help_table() -> str:
    """The config keys by section, with type, default and meaning: the epilog of ``mjp train --help``."""
    defaults = TrainConfig()
    lines = []
    for section in SECTIONS:
        lines.append(f"{section}:")
        for name, field in FIELDS.items():
            if field.metadata["section"] != section:
                continue
            default = getattr(defaults, name)
            shown = "none" if default is None else default
            choices = field.metadata.get("choices")
            kind = " | ".join(choices) if choices else describe_type(_hint(name))
            lines.append(f"  {name}={shown}  ({kind})")
            lines.append(f"      {field.metadata['help']}")
    return "\n".join(lines)
