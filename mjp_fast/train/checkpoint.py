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
(``os.replace``, atomic on POSIX): a run killed while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mjp_fast.train.config import ConfigError

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
    """``torch.save(payload)`` to ``path`` through a temporary file in the same folder, fsync and rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(payload, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError:
        pass
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Reads a checkpoint on the CPU. Raises ConfigError when the file is missing or is not an mjp checkpoint.

    Checkpoints hold Python objects (generator states, the config), so they are unpickled in full: load only
    checkpoints you trust, as with any ``torch.load(weights_only=False)``.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"checkpoint {str(path)!r} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 - torch.load raises many kinds for a damaged file
        raise ConfigError(f"cannot read checkpoint {str(path)!r}: {str(error).splitlines()[0]}") from None
    if not isinstance(checkpoint, dict) or any(key not in checkpoint for key in REQUIRED_KEYS):
        raise ConfigError(
            f"{str(path)!r} is not an mjp checkpoint (expected a dict with {', '.join(REQUIRED_KEYS)}); "
            "checkpoints come from `mjp train`"
        )
    return checkpoint


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuilds the model of a checkpoint with its weights, in eval mode; returns (model, checkpoint)."""
    from mjp_fast.train.models import create_model

    checkpoint = load_checkpoint(path)
    model = create_model(checkpoint["model_name"], dict(checkpoint["model_kwargs"]))
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as error:
        raise ConfigError(
            f"checkpoint {str(path)!r} does not fit its own model: {str(error).splitlines()[0]}"
        ) from None
    return model.to(device).eval(), checkpoint
