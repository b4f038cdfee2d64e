"""The DAL loss's Triton kernels (in the interpreter here): against the formula, the package oracle, and themselves.

``pos`` may be a model's full table, ``[skip_rows + N, D]`` or ``[1, skip_rows + N, D]``: the kernels regress its rows
``skip_rows..`` and return grad_pos in the table's shape, zeros in the skipped rows.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

pytest.importorskip("triton")

from mjp_fast import DALRegressor  # noqa: E402
from mjp_fast.ops.dal_loss import dal_loss_ref, grid_coordinates  # noqa: E402
from mjp_fast.triton import dal_loss as dal_triton  # noqa: E402
from mjp_fast.triton.dal_loss import (  # noqa: E402
    dal_backward_launch,
    dal_forward_launch,
    dal_loss_triton,
    dal_loss_triton_backward,
)

# (N, D, H). In the interpreter tiles are 16 and the forward aims at 4 programs, so these cover: one position and
# D, H < 16; H in 3 splits of one tile; 2 splits of 3 and 2 tiles; 1 split of 3 tiles over 5 position blocks.
SHAPES = [(1, 5, 3), (7, 16, 16), (7, 13, 40), (20, 37, 80), (70, 24, 40), (33, 8, 17)]
MASKS = ["none", "random", "all_true", "all_false", "empty_batch"]
KINDS = ["nonlinear", "linear"]


def _mask(kind: str, num_positions: int, generator: torch.Generator) -> torch.Tensor | None:
    batch = 3
    if kind == "none":
        return None
    if kind == "random":
        return torch.rand(batch, num_positions, generator=generator) < 0.5
    if kind == "all_true":
        return torch.ones(batch, num_positions, dtype=torch.bool)
    if kind == "all_false":
        return torch.zeros(batch, num_positions, dtype=torch.bool)
    return torch.zeros(0, num_positions, dtype=torch.bool)  # "empty_batch"


def _inputs(
    num_positions: int,
    dim: int,
    hidden_dim: int,
    kind: str,
    mask_kind: str,
    dtype: torch.dtype = torch.float32,
    *,
    weight_dtype: torch.dtype | None = None,
    biases: tuple[bool, bool] = (True, True),
    seed: int = 0,
    skip_rows: int = 0,
    batched_table: bool = False,
) -> dict:
    """The launchers' keyword arguments, in their order; ``pos`` ``[skip_rows + N, D]`` (``[1, ...]`` with
    ``batched_table``), its first ``skip_rows`` rows (a class token's) not regressed."""
    generator = torch.Generator().manual_seed(seed)
    weight_dtype = weight_dtype or dtype

    def randn(*shape: int, std: float = 1.0, dtype: torch.dtype = weight_dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(dtype)

    nonlinear = kind == "nonlinear"
    second_in = hidden_dim if nonlinear else dim
    pos = randn(skip_rows + num_positions, dim, dtype=dtype)
    return dict(
        pos=pos[None] if batched_table else pos,
        skip_rows=skip_rows,
        w1=randn(hidden_dim, dim, std=1 / math.sqrt(dim)) if nonlinear else None,
        b1=randn(hidden_dim, std=0.5) if nonlinear and biases[0] else None,
        w2=randn(2, second_in, std=1 / math.sqrt(second_in)),
        b2=randn(2) if biases[1] else None,
        coords=torch.randn(num_positions, 2, generator=generator) * 2,
        mask=_mask(mask_kind, num_positions, generator),
        scale=0.75,
    )


def _reference(pos, skip_rows, w1, b1, w2, b2, coords, mask, scale, *, dtype=torch.float64):
    """The formula, straightforwardly, in ``dtype`` (float64: the truth), with autograd on the five parameters.

    Returns ``(loss, pred, hidden, weights), (grad_pos, grad_w1, grad_b1, grad_w2, grad_b2)``; None where absent.
    grad_pos has pos's shape (zeros in the skipped rows: autograd through the slice).
    """
    leaves = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in (pos, w1, b1, w2, b2)]
    table, w1_, b1_, w2_, b2_ = leaves
    pos_ = table.reshape(-1, table.shape[-1])[skip_rows:]
    if w1_ is not None:
        hidden = torch.relu(pos_ @ w1_.T + (b1_ if b1_ is not None else 0))
        pred = hidden @ w2_.T
    else:
        hidden = pos_.new_empty(pos_.shape[0], 0)
        pred = pos_ @ w2_.T
    pred = pred + (b2_ if b2_ is not None else 0)
    if mask is None:
        kept = torch.ones(pos_.shape[0], dtype=torch.float64)
    else:
        kept = (~mask).sum(0, dtype=torch.float64)
    weights = kept / kept.sum().clamp_min(1)
    loss = scale * (weights * (pred.double() - coords.double()).abs().sum(-1)).sum()
    present = [leaf for leaf in leaves if leaf is not None]
    grads = iter(torch.autograd.grad(loss, present))
    return (loss, pred, hidden, weights), tuple(next(grads) if leaf is not None else None for leaf in leaves)


def _run(inputs: dict, *, operator: bool = False):
    forward, backward = (
        (dal_loss_triton, dal_loss_triton_backward)
        if operator
        else (
            dal_forward_launch,
            dal_backward_launch,
        )
    )
    loss, saved = forward(**inputs)
    num_positions = inputs["coords"].shape[0]
    hidden_dim = inputs["w1"].shape[0] if inputs["w1"] is not None else 0
    # predictions, weights and the hidden layer side by side
    assert saved.dtype == torch.float32 and saved.shape == (num_positions, 3 + hidden_dim)
    grads = backward(
        torch.ones((), dtype=torch.float32),
        inputs["pos"],
        inputs["skip_rows"],
        inputs["w1"],
        inputs["w2"],
        inputs["coords"],
        saved,
        inputs["scale"],
        inputs["b1"] is not None,
        inputs["b2"] is not None,
    )
    return (loss, saved[:, :2], saved[:, 3:], saved[:, 2]), tuple(grads)


GRAD_NAMES = ("pos", "w1", "b1", "w2", "b2")


def _check_shapes_and_dtypes(inputs, outputs, grads):
    num_positions = inputs["coords"].shape[0]
    hidden_dim = inputs["w1"].shape[0] if inputs["w1"] is not None else 0
    loss, pred, hidden, weights = outputs
    assert [t.dtype for t in outputs] == [torch.float32] * 4
    assert [tuple(t.shape) for t in outputs] == [(), (num_positions, 2), (num_positions, hidden_dim), (num_positions,)]
    for name, grad in zip(GRAD_NAMES, grads):
        tensor = inputs[name]
        if tensor is None:
            assert grad.shape == (0,), name
        else:
            assert grad.shape == tensor.shape and grad.dtype == tensor.dtype, name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float32_matches_formula(shape, mask_kind, kind):
    inputs = _inputs(*shape, kind, mask_kind)
    outputs, grads = _run(inputs)
    _check_shapes_and_dtypes(inputs, outputs, grads)
    expected, expected_grads = _reference(**inputs)
    for name, got, want in zip(("loss", "pred", "hidden", "weights"), outputs, expected):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for name, got, want in zip(GRAD_NAMES, grads, expected_grads):
        if want is not None:
            torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")
    if mask_kind in ("all_true", "empty_batch"):  # nothing counted: zero loss and gradients, no division by zero
        assert outputs[0].item() == 0 and not outputs[3].any() and not grads[0].any()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("biases", [(False, True), (True, False), (False, False)], ids=str)
def test_without_biases(biases, kind):
    inputs = _inputs(20, 37, 40, kind, "random", biases=biases)
    outputs, grads = _run(inputs)
    _check_shapes_and_dtypes(inputs, outputs, grads)
    expected, expected_grads = _reference(**inputs)
    torch.testing.assert_close(outputs[1].double(), expected[1], atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        if want is not None:
            torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item() if want.numel() else 0.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(7, 13, 40), (33, 8, 17), (20, 37, 80)], ids=lambda s: "x".join(map(str, s)))
