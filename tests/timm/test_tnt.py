"""MJP's token path for timm's TNT (mjp_fast/timm/tnt.py, issue 40 item 1): convert, eval equal to timm's, a training
step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the step against a pure-torch jigsaw
(inner and outer tokens move with their patch, ``unk_embed`` in place of the masked positions' ``patch_pos`` rows,
``pixel_pos`` kept), DAL on the patch rows, FX (plain and timm's feature extractor), ``forward_intermediates``,
``features_only``, checkpoints both ways and pickling; the legacy pixel embedding too."""

from __future__ import annotations

import copy
import io

import pytest
import timm
import torch
from timm.models import get_graph_node_names
from timm.models._features_fx import create_feature_extractor

import mjp_fast
import mjp_fast.timm as mjp_timm
from mjp_fast.timm.convert import runs_fused
from mjp_fast.timm.tnt import MJPTNT, TntOuterTokensLayerNorm, TntPixelEmbed

# 32 pixels in 8-pixel patches: a 4x4 grid; inside each patch a stride-4 convolution gives 2x2 inner tokens of width 8.
TINY = dict(
    img_size=32, patch_size=8, embed_dim=32, inner_dim=8, depth=2, num_heads_inner=2, num_heads_outer=2, num_classes=5
)
KINDS = {"tnt": dict(legacy=False), "legacy": dict(legacy=True)}  # legacy: the convolution over the whole image
SETTINGS = dict(ratio=0.5, prob=1.0, min_block=1)  # a 4x4 grid: min_block 1 so that the sampler masks positions


