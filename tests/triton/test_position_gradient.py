"""The position gradient (mjp_fast/triton/patch_embed.py): its launch plan, and its two kernels in the interpreter.

The kernels are checked against the oracle ``mjp_pos_embed_ref`` with gradients, with plans forced to split the
batch into several chunks (the interpreter's own plan has one) and with the GPU's tiles.
"""

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from mjp_fast import Jigsaw  # noqa: E402
from mjp_fast.ops.pos_embed import mjp_pos_embed_ref  # noqa: E402
from mjp_fast.triton import patch_embed  # noqa: E402
from mjp_fast.triton import pos_embed as pos_embed_kernels  # noqa: E402
from mjp_fast.triton.patch_embed import launch_position_gradient, position_gradient_plan  # noqa: E402

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


def _plan(kind, batch, num_positions, dim, dtype, **flags):
    if kind == "interpreter":
        return position_gradient_plan(batch, num_positions, dim, dtype, 1, True, **flags)
    interpreting = kind == "3 chunks"
    return position_gradient_plan(batch, num_positions, dim, dtype, H100_SMS, interpreting, chunks=3, **flags)


def _jigsaw(batch, num_positions, masked, generator):
    """``masked``: "none", "some" or "all" positions; the masked ones permuted among themselves."""
    if masked == "some":
        mask = torch.rand(batch, num_positions, generator=generator) < 0.5
    else:
        mask = torch.full((batch, num_positions), masked == "all")
    perm = torch.arange(num_positions).repeat(batch, 1)
    for sample in range(batch):
        where = mask[sample].nonzero().flatten()
        perm[sample, where] = where[torch.randperm(len(where), generator=generator)]
    return Jigsaw(mask, perm)


def _oracle_gradients(grad, jigsaw, dtype):
    """(tokens, pos_embed, unk_embed) gradients of ``mjp_pos_embed_ref`` in ``dtype``."""
    batch, num_positions, dim = grad.shape
    tokens = torch.zeros(batch, num_positions, dim, dtype=dtype, requires_grad=True)
    pos = torch.zeros(num_positions, dim, dtype=dtype, requires_grad=True)
    unk = torch.zeros(dim, dtype=dtype, requires_grad=True)
    out = mjp_pos_embed_ref(tokens, pos, unk, jigsaw)
    return torch.autograd.grad(out, (tokens, pos, unk), grad.to(dtype))


# -- the plan ----------------------------------------------------------------------------------------------------


def test_plan_fills_a_hopper_gpu_and_keeps_the_partials_small():
    # mjp_pos_embed's backward at DeiT-S's sizes: the reduction that took 216 us on 42 programs
    plan = position_gradient_plan(256, 196, 384, torch.bfloat16, H100_SMS, False)
    assert plan.programs >= 2 * H100_SMS
    assert plan.bytes_grad_read == plan.bytes_tokens_write == 256 * 196 * 384 * 2
    assert plan.bytes_partials <= 0.1 * plan.unavoidable_bytes
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
def test_plan_fills_the_gpu_for_both_backwards(flags, dtype):
    plan = position_gradient_plan(256, 196, 384, dtype, H100_SMS, False, **flags)
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


def test_plan_under_the_interpreter_or_on_cpu_tensors_has_one_chunk(monkeypatch):
    assert position_gradient_plan(256, 196, 384, torch.bfloat16, H100_SMS, True).chunks == 1
    monkeypatch.setattr(patch_embed, "_interpreting", lambda: False)
    grad = torch.empty(64, 9, 16)
    plan = patch_embed._position_plan(grad, scatter=True, has_mask=True, has_bias=False, tokens_dtype=None)
    assert plan.chunks == 1


def test_multiprocessors_are_asked_once_per_device(monkeypatch):
    queries = []

    def properties(index):
        queries.append(index)
        return type("Properties", (), {"multi_processor_count": 132})()

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    patch_embed._cuda_multiprocessors.cache_clear()
    try:
        assert [patch_embed._multiprocessors(torch.device("cuda", 0)) for _ in range(3)] == [132] * 3
        assert patch_embed._multiprocessors(torch.device("cpu")) == 1
        assert queries == [0]
    finally:
        patch_embed._cuda_multiprocessors.cache_clear()


