"""Prefix rows (class and register tokens) in the Triton kernels of mjp_pos_embed and the patch embedding.

The kernels write the whole ``[B, P + N, D]`` token sequence, read the model's full position table ``[Q + N, D]`` in
place and return gradients in the shapes and dtypes of their inputs. Checked here against the torch formulas of
tests/triton/helpers.py (a Conv2d for the patch embedding), in the interpreter, with tiny shapes.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from mjp_fast.triton import common  # noqa: E402
from mjp_fast.triton import patch_embed as patch_kernels  # noqa: E402
from mjp_fast.triton import pos_embed as pos_kernels  # noqa: E402
from tests.triton.helpers import (  # noqa: E402
    PREFIXES,
    patch_embed_reference,
    pos_embed_reference,
    random_jigsaw,
    rounded_like_the_kernels,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (batch, prefix as [1, P, D], table as [1, Q + N, D]): batch 1 and 3, both shapes of each
LAYOUTS = [(3, True, True), (1, False, False), (1, True, False), (3, False, True)]


def _layout_id(layout):
    batch, batched_prefix, batched_table = layout
    return (
        f"B{batch}-prefix{'[1,P,D]' if batched_prefix else '[P,D]'}-table{'[1,Q+N,D]' if batched_table else '[Q+N,D]'}"
    )


def _prefix_id(prefix):
    return f"P{prefix[0]}Q{prefix[1]}"


def _tables(prefix, layout, num_positions, dim, dtype, generator):
    """``(pos_embed, prefix)`` in the layout's shapes (prefix None when P = 0)."""
    prefix_count, prefix_positions = prefix
    _, batched_prefix, batched_table = layout
    pos = torch.randn(prefix_positions + num_positions, dim, generator=generator).to(dtype)
    tokens = torch.randn(prefix_count, dim, generator=generator).to(dtype) if prefix_count else None
    if batched_table:
        pos = pos[None]
    if tokens is not None and batched_prefix:
        tokens = tokens[None]
    return pos, tokens


def _close(got, want, dtype):
    """``got`` within one rounding to ``dtype`` of the float64 truth ``want`` (and the float32 sums' error)."""
    assert got.dtype == dtype and got.shape == want.shape
    eps = torch.finfo(dtype).eps
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want, atol=max(eps, 1e-6) * scale, rtol=max(eps, 1e-6))


# -- mjp_pos_embed -----------------------------------------------------------------------------------------------

POS_SHAPE = (7, 19)  # (N, D): odd; D > 16 (two channel blocks in the interpreter), 3 x 7 rows > 16 (two row blocks)


