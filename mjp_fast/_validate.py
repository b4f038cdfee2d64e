"""Argument checks shared by the public operations, and what ``validate=False`` promises.

Every check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value) whose message
names the argument, what was expected and what was given.

``validate=False``
------------------
:func:`~mjp_fast.mjp_patch_embed`, :func:`~mjp_fast.mjp_pos_embed`, :func:`~mjp_fast.jigsaw_images` and
:func:`~mjp_fast.ops.rope_identity.rope_identity` take ``validate``. Its default, True, also checks the *values* of
the jigsaw: ``perm[b]`` permutes exactly the masked positions of sample ``b``. On a GPU that check reads the device
from the host (a sync), so the modules turn it off for the jigsaws they sample themselves. ``validate=False``
skips exactly those value checks; everything read from tensor metadata (types, ranks, shapes, dtypes, devices) is
still checked, as it costs no sync (``rope_identity``, which reads no index, skips all its checks: a per-step
path of the timm models). What it promises, on every backend (``torch``, ``cpu``, ``cuda``, ``triton``):

- **No host sync.** Nothing waits for the device; the kernels guard their own indices, in the launches they
  make anyway (one exception: under ``torch.compile`` the Triton ``mjp_pos_embed`` backward zero-fills the
  tokens' gradient before its pass, one memset, since the compiled operator has no room for the forward's record
  of which rows were moved).
- **Only the call's memory.** No kernel reads or writes outside its tensors, and a sample reads only its own rows:
  whatever ``perm`` holds, there is no out-of-bounds access, no other sample's data, and no uninitialised memory in
  any output or gradient.
- **A perm entry outside** ``[0, N)`` (negative, ``N``, ``10**9``) **moves nothing**: the token shows a zero patch
  (a zero token in ``mjp_pos_embed``), so its output is the bias and the position term alone, and it sends no
  gradient to the images (tokens). ``jigsaw_images`` writes a zero patch there.
- **A perm that is in range but is not a valid jigsaw's** (a position repeated or left out, an unmasked position
  moved) **gives the formula**: ``out[b, n] = x[b, perm[b, n]] + (unk_embed if mask[b, n] else pos_embed[n])``.
  The gradients of ``weight``, ``bias``, ``pos_embed``, ``unk_embed`` and the prefix are the formula's, exactly.
  The gradient of the images (tokens) is the gather's, a patch getting the sum of the gradients of the tokens that
  show it (zeros if none), on ``torch`` and ``cpu``. ``cuda`` and ``triton`` move it back with one store per token
  and no atomics (what keeps a valid jigsaw's backward free): there a patch that several tokens show gets one
  token's gradient, which one unspecified; a patch no token shows still gets zeros.

A valid jigsaw (what :func:`~mjp_fast.sample_jigsaw` returns) gives the same results with either setting.

``validate`` itself must be True or False (``None`` or ``"yes"`` is a TypeError). On the meta device there are no
values to read: ``validate=True`` skips the value checks there, as ``validate=False`` does, and keeps the others, and
the operations give meta outputs of the right shapes (on the ``torch`` backend; the others refuse meta tensors).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

# float64 is accepted too: it is how gradcheck verifies the backward passes.
SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Returns ``value`` as an int; bools and floats are refused (``True`` is not a batch size)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def check_int_like(name: str, value: object, *, minimum: int | None = None) -> int:
    """Returns ``value`` as a Python int: an int, a NumPy integer or a 0-dim integer tensor (what a loop's
    counter may be). Bools (Python's, NumPy's, a bool tensor) and floats are refused, as by :func:`check_int`."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int, got a {value.dtype} tensor of shape {list(value.shape)}")
    elif isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    try:
        # operator.index takes exactly the integer types: int, numpy.int64, a 0-dim integer tensor; not floats, nor
        # numpy.bool_ (NumPy refuses it).
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    return check_int(name, number, minimum=minimum)


