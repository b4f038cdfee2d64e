"""Checkpoints: written atomically, read back with readable errors.

A checkpoint is a dict (``torch.save``) with:

- ``model_name``, ``model_kwargs``: ``timm.create_model(model_name, pretrained=False, **model_kwargs)`` rebuilds the
  model (``mjp_*`` names with ``mjp_*`` kwargs for MJP models, the plain timm name for baselines);
- ``state_dict``: the model's weights and buffers, MJP's sampler counter included (so a resumed run draws the
  jigsaws it would have drawn);
- ``optimizer``, ``scheduler``, ``scaler``: their state dicts (``scaler`` is None without fp16);
- ``epoch`` (the epoch being trained, 0-based), ``batch_in_epoch`` (batches of it already trained: 0 at an epoch
  boundary), ``step`` (optimizer steps so far), ``finished`` (whether the run completed);
- ``rng``: the Python, NumPy, torch and CUDA generator states;
- ``config``: the resolved :class:`TrainConfig` as a dict; ``metrics``: the per-epoch records so far, and
  ``running``: the partial sums of the epoch in progress;
- ``mjp_fast_version``.

Writing goes to a temporary file in the same folder, is flushed to disk (fsync), then renamed over the target
(``os.replace``, atomic on POSIX): a run killed while saving leaves the previous checkpoint intact. The file gets
the permissions a plain ``open(path, "w")`` would give it.

Everything in a checkpoint is tensors and plain data (dicts, lists, tuples, str, int, float, bool, None): the
saver turns NumPy values into tensors, lists or Python numbers and paths into str (:func:`plain_data`), so that
:func:`load_checkpoint` reads it with ``torch.load(weights_only=True)``. Unpickling anything else could run code (a
pickle may call any function it names), so a file that holds anything else is refused before it is built. The one
exception, allow-listed: the NumPy generator state of checkpoints written before this rule, a ``uint32`` array.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch

from mjp_fast._atomic import write_atomically
from mjp_fast.train.config import FIELDS, ConfigError, TrainConfig, build_config

REQUIRED_KEYS = ("model_name", "model_kwargs", "state_dict")


def rng_states() -> dict[str, Any]:
    """The global generators' states: Python, NumPy, torch (CPU) and every CUDA device, as tensors and plain data.

    NumPy's is ``(name, key, pos, has_gauss, cached_gaussian)`` as :func:`numpy.random.get_state` gives it, with the
    ``uint32 [624]`` key as an int64 tensor: an array would need NumPy's reconstructor allow-listed to load.
    """
    name, key, position, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = (str(name), torch.from_numpy(key.astype(np.int64)), int(position), int(has_gauss))
    return {
        "python": random.getstate(),
        "numpy": (*numpy_state, float(cached_gaussian)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_states(states: dict[str, Any]) -> None:
    """Sets the global generators to ``states`` (:func:`rng_states`; NumPy's key may also be the array that
    checkpoints written before it became a tensor hold)."""
    random.setstate(states["python"])
    name, key, *rest = states["numpy"]
    key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
    np.random.set_state((name, key.astype(np.uint32), *rest))
    torch.set_rng_state(states["torch"])
    cuda_states = states.get("cuda") or []
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)


def plain_data(value: Any) -> Any:
    """``value`` with what ``torch.load(weights_only=True)`` would refuse turned into what it reads back.

    NumPy scalars become Python numbers, NumPy arrays lists, paths str; dicts, lists and tuples are walked. What
    needs no change is returned as it is (the same object: a state dict keeps its ``_metadata``), tensors included.
    """
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, dict):
        changed = {key: new for key, item in value.items() if (new := plain_data(item)) is not item}
        if not changed:
            return value
        copied = copy.copy(value)  # keeps the dict's type and attributes (an OrderedDict's _metadata)
        copied.update(changed)
        return copied
    if type(value) in (list, tuple):  # not a subclass (torch.Size, named tuples), which would not rebuild from items
        items = [plain_data(item) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return type(value)(items)
    return value


def save_atomically(payload: Any, path: str | Path) -> Path:
    """``torch.save(plain_data(payload))`` to ``path`` through a temporary file in the same folder, fsync and rename.

    :func:`plain_data` turns NumPy values and paths into what :func:`load_checkpoint` (``weights_only=True``) reads.
    The file gets the permissions of a plain write (0o666 less the umask; an existing file keeps its own): see
    :func:`mjp_fast._atomic.write_atomically`.
    """
    path = Path(path)
    payload = plain_data(payload)
    with write_atomically(path) as file:
        torch.save(payload, file)
    return path


# Where `mjp train` puts its checkpoints in its output folder: a run's, then a compare run's two models.
CHECKPOINT_NAMES = ("last.pt", "best.pt", "mjp/last.pt", "baseline/last.pt")
_TORCH_FILE_STARTS = (b"PK\x03\x04", b"\x80")  # torch.save's zip archive; the legacy format's pickle


def _legacy_numpy_globals() -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    """What ``torch.load(weights_only=True)`` needs beyond tensors and plain data to read the checkpoints written
    before :func:`rng_states` stored NumPy's generator key as a tensor: a ``uint32`` array, pickled as
    ``_reconstruct(ndarray, shape, dtype)`` then its bytes. These build an array and nothing else: no function a
    file names runs (an object array's items would be built by the same restricted unpickler first). NumPy 1 named
    the reconstructor ``numpy.core.multiarray``, NumPy 2 ``numpy._core.multiarray``: both names point at the one
    installed, as a checkpoint may come from either.
    """
    reconstruct = np.ndarray.__reduce__(np.empty(0))[0]  # NumPy's own, wherever this NumPy keeps it
    return [
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),  # NumPy 2 builds the dtype's instance of numpy.dtypes.UInt32DType
    ]


# The weights-only unpickler's words for a global or a type it refuses (torch 2.14's). Should a torch word them
# otherwise, such a file is still refused in one line, as a damaged one ("truncated or damaged, ...").
_REFUSED_PATTERNS = (
    re.compile(r"Unsupported global: GLOBAL ([\w.]+)"),
    re.compile(r"but got <class '([\w.]+)'>"),
    re.compile(r"call reduce for unrecognized function ([\w.<>]+)"),
)


def _refused_name(message: str) -> str | None:
    """The global that ``torch.load(weights_only=True)`` refused, from its error message; None when it failed for
    another reason (a damaged file)."""
    if "Weights only load failed" not in message:
        return None
    for pattern in _REFUSED_PATTERNS:
        found = pattern.search(message)
        if found:
            return found.group(1)
    return None


# A checkpoint's keys (those that mjp train writes: the other keys are kept as they are) and what each must hold:
# the types and how a message names them. Checked before any of them is used, so that a damaged or hand-made file
# gets one line naming the key, not an AttributeError from deep inside the model's constructor.
_NONE = type(None)
_KEY_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "model_name": ((str,), "a str (a timm model name)"),
    "model_kwargs": ((dict,), "a dict of timm.create_model keywords"),
    "state_dict": ((dict,), "a dict of tensors (the model's weights)"),
    "optimizer": ((dict,), "a dict (the optimizer's state)"),
    "scheduler": ((dict, _NONE), "a dict (the schedule's state) or None"),
    "scaler": ((dict, _NONE), "a dict (the gradient scaler's state) or None"),
    "epoch": ((int,), "an int"),
    "batch_in_epoch": ((int,), "an int"),
    "step": ((int,), "an int"),
    "finished": ((bool,), "a bool"),
    "rng": ((dict, _NONE), "a dict of generator states or None"),
    "config": ((dict, _NONE), "a dict of config values or None"),
    "metrics": ((list,), "a list of epoch records"),
    "running": ((dict, _NONE), "a dict of loss sums or None"),
    "final": ((dict, _NONE), "a dict of final metrics or None"),
    "mjp_fast_version": ((str,), "a str"),
}


def _structure_problem(checkpoint: dict[str, Any]) -> str | None:
    """What is wrong with the values of a checkpoint that has the required keys (None: nothing), in the words of
    "its KEY is ...". Checks the types of :data:`_KEY_TYPES`, and one level inside the dicts that are used as
    keywords or loaded as weights (their keys must be str; the weights, tensors)."""
    for key, (types, expected) in _KEY_TYPES.items():
        if key not in checkpoint:
            continue
        value = checkpoint[key]
        # bool is an int to isinstance: a True epoch is as wrong as a str one
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"its {key!r} is {_describe(value)}, expected {expected}"
    for key in ("model_kwargs", "state_dict", "config"):
        bad = next((name for name in checkpoint.get(key) or {} if not isinstance(name, str)), None)
        if bad is not None:
            return f"its {key!r} has the key {bad!r} ({type(bad).__name__}), expected str keys"
    for name, value in checkpoint["state_dict"].items():
        # a module's get_extra_state may save anything under "<prefix>_extra_state"; nothing in mjp_fast does
        if not isinstance(value, torch.Tensor) and not name.endswith("_extra_state"):
            return f"its 'state_dict' holds {_describe(value)} under {name!r}, expected tensors"
    return None


def _describe(value: Any) -> str:
    """``value`` for an error message: its type, and a short excerpt of a str."""
    if value is None:
        return "None"
    if isinstance(value, str):
        excerpt = value if len(value) <= 40 else value[:37] + "..."
        return f"a str ({excerpt!r})"
    name = type(value).__name__
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


def _first_sentence(message: str) -> str:
    """The first sentence of an error message: torch's zip errors go on to a paragraph of advice."""
    line = (message.strip().splitlines() or [""])[0]
    return line.split(". ", 1)[0].rstrip(".") or "no message"


def _load_failure(error: Exception) -> str:
    """Why ``torch.load`` failed, in a few words. The weights-only unpickler's own reason comes after its paragraph
    of advice (to load with weights_only=False, which is no advice for a damaged file); a KeyError's message alone is
    a bare memo index."""
    message = str(error)
    if "WeightsUnpickler error:" in message:
        return _first_sentence(message.split("WeightsUnpickler error:", 1)[1])
    if isinstance(error, KeyError) or not message:
        return f"{type(error).__name__} {message}".strip()
    return _first_sentence(message)


def _check_checkpoint_file(path: Path, what: str) -> None:
    """Raises ConfigError, in the user's terms, when ``path`` is not a file that ``torch.load`` could read."""
    if path.is_dir():
        found = [f"{str(path / name)!r}" for name in CHECKPOINT_NAMES if (path / name).is_file()]
        if found:
            choices = found[0] if len(found) == 1 else f"{', '.join(found[:-1])} or {found[-1]}"
            hint = f"did you mean {choices}?"
        else:
            hint = "mjp train writes last.pt and best.pt into its output folder, and this one holds neither"
        raise ConfigError(f"{what} {str(path)!r} is a directory, not a checkpoint file; {hint}")
    if not path.exists():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} is not a regular file")


