"""The pixel-space jigsaw for every timm image model without an absolute position table (issue 40, item 2), and the
refusals: a tiny model of several families through the coverage sweep's checks (bench/timm_coverage.py: convert,
eval output = timm's, a training step in which every parameter gets a gradient from the output alone, ``mjp_eval``
changes the output, the state dict round trip), the jigsaw against its definition, ``features_only``, pickling, and
the models MJP refuses, by their messages."""

from __future__ import annotations

import copy
import pickle

import pytest
import timm
import torch

import mjp_fast.timm as mjp_timm
from bench.timm_coverage import check_model, family_models, name_rank
from mjp_fast import jigsaw_images
from mjp_fast.timm import base as mjp_base

# family -> (timm name, create_model keywords, input side, the jigsaw patch: the first stage's stride). Tiny widths and
# depths where the entry point takes them; each family's own code paths (stems, position encodings) stay.
PIXEL_FAMILIES: dict[str, tuple[str, dict, int, int]] = {
    "CNN (EfficientNet)": ("test_efficientnet", {}, 32, 2),
    "XCiT (Fourier encoding)": ("xcit_nano_12_p16_224", dict(img_size=64, depth=2), 64, 16),
    "LeViT (attention biases, 16 px stem)": ("levit_128s", dict(img_size=64, depth=(1, 1, 1)), 64, 16),
    "Twins (conditional position encoding)": (
        "twins_svt_small",
        dict(img_size=32, depths=(1, 1, 1, 1), embed_dims=(16, 32, 32, 64), num_heads=(1, 2, 2, 4)),
        32,
        4,
    ),
    "FastViT (RepCPE)": ("fastvit_t8", dict(layers=(1, 1, 1, 1)), 32, 4),
    "TinyViT": (
        "tiny_vit_5m_224",
        dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 32, 64), num_heads=(1, 1, 2, 2)),
        32,
        4,
    ),
}


class _UncoveredTableModel(torch.nn.Module):
    """A timm-like image model (``feature_info`` with its first stage's stride) with a learned absolute position
    table that no token-path front end covers (the last timm model refused so, SAM's ViT, has one now): the refusal of a
    table is tested on this one. Tokens ``[B, N, D]`` of 16-pixel patches plus ``pos_embed`` ``[1, N, D]``."""

    def __init__(self, dim: int = 8, grid: int = 2) -> None:
        super().__init__()
        self.proj = torch.nn.Conv2d(3, dim, 16, stride=16)
        self.pos_embed = torch.nn.Parameter(torch.zeros(1, grid * grid, dim))
        self.feature_info = [dict(module="proj", num_chs=dim, reduction=16)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x).flatten(2).transpose(1, 2) + self.pos_embed).mean(1)


@pytest.mark.parametrize("family", list(PIXEL_FAMILIES))
def test_each_pixel_family_converts_trains_evaluates_and_reloads(family):
    name, overrides, side, stride = PIXEL_FAMILIES[family]
    record = check_model(name, overrides, side)
    assert record["ok"], f"{family}: {record['steps']}\n{record.get('traceback', '')}"
    assert (record["path"], record["mjp"], record["patch_size"]) == ("pixel", "pixel jigsaw", stride)
    assert record["mjp_eval_jigsawed"]  # so the check that mjp_eval changes the output was made


def test_mvitv2_relative_positions_at_a_tiny_width():
    # timm's entry points take no depths for MViTv2 (its config is a dataclass): the class itself, one block a stage.
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    torch.manual_seed(0)
    plain = MultiScaleVit(MultiScaleVitCfg(depths=(1, 1, 1, 1), embed_dim=16, num_heads=1), img_size=64, num_classes=3)
    model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0)
    assert type(model).__name__ == "MJPMultiScaleVit" and model.mjp.patch_size == 4
    images = torch.randn(2, 3, 64, 64)
    model.eval(), plain.eval()
    torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)
    model.train()
    model(images).logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    torch.testing.assert_close(model(images), plain.train()(jigsaw_images(images, model.mjp.last_jigsaw, 4)))
    model.eval()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=0):
        assert not torch.equal(model(images), plain.eval()(images))
    reloaded = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0)
    reloaded.load_state_dict(model.state_dict())
    with torch.no_grad(), model.mjp_eval(seed=2), reloaded.mjp_eval(seed=2):
        assert torch.equal(reloaded(images), model(images))