@pytest.mark.parametrize("masked", ["none", "some", "all"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("prefix", PREFIXES, ids=_prefix_id)
def test_pos_embed_forward_and_backward(prefix, layout, dtype, masked):
    prefix_count, prefix_positions = prefix
    batch = layout[0]
    num_positions, dim = POS_SHAPE
    generator = torch.Generator().manual_seed(prefix_count * 100 + batch)
    tokens = torch.randn(batch, num_positions, dim, generator=generator).to(dtype)
    unk = torch.randn(dim, generator=generator).to(dtype)
    pos, prefix_tokens = _tables(prefix, layout, num_positions, dim, dtype, generator)
    mask, perm = random_jigsaw(batch, num_positions, masked, generator)

    out = pos_kernels.pos_embed_forward_launch(tokens, perm, mask, pos, unk, prefix_tokens, prefix_positions)
    # every sum in float32, rounded once: the very bits of the float32 formula, rounded
    upcast = [tensor.float() if tensor is not None else None for tensor in (tokens, pos, unk, prefix_tokens)]
    expected = pos_embed_reference(upcast[0], perm, mask, upcast[1], upcast[2], upcast[3], prefix_positions)
    assert out.shape == (batch, prefix_count + num_positions, dim) and out.dtype == dtype
    torch.testing.assert_close(out, rounded_like_the_kernels(expected, dtype), atol=0, rtol=0)
    if dtype != torch.bfloat16:  # (the interpreter truncates to bfloat16: the GPU's rounding is torch's)
        expected = pos_embed_reference(tokens, perm, mask, pos, unk, prefix_tokens, prefix_positions)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)  # torch's own adds in the dtype

    grad = torch.randn(out.shape, generator=generator).to(dtype)
    prefix_shape = list(prefix_tokens.shape) if prefix_tokens is not None else [0]
    grads = pos_kernels.pos_embed_backward_launch(
        grad, perm, mask, prefix_count, prefix_positions, list(pos.shape), prefix_shape, dtype, dtype, dtype, dtype
    )
    inputs = [tokens, pos, unk] + ([prefix_tokens] if prefix_count else [])
    leaves = [tensor.double().requires_grad_() for tensor in inputs]
    prefix_leaf = leaves[3] if prefix_count else None
    truth = pos_embed_reference(leaves[0], perm, mask, leaves[1], leaves[2], prefix_leaf, prefix_positions)
    expected_grads = torch.autograd.grad(truth, leaves, grad.double())
    torch.testing.assert_close(grads[0], expected_grads[0].to(dtype), atol=0, rtol=0)  # the inverse move: exact
    for got, want in zip(grads[1:3], expected_grads[1:3]):
        _close(got, want, dtype)  # in the input's shape: [1, Q + N, D] or [Q + N, D]; [D]
    if prefix_count:
        _close(grads[3], expected_grads[3], dtype)  # [1, P, D] or [P, D]
    else:
        assert grads[3].shape == (0,) and grads[3].dtype == dtype


def test_pos_embed_mixed_dtypes():
    # autocast: bfloat16 tokens; a float32 table, unk_embed and class token: a float32 output, float32 gradients
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randn(3, 7, 19, generator=generator).to(torch.bfloat16)
    pos, unk, prefix = torch.randn(1, 8, 19, generator=generator), torch.randn(19), torch.randn(1, 1, 19)
    mask, perm = random_jigsaw(3, 7, "some", generator)
    out = pos_kernels.pos_embed_forward_launch(tokens, perm, mask, pos, unk, prefix, 1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, pos_embed_reference(tokens, perm, mask, pos, unk, prefix, 1), atol=0, rtol=0)
    grads = pos_kernels.pos_embed_backward_launch(
        torch.ones_like(out), perm, mask, 1, 1, [1, 8, 19], [1, 1, 19], torch.bfloat16, torch.float32,
        torch.float32, torch.float32,
    )  # fmt: skip
    assert [(g.dtype, tuple(g.shape)) for g in grads] == [
        (torch.bfloat16, (3, 7, 19)),
        (torch.float32, (1, 8, 19)),
        (torch.float32, (19,)),
        (torch.float32, (1, 1, 19)),
    ]
    assert torch.equal(grads[3], torch.full((1, 1, 19), 3.0))  # the class token's gradient: summed over the batch
    assert torch.equal(grads[1][0, 0], torch.full((19,), 3.0))  # and its table row's


# -- the patch embedding -----------------------------------------------------------------------------------------

# images [B, 3, 2*3, 2*3] in patches of 2: N = 9 positions (odd), K = 12; D = 5 (odd)
GRID, PATCH, CHANNELS, DIM = (3, 3), 2, 3, 5


def _patch_inputs(batch, dtype, generator, masked):
    images = torch.randn(batch, CHANNELS, GRID[0] * PATCH, GRID[1] * PATCH, generator=generator).to(dtype)
    weight = (torch.randn(DIM, CHANNELS, PATCH, PATCH, generator=generator) / 3).to(dtype)
    bias = torch.randn(DIM, generator=generator).to(dtype)
    unk = torch.randn(DIM, generator=generator).to(dtype)
    num_positions = GRID[0] * GRID[1]
    if masked == "no jigsaw":
        return images, weight, bias, unk, None, None
    mask, perm = random_jigsaw(batch, num_positions, masked, generator)
    return images, weight, bias, unk, mask, perm


@pytest.mark.parametrize("masked", ["none", "some", "all", "no jigsaw"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=_layout_id)
@pytest.mark.parametrize("prefix", PREFIXES, ids=_prefix_id)
def test_patch_embed_forward_and_backward(prefix, layout, dtype, masked):
    prefix_count, prefix_positions = prefix
    batch = layout[0]
    generator = torch.Generator().manual_seed(prefix_count * 10 + batch)
    images, weight, bias, unk, mask, perm = _patch_inputs(batch, dtype, generator, masked)
    num_positions = GRID[0] * GRID[1]
    pos, prefix_tokens = _tables(prefix, layout, num_positions, DIM, dtype, generator)
    unk = unk if mask is not None else None

    out = patch_kernels.patch_embed_forward_launch(
        images, weight, bias, pos, unk, perm, mask, prefix_tokens, prefix_positions
    )
    inputs = [images, weight, bias, pos, unk, prefix_tokens]
    leaves = [tensor.double().requires_grad_() if tensor is not None else None for tensor in inputs]
    truth = patch_embed_reference(*leaves[:5], perm, mask, leaves[5], prefix_positions)
    assert out.shape == (batch, prefix_count + num_positions, DIM) and out.dtype == dtype
    _close(out, truth.detach(), dtype)
    if prefix_count:  # the prefix rows: no GEMM, one rounding of prefix (+ pos) computed in float32
        expected_rows = prefix_tokens.reshape(prefix_count, DIM).float()
        if prefix_positions:
            expected_rows = expected_rows + pos.reshape(-1, DIM)[:prefix_positions].float()
        expected_rows = rounded_like_the_kernels(expected_rows, dtype)
        assert torch.equal(out[:, :prefix_count], expected_rows.expand(batch, -1, -1))

    grad = torch.randn(out.shape, generator=generator).to(dtype)
    prefix_shape = list(prefix_tokens.shape) if prefix_tokens is not None else [0]
    needs = [True, True, True, True, mask is not None, prefix_count > 0]
    grads = patch_kernels.patch_embed_backward_launch(
        grad, images, weight, perm, mask, *needs, prefix_count, prefix_positions, list(pos.shape), prefix_shape
    )
    present = [leaf for leaf in leaves if leaf is not None]
    expected = iter(torch.autograd.grad(truth, present, grad.double()))
    for name, got, leaf in zip(("images", "weight", "bias", "pos", "unk", "prefix"), grads, leaves):
        if leaf is None:
            assert got is None, name  # not asked for: an eager launch allocates nothing
            continue
        want = next(expected)
        # the GEMM gradients sum over K or the tokens in float32: a few of its ulps at these sizes
        eps = max(torch.finfo(dtype).eps, 1e-6)
        scale = max(want.abs().max().item(), 1.0)
        assert got.dtype == dtype and got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want, atol=4 * eps * scale, rtol=2 * eps, msg=name)


def test_patch_embed_backward_returns_only_what_is_asked():
    generator = torch.Generator().manual_seed(4)
    images, weight, bias, unk, mask, perm = _patch_inputs(3, torch.float32, generator, "some")
    grad = torch.randn(3, 2 + 9, DIM, generator=generator)
    pos_shape, prefix_shape = [1, 2 + 9, DIM], [1, 2, DIM]
    only_prefix = patch_kernels.patch_embed_backward_launch(
        grad, images, weight, perm, mask, False, False, False, False, False, True, 2, 2, pos_shape, prefix_shape
    )
    assert only_prefix[:5] == [None] * 5 and only_prefix[5].shape == (1, 2, DIM)
    assert torch.equal(only_prefix[5], grad[:, :2].sum(0, keepdim=True))
    no_prefix = patch_kernels.patch_embed_backward_launch(
        grad, images, weight, perm, mask, False, False, True, True, True, False, 2, 2, pos_shape, prefix_shape
    )
    assert no_prefix[:2] == [None, None] and no_prefix[5] is None
    assert [tuple(g.shape) for g in no_prefix[2:5]] == [(DIM,), tuple(pos_shape), (DIM,)]
    torch.testing.assert_close(no_prefix[3][0, :2], only_prefix[5][0], atol=0, rtol=0)  # the prefix rows' table rows
    # the bias: the patch rows' gradient only
    torch.testing.assert_close(no_prefix[2], grad[:, 2:].sum((0, 1)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("masked", ["some", "no jigsaw"])
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16], ids=str)
def test_compute_dtype_rounds_in_the_loads_what_autocast_casts_before(compute, masked):
    """Autocast's step (``compute_dtype``): the float32 images and weight taken as they are, each GEMM tile rounded
    to ``compute`` as it is loaded. The forward equals the launch on the two cast first (what autocast gave the op
    before), bit for bit: the same rounded products, summed in the same order. (The bias is the epilogue's, added in
    float32 from its own dtype either way.) The backward rounds the float32 gradient too, as timm's convolution gets
    it, and returns each gradient in its input's dtype (float32: no cast after): within float32 sums of the float64
    truth of the rounded operands, which the unrounded ones miss by about a rounding of ``compute``."""
    generator = torch.Generator().manual_seed(8)
    images, weight, bias, unk, mask, perm = _patch_inputs(3, torch.float32, generator, masked)
    unk = unk if mask is not None else None
    pos, prefix = torch.randn(1, 1 + 9, DIM, generator=generator), torch.randn(1, 1, DIM, generator=generator)
    tables = (bias, pos, unk, perm, mask, prefix, 1, torch.float32)
    out = patch_kernels.patch_embed_forward_launch(images, weight, *tables, compute)
    assert out.dtype == torch.float32
    cast = [tensor.to(compute) for tensor in (images, weight)]
    assert torch.equal(out, patch_kernels.patch_embed_forward_launch(*cast, *tables))

    grad = torch.randn(out.shape, generator=generator)
    layout = (1, 1, list(pos.shape), list(prefix.shape), pos.dtype, unk.dtype if unk is not None else None, pos.dtype)
    needs = (True, True, True, True, unk is not None, True)
    grads = patch_kernels.patch_embed_backward_launch(grad, images, weight, perm, mask, *needs, *layout, compute)
    names = ("images", "weight", "bias", "pos", "unk", "prefix")
    for rounded in (True, False):
        leaves = {
            name: (tensor.to(compute) if rounded and name in ("images", "weight") else tensor).double().requires_grad_()
            for name, tensor in zip(names, (images, weight, bias, pos, unk, prefix))
            if tensor is not None
        }
        truth = patch_embed_reference(
            leaves["images"], leaves["weight"], leaves["bias"], leaves["pos"], leaves.get("unk"), perm, mask,
            leaves["prefix"], 1,
        )  # fmt: skip
        # The convolution's gradients from the output's gradient rounded to compute (as timm's convolution gets it
        # under autocast), the position terms' from the float32 one.
        conv_grad = grad.to(compute).double() if rounded else grad.double()
        wanted = dict(zip(("images", "weight"), torch.autograd.grad(truth, [leaves["images"], leaves["weight"]],
                                                                    conv_grad, retain_graph=True)))  # fmt: skip
        others = [name for name in leaves if name not in wanted]
        wanted.update(zip(others, torch.autograd.grad(truth, [leaves[name] for name in others], grad.double())))
        for name, got in zip(names, grads, strict=True):
            if name not in wanted:
                assert got is None, name
                continue
            want = wanted[name]
            assert got.dtype == torch.float32, name
            close = torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * max(want.abs().max().item(), 1.0))
            # the rounding reaches the convolution's operands alone: the others match the unrounded truth as well
            assert close == (rounded or name not in ("images", "weight")), (name, rounded)