# -- the kernels -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan_kind", PLANS)
@pytest.mark.parametrize("masked", ["none", "some", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_pos_embed_backward_equals_the_oracle(shape, dtype, masked, plan_kind):
    batch, num_positions, dim = shape
    generator = torch.Generator().manual_seed(batch * 1000 + dim)
    grad = torch.randn(shape, generator=generator).to(dtype)
    jigsaw = _jigsaw(batch, num_positions, masked, generator)
    plan = _plan(plan_kind, *shape, dtype)
    grads = pos_embed_kernels.pos_embed_backward_launch(grad, jigsaw.perm, jigsaw.mask, dtype, dtype, dtype, plan=plan)
    expected = _oracle_gradients(grad, jigsaw, dtype)
    for name, got, want in zip(("tokens", "pos_embed", "unk_embed"), grads, expected):
        assert got.dtype == dtype and got.shape == want.shape, name
    torch.testing.assert_close(grads[0], expected[0], atol=0, rtol=0)  # the inverse move: exact
    torch.testing.assert_close(grads[1], expected[1], **TOLERANCES[dtype])
    torch.testing.assert_close(grads[2], expected[2], **TOLERANCES[dtype])


@pytest.mark.parametrize("plan_kind", PLANS)
@pytest.mark.parametrize("masked", ["none", "some", "all", "no mask"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_patch_embed_position_gradients_equal_the_oracle(shape, masked, plan_kind):
    # No inverse move, a bias gradient: every token's gradient, the positions' and unk_embed's summed.
    batch, num_positions, dim = shape
    generator = torch.Generator().manual_seed(7)
    grad = torch.randn(shape, generator=generator)
    jigsaw = _jigsaw(batch, num_positions, "none" if masked == "no mask" else masked, generator)
    flags = dict(scatter=False, has_mask=masked != "no mask", has_bias=True)
    plan = _plan(plan_kind, *shape, grad.dtype, **flags)
    mask = None if masked == "no mask" else jigsaw.mask
    grad_tokens, grad_pos, grad_unk, grad_bias = launch_position_gradient(
        grad, mask, None, tokens_dtype=None, pos_dtype=torch.float32, unk_dtype=torch.float32,
        bias_dtype=torch.float32, plan=plan,
    )  # fmt: skip
    _, expected_pos, expected_unk = _oracle_gradients(grad.double(), jigsaw, torch.float64)
    assert grad_tokens is None
    torch.testing.assert_close(grad_pos, expected_pos.float(), **TOLERANCES[torch.float32])
    torch.testing.assert_close(grad_unk, expected_unk.float(), **TOLERANCES[torch.float32])
    expected_bias = (expected_pos.sum(0) + expected_unk).float()
    torch.testing.assert_close(grad_bias, expected_bias, **TOLERANCES[torch.float32])


def test_outputs_in_their_own_dtypes():
    # bfloat16 gradient (autocast), float32 table: the gradients are written in their final dtypes by the kernel
    generator = torch.Generator().manual_seed(3)
    grad = torch.randn(10, 15, 24, generator=generator).to(torch.bfloat16)
    jigsaw = _jigsaw(10, 15, "some", generator)
    plan = _plan("3 chunks", 10, 15, 24, torch.bfloat16, tokens_dtype=torch.float16)
    grads = pos_embed_kernels.pos_embed_backward_launch(
        grad, jigsaw.perm, jigsaw.mask, torch.float16, torch.float32, torch.float64, plan=plan
    )
    assert [g.dtype for g in grads] == [torch.float16, torch.float32, torch.float64]
    _, expected_pos, expected_unk = _oracle_gradients(grad.double(), jigsaw, torch.float64)
    torch.testing.assert_close(grads[0], _oracle_gradients(grad, jigsaw, torch.float16)[0], atol=0, rtol=0)
    torch.testing.assert_close(grads[1], expected_pos.float(), **TOLERANCES[torch.float32])
    torch.testing.assert_close(grads[2], expected_unk, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("plan_kind", PLANS)
def test_same_input_gives_the_same_bits(plan_kind):
    generator = torch.Generator().manual_seed(5)
    grad = torch.randn(9, 14, 33, generator=generator).to(torch.bfloat16)
    jigsaw = _jigsaw(9, 14, "some", generator)
    plan = _plan(plan_kind, 9, 14, 33, torch.bfloat16, has_bias=True)
    run = functools.partial(
        launch_position_gradient, grad, jigsaw.mask, jigsaw.perm, tokens_dtype=torch.bfloat16,
        pos_dtype=torch.bfloat16, unk_dtype=torch.bfloat16, bias_dtype=torch.bfloat16, plan=plan,
    )  # fmt: skip
    for first, second in zip(run(), run()):
        assert torch.equal(first, second)


def test_empty_batch_and_no_positions_give_zeros():
    for shape in [(0, 6, 4), (3, 0, 4)]:
        grad = torch.randn(shape)
        mask, perm = torch.zeros(shape[:2], dtype=torch.bool), torch.zeros(shape[:2], dtype=torch.int64)
        grad_tokens, grad_pos, grad_unk, grad_bias = launch_position_gradient(
            grad, mask, perm, tokens_dtype=grad.dtype, pos_dtype=grad.dtype, unk_dtype=grad.dtype,
            bias_dtype=grad.dtype,
        )  # fmt: skip
        assert grad_tokens.shape == shape and grad_pos.shape == shape[1:]
        assert torch.equal(grad_pos, torch.zeros(shape[1:]))
        assert torch.equal(grad_unk, torch.zeros(4)) and torch.equal(grad_bias, torch.zeros(4))


def test_a_plan_for_other_sizes_is_refused():
    grad = torch.randn(4, 6, 8)
    plan = position_gradient_plan(5, 6, 8, grad.dtype, 1, True)
    with pytest.raises(ValueError, match=r"plan: made for \[B, N, D\] = \[5, 6, 8\], got grad \[4, 6, 8\]"):
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

    monkeypatch.setattr(module, "_launcher", launcher)
    return launches


def test_backward_is_two_launches_and_allocations_only(monkeypatch):
    launches = _record_launches(monkeypatch, patch_embed)
    grad, mask, perm = torch.randn(10, 15, 24), torch.zeros(10, 15, dtype=torch.bool), torch.zeros(10, 15).long()
    plan = _plan("gpu tiles, 3 chunks", 10, 15, 24, grad.dtype)
    with _TorchOps() as recorded:
        pos_embed_kernels.pos_embed_backward_launch(grad, perm, mask, grad.dtype, grad.dtype, grad.dtype, plan=plan)
    assert launches == [
        (patch_embed._position_partials_kernel, plan.grid, False),
        (patch_embed._position_reduce_kernel, plan.reduce_grid, False),
    ]
    # no zeros fill, no sum, no cast, no copy: torch.empty for the three gradients and the partials
    assert recorded.ops == [torch.ops.aten.empty.memory_format] * 4


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
    generator = torch.Generator().manual_seed(11)
    grad = torch.randn(5, 7, 9, generator=generator)
    jigsaw = _jigsaw(5, 7, "some", generator)
    arguments = (grad, jigsaw.perm, jigsaw.mask, grad.dtype, grad.dtype, grad.dtype)
    eager = pos_embed_kernels.pos_embed_backward_launch(*arguments)
    assert wrapped == []
    traced = pos_embed_kernels.pos_embed_backward_launch(*arguments, traced=True)
    assert wrapped == [patch_embed._position_partials_kernel, patch_embed._position_reduce_kernel]
    for first, second in zip(eager, traced):
        assert torch.equal(first, second)
    # the operator launches through wrap_triton, with the new schema (pos and unk dtypes)
    wrapped.clear()
    grads = pos_embed_kernels.pos_embed_backward_triton(*arguments[:4], torch.float64, torch.float16)
    assert wrapped == [patch_embed._position_partials_kernel, patch_embed._position_reduce_kernel]
    assert [g.dtype for g in grads] == [grad.dtype, torch.float64, torch.float16]


def test_forward_operator_launches_through_wrap_triton(monkeypatch):
    wrapped = []
    real_wrap_triton = torch.library.wrap_triton
    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: wrapped.append(kernel) or real_wrap_triton(kernel))
    generator = torch.Generator().manual_seed(13)
    tokens, pos, unk = (torch.randn(size, generator=generator) for size in ((3, 7, 9), (7, 9), (9,)))
    jigsaw = _jigsaw(3, 7, "some", generator)
    eager = pos_embed_kernels.pos_embed_forward_launch(tokens, jigsaw.perm, jigsaw.mask, pos, unk)
    assert wrapped == []
    operator = pos_embed_kernels.pos_embed_forward_triton(tokens, jigsaw.perm, jigsaw.mask, pos, unk)
    assert wrapped == [pos_embed_kernels._forward_kernel]
    assert torch.equal(eager, operator)
    assert torch.equal(eager, mjp_pos_embed_ref(tokens, pos, unk, jigsaw))
