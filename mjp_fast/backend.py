"""Which backend runs an operation: an explicit ``backend=`` argument, else ``MJP_FAST_BACKEND``, else automatic.

Backends:

- ``torch``: pure PyTorch, always available, on any device. It is also the oracle the tests compare against.
- ``cpu``: the compiled extension ``mjp_fast._C`` on CPU tensors.
- ``cuda``: the compiled extension's CUDA kernels on CUDA tensors (when it was built with nvcc).
- ``triton``: the Triton kernels, on CUDA tensors; on CPU tensors too when ``TRITON_INTERPRET=1`` is set (how
  the tests, and users without a GPU, run the real kernels).

The automatic choice takes the fastest one measured that is available for the tensors' device: ``cuda``, else
``triton``, for CUDA tensors; ``cpu`` for CPU tensors when the extension is there; else ``torch``. ``cuda`` comes
first because it was the faster GPU backend at every point measured (H200, 2026-11-28, DeiT-S and DeiT-Ti at batch
256 in bf16: MJP's GPU busy time 199 against 381 us a DeiT-S step, its step overhead +1.1/+1.5% against
+2.3/+3.1%, host cost 2.15x against 3.65x the plain add; ``bench/results/``); ``triton`` runs where the extension
was built without nvcc. The Triton interpreter is never chosen automatically: it is for testing.

When it is read: a call of a public function (``mjp_patch_embed(...)``) resolves its backend at that call. A model
(``MJPPatchEmbed``, a converted timm model, a plain one after ``fast_patch_embed``) resolves its one backend once per
device, at its first step (:func:`resolve_once`, kept by its sampler or its patch embedding), and every part of its
step runs on it: ``MJP_FAST_BACKEND`` set mid-run moves no part of a model; setting the model's ``backend`` moves all.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch

ENV_VARIABLE = "MJP_FAST_BACKEND"
KNOWN_BACKENDS = ("torch", "cpu", "cuda", "triton")

_extension: ModuleType | None = None
_extension_error: str | None = None
_extension_loaded = False
_triton_error: str | None = None
_triton_loaded: bool | None = None


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


def triton_interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_importable() -> bool:
    """Whether the ``triton`` package imports (the operations then import their kernels, which registers their
    operators). Tried once; why it failed is kept for the error of an explicit ``backend="triton"``."""
    global _triton_loaded, _triton_error
    if _triton_loaded is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _triton_loaded = True
        except Exception as error:  # noqa: BLE001 - an old or absent triton only removes this backend
            _triton_loaded, _triton_error = False, f"{type(error).__name__}: {error}"
    return _triton_loaded


def triton_usable() -> bool:
    """Whether the ``triton`` backend can run here: triton imports, and a GPU is visible or the interpreter is on.
    The operations import their Triton kernels (which registers their operators) only then: on a machine where
    the backend cannot run, that import would only cost time (about half a second of every ``import mjp_fast`` on
    2 CPU cores, measured 2026-11-27: the kernels' modules and ``torch.library.triton_op``'s registrations)."""
    return (torch.cuda.is_available() or triton_interpreting()) and triton_importable()


def _has_cuda_kernels() -> bool:
    module = extension()
    return module is not None and bool(module.has_cuda()) and torch.cuda.is_available()


def available_backends() -> list[str]:
    """The backends that can run on this machine, fastest first for their device."""
    return list(_AVAILABLE)


def _detect_backends() -> tuple[str, ...]:
    names = []
    if _has_cuda_kernels():
        names.append("cuda")
    if triton_usable() and torch.cuda.is_available():
        names.append("triton")
    if extension() is not None:
        names.append("cpu")
    names.append("torch")
    if triton_usable() and not torch.cuda.is_available():
        names.append("triton")  # the interpreter: correct, slow, for tests
    return tuple(names)


def runs_on(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` can run on tensors on ``device`` (``triton`` on CPU tensors only in the interpreter)."""
    if backend == "cpu":
        return device.type == "cpu"
    if backend == "cuda":
        return device.type == "cuda"
    if backend == "triton":
        return device.type == "cuda" or (device.type == "cpu" and triton_interpreting())
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
        names = _AVAILABLE
        if device.type == "cuda":
            return "cuda" if "cuda" in names else "triton" if "triton" in names else "torch"
        if device.type == "cpu" and "cpu" in names:
            return "cpu"
        return "torch"
    if not isinstance(backend, str):
        raise TypeError(f"{source} must be a str or None, got {type(backend).__name__}")
    if backend not in KNOWN_BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(KNOWN_BACKENDS)}, got {backend!r}")
    if backend not in _AVAILABLE:
        if backend == "triton":
            reason = _triton_error or "no GPU is visible and TRITON_INTERPRET=1 is not set"
        else:
            reason = extension_error() or "the extension was built without CUDA or no GPU is visible"
        raise ValueError(f"{source}={backend!r} is not available on this machine: {reason}")
    if not runs_on(backend, device):
        hint = (
            " (set TRITON_INTERPRET=1 before importing mjp_fast to run Triton on the CPU)"
            if backend == "triton" and device.type == "cpu"  # the hint is no help on the meta device
            else ""
        )
        raise ValueError(f"{source}={backend!r} cannot run on tensors on device {device}{hint}")
    return backend


def resolve_once(cache: dict[tuple[str | None, torch.device], str], backend: str | None, device: torch.device) -> str:
    """:func:`resolve_backend`, remembered in ``cache`` per ``(backend, device)``: what a model holds, so that its
    sampler, embedding and DAL loss keep the one choice made at their first step (``MJP_FAST_BACKEND`` is read then,
    not at every step). Under torch.compile a choice not made yet is resolved without storing it (the graph's guards
    read the module's state)."""
    key = (backend, device)
    chosen = cache.get(key)
    if chosen is None:
        chosen = resolve_backend(backend, device)
        if not torch.compiler.is_compiling():
            cache[key] = chosen
    return chosen


# Fixed for the life of the process (what is installed, whether a GPU is visible), so found once, at import: a
# constant for torch.compile, which cannot trace the extension's own functions.
_AVAILABLE: tuple[str, ...] = _detect_backends()