def test_patch_embed_mixed_dtypes_multiply_in_float32():
    # bfloat16 images, a float32 weight (UPCAST: _dot multiplies both in float32)
    generator = torch.Generator().manual_seed(6)
    images, weight, bias, unk, mask, perm = _patch_inputs(3, torch.float32, generator, "some")
    images = images.to(torch.bfloat16)
    pos, prefix = torch.randn(1, 1 + 9, DIM, generator=generator), torch.randn(1, 1, DIM, generator=generator)
    out = patch_kernels.patch_embed_forward_launch(images, weight, bias, pos, unk, perm, mask, prefix, 1)
    truth = patch_embed_reference(images.double(), weight.double(), bias.double(), pos.double(), unk.double(), perm,
                                  mask, prefix.double(), 1)  # fmt: skip
    _close(out, truth, torch.bfloat16)


# -- both: determinism, launches, operators, errors -------------------------------------------------------------


def test_same_input_gives_the_same_bits():
    generator = torch.Generator().manual_seed(8)
    images, weight, bias, unk, mask, perm = _patch_inputs(3, torch.bfloat16, generator, "some")
    pos, prefix = _tables((3, 3), LAYOUTS[0], 9, DIM, torch.bfloat16, generator)
    forward = functools.partial(
        patch_kernels.patch_embed_forward_launch, images, weight, bias, pos, unk, perm, mask, prefix, 3
    )
    assert torch.equal(forward(), forward())
    grad = torch.randn(3, 12, DIM, generator=generator).to(torch.bfloat16)
    backward = functools.partial(
        patch_kernels.patch_embed_backward_launch, grad, images, weight, perm, mask, *[True] * 6, 3, 3,
        list(pos.shape), list(prefix.shape),
    )  # fmt: skip
    for first, second in zip(backward(), backward()):
        assert torch.equal(first, second)
    pos_backward = functools.partial(
        pos_kernels.pos_embed_backward_launch, grad, perm, mask, 3, 3, list(pos.shape), list(prefix.shape),
        *[torch.bfloat16] * 4,
    )  # fmt: skip
    for first, second in zip(pos_backward(), pos_backward()):
        assert torch.equal(first, second)


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