def check_bool(name: str, value: object) -> bool:
    """Returns ``value``, which must be True or False: ``None`` or ``"yes"`` would pass an ``if`` with the opposite
    or an unintended meaning (``validate=None`` would skip every check)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return value


def check_fraction(name: str, value: object) -> float:
    """Returns ``value`` as a float in [0, 1]; NaN and bools are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__} {value!r}")
    value = float(value)
    if not (0.0 <= value <= 1.0):  # also false for NaN
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def check_positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite float, got {value}")
    return value


def check_grid_size(grid_size: object, name: str = "grid_size") -> tuple[int, int]:
    """``grid_size`` is an int (square grid) or a pair ``(rows, cols)``, each >= 1."""
    if isinstance(grid_size, torch.Size) or (isinstance(grid_size, Sequence) and not isinstance(grid_size, str)):
        if len(grid_size) != 2:
            raise ValueError(f"{name} must be an int or a pair (rows, cols), got {tuple(grid_size)!r}")
        rows = check_int(f"{name}[0]", grid_size[0], minimum=1)
        cols = check_int(f"{name}[1]", grid_size[1], minimum=1)
        return rows, cols
    size = check_int(name, grid_size, minimum=1)
    return size, size


def check_tensor(name: str, value: object, *, ndims: Sequence[int] | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndims is not None and value.dim() not in ndims:
        expected = " or ".join(str(n) for n in ndims)
        raise ValueError(f"{name} must have {expected} dimensions, got shape {tuple(value.shape)}")
    return value


def check_float_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16 (or float64), got {tensor.dtype}")


def check_same_dtype(reference: str, **tensors: torch.Tensor | None) -> None:
    """Every given tensor must have the dtype of the one named ``reference`` (the operation's input, e.g.
    ``images``); a TypeError names the first that does not."""
    expected = tensors[reference].dtype
    for name, tensor in tensors.items():
        if tensor is not None and tensor.dtype != expected:
            raise TypeError(f"{name} has dtype {tensor.dtype} but {reference} have {expected}; use one dtype")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors must live on one device; returns it."""
    present = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in present.items())
        raise ValueError(f"mixed devices: all tensors must be on one device, got {listing}")
    return next(iter(devices))


# Device types whose tensors report no index: a tensor made on "cpu:0" (or "cpu:1") is on "cpu".
INDEXLESS_DEVICE_TYPES = ("cpu", "meta")


def canonical_device(device: torch.device) -> torch.device:
    """``device`` as the tensors made there report it, so that ``==`` compares devices: an index-less ``cuda`` is
    the current CUDA device (tensors report ``cuda:<index>``, and ``torch.device("cuda") != torch.device("cuda:0")``),
    and ``cpu:0`` is ``cpu`` (CPU tensors report no index)."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if device.type in INDEXLESS_DEVICE_TYPES and device.index is not None:
        return torch.device(device.type)
    return device


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values can be read: not on the meta device, whose tensors have shapes and dtypes only
    (a model built there, a shape check). The checks that read values skip such tensors; the others still run."""
    return tensor.device.type != "meta"


def to_device(device: torch.device | str | None) -> torch.device:
    """The device a ``device=`` argument names (None: the CPU), as its tensors report it (see
    :func:`canonical_device`)."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, (str, torch.device)):
        try:
            return canonical_device(torch.device(device))
        except RuntimeError as error:
            raise ValueError(f"device: not a valid torch device: {device!r} ({error})") from None
    raise TypeError(f"device must be a str, torch.device or None, got {type(device).__name__}")


def check_position_table(pos_embed: object, num_positions: int, dim: int, positions: str) -> torch.Tensor:
    """``pos_embed`` ``[N, D]`` or ``[1, N, D]``, returned as ``[N, D]``; ``positions`` says where N comes from."""
    pos_embed = check_tensor("pos_embed", pos_embed, ndims=(2, 3))
    if tuple(pos_embed.shape[-2:]) != (num_positions, dim) or (pos_embed.dim() == 3 and pos_embed.shape[0] != 1):
        raise ValueError(
            f"pos_embed must be [N, D] or [1, N, D] with {positions} and D = {dim}, got shape {list(pos_embed.shape)}"
        )
    return pos_embed.reshape(num_positions, dim)
