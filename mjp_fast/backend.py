"""Which backend runs an operation: an explicit ``backend=`` argument, else ``MJP_FAST_BACKEND``, else automatic.

Backends:

- ``torch``: pure PyTorch, always available, on any device. It is also the oracle the tests compare against.
- ``cpu``: the compiled extension ``mjp_fast._C`` on CPU tensors.
- ``cuda``: the compiled extension's CUDA kernels on CUDA tensors (when it was built with nvcc).

The automatic choice takes the fastest one available for the tensors' device: ``cuda`` for CUDA tensors and
``cpu`` for CPU tensors when the extension is there, else ``torch``.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch

ENV_VARIABLE = "MJP_FAST_BACKEND"
KNOWN_BACKENDS = ("torch", "cpu", "cuda")

_extension: ModuleType | None = None
_extension_error: str | None = None
_extension_loaded = False


def extension() -> ModuleType | None:
    """The compiled module ``mjp_fast._C``, or None when it is not built (said once, as a warning)."""
    global _extension, _extension_error, _extension_loaded
    if not _extension_loaded:
        _extension_loaded = True
        try:
            from mjp_fast import _C  # type: ignore[attr-defined]

            _extension = _C
        except ImportError as error:
            _extension_error = str(error)
            warnings.warn(
                f"mjp_fast: the compiled extension mjp_fast._C is not available ({error}); "
                "the 'torch' backend runs instead. Reinstall with `pip install --no-build-isolation .` to build it.",
                RuntimeWarning,
                stacklevel=3,
            )
    return _extension


def extension_error() -> str | None:
    """Why the compiled extension could not be imported, or None."""
    extension()
    return _extension_error


def _has_cuda_kernels() -> bool:
    module = extension()
    return module is not None and bool(module.has_cuda()) and torch.cuda.is_available()


def available_backends() -> list[str]:
    """The backends that can run on this machine, fastest first for their device."""
    names = []
    if _has_cuda_kernels():
        names.append("cuda")
    if extension() is not None:
        names.append("cpu")
    names.append("torch")
    return names


def _device_fits(backend: str, device: torch.device) -> bool:
    if backend == "cpu":
        return device.type == "cpu"
    if backend == "cuda":
        return device.type == "cuda"
    return True


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Returns the backend to run on ``device``.

    Args:
        backend: an explicit choice, or None to consult ``MJP_FAST_BACKEND`` and then choose automatically.
        device: where the operation's tensors live.

    Raises:
        TypeError/ValueError: an unknown name, a backend that is not available, or one that cannot run on
            ``device``.
    """
    source = "backend"
    if backend is None:
        backend = os.environ.get(ENV_VARIABLE) or None
        source = ENV_VARIABLE
    if backend is None:
        if device.type == "cuda" and _has_cuda_kernels():
            return "cuda"
        if device.type == "cpu" and extension() is not None:
            return "cpu"
        return "torch"
    if not isinstance(backend, str):
        raise TypeError(f"{source} must be a str or None, got {type(backend).__name__}")
    if backend not in KNOWN_BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(KNOWN_BACKENDS)}, got {backend!r}")
    if backend not in available_backends():
        reason = extension_error() or "the extension was built without CUDA or no GPU is visible"
        raise ValueError(f"{source}={backend!r} is not available on this machine: {reason}")
    if not _device_fits(backend, device):
        raise ValueError(f"{source}={backend!r} cannot run on tensors on device {device}")
    return backend