def test_pos_embed_with_prefix_is_one_launch_forward_two_backward(monkeypatch):
    # No cat, no slices, no sum: the output and the gradients come from torch.empty, filled by the kernels.
    pos_launches = _record_launches(monkeypatch, pos_kernels)
    position_launches = _record_launches(monkeypatch, common)
    tokens, pos, unk, prefix = torch.randn(2, 6, 8), torch.randn(1, 7, 8), torch.randn(8), torch.randn(1, 1, 8)
    mask, perm = torch.zeros(2, 6, dtype=torch.bool), torch.arange(6).repeat(2, 1)
    witness = torch.empty(2, 6, dtype=torch.int32)  # as the eager autograd node passes it
    with _TorchOps() as recorded:
        pos_kernels.pos_embed_forward_launch(tokens, perm, mask, pos, unk, prefix, 1, witness=witness)
        pos_kernels.pos_embed_backward_launch(
            torch.randn(2, 7, 8), perm, mask, 1, 1, [1, 7, 8], [1, 1, 8], *[torch.float32] * 4, witness=witness
        )
    assert [kernel for kernel, _, _ in pos_launches] == [pos_kernels._forward_kernel]
    assert pos_launches[0][1] == (2, 1)  # 12 patch rows, then 2 prefix rows: one program each in the interpreter
    assert [kernel for kernel, _, _ in position_launches] == [
        common._position_partials_kernel,
        common._position_reduce_kernel,
    ]
    assert set(recorded.ops) <= {torch.ops.aten.empty.memory_format, torch.ops.aten.randn.default}


