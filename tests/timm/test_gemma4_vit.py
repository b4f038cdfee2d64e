"""MJP's token path for timm's Gemma 4 vision models (mjp_fast/timm/gemma4_vit.py, issue 40 item 1): convert (the
classifier and the encoder), eval equal to timm's, a training step whose output alone reaches every parameter (DAL
attached), ``mjp_eval``, the step against a pure-torch expectation for images and for NaFlex patches with a grid per
sample and padding, DAL on the composed table, ``forward_intermediates`` and ``features_only``, checkpoints both ways
and pickling, the refusals, and the coverage sweep's check. (timm's Gemma 4 does not trace with torch.fx, the plain
model included: no FX test.)"""

from __future__ import annotations

import copy

import pytest
import timm
import torch

import mjp_fast.timm as mjp_timm
from mjp_fast.timm.gemma4_vit import MJPGemma4PatchEmbed, MJPGemma4VitClassifier, MJPGemma4VitEncoder
from tests.timm import front_end_checks as checks

# Patches of 8 pixels, 48 px images: a 6x6 grid (the soft pooler's 3x3 cells divide it).
TINY = dict(
    embed_dim=16, depth=2, num_heads=2, head_dim=8, intermediate_size=32, position_embedding_size=16, patch_size=8
)  # fmt: skip
SETTINGS = dict(ratio=0.3, prob=1.0, min_block=2)


def _plain(name: str = "gemma4_vit_167m", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    extra = dict(num_classes=5) if not name.endswith("_enc") else {}
    return timm.create_model(name, pretrained=False, **{**TINY, **extra, **overrides})


def _images(batch: int = 2, side: int = 48) -> torch.Tensor:
    return torch.rand(batch, 3, side, side, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", ["gemma4_vit_167m", "gemma4_vit_167m_enc"])
def test_convert_eval_train_and_mjp_eval(name):
    plain = _plain(name)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, MJPGemma4VitClassifier if name == "gemma4_vit_167m" else MJPGemma4VitEncoder)
    checks.assert_token_path_state(model, patch_size=8, grid=(96, 96), dim=16)  # the config's 768 px
    images = _images()
    expected = checks.assert_eval_equals_timm(model, plain, images)
    checks.assert_training_step_reaches_every_parameter(model, images, loss=lambda out: out.square().mean())
    assert model.mjp.last_jigsaw.mask.shape == (2, 36)
    table = model._mjp_patch_embed().position_embedding_table
    assert table.grad[:, :6].abs().sum(-1).gt(0).all()  # both factors' rows of the grid learn (DAL, positions)
    checks.assert_aux_loss_handed_out_once(model)  # then computed again, for the same grid and mask
    checks.assert_mjp_eval_jigsaws(model, plain, images, expected, min_change=1e-4)


def _tokens_ref(plain: torch.nn.Module, patches: torch.Tensor) -> torch.Tensor:
    """Gemma 4's projection of patches ``[B, N, C * P * P]`` (C-P-P order, [0, 1] pixels), in plain torch."""
    return (2 * (patches - 0.5)) @ plain.encoder.patch_embed.input_proj.weight.T


def _position_ref(plain: torch.nn.Module, coords: torch.Tensor) -> torch.Tensor:
    """The factorized table's term of (y, x) ``coords`` ``[B, N, 2]``: ``table[0, x] + table[1, y]``."""
    table = plain.encoder.patch_embed.position_embedding_table
    return table[0][coords[..., 1]] + table[1][coords[..., 0]]


def test_the_image_step_moves_the_tokens_with_unk_at_the_masked_positions():
    model = mjp_timm.convert(_plain(), **SETTINGS).eval()
    images = _images()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got, position_ids, padding = model.encoder.patch_embed(images)
        jigsaw = model.mjp.last_jigsaw
    assert 0 < int(jigsaw.mask.sum()) < jigsaw.mask.numel()
    plain = _plain().eval()
    patches = images.reshape(2, 3, 6, 8, 6, 8).permute(0, 2, 4, 1, 3, 5).reshape(2, 36, 192)
    with torch.no_grad():
        tokens = _tokens_ref(plain, patches).gather(1, jigsaw.perm.unsqueeze(-1).expand(-1, -1, 16))
        coords = torch.stack(torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij"), -1).reshape(1, 36, 2)
        position = _position_ref(plain, coords).expand_as(tokens)
    expected = tokens + torch.where(jigsaw.mask.unsqueeze(-1), model.mjp.unk_embed.expand_as(tokens), position)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(position_ids, coords.flip(-1).expand(2, -1, -1))  # the slots' (x, y): timm's


def _naflex_batch() -> dict[str, torch.Tensor]:
    """Two samples as a NaFlex loader lays them out: a 6x6 grid (36 patches), and a 4x5 grid (20 patches, shuffled
    in the sequence) then 16 padding slots (coordinates -1). Patches ``[B, N, P, P, C]``."""
    images = _images()
    patches = images.reshape(2, 3, 6, 8, 6, 8).permute(0, 2, 4, 3, 5, 1).reshape(2, 36, 8, 8, 3)
    full = torch.stack(torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij"), -1).reshape(36, 2)
    small = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(5), indexing="ij"), -1).reshape(20, 2)
    small = small[torch.randperm(20, generator=torch.Generator().manual_seed(2))]
    coord = torch.full((2, 36, 2), -1, dtype=torch.int64)
    coord[0], coord[1, :20] = full, small
    valid = coord[..., 0] >= 0
    patches[1, 20:] = 0
    return dict(patches=patches, patch_coord=coord, patch_valid=valid)


def test_naflex_patches_with_a_grid_per_sample_and_padding():
    plain = _plain().eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    batch = _naflex_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(batch), plain(batch), rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5, seed=5):
            got, _, padding = model.encoder.patch_embed(batch)
            jigsaw = model.mjp.last_jigsaw
    valid, coord = batch["patch_valid"], batch["patch_coord"]
    assert torch.equal(padding, ~valid) and not (jigsaw.mask & ~valid).any()  # padding is never masked...
    assert jigsaw.mask[0].any() and jigsaw.mask[1].any()  # ...each sample is, on its own grid
    assert torch.equal(jigsaw.perm[1, 20:], torch.arange(20, 36))  # ...nor moved
    flat = batch["patches"].permute(0, 1, 4, 2, 3).reshape(2, 36, 192)  # to Gemma 4's C-P-P order
    with torch.no_grad():
        tokens = _tokens_ref(plain, flat).gather(1, jigsaw.perm.unsqueeze(-1).expand(-1, -1, 16))
        position = torch.where(valid.unsqueeze(-1), _position_ref(plain, coord.clamp(min=0)), 0)
    expected = tokens + torch.where(jigsaw.mask.unsqueeze(-1), model.mjp.unk_embed.expand_as(tokens), position)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # A masked token shows the patch of another position of its own sample's grid
    moved = jigsaw.perm[1][jigsaw.mask[1]]
    assert (moved < 20).all()