def test_half_precision(shape, dtype, kind):
    inputs = _inputs(*shape, kind, "random", dtype)
    outputs, grads = _run(inputs)
    _check_shapes_and_dtypes(inputs, outputs, grads)
    # The kernels compute in float32 from the half inputs (exact products): the forward is float32-tight against
    # the float64 formula on the same inputs, and each gradient is rounded once, to its dtype.
    expected, expected_grads = _reference(**inputs)
    for name, got, want in zip(("loss", "pred", "hidden", "weights"), outputs, expected):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    eps = torch.finfo(dtype).eps
    # House rule: at most twice the error of torch computing the formula in that dtype (and within a few ulps).
    _, torch_grads = _reference(**inputs, dtype=dtype)
    for name, got, want, theirs in zip(GRAD_NAMES, grads, expected_grads, torch_grads):
        if want is None:
            continue
        floor = eps * want.abs().max().item()
        ours = _max_error(got, want)
        assert ours <= 2 * _max_error(theirs, want) + floor, (name, ours, _max_error(theirs, want))
        torch.testing.assert_close(got.double(), want, atol=2 * floor, rtol=2 * eps, msg=lambda m, n=name: f"{n}: {m}")


def test_half_positions_with_float32_regressor():
    # Autocast-like: bfloat16 positions, a float32 regressor; the kernel multiplies both in float32.
    inputs = _inputs(20, 37, 40, "nonlinear", "random", torch.bfloat16, weight_dtype=torch.float32)
    outputs, grads = _run(inputs)
    _check_shapes_and_dtypes(inputs, outputs, grads)
    expected, expected_grads = _reference(**inputs)
    torch.testing.assert_close(outputs[0].double(), expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1].double(), expected_grads[1], atol=1e-6, rtol=1e-5)  # float32 grad_w1
    torch.testing.assert_close(grads[0].double(), expected_grads[0], atol=1e-4, rtol=2**-7)  # bfloat16 grad_pos