def _plain(kind: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("tnt_s_patch16_224", pretrained=False, **{**TINY, **KINDS[kind], **overrides})


def _images(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _jigsaw_ref(images: torch.Tensor, perm: torch.Tensor, cols: int, block: int) -> torch.Tensor:
    """Pure torch: position n of a grid with ``cols`` columns of ``block``-pixel squares gets square ``perm[n]``."""
    out = images.clone()
    for b in range(images.shape[0]):
        for n, src in enumerate(perm[b].tolist()):
            (i, j), (si, sj) = divmod(n, cols), divmod(src, cols)
            out[b, :, i * block : (i + 1) * block, j * block : (j + 1) * block] = images[
                b, :, si * block : (si + 1) * block, sj * block : (sj + 1) * block
            ]
    return out


def _tokens(model: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's first lines of ``TNT.forward_features``: the inner tokens ``[B * N, p * p, C]`` and the outer tokens
    plus ``patch_pos`` ``[B, 1 + N, D]`` that the blocks get."""
    batch = images.shape[0]
    pixel = model.pixel_embed(images, model.pixel_pos)
    outer = model.norm2_proj(model.proj(model.norm1_proj(pixel.reshape(batch, model.num_patches, -1))))
    outer = torch.cat((model.cls_token.expand(batch, -1, -1), outer), dim=1)
    return pixel, model.pos_drop(outer + model.patch_pos)


@pytest.mark.parametrize("kind", list(KINDS))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, MJPTNT) and isinstance(model.pixel_embed, TntPixelEmbed)
    assert isinstance(model.norm2_proj, TntOuterTokensLayerNorm) and not runs_fused(model)
    assert model.mjp.unk_embed is not None and model.mjp.dal_regressor is not None and model.mjp.patch_size == 8
    assert tuple(model.mjp.sampler.grid_size) == (4, 4) and "mjp.unk_embed" in model.no_weight_decay()
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
    assert model.patch_pos.grad.abs().sum() > 0 and model.mjp.unk_embed.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=0):
        jigsawed = model(images)
    assert model.mjp.last_jigsaw.mask.any() and not torch.allclose(jigsawed, expected)
    with torch.no_grad():  # outside mjp_eval: timm's again
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(KINDS))
def test_patches_move_whole_and_masked_ones_get_unk(kind):
    """Inside mjp_eval: the inner tokens are timm's of the jigsawed images (``pixel_pos`` as it is), the outer
    tokens timm's of the jigsawed images plus ``unk_embed`` at the masked positions and their own ``patch_pos`` row
    elsewhere, the class token timm's. TNT's embedding is patch-local: moving the images' patches moved its tokens,
    inner and outer together (the legacy one's convolution also sees the neighbours' border pixels)."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    images = _images()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        pixel, outer = _tokens(model, images)
        jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.shape == (2, 16) and jigsaw.mask.any() and (jigsaw.perm != torch.arange(16)).any()
    with torch.no_grad():  # eval: timm's embedding
        expected_pixel, plain_outer = _tokens(model, _jigsaw_ref(images, jigsaw.perm, 4, 8))
        plain_outer = plain_outer - model.patch_pos
    torch.testing.assert_close(pixel, expected_pixel, rtol=0, atol=0)
    mask = jigsaw.mask.unsqueeze(-1)
    patch_rows = model.patch_pos[:, 1:].expand(2, -1, -1)
    expected = plain_outer[:, 1:] + torch.where(mask, model.mjp.unk_embed.expand_as(patch_rows), patch_rows)
    torch.testing.assert_close(outer[:, 1:], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outer[:, 0], (model.cls_token + model.patch_pos[:, :1])[:, 0].expand(2, -1))
    if kind == "tnt":  # the tokens of the unjigsawed images, moved as the jigsaw says
        with torch.no_grad():
            unmoved_pixel, unmoved_outer = _tokens(model, images)
        index = jigsaw.perm.reshape(2, 16, 1, 1).expand(-1, -1, 4, 8)
        moved = unmoved_pixel.reshape(2, 16, 4, 8).gather(1, index)
        torch.testing.assert_close(expected_pixel.reshape(2, 16, 4, 8), moved, rtol=1e-5, atol=1e-6)
        unmoved = (unmoved_outer - model.patch_pos)[:, 1:]
        moved = unmoved.gather(1, jigsaw.perm.unsqueeze(-1).expand_as(unmoved))
        torch.testing.assert_close(plain_outer[:, 1:], moved, rtol=1e-5, atol=1e-5)


def test_dal_regresses_the_patch_rows_and_mjp_aux_loss_replaces_the_attached_weight():
    model = mjp_timm.convert(_plain("tnt"), **SETTINGS).train()
    twin = copy.deepcopy(model)
    images = _images()
    out = model(images)
    expected = mjp_fast.dal_loss(
        model.patch_pos[:, 1:], model.mjp.dal_regressor, (4, 4), model.mjp.last_jigsaw.mask, backend="torch"
    )
    torch.testing.assert_close(model.mjp.last_dal_loss, expected.detach())
    # A loop adding w * mjp_aux_loss() counts DAL at w in place of the attached weight: as a model attaching at w.
    (out.sum() + 0.5 * model.mjp_aux_loss()).backward()
    twin.mjp_dal_weight = 0.5
    twin(images).sum().backward()
    for (name, got), want in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=lambda message, name=name: f"{name}: {message}")


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match=r"fused_patch_embed=True: TNT's pixel_embed .* not timm's PatchEmbed"):
        mjp_timm.convert(_plain("tnt"), fused_patch_embed=True)
    with pytest.raises(ValueError, match=r"pixel_jigsaw=True: model .*TNT.* token path covers"):
        mjp_timm.convert(_plain("tnt"), pixel_jigsaw=True)
    odd = _plain("legacy", img_size=36, patch_size=6)  # a stride-4 convolution does not step evenly over 6 pixels
    with pytest.raises(ValueError, match=r"legacy pixel embedding: the patch size \(6, 6\) is not a multiple"):
        mjp_timm.convert(odd)


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(training):
    model = mjp_timm.convert(_plain("tnt"), **SETTINGS).train(training)
    images = _images()
    graph = torch.fx.GraphModule(model, torch.fx.Tracer().trace(model))
    targets = [node.target for node in graph.graph.nodes if node.op == "call_module"]
    assert targets.count("mjp") == (2 if training else 0)  # the images' jigsaw, then the step on the outer tokens
    with torch.no_grad():
        if not training:
            torch.testing.assert_close(graph(images), model(images), rtol=0, atol=0)
        else:  # the same jigsaws from the same stream position: the graph's MJP is the model's
            model.mjp.sampler.sample_counter.zero_()
            eager = model(images)
            model.mjp.sampler.sample_counter.zero_()
            torch.testing.assert_close(graph(images), eager, rtol=0, atol=0)
            assert model.mjp.last_jigsaw.mask.any()
    train_nodes, eval_nodes = get_graph_node_names(model)
    assert any("mjp" in node for node in train_nodes) and not any("mjp" in node for node in eval_nodes)
    extractor = create_feature_extractor(model, return_nodes={eval_nodes[-1]: "out", "norm": "norm"})
    with torch.no_grad():
        features = extractor(images)
        assert features["norm"].shape == (2, 17, 32)
        if not training:
            torch.testing.assert_close(features["out"], model(images), rtol=0, atol=0)


def test_forward_intermediates():
    plain = _plain("tnt").eval()
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
    assert [tuple(f.shape) for f in jigsawed] == [(2, 32, 4, 4)] * 2
    assert not torch.allclose(jigsawed[0], expected[0])
    model.train()
    final, _ = model.forward_intermediates(images)
    final.sum().backward()
    assert model.mjp.unk_embed.grad is not None and model.mjp.last_dal_loss is not None


def test_features_only():
    torch.manual_seed(0)
    wrapper = timm.create_model("tnt_s_patch16_224", pretrained=False, features_only=True, out_indices=(0, 1), **TINY)
    plain = copy.deepcopy(wrapper).eval()
    model = mjp_timm.convert(wrapper, **SETTINGS).eval()
    assert model.mjp is model.model.mjp and isinstance(model.model.pixel_embed, TntPixelEmbed)
    images = _images()
    with torch.no_grad():
        for got, expected in zip(model(images), plain(images), strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5):
            jigsawed = model(images)
    assert jigsawed[0].shape == (2, 32, 4, 4) and not torch.allclose(jigsawed[0], plain(images)[0])
    model.train()
    sum(feature.square().mean() for feature in model(images)).backward()
    assert model.model.mjp.unk_embed.grad is not None and model.model.mjp.last_dal_loss is not None


@pytest.mark.parametrize("kind", list(KINDS))
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
        other.patch_pos.zero_()
    missing, unexpected = other.load_state_dict(model.state_dict(), strict=False)
    assert unexpected and all(key.startswith("mjp.") for key in unexpected) and not missing
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(other(images), model(images), rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    # the copy's swapped modules read the copy's tables and state
    assert loaded.pixel_embed.__dict__["_mjp_model"] is loaded and loaded.norm2_proj.__dict__["_mjp_model"] is loaded
    with torch.no_grad(), model.mjp_eval(seed=2), loaded.mjp_eval(seed=2):
        assert torch.equal(loaded(images), model(images))
    copied = copy.deepcopy(model)
    assert copied.pixel_embed.__dict__["_mjp_model"] is copied and copied.norm2_proj.__dict__["_mjp_model"] is copied