def test_naflex_dal_weights_each_row_by_the_samples_that_hold_it_unmasked():
    model = mjp_timm.convert(_plain(), **SETTINGS).train()
    batch = _naflex_batch()
    model(batch).square().mean().backward()
    checks.assert_every_parameter_has_a_grad(model)
    jigsaw = model.mjp.last_jigsaw
    coord, valid = batch["patch_coord"], batch["patch_valid"]
    kept = torch.zeros(2, 36)  # the bounding grid: 6x6
    for sample in range(2):
        for n in range(36):
            if valid[sample, n] and not jigsaw.mask[sample, n]:
                kept[sample, int(coord[sample, n, 0]) * 6 + int(coord[sample, n, 1])] = 1
    weights = kept.sum(0)
    with torch.no_grad():
        rows = torch.stack(torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij"), -1).reshape(1, 36, 2)
        table = _position_ref(model, rows)[0]
        per_position = (model.mjp.dal_regressor(table) - rows[0].float()).abs().mean(-1)
    expected = (per_position * weights).sum() / weights.sum()
    torch.testing.assert_close(model.mjp.last_dal_loss, expected, rtol=1e-5, atol=1e-6)
    model.mjp_aux_loss()  # the attached loss, once
    torch.testing.assert_close(model.mjp_aux_loss(), expected, rtol=1e-5, atol=1e-6)  # computed again: the same


def test_naflex_patches_that_do_not_tile_their_grid_are_refused_in_training():
    model = mjp_timm.convert(_plain(), **SETTINGS).train()
    batch = _naflex_batch()
    batch["patch_coord"][1, 3] = batch["patch_coord"][1, 4]  # a position held twice, another not at all
    with pytest.raises(ValueError, match=r"patch_coord: the valid patches of sample 1 do not hold each position"):
        model(batch)


def test_forward_intermediates_and_features_only():
    torch.manual_seed(0)
    wrapper = timm.create_model("gemma4_vit_167m", features_only=True, out_indices=(0, 1), num_classes=5, **TINY)
    images = _images()
    model = checks.assert_features_only(wrapper, images, SETTINGS, shape=(2, 16, 6, 6))
    assert isinstance(model.model, MJPGemma4VitClassifier)
    converted = mjp_timm.convert(_plain(), **SETTINGS)
    checks.assert_forward_intermediates(_plain(), converted, images, shapes=[(6, 6), (6, 6)], seed=1, indices=2)


def test_checkpoints_both_ways_and_pickling():
    plain = _plain().eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images()
    checks.assert_checkpoints_both_ways(plain, model, _plain, images)
    checks.assert_pickles_and_copies(model, images, _check_clone)


def _check_clone(clone: torch.nn.Module) -> None:
    assert isinstance(clone.encoder.patch_embed, MJPGemma4PatchEmbed)
    assert clone.encoder.patch_embed.__dict__["_mjp_state"] is clone.mjp


def test_refusals():
    checks.assert_refuses_fused_and_pixel_jigsaw(
        _plain, fused=r"Gemma 4's patch embedding is a Linear", model="Gemma4VitClassifier"
    )
    with pytest.raises(ValueError, match=r"model: Gemma 4's patch size \(8, 4\) is not square"):
        mjp_timm.convert(_plain(patch_size=(8, 4)))


def test_the_coverage_sweep_check_passes():
    checks.assert_coverage_sweep_passes("gemma4_vit_167m", TINY, 48, patch_size=8)