@pytest.mark.parametrize("prefix", [(0, 0), (1, 1), (3, 0)], ids=_prefix_id)
def test_pos_embed_operators_opcheck(prefix):
    prefix_count, prefix_positions = prefix
    generator = torch.Generator().manual_seed(2)
    tokens, unk = torch.randn(3, 7, 9, generator=generator), torch.randn(9, generator=generator)
    pos, prefix_tokens = _tables(prefix, LAYOUTS[0], 7, 9, torch.float32, generator)
    mask, perm = random_jigsaw(3, 7, "some", generator)
    forward_args = (tokens, perm, mask, pos, unk, prefix_tokens, prefix_positions)
    torch.library.opcheck(pos_kernels.pos_embed_forward_triton, forward_args)
    out = pos_kernels.pos_embed_forward_triton(*forward_args)
    assert torch.equal(out, pos_kernels.pos_embed_forward_launch(*forward_args))
    prefix_shape = list(prefix_tokens.shape) if prefix_tokens is not None else [0]
    backward_args = (torch.randn_like(out), perm, mask, prefix_count, prefix_positions, list(pos.shape), prefix_shape)
    dtypes = (torch.float32, torch.float32, torch.float32, torch.float32)
    torch.library.opcheck(pos_kernels.pos_embed_backward_triton, (*backward_args, *dtypes))
    assert str(torch.ops.mjp_fast.pos_embed_triton.default._schema) == (
        "mjp_fast::pos_embed_triton(Tensor tokens, Tensor perm, Tensor mask, Tensor pos_embed, Tensor unk_embed, "
        "Tensor? prefix, SymInt prefix_positions) -> Tensor"
    )


