"""MJP's token path for timm's NesT (mjp_fast/timm/nest.py, issue 40 item 1): convert, eval equal to timm's, a
training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the step against a pure-torch
expectation (the moved tokens, ``unk_embed`` at the masked positions, level 0's table rows mapped from its blocks to
the grid elsewhere), DAL on those rows, FX (plain and timm's feature extractor), ``forward_intermediates``,
``features_only`` (a FeatureListNet of the model's modules), checkpoints both ways and pickling, the refusals, and the
coverage sweep's check."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from timm.layers import get_notrace_functions, is_notrace_module
from timm.models._features_fx import create_feature_extractor
from timm.models.nest import _create_nest, blockify

import mjp_fast
import mjp_fast.timm as mjp_timm
from bench.timm_coverage import check_model
from mjp_fast.timm.convert import runs_fused
from mjp_fast.timm.nest import MJPNest, NestPatchEmbed, table_rows

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
    assert model.mjp.unk_embed is not None and model.mjp.dal_regressor is not None
    assert model.mjp.patch_size == 4 and tuple(model.mjp.sampler.grid_size) == (8, 8)
    assert "mjp.unk_embed" in model.no_weight_decay() and not runs_fused(model)
    images = _images()
    model.eval(), plain.eval()
    with torch.no_grad():
        expected = plain(images)
        torch.testing.assert_close(model(images), expected, rtol=0, atol=0)
    model.train()
    model(images).logsumexp(-1).mean().backward()  # the output alone: DAL rides on it
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    assert model.mjp.last_dal_loss is not None and model.mjp.last_jigsaw.mask.any()
    assert any(p.grad.abs().sum() > 0 for p in model.mjp.dal_regressor.parameters())  # DAL's, not a kept zero
    assert model.levels[0].pos_embed.grad.abs().sum() > 0 and model.mjp.unk_embed.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=0):
        jigsawed = model(images)
    assert model.mjp.last_jigsaw.mask.any() and not torch.allclose(jigsawed, expected)
    with torch.no_grad():  # outside mjp_eval: timm's again
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)


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


def test_dal_regresses_the_grid_rows_and_mjp_aux_loss_replaces_the_attached_weight():
    model = mjp_timm.convert(_plain(), **SETTINGS).train()
    twin = copy.deepcopy(model)
    images = _images()
    out = model(images)
    level = model.levels[0]
    expected = mjp_fast.dal_loss(
        _grid_rows_ref(level.pos_embed, 8, 8, level.block_size), model.mjp.dal_regressor, (8, 8),
        model.mjp.last_jigsaw.mask, backend="torch",
    )  # fmt: skip
    torch.testing.assert_close(model.mjp.last_dal_loss, expected.detach())
    # A loop that adds w * mjp_aux_loss() counts DAL at w in place of the attached weight (never both): the same
    # gradients as a model whose attached weight is w and whose loop adds nothing.
    (out.sum() + 0.5 * model.mjp_aux_loss()).backward()
    twin.mjp_dal_weight = 0.5
    twin(images).sum().backward()
    for (name, got), want in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=lambda message, name=name: f"{name}: {message}")


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match=r"fused_patch_embed=True: NesT's patch embedding writes an NCHW map"):
        mjp_timm.convert(_plain(), fused_patch_embed=True)
    with pytest.raises(ValueError, match=r"pixel_jigsaw=True: model .*Nest.* token path covers"):
        mjp_timm.convert(_plain(), pixel_jigsaw=True)
    padded = _plain()
    padded.patch_embed.proj.padding = (1, 1)
    with pytest.raises(ValueError, match=r"padding \(1, 1\) overlap the patches"):
        mjp_timm.convert(padded)
    assert isinstance(mjp_timm.convert(_plain(), fused_patch_embed=False), MJPNest)


class _LeafTracer(torch.fx.Tracer):
    """torch.fx's tracer with the modules and functions timm marks as not traceable kept as calls (NesT's
    ``deblockify``), as timm's feature extractor."""

    def __init__(self) -> None:
        super().__init__(autowrap_functions=tuple(get_notrace_functions()))

    def is_leaf_module(self, module: torch.nn.Module, qualified_name: str) -> bool:
        return is_notrace_module(type(module)) or super().is_leaf_module(module, qualified_name)


