"""MJP's token path for timm's NesT (mjp_fast/timm/nest.py, issue 40 item 1): convert, eval equal to timm's, a
training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the step against a pure-torch
expectation (the moved tokens, ``unk_embed`` at the masked positions, level 0's table rows mapped from its blocks to
the grid elsewhere), DAL on those rows, FX (plain and timm's feature extractor), ``forward_intermediates``,
``features_only`` (a FeatureListNet of the model's modules), checkpoints both ways and pickling, the refusals, and the
coverage sweep's check."""

from __future__ import annotations

import copy

import pytest
import torch
from timm.models._features_fx import create_feature_extractor
from timm.models.nest import _create_nest, blockify

import mjp_fast
import mjp_fast.timm as mjp_timm
from mjp_fast.timm.nest import MJPNest, NestPatchEmbed, table_rows
from tests.timm import front_end_checks as checks

# 32 px in patches of 4: an 8x8 grid. Three levels: level 0 is 16 blocks of 2x2 patches; two levels: 4 blocks of 4x4.
# No stochastic depth (NesT's default rate is 0.5): two forwards of one model compare.
TINY = dict(img_size=32, embed_dims=(8, 8, 8), num_heads=(2, 2, 2), depths=(1, 1, 1), num_classes=5, drop_path_rate=0.0)
MODELS = {
    "three_levels": TINY,
    "two_levels": dict(TINY, num_levels=2, embed_dims=(8, 16), num_heads=(2, 2), depths=(1, 1)),
}
SETTINGS = dict(ratio=0.5, prob=1.0, min_block=1)  # small grids: min_block 1 so that the sampler masks positions


