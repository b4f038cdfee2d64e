"""``sample_jigsaw``: the public sampler, its plan, and the operators of its compiled and Triton kernels.

The settings are checked and turned into integers once (:class:`SamplerPlan`); a plan then runs one kernel:
the oracle on the ``torch`` backend (``reference.py``), the compiled extension on ``cpu`` and ``cuda``
(``csrc/sampler_cpu.cpp``, ``csrc/sampler_cuda.cu``), or the Triton kernel (``triton_kernel.py``). Each kernel
implements docs/sampler.md exactly, so a sample is a pure function of ``(seed, offset + i)`` and the settings,
bit-identical on every backend and device.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import torch

from mjp_fast import backend as backend_module
from mjp_fast._validate import (
    canonical_device,
    check_fraction,
    check_int,
    check_positive_float,
    to_device,
)
from mjp_fast.sampler.jigsaw import Jigsaw, empty_jigsaw
from mjp_fast.sampler.reference import (
    MAX_GRID_POSITIONS,
    check_sampler_grid,
    prob_threshold,
    sample_from_tables,
    sampler_tables,
    seed_bits,
    target_count,
)

_UINT64 = 2**64 - 1
# The Triton kernel holds a sample's grid in one block of BLOCK_N = next_power_of_2(N) lanes; Triton refuses blocks of
# more elements than this (triton.language.core.TRITON_MAX_TENSOR_NUMEL).
TRITON_MAX_POSITIONS = 1 << 20

# ----------------------------------------------------------------------------------------------------------------
# The kernels as torch.library operators (opaque to torch.compile, no graph break): one schema for both
# ----------------------------------------------------------------------------------------------------------------

# counter: int64, one element: sample i uses stream counter * counter_scale + stream_shift (+ i unless shared);
# params: int64 [2], the seed's 64 bits (seed_bits) and the prob threshold; the tables: sampler_tables. Every int
# fits in int32 (Inductor compiles a user Triton kernel's call only then): the seed and the threshold, which may
# not, come in params.
SCHEMA = (
    "(Tensor counter, Tensor params, Tensor h_thresholds, Tensor w_thresholds, SymInt batch_size, SymInt rows, "
    "SymInt cols, SymInt target, SymInt min_block, SymInt counter_scale, SymInt stream_shift, bool shared) "
    "-> (Tensor, Tensor)"
)


def _fake(counter, params, h_thresholds, w_thresholds, batch_size, rows, cols, *_):  # noqa: ANN001 - the schema's
    return empty_jigsaw(batch_size, rows * cols, h_thresholds.device)


def run_extension(
    counter: torch.Tensor, params: torch.Tensor, *tables_and_sizes: torch.Tensor | int | bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled sampler (``cpu`` or ``cuda`` backend) on the tables' device, with :data:`SCHEMA`'s arguments.

    ``counter`` and ``params`` go to the kernel as they are: the CUDA kernel reads them from device memory, as the
    Triton kernel does (no host sync, and a CUDA graph replays each step's stream position); the CPU path reads them
    in place.
    """
    return backend_module.extension().sample_jigsaw_from_counter(counter, params, *tables_and_sizes)


_extension_operator = torch.library.custom_op(
    "mjp_fast::sample_jigsaw_extension", run_extension, mutates_args=(), schema=SCHEMA
)
_extension_operator.register_fake(_fake)
_LAUNCHES = {"cpu": run_extension, "cuda": run_extension}
_OPERATORS = {"cpu": _extension_operator, "cuda": _extension_operator}

