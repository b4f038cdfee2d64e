"""The position gradient (mjp_fast/triton/common.py): its launch plan, and its two kernels in the interpreter.

The kernels are checked against the torch reference formula (tests/triton/helpers.py) with gradients, with plans
forced to split the batch into several chunks (the interpreter's own plan has one) and with the GPU's tiles, without
and with prefix rows (class and register tokens: positions that are never masked nor moved).
"""

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from mjp_fast import Jigsaw  # noqa: E402
from mjp_fast.triton import common  # noqa: E402
from mjp_fast.triton import pos_embed as pos_embed_kernels  # noqa: E402
from mjp_fast.triton.common import launch_position_gradient, position_gradient_plan  # noqa: E402
from tests.triton.helpers import pos_embed_reference, random_jigsaw  # noqa: E402

H100_SMS = 132  # H100 and H200 SXM

TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=6e-2, rtol=2e-2),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
}

# (batch, N, D): batch 1, odd N and D, N not a multiple of the position blocks, batches that 3 chunks do not divide
SHAPES = [(1, 1, 1), (3, 7, 5), (10, 15, 24), (9, 14, 33)]

# how the plan is made: the interpreter's (one chunk), the interpreter's tiles with 3 chunks, the GPU's with 3
PLANS = ["interpreter", "3 chunks", "gpu tiles, 3 chunks"]

# (P, Q): prefix rows of the gradient, and how many of them have rows in the position table
PREFIXES = [(0, 0), (1, 1), (3, 0)]


def _plan(kind, batch, num_positions, dim, dtype, **flags):
    """The plan of ``kind`` for a gradient ``[batch, num_positions, dim]`` (``num_positions``: P + N rows)."""
    if kind == "interpreter":
        return position_gradient_plan(batch, num_positions, dim, dtype, 1, True, **flags)
    interpreting = kind == "3 chunks"
    return position_gradient_plan(batch, num_positions, dim, dtype, H100_SMS, interpreting, chunks=3, **flags)


def _jigsaw(batch, num_positions, masked, generator):
    """``masked``: "none", "some" or "all" positions; the masked ones permuted among themselves."""
    return Jigsaw(*random_jigsaw(batch, num_positions, masked, generator))


def _oracle_gradients(grad, jigsaw, dtype, prefix_count=0, prefix_positions=0):
    """(tokens, pos_embed, unk_embed[, prefix]) gradients of the torch reference in ``dtype``; grad ``[B, P + N, D]``,
    the table ``[Q + N, D]``, the prefix ``[P, D]`` (its gradient only when P > 0)."""
    batch, rows, dim = grad.shape
    num_positions = rows - prefix_count
    tokens = torch.zeros(batch, num_positions, dim, dtype=dtype, requires_grad=True)
    pos = torch.zeros(prefix_positions + num_positions, dim, dtype=dtype, requires_grad=True)
    unk = torch.zeros(dim, dtype=dtype, requires_grad=True)
    prefix = torch.zeros(prefix_count, dim, dtype=dtype, requires_grad=True) if prefix_count else None
    out = pos_embed_reference(tokens, jigsaw.perm, jigsaw.mask, pos, unk, prefix, prefix_positions)
    leaves = (tokens, pos, unk) + ((prefix,) if prefix_count else ())
    return torch.autograd.grad(out, leaves, grad.to(dtype))


def _backward(grad, jigsaw, dtypes, prefix_count=0, prefix_positions=0, **options):
    """``pos_embed_backward_launch`` with tables ``[Q + N, D]`` and prefixes ``[P, D]``; ``dtypes``: of tokens,
    pos_embed, unk_embed (and prefix: pos_embed's)."""
    _, rows, dim = grad.shape
    table = [prefix_positions + rows - prefix_count, dim]
    tokens_dtype, pos_dtype, unk_dtype = dtypes
    return pos_embed_kernels.pos_embed_backward_launch(
        grad, jigsaw.perm, jigsaw.mask, prefix_count, prefix_positions, table, [prefix_count, dim],
        tokens_dtype, pos_dtype, unk_dtype, pos_dtype, **options,
    )  # fmt: skip


