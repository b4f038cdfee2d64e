"""The compiled sampler's entry with its stream position and random settings in tensors (``run_extension``, the
operator ``mjp_fast::sample_jigsaw_extension``, ``_C.sample_jigsaw_from_counter``), and the ``cuda`` backend's route
through it: the counter and params go to the kernel as tensors on the device and are never read on the host.

Without a GPU the ``cuda`` route is followed on CPU tensors (a plan made for the ``cuda`` backend on the CPU): the
Python side is the same, and the extension's CPU path reads the tensors where the CUDA kernel would.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mjp_fast
from mjp_fast import backend as backend_module
from mjp_fast.sampler import dispatch, sample_jigsaw_ref
from mjp_fast.sampler.dispatch import make_sampler_plan, sampler_params
from mjp_fast.sampler.reference import prob_threshold, sampler_tables, seed_bits, target_count

pytestmark = pytest.mark.skipif("cpu" not in mjp_fast.available_backends(), reason="needs mjp_fast._C")


class _RefuseScalarReads(TorchDispatchMode):
    """Fails on any operator that copies a tensor's value to a Python number (int(), item(), bool(), ...)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a tensor's value was read on the host")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _no_host_reads(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError("a tensor's value was read on the host")

    with monkeypatch.context() as patch:
        for name in ("__int__", "__index__", "__bool__", "__float__", "item", "tolist", "numpy"):
            patch.setattr(torch.Tensor, name, refuse)
        with _RefuseScalarReads():
            yield


class _RecordingExtension:
    """The extension, recording which entry is called with which arguments."""

    def __init__(self, extension):
        self._extension, self.calls = extension, []

    def __getattr__(self, name):
        function = getattr(self._extension, name)

        def call(*args):
            self.calls.append((name, args))
            return function(*args)

        return call


def _cuda_route_plan(grid, ratio, *, seed, prob, shared, min_block=2):
    # The plan a CUDA device gets on the cuda backend, made on the CPU: the same Python route, CPU tensors.
    return make_sampler_plan(
        grid, ratio, seed=seed, prob=prob, shared=shared, min_block=min_block, min_aspect=0.3,
        device=torch.device("cpu"), backend="cuda",
    )  # fmt: skip


def _assert_same(jigsaw, expected):
    assert torch.equal(jigsaw[0], expected.mask) and torch.equal(jigsaw[1], expected.perm)


# ----------------------------------------------------------------------------------------------------------------
# The cuda backend's route: tensors to the kernel, nothing read on the host
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True])
def test_cuda_route_hands_the_counter_and_params_to_the_kernel_unread(monkeypatch, shared):
    plan = _cuda_route_plan((5, 7), 0.4, seed=2**64 - 3, prob=0.6, shared=shared)
    recording = _RecordingExtension(backend_module.extension())
    monkeypatch.setattr(backend_module, "extension", lambda: recording)
    counter = torch.tensor(11, dtype=torch.int64)
    with _no_host_reads(monkeypatch):
        sampled = plan.sample(6, counter, 3, 5)
        stepped = plan.sample_step(6, counter, 3, 5)
    # one kernel call each, with the module's own counter and the plan's params, not host copies of them
    assert [name for name, _ in recording.calls] == ["sample_jigsaw_from_counter"] * 2
    for _, args in recording.calls:
        assert args[0] is counter and args[1] is plan.params
    assert int(counter) == 17  # sample_step advanced it, on the counter's device
    settings = dict(seed=2**64 - 3, prob=0.6, shared=shared, min_block=2)
    expected = sample_jigsaw_ref(6, (5, 7), 0.4, offset=11 * 3 + 5, **settings)
    _assert_same(sampled, expected)
    _assert_same(stepped, expected)  # sampled before the counter moved
    _assert_same(plan.sample(6, counter, 3, 5), sample_jigsaw_ref(6, (5, 7), 0.4, offset=17 * 3 + 5, **settings))


def test_cuda_route_step_dispatches_its_outputs_and_the_increment_only():
    # The host cost of a cuda-backend training step: the kernel's two outputs and the counter's add_ on the device
    # (no _local_scalar_dense, the operator behind int() and item()).
    from tests.harness.host_cost import count_ops

    plan = _cuda_route_plan((4, 4), 0.5, seed=1, prob=1.0, shared=False)
    counter = torch.tensor(0, dtype=torch.int64)
    counts = count_ops(lambda: plan.sample_step(4, counter, 2, 1)).counts
    assert dict(counts) == {"empty": 2, "add_": 1}


