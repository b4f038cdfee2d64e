"""What the Triton operations share: the interpreter switch, launches and operators, tile settings, the scratch
buffers of their partial sums, the row layout's checks, and the position gradient's kernels.

``patch_embed.py``, ``pos_embed.py`` and ``dal_loss.py`` import from this module (and triton, torch) only, never
from one another; ``mjp_fast.triton`` re-exports what code outside the package uses of it (its ``__all__``).

Row layout (the C++ operators' too): each sample's output has ``T = P + N`` rows of ``D`` channels. The first
``P`` (0 to 8) are the prefix tokens (class and register tokens), ``out[b, t] = prefix[t] + (pos[t] if t < Q
else 0)``, with ``Q`` (0 or ``P``) the rows of the position table that belong to them; then the ``N`` patch
tokens. ``pos`` is the model's full table ``[Q + N, D]`` (any leading dims of 1), read in place.

The position gradient (the backward of both embeddings' position terms): one pass over the incoming gradient
``[B, P + N, D]``, split over positions (a prefix row is a position that is never masked nor moved), channels and
batch chunks (enough programs to fill the GPU); each program writes float32 partial sums that only it owns (and,
for ``mjp_pos_embed``, the inverse move of the patch rows from the same loads), then a small kernel adds them in a
fixed order and writes the gradients in their final dtypes and shapes: no atomics, deterministic, two launches.
:func:`position_gradient_plan` says how (grids, tiles, chunks, bytes moved).
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mjp_fast.backend import triton_interpreting  # where TRITON_INTERPRET is read, the only place

INTERPRETING: bool = triton_interpreting()
"""Whether the kernels run in the Triton interpreter: ``TRITON_INTERPRET`` read once, when this module is imported.
The operators are registered from it then (:func:`operator`), and triton picks the interpreter for each kernel at
its definition, so every tile, launch and plan decision reads this one value, never the environment again."""


def interpreting() -> bool:
    """:data:`INTERPRETING`: whether the kernels run in the Triton interpreter (for code outside this module)."""
    return INTERPRETING


# ----------------------------------------------------------------------------------------------------------------
# Launches and operators
# ----------------------------------------------------------------------------------------------------------------


def launcher(kernel, grid, traced: bool):
    """``kernel[grid]``, through ``torch.library.wrap_triton`` only when a ``triton_op`` traces the launch (so
    torch.compile sees the kernel itself). In eager mode that wrapper is host time for nothing, and under the
    interpreter the operators are plain custom ops (see :func:`operator`), whose kernels torch 2.11's
    ``wrap_triton`` refuses."""
    if traced and not INTERPRETING:
        return torch.library.wrap_triton(kernel)[grid]
    return kernel[grid]


def operator(name: str, *, mutates_args: tuple[str, ...] = (), schema: str | None = None) -> Callable:
    """Registers a function that launches Triton kernels as a torch operator.

    On a GPU: ``torch.library.triton_op``, so torch.compile sees the kernels themselves (with ``wrap_triton``).
    Under the CPU interpreter (``TRITON_INTERPRET=1``): an opaque ``custom_op``, since compiled graphs cannot
    run interpreted kernels; forward, backward and torch.compile tracing behave the same. ``schema``: the
    operator's schema, when not inferred from the function's type hints.
    """
    if INTERPRETING:
        return torch.library.custom_op(name, mutates_args=mutates_args, schema=schema)
    return torch.library.triton_op(name, mutates_args=mutates_args, schema=schema)


def define_operator(
    name: str,
    launch: Callable,
    *,
    fake: Callable,
    mutates_args: tuple[str, ...] = (),
    required: tuple[str, ...] = (),
) -> torch.library.CustomOpDef:
    """The torch operator ``name`` over a launch function: ``launch(..., traced=True)``, registered by
    :func:`operator`, so that the argument list is written once, in ``launch``.

    The operator takes the launch's positional parameters (not its keyword-only ones, such as ``traced``) with their
    type hints (types that ``torch.library`` infers a schema from: ``list[int]``, not ``Sequence[int]``) and defaults,
    but for the names in ``required``, which lose their defaults in the operator (its callers pass them all).
    ``fake`` gives the outputs' shapes and dtypes (torch.compile, meta tensors): it is called with the operator's
    arguments by name, defaults filled in, so it names those it reads and takes the others as ``**_``.
    """
    launch_signature = inspect.signature(launch, eval_str=True)  # the hints as types: they are strings here
    positional = [p for p in launch_signature.parameters.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    unknown = set(required) - {parameter.name for parameter in positional}
    if unknown:
        raise ValueError(f"required must name positional parameters of {launch.__name__}, got {sorted(unknown)}")
    signature = launch_signature.replace(
        parameters=[p.replace(default=inspect.Parameter.empty) if p.name in required else p for p in positional]
    )

    def traced_launch(*arguments, **keywords):
        return launch(*arguments, **keywords, traced=True)

    def named_fake(*arguments, **keywords):
        bound = signature.bind(*arguments, **keywords)
        bound.apply_defaults()
        return fake(**bound.arguments)

    traced_launch.__signature__ = signature  # what the operator's schema is inferred from
    traced_launch.__name__ = traced_launch.__qualname__ = launch.__name__
    traced_launch.__module__ = launch.__module__
    traced_launch.__doc__ = f"The torch operator ``{name}`` over :func:`{launch.__name__}` (``traced=True``)."
    registered = operator(name, mutates_args=mutates_args)(traced_launch)
    registered.register_fake(named_fake)
    return registered


# ----------------------------------------------------------------------------------------------------------------
# Tiles and launch settings
# ----------------------------------------------------------------------------------------------------------------

INTERPRETER_TILE = 16
"""Every tile side in the interpreter: it runs each program in numpy, one after another, so its cost grows with the
tile; 16 is the smallest side that ``tl.dot`` takes."""

INTERPRETER_WARPS = 1
"""Warps per program in the interpreter: it runs a program as numpy operations on whole tiles, so warps change
nothing there."""

ROW_TILE = 32
"""Rows of a ``[rows, D]`` tensor that a program loads per step on a GPU (``mjp_pos_embed``'s forward; the position
gradient's partials, as samples x positions): with up to ``MAX_CHANNEL_TILE`` channels, 8 KB of bfloat16 per load,
coalesced rows, and thousands of programs at ViT sizes."""

MAX_CHANNEL_TILE = 128
"""The widest channel tile on a GPU: rows of 256 contiguous bytes in bfloat16, 8 KB per load with ``ROW_TILE``
rows."""


def tile_size(gpu: int) -> int:
    """A tile side: ``gpu`` on a GPU, :data:`INTERPRETER_TILE` in the interpreter."""
    return INTERPRETER_TILE if INTERPRETING else gpu


def warp_count(gpu: int) -> int:
    """Warps per program: ``gpu`` on a GPU, :data:`INTERPRETER_WARPS` in the interpreter."""
    return INTERPRETER_WARPS if INTERPRETING else gpu


# Host-side arithmetic of the launchers. triton.cdiv and triton.next_power_of_2 are constexpr functions (in triton
# 3.6, the GPU image's, and 3.8): a call from host code costs about 2 us here (it unwraps its arguments as
# constexprs), and a step's launches make over a dozen of them. These are plain Python, with the same results (ints,
# or torch.SymInts while a torch operator is traced).


def cdiv(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for ``denominator > 0``, as ``triton.cdiv``."""
    return (numerator + denominator - 1) // denominator


def next_power_of_2(size: int) -> int:
    """The smallest power of two ``>= size`` for ``size >= 1`` (0 for ``size <= 0``), as ``triton.next_power_of_2``."""
    if isinstance(size, int):
        return 1 << (size - 1).bit_length() if size > 0 else 0
    return triton.next_power_of_2(size)  # a SymInt: triton's bit operations trace


def power_of_two_tile(size: int, smallest: int, largest: int) -> int:
    """The power of two that covers ``size`` (Triton's tiles are powers of two), within ``[smallest, largest]``."""
    return min(largest, max(smallest, next_power_of_2(size)))


@functools.cache
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def shared_memory_optin(device: torch.device) -> int:
    """The most shared memory one block of a CUDA device may use (opt-in), in bytes, asked once per device; 0 for
    other devices."""
    if device.type != "cuda":
        return 0
    return _cuda_properties(_cuda_index(device)).shared_memory_per_block_optin


def multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device (asked once per device: the query costs host time on every launch); 1 otherwise."""
    if device.type != "cuda":
        return 1
    return _cuda_properties(_cuda_index(device)).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``. Triton reads it for float32 operands only:
    "ieee" keeps their products exact, as torch's matmul does by default (no TF32 rounding). For float16 and
    bfloat16 it is ignored (their products are exact in the float32 accumulator on the tensor cores), so the "tf32"
    returned for them rounds nothing; it is kept so that the compiled kernels stay the ones measured."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_upcast(first: torch.dtype, second: torch.dtype) -> bool:
    """Multiply in float32: operands of two dtypes (tl.dot takes one), or bfloat16 in the interpreter (which
    multiplies it wrongly)."""
    return first != second or (INTERPRETING and torch.bfloat16 in (first, second))


# ----------------------------------------------------------------------------------------------------------------
# Scratch buffers
# ----------------------------------------------------------------------------------------------------------------

SCRATCH_BUFFERS = 8
"""Scratch buffers kept per host thread (the least recently used is dropped first): a few roles times the shapes
that a run meets (a training batch, its last partial batch, an evaluation batch)."""


class _ThreadScratch(threading.local):
    """One thread's scratch buffers. Per thread, because a buffer is safe to hand out again only once the launches
    of its previous use are queued: on one thread they are, before it asks again (two threads could queue writes to
    one buffer between each other's write and read, on one stream)."""

    def __init__(self) -> None:
        self.buffers: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()


_scratch = _ThreadScratch()


def scratch(
    role: str, shape: tuple[int, ...], device: torch.device, traced: bool, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A buffer of ``shape`` and ``dtype`` (float32 partial sums; the int32 inverse of a perm) that one call's kernels
    write and then read back, with no use after: the same tensor each call with the same ``role``, shape, dtype,
    device and stream (and host thread), where an eager step would otherwise dispatch a ``torch.empty`` per step.

    Reuse is safe because the kernels of a stream run in the order they were queued: the next call's writes queue
    after this call's reads. Its contents are what the last call left: the kernels must write every element they
    read, as they must of a ``torch.empty`` tensor. A fresh tensor (``torch.empty``) is returned instead when
    ``traced`` (inside a torch operator: torch.compile and the CUDA graphs it records own their memory) and while a
    CUDA graph is being captured (a buffer from the graph's private pool must not outlive it here). The buffers are
    kept until the least recently used is dropped (:data:`SCRATCH_BUFFERS` per thread) or :func:`clear_scratch`.
    """
    if traced:
        return torch.empty(shape, dtype=dtype, device=device)
    stream = 0
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.empty(shape, dtype=dtype, device=device)
        # the raw stream handle that Triton's launcher reads too: no Stream object made
        stream = torch._C._cuda_getCurrentRawStream(_cuda_index(device))
    key = (role, shape, dtype, device, stream)
    buffers = _scratch.buffers
    buffer = buffers.get(key)
    if buffer is not None:
        buffers.move_to_end(key)
        return buffer
    buffer = torch.empty(shape, dtype=dtype, device=device)
    # Kept only if it is a plain tensor that any later call may use: not a fake tensor (a tracing mode's), nor
    # one made under inference_mode (torch refuses in-place ops on those outside it).
    if type(buffer) is torch.Tensor and not buffer.is_inference():
        buffers[key] = buffer
        if len(buffers) > SCRATCH_BUFFERS:
            buffers.popitem(last=False)
    return buffer


def clear_scratch() -> None:
    """Drops this thread's scratch buffers (their memory goes back to torch's allocator)."""
    _scratch.buffers.clear()


# ----------------------------------------------------------------------------------------------------------------
# The row layout: checks, and the prefix rows' tile
# ----------------------------------------------------------------------------------------------------------------


def prefix_rows(prefix: torch.Tensor | None, dim: int) -> int:
    """``P``: the rows of ``prefix`` (any contiguous shape ``[..., D]``, e.g. ``[1, P, D]``); 0 for None."""
    if prefix is None:
        return 0
    if prefix.dim() == 0 or prefix.shape[-1] != dim:
        raise ValueError(f"prefix must be [P, D] or [1, P, D] with D = {dim}, got shape {list(prefix.shape)}")
    if not prefix.is_contiguous():
        raise ValueError(f"prefix must be contiguous, got strides {list(prefix.stride())}")
    return math.prod(prefix.shape[:-1])


def check_row_layout(
    prefix_count: int, prefix_positions: int, table_shape: Sequence[int], num_positions: int, dim: int
) -> None:
    """``prefix_positions`` is 0 or ``prefix_count``, and ``table_shape`` is the full table ``[Q + N, D]`` (any
    leading dims of 1: one table)."""
    if prefix_positions not in (0, prefix_count):
        raise ValueError(f"prefix_positions must be 0 or the prefix count P = {prefix_count}, got {prefix_positions}")
    rows = prefix_positions + num_positions
    if len(table_shape) < 2 or tuple(table_shape[-2:]) != (rows, dim) or math.prod(table_shape[:-2]) != 1:
        raise ValueError(
            f"pos_embed must be the full table [Q + N, D] = [{rows}, {dim}] (or [1, Q + N, D]) with "
            f"Q = prefix_positions = {prefix_positions}, N = {num_positions}, got shape {list(table_shape)}"
        )


def check_prefix_shape(prefix_shape: Sequence[int], prefix_count: int, dim: int) -> None:
    """``prefix_shape`` holds ``prefix_count`` rows of ``dim`` channels (``[P, D]``, ``[1, P, D]``, ...)."""
    if len(prefix_shape) == 0 or prefix_shape[-1] != dim or math.prod(prefix_shape[:-1]) != prefix_count:
        raise ValueError(
            f"prefix_shape must hold P = {prefix_count} rows of D = {dim} ([P, D] or [1, P, D]), "
            f"got {list(prefix_shape)}"
        )


def check_contiguous(**tensors: torch.Tensor | None) -> None:
    """Each tensor given (by its argument's name) is None or contiguous."""
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous, got shape {list(tensor.shape)} strides {list(tensor.stride())}"
            )


@triton.jit
def prefix_rows_tile(
    prefix_ptr,  # [P, D]
    pos_ptr,  # [Q + N, D]
    out_ptr,  # [B, P + N, D]
    rows,  # [BLOCK] flat (sample, prefix token) indices, of B * P
    channels,  # [BLOCK_D]
    total_prefix,  # B * P
    num_positions,  # N
    prefix_count,  # P
    prefix_positions,  # Q: 0 or P
    D,
):
    """Stores ``out[b, t] = prefix[t] + (pos[t] if t < Q else 0)`` for the prefix rows ``rows``: a sum in float32,
    rounded once."""
    token = rows % prefix_count
    sample = rows // prefix_count
    ok = (rows < total_prefix)[:, None] & (channels[None, :] < D)
    offsets = token[:, None].to(tl.int64) * D + channels[None, :]
    value = tl.load(prefix_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    value += tl.load(pos_ptr + offsets, mask=ok & (token < prefix_positions)[:, None], other=0.0).to(tl.float32)
    out_rows = sample * (prefix_count + num_positions) + token
    tl.store(
        out_ptr + out_rows[:, None].to(tl.int64) * D + channels[None, :], value.to(out_ptr.dtype.element_ty), mask=ok
    )


# ----------------------------------------------------------------------------------------------------------------
# Position gradient: the kernels, the launch plan (one source of truth for the launcher and the tests), the launcher
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _patch_rows(start, last, patches, is_patch, num_patches, BLOCK_B: tl.constexpr):
    """``(rows, ok)`` ``[BLOCK_B, BLOCK_N]``: the rows ``b * N + n`` of a ``[B, N]`` tensor (mask, perm) for the
    samples ``b`` in ``start .. start + BLOCK_B`` and the patch positions ``patches`` ``[BLOCK_N]``, and which of
    them exist: before sample ``last`` (exclusive) and where ``is_patch``."""
    samples = start + tl.arange(0, BLOCK_B)
    rows = samples[:, None] * num_patches + patches[None, :]  # int32 is enough
    return rows, (samples[:, None] < last) & is_patch[None, :]


@triton.jit
def _mask_tile(mask_ptr, start, last, patches, is_patch, num_patches, BLOCK_B: tl.constexpr):
    """``mask[b, n]`` (bool ``[B, N]``) at :func:`_patch_rows`, as int1 ``[BLOCK_B, BLOCK_N]``; False where no row
    exists."""
    rows, ok = _patch_rows(start, last, patches, is_patch, num_patches, BLOCK_B)
    return tl.load(mask_ptr + rows, mask=ok, other=0).to(tl.int1)


@triton.jit
def _position_partials_kernel(
    grad_ptr,  # [B, P + N, D], contiguous: the incoming gradient
    mask_ptr,  # [B, N] bool (HAS_MASK)
    perm_ptr,  # [B, N] int64 (SCATTER)
    grad_tokens_ptr,  # [B, N, D] (SCATTER): the inverse move of grad's patch rows
    partial_ptr,  # float32 [chunks * (P + N) + (1 + HAS_BIAS) * chunks * position_blocks, D]: rows as stored below
    batch,
    num_positions,  # P + N: the rows of each sample, prefix rows first
    D,
    samples_per_chunk,
    prefix_count,  # P (HAS_PREFIX); last, so that without a prefix the kernel compiles as before prefix rows
    witness_ptr,  # int32 [B, N] (ZERO_UNSHOWN): the forward's witness[b, perm[b, n]] = n
    inverse_ptr,  # int32 [B, N] (INVERSE): inverse[b, perm[b, n]] = n, written
    HAS_MASK: tl.constexpr,
    SCATTER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    ZERO_UNSHOWN: tl.constexpr,
    INVERSE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Program (position block, channel block, batch chunk) sums grad over its chunk's samples into float32
    # partials that only it writes: no atomics, and the reduction kernel adds the chunks in a fixed order.
    # SCATTER (mjp_pos_embed's backward): also grad_tokens[b, perm[b, n]] = grad[b, P + n], the inverse move, from
    # the same loads. perm[b] permutes the positions, so every row of grad_tokens is written exactly once. Any other
    # perm (validate=False, mjp_fast/_validate.py): an entry outside [0, N) stores nothing (masked, its address
    # clamped into the sample's rows), and with ZERO_UNSHOWN each program also writes zeros to its own rows m that no
    # entry names, found from the forward's witness: m is named iff witness[b, m] = w is in range and perm[b, w] = m
    # (the witness is uninitialised where m is not named, and then cannot pass the test). No other program writes a
    # row that no entry names, so no store races with these.
    # INVERSE (the patch embedding's backward, for its weight gradient): also inverse[b, perm[b, n]] = n, the token
    # that shows each patch, written by the programs of the first channel block from the perm entries of their own
    # rows (no extra launch; 12 bytes a patch). For a permutation every entry of inverse is written; an entry of perm
    # outside [0, N) stores nothing.
    # A prefix row (t < P) is a position that is never masked and never moved: it only adds to its own sum.
    chunk = tl.program_id(2)
    positions = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    position_ok = positions < num_positions
    channel_ok = channels < D
    if HAS_PREFIX:
        patches = positions - prefix_count  # the patch position n of each row; negative on prefix rows
        is_patch = position_ok & (patches >= 0)
        num_patches = num_positions - prefix_count
    else:
        patches = positions
        is_patch = position_ok
        num_patches = num_positions
    # BLOCK_B samples per step as a third tile axis: more bytes in flight per load. That axis lies within each
    # thread's registers (sm_90 TTGIR: no layout conversion in the loop), so summing it every step costs no
    # shuffles, and 2D accumulators keep registers low (48 to 100 on sm_90, the most with a mask prefetched in
    # float32): every program of the plan is resident.
    kept = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    shuffled = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    first = chunk * samples_per_chunk
    last = tl.minimum(first + samples_per_chunk, batch)
    if HAS_MASK:
        upcoming = _mask_tile(mask_ptr, first, last, patches, is_patch, num_patches, BLOCK_B)
    # NUM_STAGES > 1 (a GPU's plan): the gradient tiles of the next steps are copied to shared memory while this
    # step adds up (asynchronous copies). Without it, ptxas issued a step's loads in pairs between the adds that
    # consume them, their registers reused (sm_90 SASS), so each step waited on two to four memory round trips.
    # The mask's bytes are too small for those copies (4 bytes at least): they are loaded a step ahead instead.
    for start in tl.range(first, last, BLOCK_B, num_stages=NUM_STAGES):
        samples = start + tl.arange(0, BLOCK_B)
        rows = samples[:, None].to(tl.int64) * num_positions + positions[None, :]  # int64: B*T*D may pass 2**31
        row_ok = (samples[:, None] < last) & position_ok[None, :]
        ok = row_ok[:, :, None] & channel_ok[None, None, :]
        grad = tl.load(grad_ptr + rows[:, :, None] * D + channels[None, None, :], mask=ok, other=0.0)
        if HAS_PREFIX:
            patch_rows, patch_ok = _patch_rows(start, last, patches, is_patch, num_patches, BLOCK_B)
            patch_tile_ok = patch_ok[:, :, None] & channel_ok[None, None, :]
        else:
            patch_rows = rows
            patch_ok = row_ok
            patch_tile_ok = ok
        if SCATTER:
            if HAS_PREFIX:
                patch_count = num_patches
            else:
                patch_count = num_positions
            sample_rows = patch_rows - patches[None, :]  # b * N: the sample's first row of perm
            source = tl.load(perm_ptr + patch_rows, mask=patch_ok, other=0)
            source_ok = (source >= 0) & (source < patch_count)
            target = sample_rows + tl.where(source_ok, source, 0)
            tl.store(
                grad_tokens_ptr + target[:, :, None] * D + channels[None, None, :],
                grad.to(grad_tokens_ptr.dtype.element_ty),
                mask=patch_tile_ok & source_ok[:, :, None],
            )
            if ZERO_UNSHOWN:
                named_by = tl.load(witness_ptr + patch_rows, mask=patch_ok, other=0).to(tl.int64)
                named_ok = (named_by >= 0) & (named_by < patch_count)
                back = tl.load(
                    perm_ptr + sample_rows + tl.where(named_ok, named_by, 0), mask=patch_ok & named_ok, other=-1
                )
                unshown = patch_ok & ~(named_ok & (back == patches[None, :]))
                tl.store(
                    grad_tokens_ptr + patch_rows[:, :, None] * D + channels[None, None, :],
                    tl.zeros((BLOCK_B, BLOCK_N, BLOCK_D), dtype=grad_tokens_ptr.dtype.element_ty),
                    mask=unshown[:, :, None] & channel_ok[None, None, :],
                )
        if INVERSE:
            if tl.program_id(1) == 0:
                if HAS_PREFIX:
                    inverse_count = num_patches
                else:
                    inverse_count = num_positions
                first_rows = patch_rows - patches[None, :]  # b * N: the sample's first row of perm
                shows = tl.load(perm_ptr + patch_rows, mask=patch_ok, other=-1)
                shows_ok = patch_ok & (shows >= 0) & (shows < inverse_count)
                tl.store(
                    inverse_ptr + first_rows + tl.where(shows_ok, shows, 0),
                    (patch_rows - first_rows).to(tl.int32),
                    mask=shows_ok,
                )
        grad = grad.to(tl.float32)
        if HAS_MASK:
            masked = upcoming[:, :, None]
            upcoming = _mask_tile(mask_ptr, start + BLOCK_B, last, patches, is_patch, num_patches, BLOCK_B)
            kept += tl.sum(tl.where(masked, 0.0, grad), axis=0)
            shuffled += tl.sum(tl.where(masked, grad, 0.0), axis=0)
        else:
            kept += tl.sum(grad, axis=0)
    # Rows of partial: chunk-major position partials [chunks, P + N], then unk_embed's [chunks, position blocks]
    # (masked grad summed over the block's positions), then (HAS_BIAS) the same sums of the unmasked grad of the
    # patch rows (the bias is added to patch tokens only).
    pos_rows = (chunk * num_positions + positions).to(tl.int64)
    tl.store(
        partial_ptr + pos_rows[:, None] * D + channels[None, :],
        kept,
        mask=position_ok[:, None] & channel_ok[None, :],
    )
    small_rows = tl.num_programs(2) * tl.num_programs(0)
    unk_row = (tl.num_programs(2) * num_positions + chunk * tl.num_programs(0) + tl.program_id(0)).to(tl.int64)
    tl.store(partial_ptr + unk_row * D + channels, tl.sum(shuffled, axis=0), mask=channel_ok)
    if HAS_BIAS:
        if HAS_PREFIX:
            kept = tl.where(is_patch[:, None], kept, 0.0)
        tl.store(partial_ptr + (unk_row + small_rows) * D + channels, tl.sum(kept, axis=0), mask=channel_ok)


@triton.jit
def _position_reduce_kernel(
    partial_ptr,  # float32, as _position_partials_kernel wrote it
    grad_pos_ptr,  # [Q + N, D]: the full table's gradient
    grad_unk_ptr,  # [D]
    grad_bias_ptr,  # [D] (HAS_BIAS)
    grad_prefix_ptr,  # [P, D] (WRITE_PREFIX)
    chunks,
    num_positions,  # P + N
    prefix_count,  # P
    prefix_positions,  # Q: 0 or P
    D,
    small_rows,  # chunks * position blocks of the partials kernel
    HAS_BIAS: tl.constexpr,
    WRITE_PREFIX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # Sums the partials in a fixed order (chunk by chunk; tl.sum's tree), so equal inputs give equal bits, and
    # writes each result once, in its final dtype.
    positions = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel_ok = channels < D
    ok = (positions[:, None] < num_positions) & channel_ok[None, :]
    offsets = positions[:, None].to(tl.int64) * D + channels[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for _ in range(0, chunks):
        acc += tl.load(partial_ptr + offsets, mask=ok, other=0.0)
        offsets += num_positions * D
    # Row t of the output is row t - P + Q of the table: the patch rows, and the prefix rows when Q = P.
    table_rows = positions - prefix_count + prefix_positions
    tl.store(
        grad_pos_ptr + table_rows[:, None].to(tl.int64) * D + channels[None, :],
        acc.to(grad_pos_ptr.dtype.element_ty),
        mask=ok & (table_rows[:, None] >= 0),
    )
    if WRITE_PREFIX:
        tl.store(
            grad_prefix_ptr + positions[:, None].to(tl.int64) * D + channels[None, :],
            acc.to(grad_prefix_ptr.dtype.element_ty),
            mask=ok & (positions[:, None] < prefix_count),
        )
    if tl.program_id(0) == 0:  # the first program of each channel block also reduces the vectors
        unk = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
        kept = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
        base = partial_ptr + chunks * num_positions * D
        for start in range(0, small_rows, BLOCK_S):
            rows = start + tl.arange(0, BLOCK_S)
            row_ok = (rows[:, None] < small_rows) & channel_ok[None, :]
            address = base + rows[:, None].to(tl.int64) * D + channels[None, :]
            unk += tl.load(address, mask=row_ok, other=0.0)
            if HAS_BIAS:
                kept += tl.load(address + small_rows * D, mask=row_ok, other=0.0)
        grad_unk = tl.sum(unk, axis=0)
        tl.store(grad_unk_ptr + channels, grad_unk.to(grad_unk_ptr.dtype.element_ty), mask=channel_ok)
        if HAS_BIAS:
            # bias: every patch token's gradient, i.e. grad_pos summed over the patch positions plus grad_unk
            grad_bias = tl.sum(kept, axis=0) + grad_unk
            tl.store(grad_bias_ptr + channels, grad_bias.to(grad_bias_ptr.dtype.element_ty), mask=channel_ok)


PROGRAMS_PER_SM = 4  # programs of the partials kernel wanted per SM: enough loads in flight to keep HBM busy
PARTIAL_STAGES = 3  # the partials kernel's software pipeline on a GPU, at most (see _partial_stages)
PARTIAL_SHARED_BYTES = 32 * 1024  # its gradient tiles in shared memory, at most: no GPU needs an opt-in (48 KiB)
MAX_PARTIAL_SHARE = 0.1  # the float32 partials' traffic, at most this share of the unavoidable traffic
PARTIAL_BYTES = 8  # per float32 partial: written once, read once


def _channel_tile(dim: int) -> int:
    """The widest channel tile (coalesced rows) that loads at most 1/8 of padding columns, 16 at least."""
    for width in (MAX_CHANNEL_TILE, MAX_CHANNEL_TILE // 2, MAX_CHANNEL_TILE // 4):
        if math.ceil(dim / width) * width * 8 <= dim * 9:
            return width
    return 16


@dataclass(frozen=True)
class PositionGradientPlan:
    """How the position gradient is launched: the partials kernel, then the reduction kernel.

    The gradient is ``[batch, num_positions, dim]`` with ``num_positions = P + N``: its first ``prefix_count``
    (``P``) rows per sample are the prefix tokens', positions that are never masked nor moved. The partials
    kernel's grid is ``(position_blocks, channel_blocks, chunks)``: each program sums the gradient over
    ``samples_per_chunk`` samples of its batch chunk, ``block_b`` samples of ``block_n`` positions x ``block_d``
    channels per step. Traffic in bytes: ``bytes_grad_read`` and ``bytes_tokens_write`` (the inverse move of the
    patch rows, with SCATTER) are unavoidable; ``bytes_partials`` is the float32 partials written and read back;
    ``bytes_small`` counts perm and mask (read once per channel block) and the outputs.
    """

    batch: int
    num_positions: int  # P + N: rows per sample of the gradient, prefix rows included
    dim: int
    prefix_count: int  # P
    prefix_positions: int  # Q: rows of the position table that belong to the prefix tokens (0 or P)
    chunks: int
    samples_per_chunk: int
    block_b: int
    block_n: int
    block_d: int
    position_blocks: int
    channel_blocks: int
    small_rows: int  # rows of each vector partial (unk_embed's, bias's): chunks * position_blocks
    partial_rows: int  # rows of D float32 partials in all
    reduce_block_n: int
    reduce_block_d: int
    reduce_block_s: int
    num_stages: int  # the partials kernel's software pipeline (1: none, in the interpreter)
    bytes_grad_read: int
    bytes_tokens_write: int
    bytes_partials: int
    bytes_small: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.position_blocks, self.channel_blocks, self.chunks)

    @property
    def reduce_grid(self) -> tuple[int, int]:
        # at least one row of programs: they write grad_unk (zeros) even when there are no positions
        return (max(1, math.ceil(self.num_positions / self.reduce_block_n)), math.ceil(self.dim / self.reduce_block_d))

    @property
    def programs(self) -> int:
        return self.position_blocks * self.channel_blocks * self.chunks

    @property
    def unavoidable_bytes(self) -> int:
        return self.bytes_grad_read + self.bytes_tokens_write

    @property
    def total_bytes(self) -> int:
        return self.unavoidable_bytes + self.bytes_partials + self.bytes_small


@functools.lru_cache(maxsize=256)
def _cached_plan(*arguments) -> PositionGradientPlan:
    return _position_gradient_plan(*arguments)


def position_gradient_plan(
    batch: int,
    num_positions: int,
    dim: int,
    dtype: torch.dtype,
    multiprocessors: int,
    interpreting: bool,
    *,
    scatter: bool = True,
    has_mask: bool = True,
    has_bias: bool = False,
    tokens_dtype: torch.dtype | None = None,
    chunks: int | None = None,
    prefix_count: int = 0,
    prefix_positions: int = 0,
) -> PositionGradientPlan:
    """The launch plan of the position gradient of a ``[batch, num_positions, dim]`` gradient of ``dtype``.

    Pure (cached for plain ints). ``num_positions``: the gradient's rows per sample, ``P + N`` with the
    ``prefix_count`` (``P``) prefix rows first; ``prefix_positions``: ``Q``, 0 or ``P``. ``multiprocessors``: the
    GPU's SM count; the batch is split into chunks so that the partials kernel has about ``PROGRAMS_PER_SM``
    programs per SM, as long as the partials stay within ``MAX_PARTIAL_SHARE`` of the unavoidable traffic.
    ``interpreting``: small tiles and one chunk (the Triton interpreter runs programs one after another).
    ``scatter``: the inverse move of the patch rows is written too, in ``tokens_dtype`` (default ``dtype``).
    ``chunks`` forces the number of batch chunks (tests).
    """
    if not 0 <= prefix_count <= num_positions or prefix_positions not in (0, prefix_count):
        raise ValueError(
            f"prefix_count must be in [0, num_positions = {num_positions}] and prefix_positions 0 or prefix_count, "
            f"got {prefix_count} and {prefix_positions}"
        )
    arguments = (batch, num_positions, dim, dtype, multiprocessors, interpreting, scatter, has_mask, has_bias)
    arguments += (tokens_dtype, chunks, prefix_count, prefix_positions)
    sizes = (batch, num_positions, dim, multiprocessors, prefix_count, prefix_positions)
    if all(type(value) is int for value in sizes):
        return _cached_plan(*arguments)
    return _position_gradient_plan(*arguments)  # symbolic sizes under torch.compile: not hashable


def _position_gradient_plan(
    batch,
    num_positions,
    dim,
    dtype,
    multiprocessors,
    interpreting,
    scatter,
    has_mask,
    has_bias,
    tokens_dtype,
    chunks,
    prefix_count,
    prefix_positions,
) -> PositionGradientPlan:
    element = dtype.itemsize
    tokens_element = (tokens_dtype or dtype).itemsize if scatter else 0
    patch_positions = num_positions - prefix_count
    if interpreting:
        block_d, tiles_per_step, target_programs = INTERPRETER_TILE, ((2, 8),), 1
    else:
        # (block_b, block_n): ROW_TILE (32) rows of the gradient per step; fewer positions per block when more
        # tiles are needed to fill the GPU without more chunks
        block_d = _channel_tile(dim)
        tiles_per_step = tuple((samples, ROW_TILE // samples) for samples in (1, 2, 4))  # (1, 32), (2, 16), (4, 8)
        target_programs = PROGRAMS_PER_SM * max(1, multiprocessors)
    # Each chunk adds float32 partials (one row of D per position, plus D per position block for each vector)
    # written and read back; no more chunks than keep them within MAX_PARTIAL_SHARE of the bytes that must move
    # anyway.
    unavoidable = batch * dim * (num_positions * element + patch_positions * tokens_element)
    vectors = 2 if has_bias else 1
    channel_blocks = math.ceil(dim / block_d)
    for step_tile in tiles_per_step:
        position_blocks = max(1, math.ceil(num_positions / step_tile[1]))
        chunk_bytes = PARTIAL_BYTES * dim * (num_positions + vectors * position_blocks)
        max_chunks = max(1, unavoidable // max(1, round(chunk_bytes / MAX_PARTIAL_SHARE)))
        wanted = math.ceil(target_programs / max(1, position_blocks * channel_blocks))
        if wanted <= max_chunks:
            break
    block_b, block_n = step_tile
    wanted = min(wanted, max_chunks) if chunks is None else chunks
    wanted = max(1, min(wanted, batch))
    # whole steps of block_b samples per chunk; the last chunk takes what is left
    samples_per_chunk = math.ceil(math.ceil(max(batch, 1) / wanted) / block_b) * block_b
    chunks = max(1, math.ceil(batch / samples_per_chunk))
    small_rows = chunks * position_blocks
    partial_rows = chunks * num_positions + vectors * small_rows
    index_bytes = (8 if scatter else 0) + (1 if has_mask else 0)
    # grad_pos (Q + N rows), grad_prefix (P rows), then grad_unk and grad_bias
    outputs = (prefix_positions + patch_positions + prefix_count) * dim * element + dim * element * vectors
    return PositionGradientPlan(
        batch=batch,
        num_positions=num_positions,
        dim=dim,
        prefix_count=prefix_count,
        prefix_positions=prefix_positions,
        chunks=chunks,
        samples_per_chunk=samples_per_chunk,
        block_b=block_b,
        block_n=block_n,
        block_d=block_d,
        position_blocks=position_blocks,
        channel_blocks=channel_blocks,
        small_rows=small_rows,
        partial_rows=partial_rows,
        reduce_block_n=8 if interpreting else 16,
        reduce_block_d=INTERPRETER_TILE if interpreting else min(64, block_d),
        reduce_block_s=4 if interpreting else 16,
        num_stages=_partial_stages(block_b * block_n * block_d * element, interpreting),
        bytes_grad_read=batch * num_positions * dim * element,
        bytes_tokens_write=batch * patch_positions * dim * tokens_element,
        bytes_partials=PARTIAL_BYTES * partial_rows * dim,
        bytes_small=batch * patch_positions * channel_blocks * index_bytes + outputs,
    )


def _partial_stages(step_bytes: int, interpreting: bool) -> int:
    """The partials kernel's pipeline stages (``tl.range``'s ``num_stages``) for a step tile of ``step_bytes``
    gradient bytes: as many as ``PARTIAL_STAGES`` with that many tiles within ``PARTIAL_SHARED_BYTES`` (triton 3.6,
    the lent GPUs', keeps ``num_stages`` tiles in shared memory; triton 3.8 keeps one less): 3 for bfloat16 and
    float16 tiles of 8 KiB, 2 for float32's 16 KiB, and 1 (no pipeline) for float64 and in the interpreter, which
    runs the loop as written."""
    if interpreting:
        return 1
    return max(1, min(PARTIAL_STAGES, PARTIAL_SHARED_BYTES // max(step_bytes, 1)))


def _position_plan(grad: torch.Tensor, **flags: bool | int | torch.dtype | None) -> PositionGradientPlan:
    """The plan for ``grad`` on its device; ``flags``: the keyword arguments of :func:`position_gradient_plan`
    (tests replace this to force several chunks under the interpreter)."""
    batch, num_positions, dim = grad.shape
    serial = INTERPRETING or grad.device.type != "cuda"  # programs run one after another: one chunk
    return position_gradient_plan(batch, num_positions, dim, grad.dtype, multiprocessors(grad.device), serial, **flags)


PositionGradients = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""``(grad_tokens, grad_pos, grad_unk, grad_bias, grad_prefix)``, as :func:`launch_position_gradient` returns them."""


def launch_position_gradient(
    grad: torch.Tensor,
    mask: torch.Tensor | None,
    perm: torch.Tensor | None,
    *,
    tokens_dtype: torch.dtype | None,
    pos_dtype: torch.dtype,
    unk_dtype: torch.dtype,
    bias_dtype: torch.dtype | None = None,
    prefix_count: int = 0,
    prefix_positions: int = 0,
    pos_shape: Sequence[int] | None = None,
    prefix_dtype: torch.dtype | None = None,
    prefix_shape: Sequence[int] | None = None,
    plan: PositionGradientPlan | None = None,
    traced: bool = False,
    witness: torch.Tensor | None = None,
    permutation: bool = False,
    inverse: torch.Tensor | None = None,
) -> PositionGradients:
    """The gradients that one pass over ``grad`` gives: two kernel launches, outputs made with ``torch.empty``.

    Args:
        grad: ``[B, P + N, D]``, contiguous: the gradient of ``out[b, t] = prefix[t] + (pos[t] if t < Q else 0)``
            (``t < P``) and ``out[b, P + n] = token[b, n] + (unk if mask[b, n] else pos[Q + n])``.
        mask: bool ``[B, N]``, contiguous, or None (no position is masked).
        perm: int64 ``[B, N]``, contiguous; read only with ``tokens_dtype``.
        tokens_dtype: the dtype of ``grad_tokens``, the inverse move ``grad_tokens[b, perm[b, n]] = grad[b, P + n]``;
            None: no inverse move (``perm`` is not read).
        pos_dtype, unk_dtype, bias_dtype: the dtypes of ``grad_pos``, ``grad_unk`` and ``grad_bias`` (None: no
            bias gradient).
        prefix_count: ``P``, the prefix rows of ``grad`` (0 to P + N).
        prefix_positions: ``Q``, 0 or ``P``: the leading rows of the position table that belong to the prefix.
        pos_shape: the table's shape, ``[Q + N, D]`` or ``[1, Q + N, D]``; default ``[Q + N, D]``.
        prefix_dtype: the dtype of ``grad_prefix``; None: not computed.
        prefix_shape: the prefix's shape (``P * D`` elements); default ``[P, D]``.
        plan: from :func:`position_gradient_plan` for these sizes; default the device's.
        traced: launch through ``torch.library.wrap_triton`` (inside a torch operator).
        witness: int32 ``[B, N]``, what the forward wrote (``witness[b, perm[b, n]] = n``), for the inverse move:
            the rows of ``grad_tokens`` that no entry of ``perm`` names get zeros in the same pass. None:
            ``grad_tokens`` starts from zeros (a fill more). Only a perm that is not a permutation (validate=False)
            leaves such rows; either way none is left uninitialised.
        permutation: each row of ``perm`` is a permutation (a jigsaw that was validated, or that a sampler made):
            the inverse move writes every row of ``grad_tokens``, so neither a witness nor a fill is needed.
        inverse: int32 ``[B, N]``, contiguous, or None: written in the same pass, ``inverse[b, perm[b, n]] = n`` (the
            token that shows each patch; ``perm`` must be given). Entries that no entry of ``perm`` names are left as
            they were: for a permutation, none.

    Returns:
        ``grad_tokens [B, N, D]`` (or None); ``grad_pos`` (``pos_shape``: rows ``t < Q`` the prefix rows summed
        over the batch, rows ``Q + n`` grad summed over the samples where position n is unmasked); ``grad_unk [D]``
        (over the masked ones); ``grad_bias [D]`` (over all patch rows, or None); ``grad_prefix`` (``prefix_shape``,
        the prefix rows summed over the batch; an empty ``[0]`` tensor when ``P = 0``; None without
        ``prefix_dtype``).
    """
    scatter = tokens_dtype is not None
    read_perm = perm if scatter or inverse is not None else None
    if inverse is not None:
        if perm is None:
            raise ValueError("inverse: written from perm, which is None")
        if inverse.dtype != torch.int32 or inverse.shape != perm.shape or not inverse.is_contiguous():
            raise ValueError(
                f"inverse must be a contiguous int32 tensor of perm's shape {list(perm.shape)}, got "
                f"{inverse.dtype} {list(inverse.shape)}"
            )
    pos_shape = _checked_position_layout(grad, mask, read_perm, prefix_count, prefix_positions, pos_shape)
    gradients = _empty_position_gradients(
        grad, pos_shape, tokens_dtype, pos_dtype, unk_dtype, bias_dtype, prefix_count, prefix_dtype, prefix_shape
    )
    if scatter and witness is None and not permutation and gradients[0].numel():
        gradients[0].zero_()
    if grad.shape[2] == 0:  # D = 0: nothing to add up
        return gradients
    if plan is None:
        plan = _position_plan(
            grad,
            scatter=scatter,
            has_mask=mask is not None,
            has_bias=bias_dtype is not None,
            tokens_dtype=tokens_dtype,
            prefix_count=prefix_count,
            prefix_positions=prefix_positions,
        )
    else:
        _check_plan(plan, grad, prefix_count)
    _launch_position_kernels(
        plan, grad, mask, perm, gradients, prefix_count, prefix_positions, traced, witness, inverse
    )
    return gradients


def _checked_position_layout(
    grad: torch.Tensor,
    mask: torch.Tensor | None,
    perm: torch.Tensor | None,
    prefix_count: int,
    prefix_positions: int,
    pos_shape: Sequence[int] | None,
) -> tuple[int, ...]:
    """The position table's shape (default ``[Q + N, D]``), once ``grad [B, P + N, D]``, the row layout, and the
    ``[B, N]`` indices given (``perm`` None where it is not read) are checked."""
    batch, num_positions, dim = grad.shape
    if not 0 <= prefix_count <= num_positions:
        raise ValueError(f"prefix_count must be in [0, {num_positions}] (grad's rows per sample), got {prefix_count}")
    patch_positions = num_positions - prefix_count
    pos_shape = (prefix_positions + patch_positions, dim) if pos_shape is None else tuple(pos_shape)
    check_row_layout(prefix_count, prefix_positions, pos_shape, patch_positions, dim)
    for name, index in (("mask", mask), ("perm", perm)):
        if index is not None and tuple(index.shape) != (batch, patch_positions):
            raise ValueError(f"{name} must be [B, N] = {[batch, patch_positions]}, got {list(index.shape)}")
    return pos_shape


def _empty_position_gradients(
    grad: torch.Tensor,
    pos_shape: tuple[int, ...],
    tokens_dtype: torch.dtype | None,
    pos_dtype: torch.dtype,
    unk_dtype: torch.dtype,
    bias_dtype: torch.dtype | None,
    prefix_count: int,
    prefix_dtype: torch.dtype | None,
    prefix_shape: Sequence[int] | None,
) -> PositionGradients:
    """``(grad_tokens, grad_pos, grad_unk, grad_bias, grad_prefix)`` made with ``torch.empty`` in their final shapes
    and dtypes (see :func:`launch_position_gradient`); None for those not asked for."""
    batch, num_positions, dim = grad.shape
    device = grad.device
    grad_prefix = None
    if prefix_dtype is not None:
        if prefix_count and prefix_shape is not None:
            check_prefix_shape(prefix_shape, prefix_count, dim)
        shape = ((prefix_count, dim) if prefix_shape is None else tuple(prefix_shape)) if prefix_count else (0,)
        grad_prefix = torch.empty(shape, dtype=prefix_dtype, device=device)
    grad_tokens = None
    if tokens_dtype is not None:
        grad_tokens = torch.empty((batch, num_positions - prefix_count, dim), dtype=tokens_dtype, device=device)
    grad_pos = torch.empty(pos_shape, dtype=pos_dtype, device=device)
    grad_unk = torch.empty((dim,), dtype=unk_dtype, device=device)
    grad_bias = torch.empty((dim,), dtype=bias_dtype, device=device) if bias_dtype is not None else None
    return grad_tokens, grad_pos, grad_unk, grad_bias, grad_prefix


def _check_plan(plan: PositionGradientPlan, grad: torch.Tensor, prefix_count: int) -> None:
    """A plan given by the caller must be the one for ``grad``'s sizes and ``P``."""
    batch, num_positions, dim = grad.shape
    if (plan.batch, plan.num_positions, plan.dim, plan.prefix_count) != (batch, num_positions, dim, prefix_count):
        raise ValueError(
            f"plan: made for [B, P + N, D] = {[plan.batch, plan.num_positions, plan.dim]} with "
            f"P = {plan.prefix_count}, got grad {list(grad.shape)} with P = {prefix_count}"
        )


def _launch_position_kernels(
    plan: PositionGradientPlan,
    grad: torch.Tensor,
    mask: torch.Tensor | None,
    perm: torch.Tensor | None,
    gradients: PositionGradients,
    prefix_count: int,
    prefix_positions: int,
    traced: bool,
    witness: torch.Tensor | None = None,
    inverse: torch.Tensor | None = None,
) -> None:
    """The two launches: float32 partial sums per batch chunk (and the inverse move into ``grad_tokens``, the
    ``inverse`` permutation), then
    their fixed-order sum into ``gradients`` (from :func:`_empty_position_gradients`). An absent tensor's argument
    is one that the kernel never reads nor writes through (its flag is off)."""
    grad_tokens, grad_pos, grad_unk, grad_bias, grad_prefix = gradients
    batch, num_positions, dim = grad.shape
    scatter, has_mask, has_bias = grad_tokens is not None, mask is not None, grad_bias is not None
    write_prefix = grad_prefix is not None and prefix_count > 0
    partials = scratch("position gradient partials", (plan.partial_rows, dim), grad.device, traced)
    launcher(_position_partials_kernel, plan.grid, traced)(
        grad,
        mask if has_mask else grad,
        perm if scatter or inverse is not None else grad,
        grad_tokens if scatter else grad,
        partials,
        batch,
        num_positions,
        dim,
        plan.samples_per_chunk,
        prefix_count,
        witness if scatter and witness is not None else grad,
        inverse if inverse is not None else grad,
        HAS_MASK=has_mask,
        SCATTER=scatter,
        HAS_BIAS=has_bias,
        HAS_PREFIX=prefix_count > 0,
        ZERO_UNSHOWN=scatter and witness is not None,
        INVERSE=inverse is not None,
        BLOCK_B=plan.block_b,
        BLOCK_N=plan.block_n,
        BLOCK_D=plan.block_d,
        NUM_STAGES=plan.num_stages,
    )
    launcher(_position_reduce_kernel, plan.reduce_grid, traced)(
        partials,
        grad_pos,
        grad_unk,
        grad_bias if has_bias else grad_unk,
        grad_prefix if write_prefix else grad_unk,
        plan.chunks,
        num_positions,
        prefix_count,
        prefix_positions,
        dim,
        plan.small_rows,
        HAS_BIAS=has_bias,
        WRITE_PREFIX=write_prefix,
        BLOCK_N=plan.reduce_block_n,
        BLOCK_D=plan.reduce_block_d,
        BLOCK_S=plan.reduce_block_s,
    )
