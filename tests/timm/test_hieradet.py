"""MJP's token path for timm's HieraDet (SAM 2's Hiera; mjp_fast/timm/hieradet.py, issue 40 item 1): convert, eval
equal to timm's, a training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the step
itself against a pure-torch expectation (the images jigsawed before the overlapping stem, or the tokens of timm's
``PatchEmbed`` moved; ``unk_embed`` at the masked positions in place of the resampled-plus-tiled position term), DAL
on that term, FX, ``forward_intermediates`` and ``features_only``, checkpoints both ways and pickling, the refusals,
and the coverage sweep's check."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.models import create_feature_extractor

import mjp_fast.timm as mjp_timm
from mjp_fast import jigsaw_images
from mjp_fast.sampler.jigsaw import Jigsaw
from mjp_fast.timm.hieradet import MJPHieraDet
from tests.timm import front_end_checks as checks

# A 16x16 grid of 4-pixel blocks (64 px): first-stage windows of 4 (the window table tiled 4x4 times), a 3x5 global
# table resampled bicubically to the grid, one block a stage, no global-attention blocks.
TINY = dict(
    embed_dim=16, num_heads=1, stages=(1, 1, 1, 1), global_att_blocks=(), window_spec=(4, 2, 2, 2),
    global_pos_size=(3, 5), num_classes=5,
)  # fmt: skip
MODELS = {"stem": {}, "patch": dict(patch_size=4)}  # the overlapping stem; timm's non-overlapping PatchEmbed
SETTINGS = dict(ratio=0.3, prob=1.0, min_block=2)


def _plain(kind: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("sam2_hiera_tiny", pretrained=False, **{**TINY, **MODELS[kind], **overrides})
    with torch.no_grad():  # timm scales the head to 1e-3 of its init: the logits would hardly tell inputs apart
        for parameter in model.parameters():
            if parameter.dim() >= 2 and parameter.abs().max() < 1e-2:
                parameter.normal_(0, 0.2)
    return model


def _images(batch: int = 2, side: int = 64) -> torch.Tensor:
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(MODELS))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, MJPHieraDet)
    # the config's 896 px in 4-pixel blocks: the default grid
    checks.assert_token_path_state(model, patch_size=4, grid=(224, 224), dim=16)
    images = _images()
    expected = checks.assert_eval_equals_timm(model, plain, images)
    # DAL regresses the sum timm adds: both of its parameters learn from it (and from the unmasked tokens)
    tables = [model.pos_embed, model.pos_embed_window]
    checks.assert_training_step_reaches_every_parameter(model, images, tables=tables)
    assert model.mjp.last_jigsaw.mask.shape == (2, 256)
    checks.assert_aux_loss_handed_out_once(model)  # for its own table
    checks.assert_mjp_eval_jigsaws(model, plain, images, expected, min_change=1e-3)


def _position_term_ref(model: torch.nn.Module, rows: int, cols: int) -> torch.Tensor:
    """HieraDet's position term of a ``rows x cols`` grid, ``[1, rows * cols, D]`` row-major, in plain torch: the global
    table resampled bicubically to the grid plus the window table tiled over it (SAM 2's windowed embedding)."""
    resampled = torch.nn.functional.interpolate(model.pos_embed, size=(rows, cols), mode="bicubic")
    window = model.pos_embed_window
    tiled = window.repeat(1, 1, rows // window.shape[-2], cols // window.shape[-1])
    return (resampled + tiled).flatten(2).transpose(1, 2)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("side", [64, 48])  # the table's grid, and another: resampled per input
def test_the_step_is_the_jigsaw_with_unk_at_the_masked_positions(kind, side):
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    images = _images(side=side)
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got = model._pos_embed(model.patch_embed(images))
        jigsaw = model.mjp.last_jigsaw
    rows = cols = side // 4
    assert got.shape == (2, rows, cols, 16) and jigsaw.mask.shape == (2, rows * cols)
    assert 0 < int(jigsaw.mask.sum()) < jigsaw.mask.numel()
    plain = _plain(kind).eval()
    with torch.no_grad():
        if kind == "stem":  # the overlapping stem sees the jigsawed images
            tokens = plain.patch_embed(jigsaw_images(images, jigsaw, 4)).reshape(2, rows * cols, 16)
        else:  # each token its own patch's: the tokens are moved
            tokens = plain.patch_embed(images).reshape(2, rows * cols, 16)
            tokens = tokens.gather(1, jigsaw.perm.unsqueeze(-1).expand(-1, -1, 16))
        table = _position_term_ref(plain, rows, cols)
    mask = jigsaw.mask.unsqueeze(-1)
    expected = tokens + torch.where(mask, model.mjp.unk_embed.expand_as(tokens), table.expand_as(tokens))
    torch.testing.assert_close(got.reshape(2, rows * cols, 16), expected, rtol=1e-5, atol=1e-6)


def test_dal_regresses_the_position_term_of_the_input_grid_over_the_unmasked_positions():
    model = mjp_timm.convert(_plain("stem"), **SETTINGS).train()
    images = _images(side=32)  # an 8x8 grid: not the 16x16 of the other tests, nor the config's
    model(images)
    jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.shape == (2, 64) and jigsaw.mask.any()
    regressor = model.mjp.dal_regressor
    with torch.no_grad():
        table = _position_term_ref(model, 8, 8)[0]
        coords = torch.stack(torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij"), -1).reshape(-1, 2)
        per_position = (regressor(table) - coords).abs().mean(-1)
        kept = (~jigsaw.mask).sum(0).float()
        expected = (per_position * kept).sum() / kept.sum()
    torch.testing.assert_close(model.mjp.last_dal_loss, expected, rtol=1e-5, atol=1e-6)
    # mjp_aux_loss hands out the attached loss once, then computes the same loss again for the last grid
    torch.testing.assert_close(model.mjp_aux_loss(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.mjp_aux_loss(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("training", [False, True])
def test_timm_feature_extractor_graphs(kind, training):
    model = mjp_timm.convert(_plain(kind), **SETTINGS).train(training)
    images = _images()
    graph = create_feature_extractor(model, return_nodes={"blocks.1": "stage", "head": "logits"})
    targets = [node.target for node in graph.graph.nodes if node.op == "call_module"]
    # in training: the images' jigsaw and the step on the stem's tokens (one step where tokens are moved)
    assert targets.count("mjp") == ((2 if kind == "stem" else 1) if training else 0)
    with torch.no_grad():
        out = graph(images)
    assert out["logits"].shape == (2, 5) and out["stage"].shape == (2, 8, 8, 32)
    if training:
        assert model.mjp.last_jigsaw.mask.any()
    else:
        torch.testing.assert_close(out["logits"], _plain(kind).eval()(images), rtol=0, atol=0)


def test_forward_intermediates_and_features_only():
    torch.manual_seed(0)
    wrapper = timm.create_model("sam2_hiera_tiny", pretrained=False, features_only=True, out_indices=(0, 1), **TINY)
    images = _images()
    model = checks.assert_features_only(wrapper, images, SETTINGS, shape=(2, 16, 16, 16))
    assert isinstance(model.model, MJPHieraDet)
    converted = mjp_timm.convert(_plain("stem"), **SETTINGS)
    checks.assert_forward_intermediates(_plain("stem"), converted, images, shapes=[(4, 4), (2, 2)], seed=1, indices=2)


@pytest.mark.parametrize("kind", list(MODELS))
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images()
    checks.assert_checkpoints_both_ways(plain, model, lambda: _plain(kind), images)
    # a training forward keeps its table for mjp_aux_loss: not pickled, not deep-copied
    checks.assert_pickles_and_copies(model, images, lambda clone: _check_clone(clone, kind))


def _check_clone(clone: torch.nn.Module, kind: str) -> None:
    assert "_mjp_table" not in clone.__dict__
    if kind == "stem":
        assert clone.patch_embed.__dict__["_mjp_state"] is clone.mjp


def test_refusals():
    checks.assert_refuses_fused_and_pixel_jigsaw(
        lambda: _plain("stem"), fused=r"HieraDet's stem .* overlap", model="HieraDet"
    )
    with pytest.raises(ValueError, match=r"fused_patch_embed=True: HieraDet's PatchEmbed pads"):
        mjp_timm.convert(_plain("patch"), fused_patch_embed=True)
    with pytest.raises(ValueError, match=r"model: HieraDet's stem stride \(4, 2\) is not square"):
        mjp_timm.convert(_plain("stem", patch_stride=(4, 2)))
    model = mjp_timm.convert(_plain("stem"), **SETTINGS)
    with pytest.raises(ValueError, match="multiples of the jigsaw patch size 4"):
        model(torch.randn(1, 3, 62, 62))


def test_naive_shuffle_keeps_each_position_term():
    model = mjp_timm.convert(_plain("patch"), unk=False, **SETTINGS).eval()
    images = _images()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=4):
        got = model._pos_embed(model.patch_embed(images)).reshape(2, 256, 16)
        jigsaw: Jigsaw = model.mjp.last_jigsaw
    tokens = model.patch_embed(images).reshape(2, 256, 16).gather(1, jigsaw.perm.unsqueeze(-1).expand(-1, -1, 16))
    torch.testing.assert_close(got, tokens + _position_term_ref(model, 16, 16), rtol=1e-5, atol=1e-6)
    assert model.mjp.unk_embed is None and jigsaw.mask.any()


def test_the_coverage_sweep_check_passes():
    overrides = {key: value for key, value in TINY.items() if key != "num_classes"}
    checks.assert_coverage_sweep_passes("sam2_hiera_tiny", overrides, 64, patch_size=4)
