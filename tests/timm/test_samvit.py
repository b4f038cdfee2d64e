"""MJP's token path for timm's ``VisionTransformerSAM`` (mjp_fast/timm/samvit.py, issue 40): convert, eval equal to
timm's, a training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the fused and unfused
embeddings against each other, the step against a pure-torch expectation (the moved tokens, ``unk_embed`` at the
masked positions, the NHWC table's rows elsewhere, resampled at another input size), DAL on the stored table's rows,
FX (plain and timm's feature extractor), ``forward_intermediates``, ``features_only``, checkpoints both ways and
pickling, the refusals, the coverage sweep's check; a SAM ViT without a table keeps the pixel-space jigsaw."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import create_feature_extractor
from torch import nn

import mjp_fast
import mjp_fast.timm as mjp_timm
from bench.timm_coverage import check_model
from mjp_fast.timm import samvit
from mjp_fast.timm.samvit import MJPVisionTransformerSAM, SamPatchEmbed
from tests.timm import front_end_checks as checks

# 64 px in patches of 16: a 4x4 grid. Two blocks: windowed attention (windows of 2) with relative positions, then
# global attention; a conv neck of 16 channels. No stochastic depth: two forwards of one model compare.
TINY = dict(
    img_size=64, embed_dim=32, depth=2, num_heads=2, window_size=2, global_attn_indexes=(1,), neck_chans=16,
    num_classes=5, use_rel_pos=True,
)  # fmt: skip
SETTINGS = dict(ratio=0.5, prob=1.0, min_block=1)  # a 4x4 grid: min_block 1 so that the sampler masks positions
FUSED = {"fused": None, "unfused": False}  # convert's fused_patch_embed: by default fused (timm's PatchEmbed)


def _plain(**overrides) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("samvit_base_patch16", pretrained=False, **{**TINY, **overrides})


def _images(batch: int = 2, height: int = 64, width: int = 64) -> torch.Tensor:
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(1))


def _convert(plain: nn.Module, kind: str = "fused") -> nn.Module:
    return mjp_timm.convert(plain, fused_patch_embed=FUSED[kind], **SETTINGS)


def _table_rows_ref(table: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Pure torch, one position at a time: grid position (i, j) is ``table[0, i, j]`` of the NHWC table, resampled
    to ``rows x cols`` (bicubic, antialiased, as timm resamples it) where that is not the table's grid. Returns
    ``[1, rows * cols, D]``."""
    if tuple(table.shape[1:3]) != (rows, cols):
        nchw = F.interpolate(table.permute(0, 3, 1, 2), size=(rows, cols), mode="bicubic", antialias=True)
        table = nchw.permute(0, 2, 3, 1)
    out = table.new_empty(1, rows * cols, table.shape[-1])
    for i in range(rows):
        for j in range(cols):
            out[0, i * cols + j] = table[0, i, j]
    return out


@pytest.mark.parametrize("kind", list(FUSED))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain()
    model = _convert(copy.deepcopy(plain), kind)
    assert isinstance(model, MJPVisionTransformerSAM) and isinstance(model.patch_embed, SamPatchEmbed)
    checks.assert_token_path_state(model, patch_size=16, grid=(4, 4), dim=32, fused=kind == "fused")
    images = _images()
    expected = checks.assert_eval_equals_timm(model, plain, images)
    checks.assert_training_step_reaches_every_parameter(model, images, tables=[model.pos_embed])
    checks.assert_mjp_eval_jigsaws(model, plain, images, expected)


@pytest.mark.parametrize("kind", list(FUSED))
def test_another_input_size_resamples_the_table_and_trains_it(kind):
    """At 96x64 px (a 6x4 grid, the table resampled as timm resamples it): eval is timm's, and a training step
    reaches every parameter, the stored table included, with DAL on the stored table's 4x4 rows."""
    plain = _plain()
    model = _convert(copy.deepcopy(plain), kind)
    images = _images(height=96)
    checks.assert_eval_equals_timm(model, plain, images)
    checks.assert_training_step_reaches_every_parameter(model, images, tables=[model.pos_embed])
    assert model.mjp.last_jigsaw.mask.shape == (2, 24)
    checks.assert_aux_loss_handed_out_once(model)