# -- the plan ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_count", [0, 1], ids=["patches only", "class token"])
def test_plan_fills_a_hopper_gpu_and_keeps_the_partials_small(prefix_count):
    # mjp_pos_embed's backward at DeiT-S's sizes: the reduction that took 216 us on 42 programs; with the class
    # token's row, the gradient is 256 x (1 + 196) x 384 and the plan the same
    plan = position_gradient_plan(
        256, prefix_count + 196, 384, torch.bfloat16, H100_SMS, False, prefix_count=prefix_count,
        prefix_positions=prefix_count,
    )  # fmt: skip
    assert plan.programs >= 2 * H100_SMS
    assert plan.bytes_grad_read == 256 * (prefix_count + 196) * 384 * 2
    assert plan.bytes_tokens_write == 256 * 196 * 384 * 2  # the inverse move of the patch rows only
    assert plan.bytes_partials <= 0.1 * plan.unavoidable_bytes
    assert plan.bytes_small <= 0.05 * plan.unavoidable_bytes
    assert plan.block_d == 128  # 256-byte rows of bfloat16
    assert plan.grid == (plan.position_blocks, plan.channel_blocks, plan.chunks) == (25, 3, 8)
    assert plan.reduce_grid == (13, 6)
    assert plan.samples_per_chunk == 32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "flags",
    [dict(), dict(scatter=False, has_bias=True), dict(scatter=False, has_bias=True, has_mask=False)],
    ids=["pos_embed", "patch_embed", "patch_embed without jigsaw"],
)
@pytest.mark.parametrize("prefix_count", [0, 1], ids=["patches only", "class token"])
def test_plan_fills_the_gpu_for_both_backwards(flags, dtype, prefix_count):
    flags = dict(flags, prefix_count=prefix_count, prefix_positions=prefix_count)
    plan = position_gradient_plan(256, prefix_count + 196, 384, dtype, H100_SMS, False, **flags)
    assert plan.programs >= 2 * H100_SMS
    assert plan.bytes_partials <= 0.1 * plan.unavoidable_bytes
    assert plan.bytes_small <= 0.05 * plan.unavoidable_bytes
    assert plan.total_bytes == plan.unavoidable_bytes + plan.bytes_partials + plan.bytes_small


@pytest.mark.parametrize("batch", [0, 1, 3, 31, 32, 33, 255, 256, 1000])
@pytest.mark.parametrize("chunks", [None, 1, 3, 7])
@pytest.mark.parametrize("interpreting", [True, False])
def test_plan_chunks_cover_every_sample_once(batch, chunks, interpreting):
    plan = position_gradient_plan(batch, 196, 192, torch.bfloat16, H100_SMS, interpreting, chunks=chunks)
    assert plan.samples_per_chunk % plan.block_b == 0
    assert plan.chunks >= 1 and plan.chunks * plan.samples_per_chunk >= batch
    assert batch == 0 or (plan.chunks - 1) * plan.samples_per_chunk < batch  # no chunk without samples
    assert plan.small_rows == plan.chunks * plan.position_blocks
    assert plan.position_blocks * plan.block_n >= 196 and plan.channel_blocks * plan.block_d >= 192


