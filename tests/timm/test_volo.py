"""MJP's token path for timm's VOLO (mjp_fast/timm/volo.py, issue 40 item 1): convert, eval equal to timm's, a
training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the step against a pure-torch
expectation (timm's stem, outlooker and Downsample on the images jigsawed in 16-pixel blocks, ``unk_embed`` at the
masked positions, the table's rows elsewhere), DAL on those rows, FX (plain and timm's feature extractor),
``forward_intermediates``, ``features_only``, checkpoints both ways and pickling, the refusals, and the coverage
sweep's check."""

from __future__ import annotations

import copy
import io

import pytest
import timm
import torch
from packaging.version import Version
from timm.layers import is_notrace_module
from timm.models._features_fx import create_feature_extractor
from timm.models.volo import _create_volo

import mjp_fast
import mjp_fast.timm as mjp_timm
from bench.timm_coverage import check_model
from mjp_fast.timm.convert import runs_fused
from mjp_fast.timm.volo import MJPVOLO

# volo_d1's layout at width 16, one block per stage. The stem works at 1/8, the table's grid at 1/16: a 4x4 grid of
# 16-px blocks on 64 px; on 72 px the blocks cover the top-left 64x64 and an 8-px strip stays.
TINY = dict(layers=(1, 1, 1, 1), embed_dims=(16, 16, 16, 16), num_heads=(2, 2, 2, 2), stem_hidden_dim=8, num_classes=5)
MODELS = {
    "volo": dict(TINY, img_size=64),
    "margin": dict(TINY, img_size=72),
    "no_class_token": dict(TINY, img_size=64, post_layers=None, global_pool="avg"),
}
SETTINGS = dict(ratio=0.5, prob=1.0, min_block=1)  # small grids: min_block 1 so that the sampler masks positions