@pytest.mark.filterwarnings("ignore:.*The nodes obtained by tracing the model in")
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(training):
    model = mjp_timm.convert(_plain(), **SETTINGS).train(training)
    images = _images()
    graph = torch.fx.GraphModule(model, _LeafTracer().trace(model))
    targets = [node.target for node in graph.graph.nodes if node.op == "call_module"]
    assert targets.count("mjp") == (1 if training else 0)  # the step on the moved tokens
    with torch.no_grad():
        if training:
            assert graph(images).shape == (2, 5) and model.mjp.last_jigsaw.mask.any()
            model.mjp.sampler.sample_counter.zero_()  # the graph's MJP equals the model's: the same jigsaws
            eager = model(images)
            model.mjp.sampler.sample_counter.zero_()
            torch.testing.assert_close(graph(images), eager, rtol=0, atol=0)
        else:
            torch.testing.assert_close(graph(images), model(images), rtol=0, atol=0)
    extractor = create_feature_extractor(model, return_nodes={"levels.0": "level0", "norm": "norm"})
    with torch.no_grad():
        features = extractor(images)
    assert features["level0"].shape == (2, 8, 8, 8) and features["norm"].shape == (2, 2, 2, 8)


def test_forward_intermediates():
    plain = _plain().eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images()
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(images)
        expected_final, expected = plain.forward_intermediates(images)
        torch.testing.assert_close(final, expected_final, rtol=0, atol=0)
        for got, want in zip(intermediates, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5):
            _, jigsawed = model.forward_intermediates(images)
    assert [tuple(f.shape[-2:]) for f in jigsawed] == [(8, 8), (4, 4), (2, 2)]
    assert not torch.allclose(jigsawed[0], expected[0])
    model.train()
    final, _ = model.forward_intermediates(images)
    final.sum().backward()
    assert model.mjp.unk_embed.grad is not None and model.mjp.last_dal_loss is not None


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
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    assert model.mjp.unk_embed.grad.abs().sum() > 0 and torch.isfinite(model.mjp_aux_loss())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    embed = loaded["patch_embed"]  # the copy's embedding reads the copy's state and table
    assert embed.__dict__["_mjp_state"] is loaded.mjp and embed.__dict__["_mjp_level"] is loaded["levels_0"]
    loaded.eval()
    with torch.no_grad(), model.mjp_eval(seed=2), loaded.mjp_eval(seed=2):
        for got, expected in zip(loaded(images), model(images), strict=True):
            assert torch.equal(got, expected)


def test_checkpoints_both_ways_and_pickling():
    plain = _plain().eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    with torch.no_grad():
        model.mjp.unk_embed.normal_()
    # plain timm -> MJP: only mjp.* missing; MJP -> plain timm: only mjp.* unexpected
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert missing and all(key.startswith("mjp.") for key in missing) and not unexpected
    other = _plain().eval()
    with torch.no_grad():
        other.levels[0].pos_embed.zero_()
    missing, unexpected = other.load_state_dict(model.state_dict(), strict=False)
    assert unexpected and all(key.startswith("mjp.") for key in unexpected) and not missing
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(other(images), model(images), rtol=0, atol=0)
    model.train()
    model(images)  # a training forward keeps the table's rows for mjp_aux_loss: copies and pickles drop them
    model.eval()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.patch_embed.__dict__["_mjp_level"] is loaded.levels[0]  # the copy's embedding reads its own table
    assert loaded.patch_embed.__dict__["_mjp_state"] is loaded.mjp
    assert loaded.patch_embed.__dict__["_mjp_kept_rows"].rows is None
    with torch.no_grad(), model.mjp_eval(seed=2), loaded.mjp_eval(seed=2):
        assert torch.equal(loaded(images), model(images))
    copied = copy.deepcopy(model)
    assert copied.patch_embed.__dict__["_mjp_level"] is copied.levels[0]
    copied.train()
    copied(images).sum().backward()
    assert torch.isfinite(copied.mjp_aux_loss()) and copied.levels[0].pos_embed.grad is not None


def test_the_coverage_sweeps_check_passes():
    record = check_model("nest_tiny", dict(img_size=32), 32)
    assert record["ok"], f"{record['steps']}\n{record.get('traceback', '')}"
    assert (record["path"], record["mjp"], record["patch_size"], record["fused"]) == (
        "token", "UNK on the table", 4, False,
    )  # fmt: skip