if backend_module.triton_usable():
    from mjp_fast.sampler import triton_kernel as _triton_kernel
    from mjp_fast.triton import operator as _triton_operator

    def _run_triton_traced(*arguments: object) -> tuple[torch.Tensor, torch.Tensor]:
        return _triton_kernel.sample_jigsaw_launch(*arguments, traced=True)

    # torch 2.11's triton_op infers a schema from the function even when given one (2.14 takes the one given), and
    # refuses *arguments: so the function shows the launch's positional parameters, which SCHEMA states.
    _launch_signature = inspect.signature(_triton_kernel.sample_jigsaw_launch, eval_str=True)
    _run_triton_traced.__signature__ = _launch_signature.replace(
        parameters=[p for p in _launch_signature.parameters.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    )
    # On a GPU a triton_op, so torch.compile sees the kernel itself; its fake stays shapes only, since under the
    # CPU interpreter the launch cannot be traced.
    _triton_operator_def = _triton_operator("mjp_fast::sample_jigsaw_triton", schema=SCHEMA)(_run_triton_traced)
    _triton_operator_def.register_fake(_fake)
    _LAUNCHES["triton"] = _triton_kernel.sample_jigsaw_launch
    _OPERATORS["triton"] = _triton_operator_def


def sampler_params(seed: int, prob: float, device: torch.device | str) -> torch.Tensor:
    """int64 ``[2]`` on ``device``: the seed's 64 bits and the prob threshold, as the operators read them.

    Made once per (seed, prob, device) and shared: callers must not write to it.
    """
    return _sampler_params_on_device(seed_bits(seed), prob_threshold(prob), str(device))


@functools.lru_cache(maxsize=256)
def _sampler_params_on_device(bits: int, threshold: int, device: str) -> torch.Tensor:
    return torch.tensor([bits, threshold], dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------------------------------------------
# The plan: settings checked and turned into integers once, then one kernel per call
# ----------------------------------------------------------------------------------------------------------------


class SamplerPlan(NamedTuple):
    """Everything a sampler kernel needs besides the batch size and the stream position, made once.

    :class:`mjp_fast.JigsawSampler` keeps one per grid and device, so a training step only launches the sampler:
    nothing is checked, resolved or built on the host per call. Make one with :func:`make_sampler_plan`.
    """

    backend: str  # "torch", "cpu", "cuda" or "triton"
    rows: int
    cols: int
    target: int
    min_block: int
    shared: bool
    seed: int  # in [0, 2**64)
    prob_threshold: int
    h_thresholds: torch.Tensor  # int64 [1024, rows] on the device
    w_thresholds: torch.Tensor  # int64 [1024, cols] on the device
    params: torch.Tensor  # int64 [2] on the device: the seed's bits and prob_threshold (sampler_params)

    def sample(
        self, batch_size: int, counter: torch.Tensor | int, counter_scale: int = 1, stream_shift: int = 0
    ) -> Jigsaw:
        """``batch_size`` jigsaws; sample ``i`` uses stream ``counter * counter_scale + stream_shift + i``.

        ``counter``: an int, or an int64 one-element tensor on the plan's device (what the modules pass: the
        ``triton`` and ``cuda`` kernels read it on the device, so no host sync, and a CUDA graph replays the right
        stream).
        """
        if self.backend == "torch":
            return sample_from_tables(
                batch_size, self.rows, self.cols, self.target, self.min_block, self.seed, self.prob_threshold,
                self.h_thresholds, self.w_thresholds, counter * counter_scale + stream_shift, self.shared,
            )  # fmt: skip
        compiling = torch.compiler.is_compiling()
        if not isinstance(counter, torch.Tensor):
            if not compiling and self.backend != "triton":
                # An int offset on the extension (sample_jigsaw(offset=int)): it is on the host already, so the
                # position, the seed and the threshold go as the kernel's arguments, with no tensor to make or copy.
                offset = (counter * counter_scale + stream_shift) & _UINT64
                return Jigsaw(
                    *backend_module.extension().sample_jigsaw(
                        batch_size, self.rows, self.cols, self.target, self.min_block, self.seed, offset, self.shared,
                        self.prob_threshold, self.h_thresholds, self.w_thresholds,
                    )
                )  # fmt: skip
            counter = _as_offset_tensor(counter * counter_scale + stream_shift, self.h_thresholds.device)
            counter_scale, stream_shift = 1, 0
        # Every kernel reads the stream position, the seed and the threshold from the tensors, on their device.
        arguments = (
            counter, self.params, self.h_thresholds, self.w_thresholds, batch_size, self.rows, self.cols, self.target,
            self.min_block, counter_scale, stream_shift, self.shared,
        )  # fmt: skip
        if compiling:
            return Jigsaw(*_OPERATORS[self.backend](*arguments))
        # Eager: the launch itself (the operator wrapper, needed only for torch.compile, costs more host time than
        # sampling a batch of 64 on the CPU).
        return Jigsaw(*_LAUNCHES[self.backend](*arguments))

    def sample_step(
        self, batch_size: int, counter: torch.Tensor, counter_scale: int = 1, stream_shift: int = 0
    ) -> Jigsaw:
        """:meth:`sample`, then ``counter += batch_size`` in place: a module's training step (``counter``: its int64
        one-element stream counter on the plan's device). On the CPU, one call of the extension does both; on a GPU
        the increment is a second launch on the device, after the kernel that read the counter."""
        if self.backend == "cpu" and not torch.compiler.is_compiling():
            mask, perm = backend_module.extension().sample_jigsaw_step(
                counter, counter_scale, stream_shift, batch_size, self.rows, self.cols, self.target, self.min_block,
                self.seed, self.shared, self.prob_threshold, self.h_thresholds, self.w_thresholds,
            )  # fmt: skip
            return Jigsaw(mask, perm)
        jigsaw = self.sample(batch_size, counter, counter_scale, stream_shift)
        counter.add_(batch_size)  # a buffer that needs no gradient: nothing is recorded
        return jigsaw


def make_sampler_plan(
    grid_size: tuple[int, int],
    ratio: float,
    *,
    seed: int,
    prob: float,
    shared: bool,
    min_block: int,
    min_aspect: float,
    device: torch.device,
    backend: str,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    params: torch.Tensor | None = None,
) -> SamplerPlan:
    """A :class:`SamplerPlan` for checked settings on ``device`` and a resolved ``backend``.

    ``tables`` and ``params``: the module's own copies on ``device`` (default :func:`sampler_tables` and
    :func:`sampler_params`, shared and cached).
    """
    rows, cols = grid_size
    if backend == "triton" and rows * cols > TRITON_MAX_POSITIONS:
        raise ValueError(
            f"grid_size: the triton sampler takes at most {TRITON_MAX_POSITIONS} positions (one block per sample), "
            f"got {rows}x{cols}; the cpu and cuda backends take up to {MAX_GRID_POSITIONS}"
        )
    h_thresholds, w_thresholds = tables if tables is not None else sampler_tables(rows, cols, min_aspect, device)
    return SamplerPlan(
        backend=backend,
        rows=rows,
        cols=cols,
        target=target_count(ratio, rows * cols),
        min_block=min_block,
        shared=shared,
        seed=seed,
        prob_threshold=prob_threshold(prob),
        h_thresholds=h_thresholds,
        w_thresholds=w_thresholds,
        params=params if params is not None else sampler_params(seed, prob, device),
    )


def _as_offset_tensor(offset: int | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    if isinstance(offset, torch.Tensor):
        return offset.reshape(1).to(device=device, dtype=torch.int64)
    # A stream position mod 2**64, as the kernels take it, in an int64's bits.
    return torch.tensor([seed_bits(offset & _UINT64)], dtype=torch.int64, device=device)


def check_device(device: torch.device) -> torch.device:
    """``device``, if tensors can be made there (``cuda`` without a GPU, a CUDA index past the last GPU: a
    ValueError naming ``device`` instead of torch's RuntimeError). Probed once per usable device."""
    if not torch.compiler.is_compiling():
        _probe_device(device)
    return device


@functools.lru_cache(maxsize=64)  # a failed probe raises, so only usable devices are remembered
def _probe_device(device: torch.device) -> None:
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, NotImplementedError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"device: no tensor can be made on {device} here ({message})") from None


def _check_offset(offset: object, batch_size: int, device: torch.device) -> int | torch.Tensor:
    """An int in ``[0, 2**63)`` with ``offset + batch_size <= 2**63``, or a one-element integer tensor on ``device``:
    on the CPU its value is checked the same way (reading it costs no sync); on a GPU it is not (a check would
    sync), and every backend takes it mod 2**64, so they agree whatever it holds."""
    if isinstance(offset, torch.Tensor):
        if (
            offset.numel() != 1
            or offset.dtype.is_floating_point
            or offset.dtype.is_complex
            or offset.dtype == torch.bool
        ):
            raise TypeError(
                f"offset must be an int or a one-element integer tensor, got {offset.dtype} {list(offset.shape)}"
            )
        if canonical_device(offset.device) != device:
            raise ValueError(f"offset is on {offset.device} but the jigsaw is made on {device}")
        if offset.device.type == "cpu" and not torch.compiler.is_compiling():
            _check_offset_range(int(offset.reshape(())), batch_size)
        return offset if offset.dtype == torch.int64 else offset.to(torch.int64)
    return _check_offset_range(check_int("offset", offset), batch_size)


def _check_offset_range(offset: int, batch_size: int) -> int:
    if not 0 <= offset < 2**63:
        raise ValueError(f"offset must be in [0, 2**63), got {offset}")
    if offset + batch_size > 2**63:
        raise ValueError(f"offset + batch_size must be <= 2**63, got offset={offset}, batch_size={batch_size}")
    return offset


# ----------------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------------


def sample_jigsaw(
    batch_size: int,
    grid_size: int | tuple[int, int],
    ratio: float,
    *,
    seed: int,
    offset: int | torch.Tensor = 0,
    shared: bool = False,
    prob: float = 1.0,
    min_block: int = 8,
    min_aspect: float = 0.3,
    device: torch.device | str | None = None,
    backend: str | None = None,
) -> Jigsaw:
    """Samples a block-wise jigsaw (mask and permutation) for every sample of a batch.

    Sample ``i`` is a pure function of ``(seed, offset + i)`` and the other arguments, bit-identical on every
    backend and device: a training loop passes ``offset = global index of the batch's first sample`` and gets
    fresh jigsaws each step, distinct ones on each rank, and the same ones after a resume.

    Args:
        batch_size: B >= 0.
        grid_size: the patch grid, an int (square) or ``(rows, cols)``; ``N = rows * cols``, position
            ``n = row * cols + col``. At most ``2**14`` rows and columns (the sampler's tables hold 8 KiB per row
            and per column) and ``2**30`` positions; the ``triton`` backend takes at most ``2**20`` positions.
        ratio: in [0, 1]; each mask aims at ``floor(ratio * N)`` positions and, as BEiT's, may end short of it.
        seed: an int in ``[0, 2**64)``.
        offset: the stream index of sample 0: an int in ``[0, 2**63)`` with ``offset + batch_size <= 2**63``, or a
            one-element integer tensor on ``device`` (what :class:`mjp_fast.MJPPatchEmbed` passes: no recompilation
            under torch.compile, and on the ``triton`` and ``cuda`` backends no host sync). A CPU tensor's value is
            checked as an int's; a GPU tensor's is not (that would sync): every backend takes it mod 2**64.
        shared: one jigsaw (that of stream ``offset``) for the whole batch, as the paper's code does.
        prob: each sample is jigsawed with this probability, else its mask is all False.
        min_block: the smallest rectangle area BEiT tries (the paper's code: 8).
        min_aspect: rectangles' aspect ratios are log-uniform in ``[min_aspect, 1 / min_aspect]``.
        device: where the result lives (default CPU). ``"meta"`` gives the shapes and dtypes only; a device where
            no tensor can be made (``"cuda"`` without a GPU) is a ValueError.
        backend: ``torch``, ``cpu``, ``cuda`` or ``triton``; default ``MJP_FAST_BACKEND``, else the fastest for
            ``device``.

    Returns:
        ``Jigsaw(mask, perm)``: mask bool ``[B, N]``, perm int64 ``[B, N]``.
    """
    batch_size = check_int("batch_size", batch_size, minimum=0)
    rows, cols = check_sampler_grid(grid_size)
    ratio = check_fraction("ratio", ratio)
    seed = check_int("seed", seed, minimum=0, maximum=2**64 - 1)
    if not isinstance(shared, bool):
        raise TypeError(f"shared must be a bool, got {type(shared).__name__}")
    prob = check_fraction("prob", prob)
    min_block = check_int("min_block", min_block, minimum=1, maximum=MAX_GRID_POSITIONS)
    min_aspect = check_positive_float("min_aspect", min_aspect)
    device = to_device(device)
    offset = _check_offset(offset, batch_size, device)
    chosen = backend_module.resolve_backend(backend, device)
    check_device(device)
    return make_sampler_plan(
        (rows, cols),
        ratio,
        seed=seed,
        prob=prob,
        shared=shared,
        min_block=min_block,
        min_aspect=min_aspect,
        device=device,
        backend=chosen,
    ).sample(batch_size, offset)


def sample_jigsaw_ref(batch_size: int, grid_size: int | tuple[int, int], ratio: float, **settings: Any) -> Jigsaw:
    """The oracle with :func:`sample_jigsaw`'s arguments (all but ``backend``): the same checks and integers, then
    the plain-PyTorch sampler of ``reference.py`` (the ``torch`` backend). Returns ``Jigsaw(mask [B, N] bool,
    perm [B, N] int64)``."""
    if "backend" in settings:
        raise TypeError("sample_jigsaw_ref takes no backend: it is the torch backend")
    return sample_jigsaw(batch_size, grid_size, ratio, backend="torch", **settings)
