"""MJP's token path for timm's PiT (mjp_fast/timm/pit.py, issue 40 items 1 and 5): convert, eval equal to timm's,
a training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the step against a
pure-torch jigsaw of the images' top-left blocks, DAL on the NCHW table's rows, FX (plain and timm's feature
extractor), ``forward_intermediates``, ``features_only``, checkpoints both ways and pickling, a distilled PiT; and
timm's own model checks on a registered ``mjp_pit_ti_224``."""

from __future__ import annotations

import copy
import io

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models import get_graph_node_names
from timm.models._features_fx import create_feature_extractor

import mjp_fast
import mjp_fast.timm as mjp_timm
from mjp_fast.timm import register
from mjp_fast.timm.convert import runs_fused
from mjp_fast.timm.pit import MJPPoolingVisionTransformer, PitConvEmbedding

# Width 8 x 2 heads = 16, one block per stage. Kernel 4 at stride 2 on 32 pixels: a 15x15 grid whose blocks of 2
# pixels cover the top-left 30x30 pixels (the last 2 rows and columns are only the far edge of the last kernels).
TINY = dict(img_size=32, patch_size=4, stride=2, base_dims=[8, 8, 8], depth=[1, 1, 1], heads=[2, 2, 2], num_classes=5)
MODELS = {
    "pit": ("pit_ti_224", TINY),
    "distilled": ("pit_ti_distilled_224", TINY),
    "tiled": ("pit_ti_224", {**TINY, "patch_size": 2}),  # kernel == stride: a 16x16 grid that tiles the image
}
SETTINGS = dict(ratio=0.5, prob=1.0, min_block=1)  # small grids: min_block 1 so that the sampler masks positions


def _plain(kind: str, **overrides) -> torch.nn.Module:
    name, keywords = MODELS[kind]
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **{**keywords, **overrides})