@pytest.mark.parametrize("prefix", [(0, 0), (1, 1), (3, 0)], ids=_prefix_id)
def test_patch_embed_operators_opcheck(prefix):
    prefix_count, prefix_positions = prefix
    generator = torch.Generator().manual_seed(3)
    images, weight, bias, unk, mask, perm = _patch_inputs(3, torch.float32, generator, "some")
    pos, prefix_tokens = _tables(prefix, LAYOUTS[0], 9, DIM, torch.float32, generator)
    forward_args = (images, weight, bias, pos, unk, perm, mask, prefix_tokens, prefix_positions)
    torch.library.opcheck(patch_kernels.patch_embed_forward_triton, forward_args)
    prefix_shape = list(prefix_tokens.shape) if prefix_tokens is not None else [0]
    grad = torch.randn(3, prefix_count + 9, DIM, generator=generator)
    for needs in ([True] * 5 + [prefix_count > 0], [False, False, True, False, True, True]):
        backward_args = (grad, images, weight, perm, mask, *needs, prefix_count, prefix_positions, list(pos.shape),
                         prefix_shape)  # fmt: skip
        torch.library.opcheck(patch_kernels.patch_embed_backward_triton, backward_args)
        # a perm known to be a permutation: the weight gradient through its inverse, written by the operator's pass
        torch.library.opcheck(patch_kernels.patch_embed_backward_triton, backward_args, {"permutation": True})


def test_schemas():
    schemas = {
        name: str(getattr(torch.ops.mjp_fast, name).default._schema)
        for name in ("pos_embed_triton_backward", "patch_embed_triton", "patch_embed_triton_backward")
    }
    assert schemas["pos_embed_triton_backward"] == (
        "mjp_fast::pos_embed_triton_backward(Tensor grad_out, Tensor perm, Tensor mask, SymInt prefix_count, "
        "SymInt prefix_positions, SymInt[] pos_shape, SymInt[] prefix_shape, ScalarType tokens_dtype, "
        "ScalarType pos_dtype, ScalarType unk_dtype, ScalarType prefix_dtype) -> Tensor[]"
    )
    assert schemas["patch_embed_triton"].endswith(
        "Tensor? mask, Tensor? prefix, SymInt prefix_positions, ScalarType? out_dtype=None, "
        "ScalarType? compute_dtype=None) -> Tensor"
    )
    assert schemas["patch_embed_triton_backward"].endswith(
        "bool need_unk, bool need_prefix, SymInt prefix_count, SymInt prefix_positions, SymInt[] pos_shape, "
        "SymInt[] prefix_shape, ScalarType? pos_dtype=None, ScalarType? unk_dtype=None, "
        "ScalarType? prefix_dtype=None, ScalarType? compute_dtype=None, bool permutation=False) -> Tensor[]"
    )


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(prefix_positions=2), "prefix_positions must be 0 or the prefix count P = 1, got 2"),
        (dict(pos=torch.zeros(1, 7, 8)), "pos_embed must be the full table [Q + N, D] = [8, 8] (or [1, Q + N, D])"),
        (dict(pos=torch.zeros(2, 8, 8)), "got shape [2, 8, 8]"),
        (dict(prefix=torch.zeros(1, 1, 5)), "prefix must be [P, D] or [1, P, D] with D = 8, got shape [1, 1, 5]"),
        (dict(prefix=torch.zeros(8, 2).T), "prefix must be contiguous"),
    ],
)
def test_layout_errors_name_the_argument(change, words):
    arguments = dict(
        tokens=torch.zeros(2, 7, 8), perm=torch.arange(7).repeat(2, 1), mask=torch.zeros(2, 7, dtype=torch.bool),
        pos=torch.zeros(1, 8, 8), unk=torch.zeros(8), prefix=torch.zeros(1, 1, 8), prefix_positions=1,
    )  # fmt: skip
    arguments.update(change)
    with pytest.raises(ValueError, match=re.escape(words)):
        pos_kernels.pos_embed_forward_launch(*arguments.values())
    images, weight = torch.zeros(2, 3, 2, 14), torch.zeros(8, 3, 2, 2)  # 7 patches of 2 x 2
    with pytest.raises(ValueError, match=re.escape(words)):
        patch_kernels.patch_embed_forward_launch(
            images, weight, None, arguments["pos"], arguments["unk"], arguments["perm"], arguments["mask"],
            arguments["prefix"], arguments["prefix_positions"],
        )  # fmt: skip