@pytest.mark.parametrize(("height", "width"), [(64, 64), (96, 64)])
def test_fused_and_unfused_embeddings_agree(height, width):
    plain = _plain()
    fused, unfused = _convert(copy.deepcopy(plain)), _convert(copy.deepcopy(plain), "unfused")
    assert samvit.runs_fused(fused) and not samvit.runs_fused(unfused)
    unfused.mjp.load_state_dict(fused.mjp.state_dict())  # the same unk_embed and DAL regressor
    images = _images(height=height, width=width)
    fused.eval(), unfused.eval()
    with torch.no_grad(), fused.mjp_eval(ratio=0.5, seed=4), unfused.mjp_eval(ratio=0.5, seed=4):
        got, expected = fused(images), unfused(images)
    assert torch.equal(fused.mjp.last_jigsaw.perm, unfused.mjp.last_jigsaw.perm)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", list(FUSED))
@pytest.mark.parametrize(("height", "width"), [(64, 64), (96, 64)])
def test_the_step_is_the_moved_tokens_with_unk_at_the_masked_positions(kind, height, width):
    """Inside mjp_eval, the blocks get timm's tokens moved as the jigsaw says, plus ``unk_embed`` at the masked
    positions and the table's own row (resampled to the input's grid) elsewhere, NHWC (within the rounding of timm's
    ``+ table`` after the hook)."""
    model = _convert(_plain(), kind).eval()
    images = _images(height=height, width=width)
    rows, cols = height // 16, width // 16
    table = model.pos_embed.detach()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got = model.patch_embed(images) + timm.layers.resample_abs_pos_embed_nhwc(table, (rows, cols))
        jigsaw = model.mjp.last_jigsaw
    count = rows * cols
    assert jigsaw.mask.shape == (2, count) and jigsaw.mask.any() and (jigsaw.perm != torch.arange(count)).any()
    with torch.no_grad():
        tokens = model.patch_embed(images).flatten(1, 2)  # eval: timm's embedding, [B, N, D]
    moved = torch.stack([tokens[b, jigsaw.perm[b]] for b in range(2)])
    expected_rows = _table_rows_ref(table, rows, cols).expand_as(moved)
    unk = model.mjp.unk_embed.reshape(1, 1, -1).expand_as(moved)
    expected = moved + torch.where(jigsaw.mask.unsqueeze(-1), unk, expected_rows)
    torch.testing.assert_close(got, expected.reshape(2, rows, cols, -1), rtol=1e-4, atol=1e-5)


def _dal_of_the_stored_rows(model: nn.Module) -> torch.Tensor:
    return mjp_fast.dal_loss(
        _table_rows_ref(model.pos_embed, 4, 4), model.mjp.dal_regressor, (4, 4), model.mjp.last_jigsaw.mask,
        backend="torch",
    )  # fmt: skip


@pytest.mark.parametrize("kind", list(FUSED))
def test_dal_regresses_the_stored_rows_and_mjp_aux_loss_replaces_the_attached_weight(kind):
    model = _convert(_plain(), kind)
    checks.assert_aux_loss_at_a_weight_replaces_the_attached_one(model, _images(), _dal_of_the_stored_rows)
    model(_images())
    checks.assert_aux_loss_handed_out_once(model)


def _with_a_norm() -> nn.Module:
    plain = _plain()
    plain.patch_embed.norm = nn.LayerNorm(32)
    return plain


