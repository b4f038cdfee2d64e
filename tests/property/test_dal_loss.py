"""Property tests of :func:`mjp_fast.dal_loss` under valid edge values and plausible mistakes (issue 25).

On every backend that runs on CPU tensors here, a call gives the ``torch`` backend's loss and gradients (same dtype,
values within the table dtype's tolerance), or a ``ValueError``/``TypeError`` whose message names the argument.
Non-finite values: at a position that every sample masks they reach neither the loss nor the gradients; at a kept
position the loss is not finite on any backend.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mjp_fast
from mjp_fast.ops.dal_loss import dal_loss_ref
from tests.conftest import backends_for
from tests.harness.isolated import run_isolated

BACKENDS = backends_for("cpu")
OTHERS = [name for name in BACKENDS if name != "torch"]
TABLE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# (rtol, atol) of a backend against the torch backend: fused kernels sum in another order.
TOLERANCE = {torch.float64: (1e-9, 1e-9), torch.float32: (1e-4, 1e-5), torch.float16: (2e-2, 2e-2),
             torch.bfloat16: (5e-2, 5e-2)}  # fmt: skip


@st.composite
def dal_cases(draw: st.DrawFn) -> dict:
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    num_positions = rows * cols
    batch = draw(st.integers(0, 3))
    mask_bits = draw(st.lists(st.booleans(), min_size=batch * num_positions, max_size=batch * num_positions))
    return dict(
        grid=draw(st.sampled_from([(rows, cols), rows] if rows == cols else [(rows, cols)])),
        num_positions=num_positions,
        dim=draw(st.integers(1, 6)),
        kind=draw(st.sampled_from(["nonlinear", "linear", "pca"])),
        hidden=draw(st.integers(1, 5)),
        mask=torch.tensor(mask_bits, dtype=torch.bool).reshape(batch, num_positions) if draw(st.booleans()) else None,
        normalize=draw(st.booleans()),
        reduction=draw(st.sampled_from(["mean", "sum"])),
        table_dtype=draw(st.sampled_from(TABLE_DTYPES)),
        regressor_dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        leading_one=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        scale=draw(st.sampled_from([1.0, 1e-3, 30.0])),
    )


def _make(case: dict) -> tuple[torch.Tensor, mjp_fast.DALRegressor]:
    generator = torch.Generator().manual_seed(case["seed"])
    table = (torch.randn(case["num_positions"], case["dim"], generator=generator) * case["scale"]).to(
        case["table_dtype"]
    )
    if case["leading_one"]:
        table = table[None]
    torch.manual_seed(case["seed"])
    hidden = case["hidden"] if case["kind"] == "nonlinear" else None
    regressor = mjp_fast.DALRegressor(case["dim"], case["kind"], hidden).to(case["regressor_dtype"])
    return table, regressor


def _loss_and_grads(table, regressor, case, backend, **changes):
    arguments = dict(mask=case["mask"], normalize=case["normalize"], reduction=case["reduction"])
    arguments.update(changes)
    table = table.detach().clone().requires_grad_(True)
    regressor.zero_grad(set_to_none=True)
    loss = mjp_fast.dal_loss(table, regressor, case["grid"], backend=backend, **arguments)
    loss.backward()
    grads = [table.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in regressor.parameters()]
    return loss.detach(), grads


def _assert_close(actual, expected, dtype):
    rtol, atol = TOLERANCE[dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def _compute_dtype(case):
    return torch.float64 if case["table_dtype"] == torch.float64 else torch.float32


def _tolerance_dtype(case):
    """The least precise dtype a backend may compute this case in (the fused kernels: float32 unless the table is
    float64; the torch backend: the table's and the regressor's promotion)."""
    if case["table_dtype"] in (torch.float16, torch.bfloat16):
        return case["table_dtype"]
    both_double = case["table_dtype"] == case["regressor_dtype"] == torch.float64
    return torch.float64 if both_double else torch.float32


@given(dal_cases())
def test_every_backend_gives_the_torch_backends_loss_and_gradients(case):
    table, regressor = _make(case)
    loss, grads = _loss_and_grads(table, regressor, case, "torch")
    assert loss.dtype == _compute_dtype(case) and loss.shape == ()
    # the oracle agrees with the torch backend
    oracle = dal_loss_ref(table, regressor, case["grid"], case["mask"], case["normalize"], case["reduction"])
    _assert_close(oracle.detach().to(loss.dtype), loss, _compute_dtype(case))
    for backend in OTHERS:
        other_loss, other_grads = _loss_and_grads(table, regressor, case, backend)
        _assert_close(other_loss, loss, _tolerance_dtype(case))
        for actual, expected in zip(other_grads, grads):
            _assert_close(actual, expected, _tolerance_dtype(case))


@given(dal_cases(), st.sampled_from([float("nan"), float("inf"), float("-inf")]), st.data())
def test_a_non_finite_value_where_every_sample_masks_stays_out(case, value, data):
    if case["kind"] == "pca":  # it reads the whole table: its output is NaN (test_pca_gives_nan_for_a_non_finite_table)
        case["kind"] = "linear"
    position = data.draw(st.integers(0, case["num_positions"] - 1))
    if case["mask"] is None or case["mask"].shape[0] == 0:
        case["mask"] = torch.zeros(1, case["num_positions"], dtype=torch.bool)
    case["mask"] = case["mask"].clone()
    case["mask"][:, position] = True
    table, regressor = _make(case)
    clean = table.detach().clone()
    clean[..., position, :] = 0
    poisoned = table.detach().clone()
    poisoned[..., position, data.draw(st.integers(0, case["dim"] - 1))] = value
    expected_loss, expected_grads = _loss_and_grads(clean, regressor, case, "torch")
    assert torch.isfinite(expected_loss)
    for backend in BACKENDS:
        loss, grads = _loss_and_grads(poisoned, regressor, case, backend)
        _assert_close(loss, expected_loss, _tolerance_dtype(case))
        for actual, expected in zip(grads, expected_grads):
            assert torch.isfinite(actual).all(), backend
            _assert_close(actual, expected, _tolerance_dtype(case))
        assert not grads[0][..., position, :].any()  # the excluded row gets no gradient


@given(dal_cases(), st.sampled_from([float("nan"), float("inf")]), st.data())
def test_a_non_finite_value_at_a_kept_position_gives_a_non_finite_loss(case, value, data):
    case["mask"] = None
    table, regressor = _make(case)
    table = table.detach().clone()
    table[..., data.draw(st.integers(0, case["num_positions"] - 1)), data.draw(st.integers(0, case["dim"] - 1))] = value
    expected, _ = _loss_and_grads(table, regressor, case, "torch")
    for backend in OTHERS:
        loss, _ = _loss_and_grads(table, regressor, case, backend)
        assert torch.isfinite(loss) == torch.isfinite(expected), (backend, loss, expected)
        if value != value:  # NaN in, NaN out (issue 25 item 5)
            assert torch.isnan(loss), backend


# ---- mistakes


def _good():
    torch.manual_seed(0)
    return torch.randn(6, 4), mjp_fast.DALRegressor(4)


BAD_CALLS = [
    ("pos_embed", lambda t, r: dict(pos_embed=t.long())),
    ("pos_embed", lambda t, r: dict(pos_embed=t.to(torch.complex64))),
    ("pos_embed", lambda t, r: dict(pos_embed=t.bool())),
    ("pos_embed", lambda t, r: dict(pos_embed=t.reshape(-1))),
    ("pos_embed", lambda t, r: dict(pos_embed=t[None, None])),
    ("pos_embed", lambda t, r: dict(pos_embed=t[:5])),
    ("pos_embed", lambda t, r: dict(pos_embed=torch.randn(6, 5))),
    ("pos_embed", lambda t, r: dict(pos_embed=torch.randn(2, 6, 4))),
    ("pos_embed", lambda t, r: dict(pos_embed=t.tolist())),
    ("regressor", lambda t, r: dict(regressor=3)),
    ("regressor", lambda t, r: dict(regressor=None)),
    ("pos_embed", lambda t, r: dict(grid_size=(3, 3))),  # N = 9: the table's rows are named
    ("grid_size", lambda t, r: dict(grid_size=0)),
    ("grid_size", lambda t, r: dict(grid_size=(2.0, 3))),
    ("grid_size", lambda t, r: dict(grid_size="6")),
    ("mask", lambda t, r: dict(mask=torch.zeros(2, 6, dtype=torch.int64))),
    ("mask", lambda t, r: dict(mask=torch.zeros(2, 5, dtype=torch.bool))),
    ("mask", lambda t, r: dict(mask=torch.zeros(6, dtype=torch.bool))),
    ("mask", lambda t, r: dict(mask=[[False] * 6])),
    ("mask", lambda t, r: dict(mask=torch.zeros(2, 6, dtype=torch.bool, device="meta"))),
    ("reduction", lambda t, r: dict(reduction=["mean"])),
    ("reduction", lambda t, r: dict(reduction="avg")),
    ("reduction", lambda t, r: dict(reduction=None)),
    ("normalize", lambda t, r: dict(normalize="yes")),
    ("normalize", lambda t, r: dict(normalize=None)),
    ("backend", lambda t, r: dict(backend="bogus")),
    ("backend", lambda t, r: dict(backend=3)),
]


@given(st.sampled_from(BAD_CALLS), st.sampled_from(BACKENDS))
def test_a_mistake_is_refused_by_name(bad, backend):
    name, change = bad
    table, regressor = _good()
    arguments = dict(pos_embed=table, regressor=regressor, grid_size=(2, 3), backend=backend)
    arguments.update(change(table, regressor))
    with pytest.raises((ValueError, TypeError)) as caught:
        mjp_fast.dal_loss(**arguments)
    assert name in str(caught.value), str(caught.value)


@given(st.sampled_from(TABLE_DTYPES), st.sampled_from(TABLE_DTYPES), st.sampled_from(["nonlinear", "linear", "pca"]))
def test_any_float_table_with_any_float_regressor(table_dtype, regressor_dtype, kind):
    torch.manual_seed(1)
    table = torch.randn(6, 4).to(table_dtype)
    regressor = mjp_fast.DALRegressor(4, kind).to(regressor_dtype)
    expected = mjp_fast.dal_loss(table, regressor, (2, 3), backend="torch")
    assert expected.dtype == (torch.float64 if table_dtype == torch.float64 else torch.float32)
    low = torch.bfloat16 if torch.bfloat16 in (table_dtype, regressor_dtype) else torch.float16
    for backend in OTHERS:
        got = mjp_fast.dal_loss(table, regressor, (2, 3), backend=backend)
        _assert_close(got, expected, low if low in (table_dtype, regressor_dtype) else torch.float32)


@given(st.sampled_from([None, *BACKENDS]), st.booleans())
def test_meta_tensors_give_a_meta_loss_or_name_the_backend(backend, masked):
    table = torch.empty(6, 4, device="meta")
    regressor = mjp_fast.DALRegressor(4).to("meta")
    mask = torch.zeros(2, 6, dtype=torch.bool, device="meta") if masked else None
    if backend in (None, "torch"):
        loss = mjp_fast.dal_loss(table, regressor, (2, 3), mask, backend=backend)
        assert loss.device.type == "meta" and loss.shape == () and loss.dtype == torch.float32
    else:
        with pytest.raises(ValueError, match="backend"):
            mjp_fast.dal_loss(table, regressor, (2, 3), mask, backend=backend)


def test_a_regressor_on_another_device_is_named():
    table = torch.randn(6, 4)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="regressor"):
            mjp_fast.dal_loss(table, mjp_fast.DALRegressor(4).to("meta"), (2, 3), backend=backend)


@given(st.sampled_from([float("nan"), float("inf"), float("-inf")]), st.sampled_from([None, *BACKENDS]))
def test_pca_gives_nan_for_a_non_finite_table(value, backend):
    table = torch.randn(6, 4)
    table[2, 1] = value
    loss = mjp_fast.dal_loss(table, mjp_fast.DALRegressor(4, "pca"), (2, 3), backend=backend)
    assert torch.isnan(loss)


# ---- the compiled CPU kernel at the edges, in a child process (a memory error there must fail one test, not the
# run): every shape edge, masks that keep nothing or one position, non-finite excluded rows, both GEMM paths.


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs mjp_fast._C")
def test_the_cpu_kernel_at_the_edges_in_a_child_process():
    done = run_isolated(
        """
        import itertools, torch, mjp_fast
        import importlib
        dal = importlib.import_module("mjp_fast.ops.dal_loss")
        for (rows, cols), dim, hidden, batch, kind, skip in itertools.product(
                [(1, 1), (1, 5), (3, 2), (17, 17)], [1, 3, 80], [1, 64], [0, 1, 3], ["nonlinear", "linear"], [0, 2]):
            torch.manual_seed(rows * dim + batch)
            n = rows * cols
            table = torch.randn(1, skip + n, dim)
            mask = torch.rand(batch, n) < 0.5
            if batch:
                mask[:, 0] = True
                table[0, skip, 0] = float("inf")
            regressor = mjp_fast.DALRegressor(dim, kind, hidden if kind == "nonlinear" else None)
            table.requires_grad_(True)
            coords = dal.grid_coordinates((rows, cols))
            used = mask if batch else None
            loss = dal.dal_loss_unchecked(table, regressor, coords, used, "cpu", skip)
            loss.backward()
            expected = dal.dal_loss_unchecked(table, regressor, coords, used, "torch", skip)
            assert torch.isfinite(loss) == torch.isfinite(expected), (rows, cols, dim, batch, kind, skip)
            if torch.isfinite(expected):
                torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
                assert torch.isfinite(table.grad).all()
        print("ok")
        """,
        timeout=600,
    )
    assert not done.crashed and done.returncode == 0 and "ok" in done.stdout, done.explain()


# ---- the issue's exact cases


def test_issue_25_item_5_a_nan_in_pos_embed_gives_nan_on_every_backend():
    torch.manual_seed(0)
    regressor, table = mjp_fast.DALRegressor(4), torch.randn(6, 4)
    table[1, 2] = float("nan")
    for backend in BACKENDS:
        loss, grads = _loss_and_grads(
            table, regressor, dict(mask=None, normalize=False, reduction="mean", grid=(2, 3)), backend
        )
        assert torch.isnan(loss), backend
        assert torch.isnan(grads[1]).any() and torch.isnan(grads[3]).any(), backend  # w1's and w2's gradients


def test_issue_25_item_6_an_inf_at_a_position_every_sample_masks():
    torch.manual_seed(0)
    regressor, table = mjp_fast.DALRegressor(4), torch.randn(6, 4)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[:, 1] = True
    table[1, :] = float("inf")
    case = dict(mask=mask, normalize=False, reduction="mean", grid=(2, 3))
    expected = dal_loss_ref(table, regressor, (2, 3), mask)
    for backend in BACKENDS:
        loss, grads = _loss_and_grads(table, regressor, case, backend)
        torch.testing.assert_close(loss, expected.detach())
        assert all(torch.isfinite(grad).all() for grad in grads), backend


def test_issue_25_item_7_a_float64_table_gives_float64_on_every_backend():
    table = torch.randn(6, 4, dtype=torch.float64)
    for regressor in (mjp_fast.DALRegressor(4), mjp_fast.DALRegressor(4).double()):
        for backend in BACKENDS:
            assert mjp_fast.dal_loss(table, regressor, (2, 3), backend=backend).dtype == torch.float64
        assert mjp_fast.dal_loss(table.float(), regressor, (2, 3)).dtype == torch.float32


def test_issue_25_item_13_cases():
    table, regressor = _good()
    for backend in BACKENDS:
        for bad in (torch.ones(6, 4, dtype=torch.int64), torch.ones(6, 4, dtype=torch.complex64)):
            with pytest.raises(TypeError, match="pos_embed"):
                mjp_fast.dal_loss(bad, regressor, (2, 3), backend=backend)
        for dtype in (torch.float16, torch.bfloat16, torch.float64):
            assert torch.isfinite(mjp_fast.dal_loss(table.to(dtype), regressor, (2, 3), backend=backend))
        with pytest.raises(ValueError, match="pos_embed"):
            mjp_fast.dal_loss(torch.randn(6, 5), regressor, (2, 3), backend=backend)
        with pytest.raises(TypeError, match="reduction"):
            mjp_fast.dal_loss(table, regressor, (2, 3), reduction=["mean"], backend=backend)
    for value in (float("inf"), float("nan")):
        assert torch.isnan(mjp_fast.dal_loss(torch.full((6, 4), value), mjp_fast.DALRegressor(4, "pca"), (2, 3)))
    assert torch.isfinite(mjp_fast.dal_loss(table.half(), mjp_fast.DALRegressor(4, "pca"), (2, 3)))