def _images(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _jigsaw_ref(images: torch.Tensor, perm: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    """Pure torch: the top-left ``rows x cols`` blocks of ``block`` pixels of ``images`` moved as ``perm`` says
    (position n gets block ``perm[n]``), the other pixels where they were."""
    out = images.clone()
    for b in range(images.shape[0]):
        for n in range(rows * cols):
            src = int(perm[b, n])
            (i, j), (si, sj) = divmod(n, cols), divmod(src, cols)
            out[b, :, i * block : (i + 1) * block, j * block : (j + 1) * block] = images[
                b, :, si * block : (si + 1) * block, sj * block : (sj + 1) * block
            ]
    return out


@pytest.mark.parametrize("kind", list(MODELS))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, MJPPoolingVisionTransformer) and isinstance(model.patch_embed, PitConvEmbedding)
    assert model.mjp.unk_embed is not None and model.mjp.dal_regressor is not None
    assert model.mjp.patch_size == 2 and tuple(model.mjp.sampler.grid_size) == tuple(model.patch_embed.grid_size)
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
    assert model.pos_embed.grad.abs().sum() > 0 and model.mjp.unk_embed.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=0):
        jigsawed = model(images)
    assert model.mjp.last_jigsaw.mask.any() and not torch.allclose(jigsawed, expected)
    with torch.no_grad():  # outside mjp_eval: timm's again
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["pit", "tiled"])
def test_the_step_is_unk_on_the_table_of_the_jigsawed_images(kind):
    """Inside mjp_eval, the feature map timm's first stage gets is timm's embedding of the images whose top-left
    blocks were jigsawed (the rest untouched), plus ``unk_embed`` at the masked positions and the table's own rows
    elsewhere (within the rounding of timm's ``+ pos_embed`` after the hook)."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    images = _images()
    rows, cols = model.patch_embed.grid_size
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got = model.pos_drop(model.patch_embed(images) + model.pos_embed)
        jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.shape == (2, rows * cols) and jigsaw.mask.any()
    assert (jigsaw.perm != torch.arange(rows * cols)).any()  # something moved
    with torch.no_grad():
        tokens = model.patch_embed.conv(_jigsaw_ref(images, jigsaw.perm, rows, cols, 2))
    mask = jigsaw.mask.reshape(2, 1, rows, cols)
    unk = model.mjp.unk_embed.reshape(1, -1, 1, 1).expand_as(tokens)
    expected = tokens + torch.where(mask, unk, model.pos_embed.expand_as(tokens))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if kind == "tiled":  # kernel == stride: each token is its own block's, so the tokens themselves moved
        with torch.no_grad():
            plain_tokens = model.patch_embed(images).flatten(2).transpose(1, 2)  # eval: timm's embedding
        moved = plain_tokens.gather(1, jigsaw.perm.unsqueeze(-1).expand_as(plain_tokens))
        torch.testing.assert_close(tokens.flatten(2).transpose(1, 2), moved, rtol=1e-5, atol=1e-6)


def test_the_margin_outside_the_blocks_is_not_moved():
    """The pixels below and right of the token grid's blocks (the last 2 rows and columns here) reach the embedding
    as they were: with a kernel that reads only its bottom-right 2x2 pixels, the last row and column of tokens read
    only that margin, and are the same inside and outside mjp_eval."""
    model = mjp_timm.convert(_plain("pit"), **SETTINGS).eval()
    with torch.no_grad():
        model.patch_embed.conv.weight.zero_()
        model.patch_embed.conv.weight[:, :, 2:, 2:] = 1.0  # token (i, j) reads block (i + 1, j + 1) only
        model.mjp.unk_embed.zero_()  # no position terms: the tokens are the embedding's
        model.pos_embed.zero_()
    images = _images()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        jigsawed = model.patch_embed(images)
    with torch.no_grad():
        plain = model.patch_embed(images)
    torch.testing.assert_close(jigsawed[..., -1, :], plain[..., -1, :], rtol=0, atol=0)
    torch.testing.assert_close(jigsawed[..., :, -1], plain[..., :, -1], rtol=0, atol=0)
    assert not torch.equal(jigsawed, plain)


def test_dal_regresses_the_tables_rows_and_mjp_aux_loss_replaces_the_attached_weight():
    model = mjp_timm.convert(_plain("pit"), **SETTINGS).train()
    twin = copy.deepcopy(model)
    images = _images()
    out = model(images)
    rows, cols = model.patch_embed.grid_size
    table_rows = model.pos_embed.permute(0, 2, 3, 1).reshape(1, rows * cols, -1)  # row-major, [1, N, D]
    expected = mjp_fast.dal_loss(
        table_rows, model.mjp.dal_regressor, (rows, cols), model.mjp.last_jigsaw.mask, backend="torch"
    )
    torch.testing.assert_close(model.mjp.last_dal_loss, expected.detach())
    # A loop that adds w * mjp_aux_loss() counts DAL at w in place of the attached weight (never both): the same
    # gradients as a model whose attached weight is w and whose loop adds nothing.
    (out.sum() + 0.5 * model.mjp_aux_loss()).backward()
    twin.mjp_dal_weight = 0.5
    twin(images).sum().backward()
    for (name, got), want in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=lambda message, name=name: f"{name}: {message}")


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match=r"fused_patch_embed=True: patch_embed is PiT's ConvEmbedding"):
        mjp_timm.convert(_plain("pit"), fused_patch_embed=True)
    with pytest.raises(ValueError, match=r"pixel_jigsaw=True: model .*PoolingVisionTransformer.* token path covers"):
        mjp_timm.convert(_plain("pit"), pixel_jigsaw=True)
    padded = _plain("pit")
    padded.patch_embed.conv.padding = (1, 1)
    with pytest.raises(ValueError, match=r"padding \(1, 1\).*does not start at a whole block"):
        mjp_timm.convert(padded)
    assert isinstance(mjp_timm.convert(_plain("pit"), fused_patch_embed=False), MJPPoolingVisionTransformer)


class _Tracer(torch.fx.Tracer):
    pass


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(training):
    model = mjp_timm.convert(_plain("pit"), **SETTINGS).train(training)
    images = _images()
    graph = torch.fx.GraphModule(model, _Tracer().trace(model))
    targets = [node.target for node in graph.graph.nodes if node.op == "call_module"]
    assert targets.count("mjp") == (2 if training else 0)  # the images' jigsaw, then the step on the tokens
    with torch.no_grad():
        if training:
            out = graph(images)
            assert out.shape == (2, 5) and model.mjp.last_jigsaw.mask.any()
        else:
            torch.testing.assert_close(graph(images), model(images), rtol=0, atol=0)
    if training:  # the graph's MJP equals the model's: the same jigsaws from the same stream position
        model.mjp.sampler.sample_counter.zero_()
        with torch.no_grad():
            eager = model(images)
        model.mjp.sampler.sample_counter.zero_()
        with torch.no_grad():
            torch.testing.assert_close(graph(images), eager, rtol=0, atol=0)
    extractor = create_feature_extractor(model, return_nodes={"transformers.0": "stage0", "norm": "norm"})
    with torch.no_grad():
        features = extractor(images)
    assert features["stage0"].shape == (2, 16, 15, 15) and features["norm"].shape == (2, 1, 16)


def test_forward_intermediates():
    plain = _plain("pit").eval()
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
    assert [tuple(f.shape[-2:]) for f in jigsawed] == [(15, 15), (8, 8), (4, 4)]
    assert not torch.allclose(jigsawed[0], expected[0])
    model.train()
    final, _ = model.forward_intermediates(images)
    final.sum().backward()
    assert model.mjp.unk_embed.grad is not None and model.mjp.last_dal_loss is not None


def test_features_only():
    name, keywords = MODELS["pit"]
    torch.manual_seed(0)
    wrapper = timm.create_model(name, pretrained=False, features_only=True, out_indices=(0, 1, 2), **keywords)
    plain = copy.deepcopy(wrapper).eval()
    model = mjp_timm.convert(wrapper, **SETTINGS).eval()
    images = _images()
    with torch.no_grad():
        for got, expected in zip(model(images), plain(images), strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    model.train()
    sum(feature.square().mean() for feature in model(images)).backward()
    assert model.mjp.unk_embed.grad is not None and model.mjp.last_dal_loss is not None


@pytest.mark.parametrize("kind", ["pit", "distilled"])
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    with torch.no_grad():
        model.mjp.unk_embed.normal_()
    # plain timm -> MJP: only mjp.* missing; MJP -> plain timm: only mjp.* unexpected
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert missing and all(key.startswith("mjp.") for key in missing) and not unexpected
    other = _plain(kind).eval()
    with torch.no_grad():
        other.pos_embed.zero_()
    missing, unexpected = other.load_state_dict(model.state_dict(), strict=False)
    assert unexpected and all(key.startswith("mjp.") for key in unexpected) and not missing
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(other(images), model(images), rtol=0, atol=0)
    model.train()
    model(images)  # a training forward keeps a view of the table for mjp_aux_loss: copies and pickles drop it
    model.eval()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.patch_embed.__dict__["_mjp_model"] is loaded  # the copy's embedding reads the copy's table
    assert loaded.patch_embed.__dict__["_mjp_table_view"].view is None
    with torch.no_grad(), model.mjp_eval(seed=2), loaded.mjp_eval(seed=2):
        assert torch.equal(loaded(images), model(images))
    copied = copy.deepcopy(model)
    assert copied.patch_embed.__dict__["_mjp_model"] is copied
    copied.train()
    copied(images).sum().backward()
    assert torch.isfinite(copied.mjp_aux_loss())


def test_distilled_heads_both_train():
    model = mjp_timm.convert(_plain("distilled"), **SETTINGS).train()
    model.set_distilled_training(True)
    logits, distilled = model(_images())
    (F.cross_entropy(logits, torch.tensor([0, 1])) + F.cross_entropy(distilled, torch.tensor([2, 3]))).backward()
    assert model.cls_token.shape[1] == 2 and model.cls_token.grad[:, 1].abs().sum() > 0
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing


# --- issue 40 item 5: timm's own model checks on a registered mjp_ PiT -------------------------------------------

REGISTERED = "pit_ti_224"
MJP = dict(mjp_ratio=0.5, mjp_prob=1.0)


def _create(**keywords) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(register(REGISTERED), pretrained=False, **{**TINY, **MJP, **keywords})


def test_registered_forward_and_backward_reach_every_parameter():
    model = _create().train()
    assert isinstance(model, MJPPoolingVisionTransformer)
    assert model.pretrained_cfg["architecture"] == f"mjp_{REGISTERED}"
    out = model(_images())
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    out.mean().backward()
    missing = [name for name, parameter in model.named_parameters() if parameter.grad is None]
    assert not missing, missing
    assert model.mjp.unk_embed.grad.abs().sum() > 0 and model.mjp.last_dal_loss is not None


def test_registered_forward_features_head_and_intermediates():
    model = _create().eval()
    images = _images()
    with torch.no_grad():
        features = model.forward_features(images)
        torch.testing.assert_close(model.forward_head(features), model(images))
        final, intermediates = model.forward_intermediates(images, indices=2)
    assert [tuple(feature.shape) for feature in intermediates] == [(2, 16, 8, 8), (2, 16, 4, 4)]
    torch.testing.assert_close(final, features)


def test_registered_features_only():
    model = _create(features_only=True, out_indices=(0, 1, 2)).train()
    features = model(_images())
    assert [tuple(feature.shape[-2:]) for feature in features] == [(15, 15), (8, 8), (4, 4)]
    sum(feature.mean() for feature in features).backward()
    assert model.mjp.unk_embed.grad is not None


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
def test_registered_fx_feature_extractor_equals_eager():
    model = _create().eval()
    train_nodes, eval_nodes = get_graph_node_names(model)
    assert any("mjp" in node for node in train_nodes) and not any("mjp" in node for node in eval_nodes)
    extractor = create_feature_extractor(model, return_nodes=[eval_nodes[-1]])
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(extractor(images)[eval_nodes[-1]], model(images))