def test_plan_refuses_a_prefix_that_does_not_fit():
    with pytest.raises(ValueError, match="prefix_count must be in"):
        position_gradient_plan(4, 6, 8, torch.float32, 1, True, prefix_count=7)
    with pytest.raises(ValueError, match="prefix_positions 0 or prefix_count"):
        position_gradient_plan(4, 6, 8, torch.float32, 1, True, prefix_count=2, prefix_positions=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("scatter", [False, True])
def test_plan_pipelines_the_partials_on_a_gpu_within_32_kib_of_shared_memory(dtype, scatter):
    # On a GPU the partials kernel copies the next steps' gradient tiles to shared memory (tl.range's num_stages;
    # tests/triton/compile_for_gpu.py checks the copies), as many stages as tiles fit in 32 KiB (triton 3.6 keeps
    # num_stages tiles), so that no GPU needs an opt-in: at ViT widths 3 for half precision, 2 for float32, none
    # (1) for float64; the interpreter runs the loop as written (1).
    for batch, num_positions, dim in ((256, 197, 384), (64, 50, 768), (7, 5, 33)):
        plan = position_gradient_plan(batch, num_positions, dim, dtype, H100_SMS, False, scatter=scatter)
        step_bytes = plan.block_b * plan.block_n * plan.block_d * dtype.itemsize
        assert plan.num_stages == max(1, min(3, 32 * 1024 // step_bytes))
        assert plan.num_stages == 1 or plan.num_stages * step_bytes <= 32 * 1024
        if dim >= 128:
            assert plan.num_stages == {torch.float64: 1, torch.float32: 2}.get(dtype, 3)
        assert position_gradient_plan(batch, num_positions, dim, dtype, 1, True, scatter=scatter).num_stages == 1


def test_plan_under_the_interpreter_or_on_cpu_tensors_has_one_chunk(monkeypatch):
    assert position_gradient_plan(256, 196, 384, torch.bfloat16, H100_SMS, True).chunks == 1
    monkeypatch.setattr(common, "INTERPRETING", False)
    grad = torch.empty(64, 9, 16)
    plan = common._position_plan(grad, scatter=True, has_mask=True, has_bias=False, tokens_dtype=None)
    assert plan.chunks == 1


def test_multiprocessors_are_asked_once_per_device(monkeypatch):
    queries = []

    def properties(index):
        queries.append(index)
        return type("Properties", (), {"multi_processor_count": 132})()

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    common._cuda_properties.cache_clear()
    try:
        assert [common.multiprocessors(torch.device("cuda", 0)) for _ in range(3)] == [132] * 3
        assert common.multiprocessors(torch.device("cpu")) == 1
        assert queries == [0]
    finally:
        common._cuda_properties.cache_clear()


# -- the kernels -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan_kind", PLANS)
@pytest.mark.parametrize("masked", ["none", "some", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("prefix", PREFIXES, ids=lambda p: f"P{p[0]}Q{p[1]}")
def test_pos_embed_backward_equals_the_oracle(prefix, shape, dtype, masked, plan_kind):
    prefix_count, prefix_positions = prefix
    batch, num_positions, dim = shape
    rows = prefix_count + num_positions
    generator = torch.Generator().manual_seed(batch * 1000 + dim)
    grad = torch.randn(batch, rows, dim, generator=generator).to(dtype)
    jigsaw = _jigsaw(batch, num_positions, masked, generator)
    plan = _plan(plan_kind, batch, rows, dim, dtype, prefix_count=prefix_count, prefix_positions=prefix_positions)
    grads = _backward(grad, jigsaw, (dtype,) * 3, prefix_count, prefix_positions, plan=plan)
    expected = _oracle_gradients(grad, jigsaw, dtype, prefix_count, prefix_positions)
    assert grads[3].shape == ((prefix_count, dim) if prefix_count else (0,))
    for name, got, want in zip(("tokens", "pos_embed", "unk_embed", "prefix"), grads, expected):
        assert got.dtype == dtype and got.shape == want.shape, name
    torch.testing.assert_close(grads[0], expected[0], atol=0, rtol=0)  # the inverse move: exact
    for got, want in zip(grads[1:], expected[1:]):
        torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.parametrize("plan_kind", PLANS)
@pytest.mark.parametrize("masked", ["none", "some", "all", "no mask"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("prefix", PREFIXES, ids=lambda p: f"P{p[0]}Q{p[1]}")
def test_patch_embed_position_gradients_equal_the_oracle(prefix, shape, masked, plan_kind):
    # No inverse move, a bias gradient: every patch token's gradient, the positions' and unk_embed's summed; the
    # prefix rows' (grad_prefix, and the table's first Q rows) summed over the batch, and not in the bias's.
    prefix_count, prefix_positions = prefix
    batch, num_positions, dim = shape
    rows = prefix_count + num_positions
    generator = torch.Generator().manual_seed(7)
    grad = torch.randn(batch, rows, dim, generator=generator)
    jigsaw = _jigsaw(batch, num_positions, "none" if masked == "no mask" else masked, generator)
    flags = dict(scatter=False, has_mask=masked != "no mask", has_bias=True)
    layout = dict(prefix_count=prefix_count, prefix_positions=prefix_positions)
    plan = _plan(plan_kind, batch, rows, dim, grad.dtype, **flags, **layout)
    mask = None if masked == "no mask" else jigsaw.mask
    grad_tokens, grad_pos, grad_unk, grad_bias, grad_prefix = launch_position_gradient(
        grad, mask, None, tokens_dtype=None, pos_dtype=torch.float32, unk_dtype=torch.float32,
        bias_dtype=torch.float32, prefix_dtype=torch.float32, plan=plan, **layout,
    )  # fmt: skip
    expected = _oracle_gradients(grad.double(), jigsaw, torch.float64, prefix_count, prefix_positions)
    expected_pos, expected_unk = expected[1], expected[2]
    assert grad_tokens is None
    torch.testing.assert_close(grad_pos, expected_pos.float(), **TOLERANCES[torch.float32])
    torch.testing.assert_close(grad_unk, expected_unk.float(), **TOLERANCES[torch.float32])
    expected_bias = (expected_pos[prefix_positions:].sum(0) + expected_unk).float()
    torch.testing.assert_close(grad_bias, expected_bias, **TOLERANCES[torch.float32])
    if prefix_count:
        torch.testing.assert_close(grad_prefix, expected[3].float(), **TOLERANCES[torch.float32])
    else:
        assert grad_prefix.shape == (0,)


def test_outputs_in_their_own_dtypes():
    # bfloat16 gradient (autocast), float32 table: the gradients are written in their final dtypes by the kernel
    generator = torch.Generator().manual_seed(3)
    grad = torch.randn(10, 15, 24, generator=generator).to(torch.bfloat16)
    jigsaw = _jigsaw(10, 15, "some", generator)
    plan = _plan("3 chunks", 10, 15, 24, torch.bfloat16, tokens_dtype=torch.float16)
    grads = _backward(grad, jigsaw, (torch.float16, torch.float32, torch.float64), plan=plan)
    assert [g.dtype for g in grads] == [torch.float16, torch.float32, torch.float64, torch.float32]
    _, expected_pos, expected_unk = _oracle_gradients(grad.double(), jigsaw, torch.float64)
    torch.testing.assert_close(grads[0], _oracle_gradients(grad, jigsaw, torch.float16)[0], atol=0, rtol=0)
    torch.testing.assert_close(grads[1], expected_pos.float(), **TOLERANCES[torch.float32])
    torch.testing.assert_close(grads[2], expected_unk, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("plan_kind", PLANS)
@pytest.mark.parametrize("prefix", PREFIXES, ids=lambda p: f"P{p[0]}Q{p[1]}")
def test_same_input_gives_the_same_bits(plan_kind, prefix):
    prefix_count, prefix_positions = prefix
    generator = torch.Generator().manual_seed(5)
    grad = torch.randn(9, prefix_count + 14, 33, generator=generator).to(torch.bfloat16)
    jigsaw = _jigsaw(9, 14, "some", generator)
    layout = dict(prefix_count=prefix_count, prefix_positions=prefix_positions)
    plan = _plan(plan_kind, 9, prefix_count + 14, 33, torch.bfloat16, has_bias=True, **layout)
    run = functools.partial(
        launch_position_gradient, grad, jigsaw.mask, jigsaw.perm, tokens_dtype=torch.bfloat16,
        pos_dtype=torch.bfloat16, unk_dtype=torch.bfloat16, bias_dtype=torch.bfloat16, prefix_dtype=torch.bfloat16,
        plan=plan, **layout,
    )  # fmt: skip
    for first, second in zip(run(), run()):
        assert torch.equal(first, second)


def test_empty_batch_and_no_positions_give_zeros():
    for shape in [(0, 6, 4), (3, 0, 4)]:
        grad = torch.randn(shape)
        mask, perm = torch.zeros(shape[:2], dtype=torch.bool), torch.zeros(shape[:2], dtype=torch.int64)
        grad_tokens, grad_pos, grad_unk, grad_bias, grad_prefix = launch_position_gradient(
            grad, mask, perm, tokens_dtype=grad.dtype, pos_dtype=grad.dtype, unk_dtype=grad.dtype,
            bias_dtype=grad.dtype,
        )  # fmt: skip
        assert grad_prefix is None  # not asked for
        assert grad_tokens.shape == shape and grad_pos.shape == shape[1:]
        assert torch.equal(grad_pos, torch.zeros(shape[1:]))
        assert torch.equal(grad_unk, torch.zeros(4)) and torch.equal(grad_bias, torch.zeros(4))


def test_a_plan_for_other_sizes_is_refused():
    grad = torch.randn(4, 6, 8)
    plan = position_gradient_plan(5, 6, 8, grad.dtype, 1, True)
    with pytest.raises(
        ValueError, match=r"plan: made for \[B, P \+ N, D\] = \[5, 6, 8\] with P = 0, got grad \[4, 6, 8\]"
    ):
        launch_position_gradient(
            grad, None, None, tokens_dtype=None, pos_dtype=grad.dtype, unk_dtype=grad.dtype, plan=plan
        )


# -- lean launches -----------------------------------------------------------------------------------------------


class _TorchOps(TorchDispatchMode):
    """Records every torch operator called inside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _record_launches(monkeypatch, module):
    launches = []

    def launcher(kernel, grid, traced):
        return lambda *args, **kwargs: launches.append((kernel, grid, traced))

    monkeypatch.setattr(module, "launcher", launcher)
    return launches


def test_backward_is_two_launches_and_allocations_only(monkeypatch):
    launches = _record_launches(monkeypatch, common)
    grad, mask, perm = torch.randn(10, 15, 24), torch.zeros(10, 15, dtype=torch.bool), torch.zeros(10, 15).long()
    plan = _plan("gpu tiles, 3 chunks", 10, 15, 24, grad.dtype)
    witness = torch.zeros(10, 15, dtype=torch.int32)  # what the eager forward writes (any values are safe)
    common.clear_scratch()
    with _TorchOps() as recorded:
        _backward(grad, Jigsaw(mask, perm), (grad.dtype,) * 3, plan=plan, witness=witness)
    assert launches == [
        (common._position_partials_kernel, plan.grid, False),
        (common._position_reduce_kernel, plan.reduce_grid, False),
    ]
    # no zeros fill, no sum, no cast, no copy: torch.empty for the four gradients (grad_prefix [0]) and, the first
    # time, the partials' scratch buffer
    assert recorded.ops == [torch.ops.aten.empty.memory_format] * 5
    # Without the forward's witness (the compiled operator), the tokens' gradient is zero-filled first: one memset
    # more, the launches the same; the partials reuse the scratch buffer.
    with _TorchOps() as recorded:
        _backward(grad, Jigsaw(mask, perm), (grad.dtype,) * 3, plan=plan)
    assert sorted(map(str, recorded.ops)) == ["aten.empty.memory_format"] * 4 + ["aten.zero_.default"]
    assert len(launches) == 4


def test_forward_is_one_launch_and_its_output(monkeypatch):
    launches = _record_launches(monkeypatch, pos_embed_kernels)
    tokens, pos, unk = torch.randn(2, 6, 8), torch.randn(6, 8), torch.randn(8)
    mask, perm = torch.zeros(2, 6, dtype=torch.bool), torch.arange(6).repeat(2, 1)
    with _TorchOps() as recorded:
        pos_embed_kernels.pos_embed_forward_launch(tokens, perm, mask, pos, unk)
    assert [(kernel, traced) for kernel, _, traced in launches] == [(pos_embed_kernels._forward_kernel, False)]
    assert recorded.ops == [torch.ops.aten.empty.memory_format]


def test_wrap_triton_only_when_traced(monkeypatch):
    wrapped = []
    real_wrap_triton = torch.library.wrap_triton

    def wrap_triton(kernel):
        wrapped.append(kernel)
        return real_wrap_triton(kernel)

    monkeypatch.setattr(torch.library, "wrap_triton", wrap_triton)
    # traced launches go through wrap_triton off the interpreter only (torch 2.11 refuses interpreted kernels);
    # pretend to be off it, so that the traced path shows (torch 2.14's wrap_triton accepts them)
    monkeypatch.setattr(common, "INTERPRETING", False)
    generator = torch.Generator().manual_seed(11)
    grad = torch.randn(5, 7, 9, generator=generator)
    jigsaw = _jigsaw(5, 7, "some", generator)
    layout = (0, 0, [7, 9], [0])
    arguments = (grad, jigsaw.perm, jigsaw.mask, *layout, grad.dtype, grad.dtype, grad.dtype, grad.dtype)
    eager = pos_embed_kernels.pos_embed_backward_launch(*arguments)
    assert wrapped == []
    traced = pos_embed_kernels.pos_embed_backward_launch(*arguments, traced=True)
    assert wrapped == [common._position_partials_kernel, common._position_reduce_kernel]
    for first, second in zip(eager, traced):
        assert torch.equal(first, second)
    # the operator launches through wrap_triton, with its schema (the layout, then the four dtypes)
    wrapped.clear()
    grads = pos_embed_kernels.pos_embed_backward_triton(*arguments[:8], torch.float64, torch.float16, torch.float32)
    assert wrapped == [common._position_partials_kernel, common._position_reduce_kernel]
    assert [g.dtype for g in grads] == [grad.dtype, torch.float64, torch.float16, torch.float32]


def test_forward_operator_launches_through_wrap_triton(monkeypatch):
    wrapped = []
    real_wrap_triton = torch.library.wrap_triton
    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: wrapped.append(kernel) or real_wrap_triton(kernel))
    monkeypatch.setattr(common, "INTERPRETING", False)  # see test_wrap_triton_only_when_traced
    generator = torch.Generator().manual_seed(13)
    tokens, pos, unk = (torch.randn(size, generator=generator) for size in ((3, 7, 9), (7, 9), (9,)))
    jigsaw = _jigsaw(3, 7, "some", generator)
    eager = pos_embed_kernels.pos_embed_forward_launch(tokens, jigsaw.perm, jigsaw.mask, pos, unk)
    assert wrapped == []
    operator = pos_embed_kernels.pos_embed_forward_triton(tokens, jigsaw.perm, jigsaw.mask, pos, unk, None, 0)
    assert wrapped == [pos_embed_kernels._forward_kernel]
    assert torch.equal(eager, operator)
    assert torch.equal(eager, pos_embed_reference(tokens, jigsaw.perm, jigsaw.mask, pos, unk))