def _plain(kind: str = "three_levels", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return _create_nest("nest_tiny", pretrained=False, **{**MODELS[kind], **overrides})


def _images(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _grid_rows_ref(table: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    """Pure torch, one position at a time: grid position (i, j) is row (i % b) * b + j % b of block
    (i // b) * (cols // b) + j // b of NesT's blockified table ``[1, T, S, D]``. Returns ``[1, rows * cols, D]``."""
    out = table.new_empty(1, rows * cols, table.shape[-1])
    for i in range(rows):
        for j in range(cols):
            t, s = (i // block) * (cols // block) + j // block, (i % block) * block + j % block
            out[0, i * cols + j] = table[0, t, s]
    return out


@pytest.mark.parametrize("kind", list(MODELS))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, MJPNest) and isinstance(model.patch_embed, NestPatchEmbed)
    checks.assert_token_path_state(model, patch_size=4, grid=(8, 8))
    images = _images()
    expected = checks.assert_eval_equals_timm(model, plain, images)
    checks.assert_training_step_reaches_every_parameter(model, images, tables=[model.levels[0].pos_embed])
    checks.assert_mjp_eval_jigsaws(model, plain, images, expected)


@pytest.mark.parametrize("kind", list(MODELS))
def test_table_rows_map_the_blocks_to_the_grid(kind):
    level = _plain(kind).levels[0]
    table, block = level.pos_embed.detach(), level.block_size
    rows = table_rows(table, (8, 8), block)
    torch.testing.assert_close(rows, _grid_rows_ref(table, 8, 8, block), rtol=0, atol=0)
    # timm's blockify of the rows laid out on the grid is the table again, exactly: the embedding's `- rows` and
    # level 0's `+ pos_embed` meet the same values at each position
    assert torch.equal(blockify(rows.reshape(1, 8, 8, -1), block), table)


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_step_is_the_moved_tokens_with_unk_at_the_masked_positions(kind):
    """Inside mjp_eval, level 0's transformer gets timm's tokens moved as the jigsaw says, plus ``unk_embed`` at the
    masked positions and level 0's own table row (mapped from its blocks to the grid) elsewhere, blockified (within
    the rounding of timm's ``+ pos_embed`` after the hook)."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    level, images = model.levels[0], _images()
    block = level.block_size
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got = blockify(model.patch_embed(images).permute(0, 2, 3, 1), block) + level.pos_embed
        jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.shape == (2, 64) and jigsaw.mask.any() and (jigsaw.perm != torch.arange(64)).any()
    with torch.no_grad():
        tokens = model.patch_embed(images).flatten(2).transpose(1, 2)  # eval: timm's embedding, [B, 64, D]
    moved = torch.stack([tokens[b, jigsaw.perm[b]] for b in range(2)])
    rows = _grid_rows_ref(level.pos_embed.detach(), 8, 8, block).expand_as(moved)
    unk = model.mjp.unk_embed.reshape(1, 1, -1).expand_as(moved)
    expected = moved + torch.where(jigsaw.mask.unsqueeze(-1), unk, rows)
    torch.testing.assert_close(got, blockify(expected.reshape(2, 8, 8, -1), block), rtol=1e-5, atol=1e-6)


def _dal_of_the_grid_rows(model: torch.nn.Module) -> torch.Tensor:
    level = model.levels[0]
    return mjp_fast.dal_loss(
        _grid_rows_ref(level.pos_embed, 8, 8, level.block_size), model.mjp.dal_regressor, (8, 8),
        model.mjp.last_jigsaw.mask, backend="torch",
    )  # fmt: skip


def test_dal_regresses_the_grid_rows_and_mjp_aux_loss_replaces_the_attached_weight():
    model = mjp_timm.convert(_plain(), **SETTINGS)
    checks.assert_aux_loss_at_a_weight_replaces_the_attached_one(model, _images(), _dal_of_the_grid_rows)


def test_refusals_name_the_reason():
    checks.assert_refuses_fused_and_pixel_jigsaw(
        _plain, fused=r"NesT's patch embedding writes an NCHW map", model="Nest"
    )
    padded = _plain()
    padded.patch_embed.proj.padding = (1, 1)
    with pytest.raises(ValueError, match=r"padding \(1, 1\) overlap the patches"):
        mjp_timm.convert(padded)
    assert isinstance(mjp_timm.convert(_plain(), fused_patch_embed=False), MJPNest)


@pytest.mark.filterwarnings("ignore:.*The nodes obtained by tracing the model in")
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(training):
    model = mjp_timm.convert(_plain(), **SETTINGS).train(training)
    images = _images()
    # NesT's deblockify kept as one call; in training MJP is the step on the moved tokens
    tracer = checks.TimmLeafTracer(notrace_functions=True)
    checks.assert_fx_graph_is_the_model(model, images, tracer, mjp_nodes=1, out_shape=(2, 5))
    extractor = create_feature_extractor(model, return_nodes={"levels.0": "level0", "norm": "norm"})
    with torch.no_grad():
        features = extractor(images)
    assert features["level0"].shape == (2, 8, 8, 8) and features["norm"].shape == (2, 2, 2, 8)


def test_forward_intermediates():
    plain = _plain()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    checks.assert_forward_intermediates(plain, model, _images(), shapes=[(8, 8), (4, 4), (2, 2)])


def test_features_only_jigsaws_the_images_first_and_equals_the_models_step():
    """timm's FeatureListNet of a NesT runs the model's modules, not its forward: ``mjp`` goes first and jigsaws the
    images in blocks of the patch, which for NesT's non-overlapping embedding is the model's own moving of the tokens:
    the same features inside ``mjp_eval`` for the same seed."""
    torch.manual_seed(0)  # num_classes as the whole model's below: the same draws, the same weights
    wrapper = _create_nest("nest_tiny", pretrained=False, features_only=True, **TINY)
    plain = copy.deepcopy(wrapper).eval()
    model = mjp_timm.convert(wrapper, **SETTINGS).eval()
    assert list(model.keys())[:2] == ["mjp", "patch_embed"] and model.mjp.patch_size == 4
    images = _images()
    with torch.no_grad():
        for got, expected in zip(model(images), plain(images), strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    whole = mjp_timm.convert(_plain(), **SETTINGS).eval()
    with torch.no_grad():
        whole.mjp.unk_embed.copy_(model.mjp.unk_embed)
        with model.mjp_eval(ratio=0.5, seed=4), whole.mjp_eval(ratio=0.5, seed=4):
            features = model(images)
            _, intermediates = whole.forward_intermediates(images)
    assert model.mjp.last_jigsaw.mask.any() and torch.equal(model.mjp.last_jigsaw.perm, whole.mjp.last_jigsaw.perm)
    for got, expected in zip(features, intermediates, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    model.train()
    sum(feature.square().mean() for feature in model(images)).backward()
    checks.assert_every_parameter_has_a_grad(model)
    assert model.mjp.unk_embed.grad.abs().sum() > 0 and torch.isfinite(model.mjp_aux_loss())
    loaded = checks.pickled(model)
    embed = loaded["patch_embed"]  # the copy's embedding reads the copy's state and table
    assert embed.__dict__["_mjp_state"] is loaded.mjp and embed.__dict__["_mjp_level"] is loaded["levels_0"]
    loaded.eval()
    with torch.no_grad(), model.mjp_eval(seed=2), loaded.mjp_eval(seed=2):
        for got, expected in zip(loaded(images), model(images), strict=True):
            assert torch.equal(got, expected)


def test_checkpoints_both_ways_and_pickling():
    plain = _plain().eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images()
    checks.assert_checkpoints_both_ways(plain, model, _plain, images)
    _, copied = checks.assert_pickles_and_copies(model, images, _check_clone)
    assert copied.levels[0].pos_embed.grad is not None


def _check_clone(clone: torch.nn.Module) -> None:
    assert clone.patch_embed.__dict__["_mjp_level"] is clone.levels[0]  # the clone's embedding reads its own table
    assert clone.patch_embed.__dict__["_mjp_state"] is clone.mjp
    # a training forward keeps the table's rows for mjp_aux_loss: copies and pickles drop them
    assert clone.patch_embed.__dict__["_mjp_kept_rows"].rows is None


def test_the_coverage_sweeps_check_passes():
    checks.assert_coverage_sweep_passes("nest_tiny", dict(img_size=32), 32, patch_size=4)