def test_refusals_name_the_reason():
    checks.assert_refuses_fused_and_pixel_jigsaw(
        _with_a_norm, fused=r"patch_embed has a norm layer", model="VisionTransformerSAM"
    )
    # a norm per token keeps each token its own patch's: unfused, MJP moves them
    model = mjp_timm.convert(_with_a_norm(), **SETTINGS)
    assert not samvit.runs_fused(model)
    padded = _plain()
    padded.patch_embed.proj.padding = (1, 1)
    with pytest.raises(ValueError, match=r"padding \(1, 1\) overlap the patches"):
        mjp_timm.convert(padded)


def test_a_sam_vit_without_a_table_keeps_the_pixel_jigsaw():
    torch.manual_seed(0)
    plain = timm.create_model(
        "samvit_base_patch16_224", pretrained=False, img_size=64, embed_dim=32, depth=1, num_heads=2, window_size=2
    )
    assert plain.pos_embed is None and not samvit.covers(plain)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert not isinstance(model, MJPVisionTransformerSAM) and type(model.patch_embed) is type(plain.patch_embed)
    assert model.mjp.unk_embed is None and model.mjp.dal_regressor is None and model.mjp.patch_size == 16
    images = _images()
    checks.assert_eval_equals_timm(model, plain, images)


@pytest.mark.filterwarnings("ignore:.*The nodes obtained by tracing the model in")
@pytest.mark.parametrize("kind", list(FUSED))
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(kind, training):
    model = _convert(_plain(), kind).train(training)
    images = _images()
    # timm's resample_abs_pos_embed_nhwc and get_rel_pos kept as one call each (timm's own model traces so)
    tracer = checks.TimmLeafTracer(notrace_functions=True)
    checks.assert_fx_graph_is_the_model(model, images, tracer, mjp_nodes=1, out_shape=(2, 5))
    extractor = create_feature_extractor(model, return_nodes={"blocks.0": "block0", "neck": "neck"})
    with torch.no_grad():
        features = extractor(images)
    assert features["block0"].shape == (2, 4, 4, 32) and features["neck"].shape == (2, 16, 4, 4)


@pytest.mark.parametrize("kind", list(FUSED))
def test_forward_intermediates(kind):
    plain = _plain()
    model = _convert(copy.deepcopy(plain), kind)
    checks.assert_forward_intermediates(plain, model, _images(), shapes=[(32, 4, 4), (32, 4, 4)])
    checks.assert_forward_intermediates(plain, model, _images(), shapes=[(16, 4, 4)], indices=1, norm=True)


def test_features_only():
    torch.manual_seed(0)
    wrapper = timm.create_model("samvit_base_patch16", pretrained=False, features_only=True, out_indices=(0, 1), **TINY)
    model = checks.assert_features_only(wrapper, _images(), SETTINGS, shape=(2, 32, 4, 4))
    assert isinstance(model.model.patch_embed, SamPatchEmbed)


@pytest.mark.parametrize("kind", list(FUSED))
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain().eval()
    model = _convert(copy.deepcopy(plain), kind).eval()
    images = _images()
    checks.assert_checkpoints_both_ways(plain, model, _plain, images)
    _, copied = checks.assert_pickles_and_copies(model, images, _check_clone)
    assert copied.pos_embed.grad is not None


def _check_clone(clone: nn.Module) -> None:
    embed = clone.patch_embed
    assert embed.__dict__["_mjp_model"] is clone  # the clone's embedding reads its own table and state
    # a training forward keeps the table's rows for mjp_aux_loss: copies and pickles drop them
    assert embed.__dict__["_mjp_kept_rows"].rows is None


def test_the_coverage_sweeps_check_passes():
    overrides = {key: value for key, value in TINY.items() if key != "num_classes"}  # the sweep sets its own
    record = check_model("samvit_base_patch16", overrides, 64)
    assert record["ok"], f"{record['steps']}\n{record.get('traceback', '')}"
    assert (record["path"], record["mjp"], record["patch_size"], record["fused"]) == (
        "token", "UNK on the table", 16, True,
    )  # fmt: skip
    assert record["mjp_eval_jigsawed"] is True