def _plain(kind: str = "volo", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = _create_volo("volo_d1_224", pretrained=False, **{**MODELS[kind], **overrides})
    with torch.no_grad():  # timm's init leaves the outputs nearly blind to their input: scaled so that a jigsaw shows
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.mul_(5.0)
    return model


def _images(kind: str = "volo", batch: int = 2) -> torch.Tensor:
    side = MODELS[kind]["img_size"]
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(1))


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
    assert isinstance(model, MJPVOLO) and model.mjp.unk_embed is not None and model.mjp.dal_regressor is not None
    assert model.mjp.patch_size == 16 and tuple(model.mjp.sampler.grid_size) == (4, 4)
    assert "mjp.unk_embed" in model.no_weight_decay() and not runs_fused(model)
    images = _images(kind)
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
    assert model.mjp.last_jigsaw.mask.any() and (jigsawed - expected).abs().max() > 1e-3
    plain.load_state_dict(model.state_dict(), strict=False)  # the BatchNorm statistics of the training forward
    with torch.no_grad():  # outside mjp_eval: timm's again
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["volo", "margin"])
def test_the_step_is_unk_on_the_table_of_the_jigsawed_images(kind):
    """Inside mjp_eval, the tokens timm adds ``pos_embed`` to are timm's stem, outlooker stage and Downsample of the
    images whose top-left 16-px blocks were jigsawed (the strip past them untouched); the sum is those tokens plus
    ``unk_embed`` at the masked positions and the table's own row elsewhere (within the rounding of timm's
    ``+ pos_embed`` after the hook)."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    plain = _plain(kind).eval()
    images = _images(kind)
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got = model.network[1](model.network[0](model.patch_embed(images).permute(0, 2, 3, 1))) + model.pos_embed
        jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.shape == (2, 16) and jigsaw.mask.any() and (jigsaw.perm != torch.arange(16)).any()
    with torch.no_grad():
        stem = plain.patch_embed(_jigsaw_ref(images, jigsaw.perm, 4, 4, 16)).permute(0, 2, 3, 1)
        tokens = plain.network[1](plain.network[0](stem))  # [B, 4, 4, D]
    mask = jigsaw.mask.reshape(2, 4, 4, 1)
    unk = model.mjp.unk_embed.reshape(1, 1, 1, -1).expand_as(tokens)
    expected = tokens + torch.where(mask, unk, model.pos_embed.expand_as(tokens))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_dal_regresses_the_tables_rows_and_mjp_aux_loss_replaces_the_attached_weight():
    model = mjp_timm.convert(_plain(), **SETTINGS).train()
    twin = copy.deepcopy(model)
    images = _images()
    out = model(images)
    table_rows = torch.stack([model.pos_embed[0, i, j] for i in range(4) for j in range(4)]).unsqueeze(0)
    expected = mjp_fast.dal_loss(
        table_rows, model.mjp.dal_regressor, (4, 4), model.mjp.last_jigsaw.mask, backend="torch"
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
    with pytest.raises(ValueError, match=r"fused_patch_embed=True: VOLO's stem is three overlapping convolutions"):
        mjp_timm.convert(_plain(), fused_patch_embed=True)
    with pytest.raises(ValueError, match=r"pixel_jigsaw=True: model .*VOLO.* token path covers"):
        mjp_timm.convert(_plain(), pixel_jigsaw=True)
    other = _plain()
    other.network[1] = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"network\[1\] is a Identity, not timm's VOLO Downsample"):
        mjp_timm.convert(other)
    assert isinstance(mjp_timm.convert(_plain(), fused_patch_embed=False), MJPVOLO)


class _LeafTracer(torch.fx.Tracer):
    """torch.fx's tracer with the modules timm marks as not traceable kept as calls, as timm's feature extractor."""

    def is_leaf_module(self, module: torch.nn.Module, qualified_name: str) -> bool:
        return is_notrace_module(type(module)) or super().is_leaf_module(module, qualified_name)


@pytest.mark.filterwarnings("ignore:.*The nodes obtained by tracing the model in")
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(training):
    model = mjp_timm.convert(_plain(), **SETTINGS).train(training)
    images = _images()
    graph = torch.fx.GraphModule(model, _LeafTracer().trace(model))
    targets = [node.target for node in graph.graph.nodes if node.op == "call_module"]
    assert targets.count("mjp") == (2 if training else 0)  # the images' jigsaw, then the step on the tokens
    with torch.no_grad():
        if training:
            assert graph(images).shape == (2, 5) and model.mjp.last_jigsaw.mask.any()
            model.mjp.sampler.sample_counter.zero_()  # the graph's MJP equals the model's: the same jigsaws
            eager = model(images)
            model.mjp.sampler.sample_counter.zero_()
            torch.testing.assert_close(graph(images), eager, rtol=0, atol=0)
        else:
            torch.testing.assert_close(graph(images), model(images), rtol=0, atol=0)
    extractor = create_feature_extractor(model, return_nodes={"network.2": "stage1", "norm": "norm"})
    with torch.no_grad():
        features = extractor(images)
    assert features["stage1"].shape == (2, 4, 4, 16) and features["norm"].shape == (2, 17, 16)


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
    assert [tuple(f.shape[-2:]) for f in jigsawed] == [(8, 8), (4, 4), (4, 4), (4, 4)]
    assert not torch.allclose(jigsawed[1], expected[1])
    model.train()
    final, _ = model.forward_intermediates(images)
    final.sum().backward()
    assert model.mjp.unk_embed.grad is not None and model.mjp.last_dal_loss is not None


def test_features_only():
    torch.manual_seed(0)
    wrapper = _create_volo("volo_d1_224", pretrained=False, features_only=True, out_indices=(0, 1, 3), **MODELS["volo"])
    plain = copy.deepcopy(wrapper).eval()
    model = mjp_timm.convert(wrapper, **SETTINGS).eval()
    assert isinstance(model.model, MJPVOLO) and model.mjp is model.model.mjp
    images = _images()
    with torch.no_grad():
        for got, expected in zip(model(images), plain(images), strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5):
            jigsawed = model(images)
    assert not torch.allclose(jigsawed[1], plain(images)[1])
    model.train()
    sum(feature.square().mean() for feature in model(images)).backward()
    assert model.mjp.unk_embed.grad is not None and model.mjp.last_dal_loss is not None


@pytest.mark.skipif(
    Version(timm.__version__) < Version("1.0.30"),
    reason=f"timm {timm.__version__} keeps the table of a VOLO pruned before it is added (unused; 1.0.31 drops it)",
)
def test_a_volo_cut_before_its_table_gets_the_pixel_jigsaw():
    torch.manual_seed(0)
    wrapper = _create_volo("volo_d1_224", pretrained=False, features_only=True, out_indices=(0,), **MODELS["volo"])
    assert wrapper.model.pos_embed is None
    model = mjp_timm.convert(wrapper, **SETTINGS)
    assert not isinstance(model.model, MJPVOLO) and model.mjp.unk_embed is None and model.mjp.patch_size == 8


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
        other.pos_embed.zero_()
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
    assert loaded.network[1].__dict__["_mjp_model"] is loaded  # the copy's step reads the copy's table
    assert loaded.patch_embed.__dict__["_mjp_state"] is loaded.mjp
    assert loaded.network[1].__dict__["_mjp_kept_rows"].rows is None
    with torch.no_grad(), model.mjp_eval(seed=2), loaded.mjp_eval(seed=2):
        assert torch.equal(loaded(images), model(images))
    copied = copy.deepcopy(model)
    assert copied.network[1].__dict__["_mjp_model"] is copied
    copied.train()
    copied(images).sum().backward()
    assert torch.isfinite(copied.mjp_aux_loss()) and copied.pos_embed.grad is not None


def test_the_coverage_sweeps_check_passes():
    record = check_model("volo_d1_224", dict(img_size=64), 64)
    assert record["ok"], f"{record['steps']}\n{record.get('traceback', '')}"
    assert (record["path"], record["mjp"], record["patch_size"], record["fused"]) == (
        "token", "UNK on the table", 16, False,
    )  # fmt: skip