def test_backward_layout_errors_name_the_argument():
    grad, perm, mask = torch.zeros(2, 8, 4), torch.arange(7).repeat(2, 1), torch.zeros(2, 7, dtype=torch.bool)
    dtypes = [torch.float32] * 4
    with pytest.raises(ValueError, match=re.escape("prefix_shape must hold P = 1 rows of D = 4")):
        pos_kernels.pos_embed_backward_launch(grad, perm, mask, 1, 1, [8, 4], [1, 2, 4], *dtypes)
    with pytest.raises(ValueError, match=re.escape("pos_embed must be the full table [Q + N, D] = [7, 4]")):
        pos_kernels.pos_embed_backward_launch(grad, perm, mask, 1, 0, [8, 4], [1, 4], *dtypes)
    with pytest.raises(ValueError, match=re.escape("mask must be [B, N] = [2, 6], got [2, 7]")):
        pos_kernels.pos_embed_backward_launch(grad, perm, mask, 2, 2, [8, 4], [2, 4], *dtypes)
    with pytest.raises(ValueError, match=re.escape("grad_out must be [B, P + N, D] = [2, 8, 4], got [2, 7, 4]")):
        patch_kernels.patch_embed_backward_launch(
            grad[:, 1:], torch.zeros(2, 3, 2, 14), torch.zeros(4, 3, 2, 2), perm, mask, *[True] * 6, 1, 1, [8, 4],
            [1, 4],
        )  # fmt: skip


def test_patch_embed_wraps_triton_only_when_traced(monkeypatch):
    wrapped = []
    real_wrap_triton = torch.library.wrap_triton
    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: wrapped.append(kernel) or real_wrap_triton(kernel))
    monkeypatch.setattr(common, "INTERPRETING", False)  # see test_wrap_triton_only_when_traced
    generator = torch.Generator().manual_seed(9)
    images, weight, bias, unk, mask, perm = _patch_inputs(3, torch.float32, generator, "some")
    pos, prefix = _tables((1, 1), LAYOUTS[0], 9, DIM, torch.float32, generator)
    forward_args = (images, weight, bias, pos, unk, perm, mask, prefix, 1)
    eager = patch_kernels.patch_embed_forward_launch(*forward_args)
    grad = torch.randn_like(eager)
    backward_args = (grad, images, weight, perm, mask, *[True] * 6, 1, 1, [1, 10, DIM], [1, 1, DIM])
    eager_grads = patch_kernels.patch_embed_backward_launch(*backward_args)
    assert wrapped == []  # eager: plain kernel[grid] launches
    assert torch.equal(eager, patch_kernels.patch_embed_forward_triton(*forward_args))
    assert wrapped == [patch_kernels._forward_kernel]
    wrapped.clear()
    for first, second in zip(eager_grads, patch_kernels.patch_embed_backward_triton(*backward_args)):
        assert torch.equal(first, second)
    assert wrapped == [
        patch_kernels._grad_images_kernel,
        common._position_partials_kernel,  # the position pass first: with a permutation it writes the inverse
        common._position_reduce_kernel,
        patch_kernels._grad_weight_kernel,
    ]
