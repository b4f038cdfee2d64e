import warnings

import pytest
import torch

import mjp_fast
from mjp_fast.ops.dal_loss import dal_loss_ref, grid_coordinates


def test_coordinates_are_row_major():
    coords = grid_coordinates((2, 3))
    assert coords.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert grid_coordinates((3, 5), normalize=True).max().item() == 1.0


@pytest.mark.parametrize("kind", ["nonlinear", "linear", "pca"])
@pytest.mark.parametrize("normalize", [False, True])
def test_weighted_loss_equals_per_sample_average(kind, normalize):
    torch.manual_seed(0)
    regressor = mjp_fast.DALRegressor(16, kind)
    pos = torch.randn(1, 20, 16, requires_grad=True)
    mask = mjp_fast.sample_jigsaw(6, (4, 5), 0.5, seed=2, min_block=1).mask
    got = mjp_fast.dal_loss(pos, regressor, (4, 5), mask, normalize=normalize)
    expected = dal_loss_ref(pos, regressor, (4, 5), mask, normalize=normalize)
    torch.testing.assert_close(got, expected)
    got.backward()
    assert pos.grad is not None and pos.grad.abs().sum() > 0
    assert all(p.grad is not None for p in regressor.parameters())


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_default_reduction_is_the_paper_codes_l1_loss_and_sum_is_twice_it(backend):
    # The paper's code: F.l1_loss(xy, predxy) over the unmasked positions, the mean over positions and coordinates.
    torch.manual_seed(3)
    regressor = mjp_fast.DALRegressor(8, "nonlinear")
    pos = torch.randn(12, 8)
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, [1, 5, 6]] = True
    kept = ~mask[0]
    paper_code = torch.nn.functional.l1_loss(regressor(pos)[kept], grid_coordinates((3, 4))[kept])
    mean = mjp_fast.dal_loss(pos, regressor, (3, 4), mask, backend=backend)
    torch.testing.assert_close(mean, paper_code)
    total = mjp_fast.dal_loss(pos, regressor, (3, 4), mask, reduction="sum", backend=backend)
    torch.testing.assert_close(total, 2 * paper_code)
    torch.testing.assert_close(dal_loss_ref(pos, regressor, (3, 4), mask, reduction="sum"), total)
    with pytest.raises(ValueError, match="reduction"):
        mjp_fast.dal_loss(pos, regressor, (3, 4), reduction="max")


def test_without_mask_every_position_counts_and_all_masked_is_zero():
    regressor = mjp_fast.DALRegressor(8, "linear")
    pos = torch.randn(9, 8)
    torch.testing.assert_close(mjp_fast.dal_loss(pos, regressor, 3), dal_loss_ref(pos, regressor, 3))
    all_masked = torch.ones(2, 9, dtype=torch.bool)
    assert mjp_fast.dal_loss(pos, regressor, 3, all_masked).item() == 0.0


def test_a_perfect_regressor_has_zero_loss():
    pos = torch.randn(12, 12)
    regressor = mjp_fast.DALRegressor(12, "linear")
    # least squares from these embeddings to their coordinates is exact (12 points, 12 dims + bias)
    coords = grid_coordinates((3, 4))
    design = torch.cat((pos, torch.ones(12, 1)), 1).double()
    solution = torch.linalg.lstsq(design, coords.double()).solution.float()
    with torch.no_grad():
        regressor.net.weight.copy_(solution[:12].t())
        regressor.net.bias.copy_(solution[12])
    assert mjp_fast.dal_loss(pos, regressor, (3, 4)).item() < 1e-3


def test_pca_regressor_is_invariant_to_rotations_of_the_embedding_space():
    torch.manual_seed(1)
    regressor = mjp_fast.DALRegressor(6, "pca")
    pos = torch.randn(10, 6)
    rotation, _ = torch.linalg.qr(torch.randn(6, 6))
    torch.testing.assert_close(regressor(pos @ rotation), regressor(pos), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(regressor(pos + 3.0), regressor(pos), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(pos_embed=torch.randn(10, 8)), ValueError, "pos_embed"),
        (dict(pos_embed=torch.randn(2, 9, 8)), ValueError, "pos_embed"),
        (dict(mask=torch.zeros(2, 8, dtype=torch.bool)), ValueError, "mask"),
        (dict(mask=torch.zeros(2, 9)), ValueError, "mask"),
        (dict(regressor=torch.nn.Linear(8, 3)), ValueError, "regressor"),
        (dict(regressor=5), TypeError, "regressor"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, words):
    arguments = dict(pos_embed=torch.randn(9, 8), regressor=mjp_fast.DALRegressor(8), grid_size=3)
    arguments.update(kwargs)
    with pytest.raises(error, match=words):
        mjp_fast.dal_loss(**arguments)


def test_regressor_arguments_are_checked():
    with pytest.raises(ValueError, match="kind"):
        mjp_fast.DALRegressor(8, "quadratic")
    with pytest.raises(ValueError, match="dim"):
        mjp_fast.DALRegressor(0)


@pytest.mark.parametrize("backend", [name for name in ("torch", "cpu") if name in mjp_fast.available_backends()])
def test_compiled_dal_loss_traces_no_lru_cache(backend, monkeypatch):
    # Dynamo traces through an lru_cache-wrapped function without consulting it and warns "Silent incorrectness is
    # only a *potential* risk" (once per message: a fresh record, so an earlier test cannot hide it).
    import torch._dynamo.utils

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    torch.manual_seed(4)
    regressor = mjp_fast.DALRegressor(8, "nonlinear")
    pos = torch.randn(12, 8, requires_grad=True)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, [2, 7]] = True
    compiled = torch.compile(
        lambda table, sampled: mjp_fast.dal_loss(table, regressor, (3, 4), sampled, normalize=True, backend=backend),
        backend="eager",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = compiled(pos, mask)
    assert not [str(warning.message) for warning in caught if "lru_cache" in str(warning.message)]
    torch.testing.assert_close(loss, dal_loss_ref(pos, regressor, (3, 4), mask, normalize=True))
    loss.backward()
    assert pos.grad is not None and pos.grad.abs().sum() > 0


@pytest.mark.parametrize("table", ["one position", "equal rows", "zeros"])
def test_pca_gives_finite_gradients_on_a_table_that_centres_to_zero(table):
    # linalg.svd's backward at a zero matrix is NaN; NaN times any DAL weight, 0 included, poisoned the table's
    # gradient (found by tests/property/test_dal_attached.py)
    torch.manual_seed(0)
    grid = (1, 1) if table == "one position" else (2, 3)
    pos = torch.randn(1, grid[0] * grid[1], 8)
    if table == "equal rows":
        pos = pos[:, :1].expand_as(pos).clone()
    elif table == "zeros":
        pos = torch.zeros_like(pos)
    pos.requires_grad_(True)
    regressor = mjp_fast.DALRegressor(8, "pca")
    loss = mjp_fast.dal_loss(pos, regressor, grid, backend="torch")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(pos.grad).all()
    assert all(torch.isfinite(parameter.grad).all() for parameter in regressor.parameters())
