"""Position regression against hand-computed values."""

import numpy as np
import pytest
import timm

from mjp_fast.evaluate.position import grid_targets, patch_position_embeddings, position_regression


def test_targets_are_row_major():
    index, coordinates = grid_targets((2, 3))
    assert index.tolist() == [0, 1, 2, 3, 4, 5]
    assert coordinates.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


def test_embeddings_linear_in_the_position_give_zero_error():
    rows, cols = 4, 5
    _, coordinates = grid_targets((rows, cols))
    rng = np.random.default_rng(0)
    embeddings = coordinates @ rng.normal(size=(2, 8)) + rng.normal(size=8)  # an affine image of (row, col)
    result = position_regression(embeddings, (rows, cols))
    assert result["mae_1d"] == pytest.approx(0.0, abs=1e-8)
    assert result["mae_2d"] == pytest.approx(0.0, abs=1e-8)


def test_constant_embeddings_predict_the_training_mean():
    # 1x5 grid, 5 folds = leave-one-out; a constant embedding makes each prediction the mean of the other four
    # indices, (10 - n) / 4, so the errors are |5n - 10| / 4 = 2.5, 1.25, 0, 1.25, 2.5: mean 1.5.
    result = position_regression(np.ones((5, 3)), (1, 5), folds=5)
    assert result["mae_1d"] == pytest.approx(1.5)
    assert result["mae_1d_std"] == pytest.approx(np.std([2.5, 1.25, 0, 1.25, 2.5]))
    # 2D: the row is always 0 (error 0); the column is the 1D index here, so half of 1.5
    assert result["mae_2d"] == pytest.approx(0.75)
    assert result["mae_2d_normalized"] == pytest.approx(0.75 / 4 / 1)  # column range 4; row range counted as 1


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="must be \\[rows\\*cols, D\\]"):
        position_regression(np.zeros((5, 3)), (2, 3))
    with pytest.raises(ValueError, match="folds must be in"):
        position_regression(np.zeros((4, 3)), (2, 2), folds=5)


def test_patch_embeddings_leave_out_the_class_token():
    model = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=8, depth=1, num_heads=2)
    embeddings, grid = patch_position_embeddings(model)
    assert grid == (4, 4) and embeddings.shape == (16, 8)
    np.testing.assert_array_equal(embeddings, model.pos_embed[0, 1:].detach().numpy())
    plain = timm.create_model("resnet18", num_classes=2)
    assert patch_position_embeddings(plain) is None