def test_hiera_takes_the_token_path_in_the_sweep_and_the_pixel_jigsaw_is_refused_for_it():
    name, overrides = "hiera_tiny_224", dict(img_size=(32, 32), embed_dim=16, num_heads=1, stages=(1, 1, 1, 1))
    record = check_model(name, overrides, 32)
    assert record["ok"], f"{record['steps']}\n{record.get('traceback', '')}"
    assert (record["path"], record["mjp"], record["patch_size"]) == ("token", "UNK on the table", 4)
    refused = check_model(name, overrides, 32, convert_options=dict(pixel_jigsaw=True))
    assert refused["path"] == "refused" and "token path covers" in refused["refused"]


def _meta_model(name: str, **kwargs) -> torch.nn.Module:
    with torch.device("meta"):
        return timm.create_model(name, pretrained=False, **kwargs)


def test_a_learned_absolute_table_no_front_end_covers_is_refused_with_the_way_out():
    with pytest.raises(TypeError) as caught:
        mjp_timm.convert(_UncoveredTableModel())
    message = str(caught.value)
    assert message.startswith("model: _UncoveredTableModel has a learned absolute position table (pos_embed)")
    assert "token path" in message and "not built yet" in message
    assert "convert(model, pixel_jigsaw=True)" in message
    # the way out the message gives: the pixel-space jigsaw, the table kept as it is
    model = mjp_timm.convert(_UncoveredTableModel(), pixel_jigsaw=True)
    assert model.mjp.patch_size == 16 and model.mjp.unk_embed is None


def test_the_pixel_jigsaw_is_the_plain_model_on_jigsawed_images():
    torch.manual_seed(0)
    plain = timm.create_model("xcit_nano_12_p16_224", img_size=32, depth=1, num_classes=3)
    model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0, min_block=1)
    assert type(model).__name__ == "MJPXcit" and isinstance(model, type(plain))
    assert model.mjp.dal_regressor is None and model.mjp.unk_embed is None and model.mjp.patch_size == 16
    images = torch.randn(2, 3, 32, 32)
    model.train(), plain.train()
    out = model(images)
    jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.shape == (2, 4) and bool(jigsaw.mask.any())
    torch.testing.assert_close(out, plain(jigsaw_images(images, jigsaw, 16)))
    # forward_intermediates (what features_only's FeatureGetterNet calls) jigsaws its input too, once
    final, _ = model.forward_intermediates(images, indices=1)
    torch.testing.assert_close(final, plain.forward_intermediates(jigsaw_images(images, model.mjp.last_jigsaw, 16))[0])
    assert float(model.mjp_aux_loss()) == 0.0


def test_images_that_the_stride_does_not_divide_are_refused_in_training_as_before():
    model = mjp_timm.convert(timm.create_model("test_efficientnet", num_classes=3), prob=1.0)
    model.eval()
    assert model(torch.randn(1, 3, 33, 33)).shape == (1, 3)  # eval mode: the plain model, any size
    model.train()
    with pytest.raises(ValueError, match="height 33 and width 33 must be multiples of the jigsaw patch size 2"):
        model(torch.randn(1, 3, 33, 33))


def test_a_first_stage_at_full_resolution_jigsaws_at_the_first_downsampling_stride():
    # VGG's first feature stage is its first convolutions' output (stride 1): the jigsaw takes the next stage's, 2
    assert mjp_timm.convert(_meta_model("vgg11")).mjp.patch_size == 2
    model = _meta_model("vgg11")
    model.feature_info = [dict(info, reduction=1) for info in model.feature_info]  # no stage downsamples
    with pytest.raises(ValueError, match=r"vgg11 \(VGG\): none of its feature stages downsamples .*patch_size=N"):
        mjp_timm.convert(model)
    assert mjp_timm.convert(model, patch_size=8).mjp.patch_size == 8  # the caller's choice


def test_an_input_size_the_stride_does_not_divide_keeps_a_border_in_place():
    """Inception's 299 px in 2-pixel blocks: the largest region of whole blocks (298 px) is jigsawed, the last row
    and column stay where they are; models built for a multiple keep the strict check."""
    assert mjp_timm.convert(_meta_model("inception_v3")).mjp.border
    assert not mjp_timm.convert(timm.create_model("test_efficientnet")).mjp.border
    torch.manual_seed(0)
    plain = timm.create_model("test_efficientnet", num_classes=3)
    model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0, min_block=1)
    model.mjp.border = True  # as convert sets it for a model built for 299 px; test_efficientnet is small
    images = torch.randn(2, 3, 35, 33, requires_grad=True)
    jigsawed = model.mjp(images)
    jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.shape == (2, 17 * 16) and bool(jigsaw.mask.any())
    expected = images.detach().clone()
    expected[..., :34, :32] = jigsaw_images(images.detach()[..., :34, :32], jigsaw, 2)
    assert torch.equal(jigsawed.detach(), expected)
    jigsawed.sum().backward()  # every pixel's gradient: moved or kept, each pixel is used once
    assert torch.equal(images.grad, torch.ones_like(images))
    model.train()
    assert model(images.detach()).shape == (2, 3)
    with pytest.raises(ValueError, match="height 1 and width 33 must be multiples"):  # less than one block
        model.mjp(torch.randn(1, 3, 1, 33))