def test_the_extension_operator_reads_nothing_on_the_host(monkeypatch):
    # What torch.compile runs on the cpu and cuda backends: the operator passes its tensors through.
    h_thresholds, w_thresholds = sampler_tables(4, 6, 0.3)
    counter, params = torch.tensor([9]), sampler_params(2**63 + 5, 0.7, "cpu")
    arguments = (counter, params, h_thresholds, w_thresholds, 5, 4, 6, 12, 2, 4, 3, False)
    with _no_host_reads(monkeypatch):
        mask, perm = torch.ops.mjp_fast.sample_jigsaw_extension(*arguments)
    expected = sample_jigsaw_ref(5, (4, 6), 0.5, seed=2**63 + 5, prob=0.7, offset=9 * 4 + 3, min_block=2)
    _assert_same((mask, perm), expected)


def test_an_int_offset_takes_the_host_integer_entry(monkeypatch):
    # sample_jigsaw(offset=int): the offset is already on the host, so it is passed as a kernel argument (no tensor
    # to make and copy to the device).
    plan = _cuda_route_plan((3, 5), 0.5, seed=4, prob=1.0, shared=False)
    recording = _RecordingExtension(backend_module.extension())
    monkeypatch.setattr(backend_module, "extension", lambda: recording)
    jigsaw = plan.sample(4, 2**33 + 1)
    assert [name for name, _ in recording.calls] == ["sample_jigsaw"]
    _assert_same(jigsaw, sample_jigsaw_ref(4, (3, 5), 0.5, seed=4, offset=2**33 + 1, min_block=2))


def test_a_counter_tensor_offset_on_the_cpu_backend_equals_the_int_offset():
    for offset in (torch.tensor(2**32 - 2), torch.tensor([7]), torch.tensor(5, dtype=torch.int32)):
        jigsaw = mjp_fast.sample_jigsaw(4, (6, 5), 0.4, seed=8, offset=offset, prob=0.5, backend="cpu")
        expected = sample_jigsaw_ref(4, (6, 5), 0.4, seed=8, offset=int(offset), prob=0.5)
        _assert_same(jigsaw, expected)


# ----------------------------------------------------------------------------------------------------------------
# _C.sample_jigsaw_from_counter against the oracle
# ----------------------------------------------------------------------------------------------------------------

