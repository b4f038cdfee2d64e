"""The device a run trains on, its autocast dtype, and where its images are normalized."""

from __future__ import annotations

import torch

from mjp_fast.train.config import ConfigError, TrainConfig


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but torch sees no CUDA GPU")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def amp_dtype(config: TrainConfig, device: torch.device) -> torch.dtype | None:
    choice = config.amp
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" else "none"
    if choice == "fp16" and device.type != "cuda":
        raise ConfigError("amp=fp16 needs a CUDA device; use amp=bf16 or amp=none on the CPU")
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[choice]


def normalizes_on_device(config: TrainConfig, device: torch.device) -> bool:
    """Whether the training loader gives uint8 images that the step normalizes on ``device`` (config
    ``normalize_on_device``; auto: on CUDA, where the loader's bytes cross to the GPU and its host is often slow)."""
    return config.normalize_on_device == "on" or (config.normalize_on_device == "auto" and device.type == "cuda")
