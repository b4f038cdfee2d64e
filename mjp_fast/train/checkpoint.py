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
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mjp_fast._atomic import write_atomically
from mjp_fast.train.config import FIELDS, ConfigError, TrainConfig, build_config

REQUIRED_KEYS = ("model_name", "model_kwargs", "state_dict")


def rng_states() -> dict[str, Any]:
    """The global generators' states: Python, NumPy, torch (CPU) and every CUDA device."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    cuda_states = states.get("cuda") or []
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)


def save_atomically(payload: Any, path: str | Path) -> Path:
    """``torch.save(payload)`` to ``path`` through a temporary file in the same folder, fsync and rename.

    The file gets the permissions of a plain write (0o666 less the umask; an existing file keeps its own): see
    :func:`mjp_fast._atomic.write_atomically`.
    """
    path = Path(path)
    with write_atomically(path) as file:
        torch.save(payload, file)
    return path


# Where `mjp train` puts its checkpoints in its output folder: a run's, then a compare run's two models.
CHECKPOINT_NAMES = ("last.pt", "best.pt", "mjp/last.pt", "baseline/last.pt")
_TORCH_FILE_STARTS = (b"PK\x03\x04", b"\x80")  # torch.save's zip archive; the legacy format's pickle


def _first_sentence(message: str) -> str:
    """The first sentence of an error message: torch's zip errors go on to a paragraph of advice."""
    line = (message.strip().splitlines() or [""])[0]
    return line.split(". ", 1)[0].rstrip(".") or "no message"


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

    Checkpoints hold Python objects (generator states, the config), so they are unpickled in full: load only
    checkpoints you trust, as with any ``torch.load(weights_only=False)``.

    Args:
        path: the checkpoint file (``last.pt`` or ``best.pt`` of ``mjp train``).
        what: how the error messages name the file, e.g. ``"baseline checkpoint"``.

    Raises:
        ConfigError: one line for the user: ``path`` is missing, a directory (naming the checkpoints in it),
            unreadable, not a torch file, truncated or damaged, or a torch file without the keys of a checkpoint.
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
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 - torch.load raises many kinds for a damaged file
        reason = f"torch.load failed: {_first_sentence(str(error)) if str(error) else type(error).__name__}"
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
        present = [str(key) for key in checkpoint][:8]
        has = ", ".join(present) + (", ..." if len(checkpoint) > len(present) else "") if present else "none"
        raise ConfigError(
            f"{what} {str(path)!r} is a torch file but not a checkpoint written by mjp train: it lacks the "
            f"key{'s' if len(missing) > 1 else ''} {', '.join(missing)} (its keys: {has})"
        )
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