CASES = [
    # (batch, grid, ratio, seed, prob, counter, counter_scale, stream_shift, shared, min_block)
    (5, (7, 13), 0.3, 2**64 - 1, 1.0, 2**31 - 3, 1, 0, False, 8),  # streams cross 2**31 and 2**32 on the way
    (3, (1, 1), 1.0, 0, 1.0, 0, 1, 0, False, 1),
    (4, (1, 7), 0.6, 3, 0.5, 5, 2, 2**32 + 1, False, 1),
    (6, (5, 9), 0.4, 0x1234_5678_9ABC_DEF0, 0.3, 2**20 + 1, 2**12, 77, False, 2),
    (4, (5, 9), 0.4, 2**63 + 11, 0.8, 13, 3, 5, True, 2),
    (1, (2, 2), 0.75, 11, 1.0, 2**40, 1, 3, True, 1),
    (0, (14, 14), 0.5, 9, 1.0, 4, 1, 0, False, 8),
    (7, (14, 14), 0.5, 5, 0.0, 4, 2, 1, False, 8),  # prob 0: every mask all False
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_from_counter_equals_the_oracle(case):
    batch, grid, ratio, seed, prob, position, scale, shift, shared, min_block = case
    h_thresholds, w_thresholds = sampler_tables(*grid, 0.3)
    target = target_count(ratio, grid[0] * grid[1])
    params = torch.tensor([seed_bits(seed), prob_threshold(prob)])
    for counter in (torch.tensor(position), torch.tensor([position])):
        got = mjp_fast._C.sample_jigsaw_from_counter(
            counter, params, h_thresholds, w_thresholds, batch, *grid, target, min_block, scale, shift, shared
        )
        expected = sample_jigsaw_ref(
            batch, grid, ratio, seed=seed, prob=prob, offset=position * scale + shift, shared=shared,
            min_block=min_block,
        )  # fmt: skip
        assert got[0].dtype == torch.bool and got[1].dtype == torch.int64
        _assert_same(got, expected)
        assert int(counter.reshape(-1)[0]) == position  # only read
    # a non-contiguous params (every other element of a longer tensor) is read as its two values
    spread = torch.stack((params, torch.zeros(2, dtype=torch.int64)), 1).reshape(-1)[::2]
    got = mjp_fast._C.sample_jigsaw_from_counter(
        torch.tensor(position), spread, h_thresholds, w_thresholds, batch, *grid, target, min_block, scale, shift,
        shared,
    )  # fmt: skip
    _assert_same(got, expected)


def test_from_counter_refuses_bad_counters_and_params():
    h_thresholds, w_thresholds = sampler_tables(4, 5, 0.3)
    good = dict(counter=torch.tensor(3), params=torch.tensor([1, 2**31]), scale=1, shift=0, rows=4, target=8)

    def call(counter, params, scale, shift, rows, target):
        return mjp_fast._C.sample_jigsaw_from_counter(
            counter, params, h_thresholds, w_thresholds, 2, rows, 5, target, 2, scale, shift, False
        )

    call(**good)
    bad_cases = [
        (dict(counter=torch.tensor(3, dtype=torch.int32)), "counter must be a one-element int64 tensor"),
        (dict(counter=torch.tensor(3.0)), "counter must be a one-element int64 tensor"),
        (dict(counter=torch.tensor([3, 4])), "counter must be a one-element int64 tensor"),
        (dict(counter=torch.zeros(0, dtype=torch.int64)), "counter must be a one-element int64 tensor"),
        (dict(counter=torch.tensor(3, device="meta")), "counter must be on the tables' device cpu, got meta"),
        (dict(params=torch.tensor([1, 2], dtype=torch.int32)), "params must be an int64 tensor of 2 elements"),
        (dict(params=torch.tensor([1, 2, 3])), "params must be an int64 tensor of 2 elements"),
        (dict(params=torch.tensor([1, 2], device="meta")), "params must be on the tables' device cpu, got meta"),
        (dict(params=torch.tensor([1, 2**32 + 1])), r"params\[1\], the prob threshold, must be in \[0, 2\*\*32\]"),
        (dict(params=torch.tensor([1, -1])), r"params\[1\], the prob threshold, must be in \[0, 2\*\*32\]"),
        (dict(scale=-1), "counter_scale must be >= 0, got -1"),
        (dict(shift=-2), "stream_shift must be >= 0, got -2"),
        (dict(rows=3), r"h_thresholds must have shape \[1024, 3\]"),
        (dict(target=21), r"target must be in \[0, 20\], got 21"),
    ]
    for bad, words in bad_cases:
        with pytest.raises(RuntimeError, match=f"sample_jigsaw_from_counter: {words}"):
            call(**{**good, **bad})


# ----------------------------------------------------------------------------------------------------------------
# On a GPU: the cuda backend's step does not synchronise
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not (torch.cuda.is_available() and "cuda" in mjp_fast.available_backends()), reason="needs the CUDA kernels"
)
def test_cuda_backend_step_runs_without_a_host_sync():
    plan = make_sampler_plan(
        (6, 7), 0.5, seed=2**64 - 5, prob=0.7, shared=False, min_block=2, min_aspect=0.3,
        device=torch.device("cuda"), backend="cuda",
    )  # fmt: skip
    counter = torch.tensor(2**32 - 3, device="cuda")
    plan.sample_step(3, counter, 2, 1)  # warm-up: the plan's tables and the kernel are loaded
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        first = plan.sample_step(5, counter, 2, 1)
        second = plan.sample_step(5, counter, 2, 1)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert int(counter) == 2**32 - 3 + 13
    settings = dict(seed=2**64 - 5, prob=0.7, min_block=2)
    for jigsaw, position in ((first, 2**32), (second, 2**32 + 5)):
        expected = sample_jigsaw_ref(5, (6, 7), 0.5, offset=position * 2 + 1, **settings)
        assert torch.equal(jigsaw.mask.cpu(), expected.mask) and torch.equal(jigsaw.perm.cpu(), expected.perm)


@pytest.mark.skipif(not backend_module.triton_usable(), reason="needs the triton backend")
def test_the_triton_operators_function_states_its_schema():
    # torch 2.11 (the GPU image's) makes triton_op's schema from the function's signature, whatever schema= says:
    # a *arguments function failed to import there. The signature must give SCHEMA itself.
    assert torch.library.infer_schema(dispatch._run_triton_traced, mutates_args=()) == dispatch.SCHEMA