def test_non_contiguous_inputs():
    inputs = _inputs(20, 37, 40, "nonlinear", "random")
    strided = dict(inputs)
    strided["pos"] = inputs["pos"].T.contiguous().T
    strided["w1"] = inputs["w1"].T.contiguous().T
    strided["mask"] = inputs["mask"].T.contiguous().T
    assert not strided["pos"].is_contiguous()
    outputs, grads = _run(strided)
    expected_outputs, expected_grads = _run(inputs)
    for got, want in zip(outputs + grads, expected_outputs + expected_grads):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mask_kind", ["none", "random", "all_true"])
@pytest.mark.parametrize("grid", [(1, 1), (1, 7), (3, 5), (14, 14)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_matches_package_oracle(grid, mask_kind, kind):
    rows, cols = grid
    num_positions, dim, hidden_dim = rows * cols, 11, 19
    torch.manual_seed(0)
    regressor = DALRegressor(dim, kind, hidden_dim=hidden_dim if kind == "nonlinear" else None)
    pos = torch.randn(num_positions, dim, requires_grad=True)
    generator = torch.Generator().manual_seed(1)
    mask = _mask(mask_kind, num_positions, generator)
    expected = dal_loss_ref(pos, regressor, grid, mask, reduction="sum")  # scale 1.0 below
    expected_grads = torch.autograd.grad(expected, [pos, *regressor.parameters()])
    if kind == "nonlinear":
        first, second = regressor.net[0], regressor.net[2]
        w1, b1 = first.weight.detach(), first.bias.detach()
    else:
        second, w1, b1 = regressor.net, None, None
    w2, b2 = second.weight.detach(), second.bias.detach()
    inputs = dict(
        pos=pos.detach(), skip_rows=0, w1=w1, b1=b1, w2=w2, b2=b2, coords=grid_coordinates(grid), mask=mask, scale=1.0
    )
    outputs, grads = _run(inputs)
    torch.testing.assert_close(outputs[0], expected.detach(), atol=1e-5, rtol=1e-5)
    present = [grad for grad, tensor in zip(grads, (pos, w1, b1, w2, b2)) if tensor is not None]
    for got, want in zip(present, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic(kind):
    inputs = _inputs(70, 24, 40, kind, "random")
    first_outputs, first_grads = _run(inputs)
    second_outputs, second_grads = _run(inputs)
    for first, second in zip(first_outputs + first_grads, second_outputs + second_grads):
        assert torch.equal(first, second)


@pytest.mark.parametrize("kind", KINDS)
def test_operators_equal_launches(kind):
    inputs = _inputs(20, 37, 40, kind, "random")
    launched = _run(inputs)
    operated = _run(inputs, operator=True)
    for first, second in zip(launched[0] + launched[1], operated[0] + operated[1]):
        assert torch.equal(first, second)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mask_kind", ["none", "random"])
@pytest.mark.parametrize("skip_rows", [0, 1])
def test_opcheck(kind, mask_kind, skip_rows):
    inputs = _inputs(7, 13, 20, kind, mask_kind, skip_rows=skip_rows, batched_table=skip_rows > 0)
    torch.library.opcheck(dal_loss_triton, tuple(inputs.values()))
    _, saved = dal_forward_launch(**inputs)
    backward_args = (
        torch.ones((), dtype=torch.float32),
        inputs["pos"],
        inputs["skip_rows"],
        inputs["w1"],
        inputs["w2"],
        inputs["coords"],
        saved,
        inputs["scale"],
        inputs["b1"] is not None,
        False,
    )
    torch.library.opcheck(dal_loss_triton_backward, backward_args)


class _NoLaunch:
    """Stands for a kernel: records its launch and runs nothing."""

    def __init__(self, launches: list):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(grid)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("traced", [False, True])
def test_launchers_only_allocate_and_launch(kind, traced, monkeypatch):
    # At most 2 launches each way, and, around them, nothing but torch.empty: no zeros, sums, casts or copies.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    inputs = _inputs(20, 37, 40, kind, "random", skip_rows=1, batched_table=True)  # a ViT's table: no slice, no pad
    _, saved = dal_forward_launch(**inputs)
    grad = torch.ones(())
    launches = []
    monkeypatch.setattr(dal_triton, "launcher", lambda kernel, grid, traced: _NoLaunch(launches)[grid])
    with Record() as forward_ops:
        dal_forward_launch(**inputs, traced=traced)
    assert len(launches) == 2
    with Record() as backward_ops:
        dal_backward_launch(
            grad, inputs["pos"], inputs["skip_rows"], inputs["w1"], inputs["w2"], inputs["coords"], saved, 0.5, True,
            True, traced=traced,
        )  # fmt: skip
    assert len(launches) == 3
    assert set(forward_ops.ops + backward_ops.ops) <= {"aten.empty"}, forward_ops.ops + backward_ops.ops


def test_shape_errors_name_the_argument():
    inputs = _inputs(7, 13, 20, "nonlinear", "random")
    with pytest.raises(ValueError, match="w2 must have shape"):
        dal_forward_launch(**{**inputs, "w2": inputs["w2"][:, :5]})
    with pytest.raises(ValueError, match="mask must be bool"):
        dal_forward_launch(**{**inputs, "mask": inputs["mask"].int()})


# -- the full table: skip_rows ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mask_kind", ["none", "random"])
@pytest.mark.parametrize("batched_table", [False, True], ids=["[S+N, D]", "[1, S+N, D]"])
@pytest.mark.parametrize("skip_rows", [1, 3])
@pytest.mark.parametrize("shape", [(7, 13, 40), (33, 8, 17)], ids=lambda s: "x".join(map(str, s)))
def test_full_table_matches_formula(shape, skip_rows, batched_table, mask_kind, kind):
    inputs = _inputs(*shape, kind, mask_kind, skip_rows=skip_rows, batched_table=batched_table, seed=skip_rows)
    outputs, grads = _run(inputs)
    _check_shapes_and_dtypes(inputs, outputs, grads)
    expected, expected_grads = _reference(**inputs)
    for name, got, want in zip(("loss", "pred", "hidden", "weights"), outputs, expected):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for name, got, want in zip(GRAD_NAMES, grads, expected_grads):
        if want is not None:
            torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")
    grad_pos = grads[0].reshape(-1, shape[1])
    assert not grad_pos[:skip_rows].any()  # the skipped rows: exact zeros


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_full_table_equals_the_sliced_table(dtype, kind):
    # Reading rows skip_rows.. in place gives the very bits of the regression of a copy of those rows (the forward,
    # the weights' gradients: the same tiles of positions). grad_pos's tiles are rows of the full table, shifted by
    # skip_rows: its products may round differently (numpy's matmul in the interpreter), within float32's.
    inputs = _inputs(20, 37, 40, kind, "random", dtype, skip_rows=2, batched_table=True)
    sliced = dict(inputs, pos=inputs["pos"][0, 2:].contiguous(), skip_rows=0)
    outputs, grads = _run(inputs)
    sliced_outputs, sliced_grads = _run(sliced)
    for first, second in zip(outputs + grads[1:], sliced_outputs + sliced_grads[1:]):
        assert torch.equal(first, second)
    assert grads[0].shape == inputs["pos"].shape and not grads[0][0, :2].any()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(grads[0][0, 2:], sliced_grads[0], atol=1e-7, rtol=eps)


@pytest.mark.parametrize("kind", KINDS)
def test_backward_kernel_writes_the_skipped_rows(kind, monkeypatch):
    # grad_pos comes from torch.empty: the kernel itself writes the zeros of the skipped rows (no fill op).
    inputs = _inputs(20, 37, 40, kind, "random", skip_rows=3, batched_table=True)
    _, saved = dal_forward_launch(**inputs)
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    grads = dal_backward_launch(
        torch.ones(()), inputs["pos"], 3, inputs["w1"], inputs["w2"], inputs["coords"], saved, inputs["scale"], True,
        True,
    )  # fmt: skip
    monkeypatch.undo()
    assert torch.equal(grads[0][0, :3], torch.zeros(3, 37))
    assert not grads[0].isnan().any()


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(skip_rows=2), "pos must be [skip_rows + N, D] (or [1, skip_rows + N, D]) with skip_rows + N = 2 + 7"),
        (dict(pos=torch.zeros(2, 8, 13)), "got shape [2, 8, 13]"),
        (dict(skip_rows=-1), "skip_rows must be >= 0, got -1"),
    ],
)
def test_full_table_errors_name_the_argument(change, words):
    inputs = dict(_inputs(7, 13, 20, "nonlinear", "random", skip_rows=1), **change)
    with pytest.raises(ValueError, match=re.escape(words)):
        dal_forward_launch(**inputs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_adds_into_a_given_table_gradient(dtype, kind):
    # The fused MJP step passes the position step's gradient of the same table: the DAL backward adds its own share
    # in place (one rounding), returns that tensor, and the regressor's gradients are unchanged.
    inputs = _inputs(20, 37, 40, kind, "random", dtype, skip_rows=1, batched_table=True)
    _, saved = dal_forward_launch(**inputs)
    arguments = (torch.ones(()), inputs["pos"], 1, inputs["w1"], inputs["w2"], inputs["coords"], saved, 0.5)
    flags = (inputs["b1"] is not None, inputs["b2"] is not None)
    alone = dal_backward_launch(*arguments, *flags)
    prior = torch.randn(inputs["pos"].shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    given = prior.clone()
    added = dal_backward_launch(*arguments, *flags, grad_pos=given)
    assert added[0] is given
    expected = (prior.float() + alone[0].float()).to(dtype) if dtype != torch.float32 else prior + alone[0]
    # bfloat16: the kernel adds its float32 share before rounding once, the reference its share rounded already
    eps = torch.finfo(dtype).eps
    tolerance = {} if dtype == torch.float32 else dict(atol=eps * alone[0].abs().max().item(), rtol=2 * eps)
    torch.testing.assert_close(added[0], expected, **tolerance)
    for first, second in zip(alone[1:], added[1:]):
        assert torch.equal(first, second)
    with pytest.raises(ValueError, match="grad_pos must have shape"):
        dal_backward_launch(*arguments, *flags, grad_pos=given[0, 1:])
    with pytest.raises(ValueError, match="grad_pos must be contiguous"):
        dal_backward_launch(*arguments, *flags, grad_pos=given.double())