def load_checkpoint(path: str | Path, *, what: str = "checkpoint") -> dict[str, Any]:
    """Reads a checkpoint on the CPU. Raises ConfigError when the file is missing or is not an mjp checkpoint.

    The file is read with ``torch.load(weights_only=True)``: tensors and plain data only (and the NumPy array of
    an older checkpoint's generator state, :func:`_legacy_numpy_globals`). A file that holds any other object is
    refused before it is built, so that nothing in it runs: unpickling it could call any function it names.

    Args:
        path: the checkpoint file (``last.pt`` or ``best.pt`` of ``mjp train``).
        what: how the error messages name the file, e.g. ``"baseline checkpoint"``.

    Raises:
        ConfigError: one line for the user: ``path`` is missing, a directory (naming the checkpoints in it),
            unreadable, not a torch file, truncated or damaged, holds objects other than tensors and plain data
            (naming the first), or is a torch file without the keys of a checkpoint or with a value of the wrong
            type under one (naming the key).
    """
    path = Path(path)
    _check_checkpoint_file(path, what)
    try:
        with path.open("rb") as file:
            start = file.read(4)
    except OSError as error:
        raise ConfigError(f"{what} {str(path)!r} cannot be read: {error.strerror or error}") from None
    if not start:
        raise ConfigError(f"{what} {str(path)!r} is an empty file, not a checkpoint written by mjp train")
    try:
        # safe_globals, not add_safe_globals: the allow-list holds for this load only, not for the process's others
        with torch.serialization.safe_globals(_legacy_numpy_globals()):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch.load raises many kinds for a damaged file
        refused = _refused_name(str(error))
        if refused is not None:
            raise ConfigError(
                f"{what} {str(path)!r} is refused: its pickle names {refused}, which is not a tensor or plain data, "
                "and loading it could run code (checkpoints are read with torch.load(weights_only=True), and mjp "
                "train writes tensors and plain data only)"
            ) from None
        reason = f"torch.load failed: {_load_failure(error)}"
        if not start.startswith(_TORCH_FILE_STARTS):
            raise ConfigError(f"{what} {str(path)!r} is not a file written by mjp train ({reason})") from None
        raise ConfigError(
            f"{what} {str(path)!r} is truncated or damaged, or not a checkpoint written by mjp train ({reason})"
        ) from None
    if not isinstance(checkpoint, dict):
        raise ConfigError(
            f"{what} {str(path)!r} holds a torch-saved {type(checkpoint).__name__}, not a checkpoint written by "
            f"mjp train (a dict with the keys {', '.join(REQUIRED_KEYS)})"
        )
    missing = [key for key in REQUIRED_KEYS if key not in checkpoint]
    if missing:
        # a key as written unless it would break the one line (a newline in it) or is no str: then its repr
        present = [key if isinstance(key, str) and key.isprintable() else repr(key) for key in checkpoint][:8]
        has = ", ".join(present) + (", ..." if len(checkpoint) > len(present) else "") if present else "none"
        raise ConfigError(
            f"{what} {str(path)!r} is a torch file but not a checkpoint written by mjp train: it lacks the "
            f"key{'s' if len(missing) > 1 else ''} {', '.join(missing)} (its keys: {has})"
        )
    problem = _structure_problem(checkpoint)
    if problem is not None:
        raise ConfigError(f"{what} {str(path)!r} is a torch file but not a checkpoint written by mjp train: {problem}")
    return checkpoint


def load_model(
    path: str | Path, device: torch.device | str = "cpu", *, what: str = "checkpoint"
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuilds the model of a checkpoint with its weights, in eval mode; returns (model, checkpoint).

    ``what`` names the file in error messages (see :func:`load_checkpoint`).
    """
    from mjp_fast.train.models import create_model

    checkpoint = load_checkpoint(path, what=what)
    model = create_model(checkpoint["model_name"], dict(checkpoint["model_kwargs"]))
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as error:
        raise ConfigError(f"{what} {str(path)!r} does not fit its own model: {str(error).splitlines()[0]}") from None
    return model.to(device).eval(), checkpoint


def checkpoint_config(checkpoint: dict[str, Any]) -> TrainConfig:
    """The run's config from a checkpoint (keys this version does not know are dropped)."""
    saved = checkpoint.get("config") or {}
    return build_config({key: value for key, value in saved.items() if key in FIELDS})