def test_bad_pixel_jigsaw_settings_are_named():
    with pytest.raises(TypeError, match="pixel_jigsaw must be a bool, got str 'yes'"):
        mjp_timm.convert(timm.create_model("test_efficientnet"), pixel_jigsaw="yes")
    vit = timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    with pytest.raises(ValueError, match="pixel_jigsaw=True: model deit_tiny_patch16_224 .* token path covers"):
        mjp_timm.convert(vit, pixel_jigsaw=True)
    assert mjp_timm.convert(timm.create_model("test_efficientnet"), pixel_jigsaw=True).mjp.patch_size == 2


@pytest.mark.parametrize(
    "name, kwargs, wrapper, stride",
    [
        ("regnetx_002", dict(out_indices=(1, 2)), "FeatureListNet", 2),  # module dict: mjp runs first
        ("test_efficientnet", dict(out_indices=(1, 2)), "EfficientNetFeatures", 2),  # a model class of its own
        ("xcit_nano_12_p16_224", dict(img_size=32, depth=2, out_indices=(1,)), "FeatureGetterNet", 16),
    ],
)
def test_features_only_of_the_new_families(name, kwargs, wrapper, stride):
    torch.manual_seed(0)
    plain = timm.create_model(name, features_only=True, **kwargs)
    assert type(plain).__name__ == wrapper
    model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0, min_block=1)
    assert model.mjp.patch_size == stride  # the unwrapped model's: the first stage's stride, not the legacy 16
    images = torch.randn(2, 3, 32, 32)
    model.eval(), plain.eval()
    for ours, theirs in zip(model(images), plain(images), strict=True):
        assert torch.equal(ours, theirs)
    model.train(), plain.train()
    features = model(images)
    jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.shape == (2, (32 // stride) ** 2) and bool(jigsaw.mask.any())
    if wrapper != "FeatureListNet":  # without BatchNorm batch statistics to differ: the plain model, jigsawed
        for ours, theirs in zip(features, plain(jigsaw_images(images, jigsaw, stride)), strict=True):
            torch.testing.assert_close(ours, theirs)


def test_a_generated_pixel_class_pickles_and_is_made_again_by_name():
    model = mjp_timm.convert(timm.create_model("test_efficientnet", num_classes=3), prob=1.0)
    data = pickle.dumps(model)
    generated = type(model)
    key = next(key for key, cls in mjp_base._SUBCLASSES.items() if cls is generated)
    del mjp_base._SUBCLASSES[key]  # as in a fresh process, where the class was never made
    try:
        loaded = pickle.loads(data)
        assert type(loaded) is not generated and type(loaded).__qualname__ == generated.__qualname__
        assert type(loaded).__name__ == "MJPEfficientNet" and isinstance(loaded, generated.__mro__[-3])
        images = torch.randn(1, 3, 32, 32)
        model.eval(), loaded.eval()
        torch.testing.assert_close(loaded(images), model(images))
        with loaded.mjp_eval(seed=1), model.mjp_eval(seed=1):
            torch.testing.assert_close(loaded(images), model(images))
    finally:
        mjp_base._SUBCLASSES[key] = generated
    with pytest.raises(AttributeError, match="has no attribute 'MJPNoSuchName'"):
        mjp_base.MJPNoSuchName  # noqa: B018 - the attribute lookup is the test


def test_the_legacy_classes_keep_their_classes_and_patches():
    resnet = mjp_timm.convert(timm.create_model("resnet18", num_classes=2))
    convnext = mjp_timm.convert(_meta_model("convnext_atto"))
    assert type(resnet) is mjp_timm.MJPResNet and resnet.mjp.patch_size == 16  # not its stem's stride, 2
    assert type(convnext) is mjp_timm.MJPConvNeXt and convnext.mjp.patch_size == 16


def test_the_family_pick_takes_the_smallest_looking_model():
    assert name_rank("test_efficientnet") < name_rank("efficientnet_b0") < name_rank("efficientnet_b3")
    assert name_rank("resnet18") < name_rank("resnet50")
    picks = family_models(["levit", "xcit"])
    # xcit: p8 and p16 have the same parameters bar the patch embedding's last convolution (p8: fewer)
    assert picks == {"levit": "levit_128s", "xcit": "xcit_nano_12_p8_224"}
