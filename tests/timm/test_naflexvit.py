"""MJP's token path for timm's NaFlexVit (mjp_fast/timm/naflexvit.py, issue 40 items 1 and 5): convert, eval equal
to timm's (images and NaFlex dicts), a training step whose output alone reaches every parameter (DAL attached),
``mjp_eval``, the per-sample jigsaw against a pure-torch oracle and the sampler's own draws on each sample's grid,
mixed grids with padding, DAL over the table's grid only, the factorized table, FX, ``forward_intermediates``,
``features_only``, checkpoints both ways, bad input; the fused embedding (where it runs, and that it takes the unfused
step's values and gradients); and timm's model checks on a registered ``mjp_`` NaFlexVit."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models import get_graph_node_names
from timm.models._features_fx import create_feature_extractor
from timm.models.naflexvit import batch_patchify

import mjp_fast.timm as mjp_timm
from mjp_fast import dal_loss, sample_jigsaw
from mjp_fast.timm import naflexvit as naflex_front_end
from mjp_fast.timm import register
from mjp_fast.timm.convert import runs_fused
from mjp_fast.timm.naflexvit import MJPNaFlexEmbeds, MJPNaFlexVit, naflex_jigsaw
from tests.conftest import backends_for
from tests.timm import front_end_checks as checks

TINY = dict(embed_dim=32, depth=1, num_heads=2, patch_size=4, pos_embed_grid_size=(4, 4), num_classes=5)
MODELS = {
    "learned": ("naflexvit_base_patch16_gap", {}),  # 4 register tokens, average pooling
    "factorized": ("naflexvit_base_patch16_parfac_gap", {}),  # aspect-preserving factorized table
    "learned_grid_sample_cls": (
        "naflexvit_base_patch16_gap",
        dict(pos_embed_use_grid_sample=True, class_token=True, reg_tokens=0, global_pool="token"),
    ),
    "factorized_grid_sample": ("naflexvit_base_patch16_parfac_gap", dict(pos_embed_use_grid_sample=True)),
    "learned_conv": ("naflexvit_base_patch16_gap", dict(embed_proj_type="conv")),  # image input only
}
DICT_KINDS = [kind for kind in MODELS if kind != "learned_conv"]
SETTINGS = dict(ratio=0.5, prob=1.0, min_block=1)  # small grids: min_block 1 so that the sampler masks positions
# Images of mixed sizes: grids 4x4 (the table's), 2x5, 3x2, 4x4, 2x5 (two samples share each of two grids).
SIZES = [(16, 16), (8, 20), (12, 8), (16, 16), (8, 20)]


def _plain(kind: str, **overrides) -> torch.nn.Module:
    name, keywords = MODELS[kind]
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **{**TINY, **keywords, **overrides})


def _images(batch: int = 2, size: tuple[int, int] = (16, 16)) -> torch.Tensor:
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(1))


def _naflex_batch(sizes: list[tuple[int, int]] = SIZES, extra_padding: int = 3) -> dict[str, torch.Tensor]:
    """A NaFlex dict of images of ``sizes``, laid out as timm's collator does: each image's patches in row-major
    order, then padding (zero patches at coordinate (0, 0), invalid) up to the longest plus ``extra_padding``."""
    generator = torch.Generator().manual_seed(2)
    sequences = []
    for height, width in sizes:
        patches, (rows, cols) = batch_patchify(torch.randn(1, 3, height, width, generator=generator), (4, 4))
        ys, xs = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        sequences.append((patches[0], torch.stack((ys.flatten(), xs.flatten()), dim=-1)))
    length = max(len(patches) for patches, _ in sequences) + extra_padding
    batch = len(sizes)
    patches = torch.zeros(batch, length, 48)
    coord = torch.zeros(batch, length, 2, dtype=torch.int64)
    valid = torch.zeros(batch, length, dtype=torch.bool)
    for index, (sample, sample_coord) in enumerate(sequences):
        patches[index, : len(sample)], coord[index, : len(sample)], valid[index, : len(sample)] = (
            sample,
            sample_coord,
            True,
        )
    return dict(patches=patches, patch_coord=coord, patch_valid=valid)


def _grids(batch: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    coord = batch["patch_coord"]
    return [(int(c[:, 0].max()) + 1, int(c[:, 1].max()) + 1) for c in coord]


def _table_at(embeds: torch.nn.Module, rows: int, cols: int) -> torch.Tensor:
    """The oracle: timm's position table for a ``rows`` x ``cols`` grid, ``[rows, cols, D]``, in plain torch."""
    if embeds.pos_embed_type == "learned":
        table = embeds.pos_embed
        if (rows, cols) == tuple(table.shape[1:3]):
            return table[0]
        size = (max(rows, cols),) * 2 if embeds.pos_embed_ar_preserving else (rows, cols)
        resized = F.interpolate(
            table.permute(0, 3, 1, 2), size=size, mode=embeds.pos_embed_interp_mode, align_corners=False,
            antialias=True,
        )  # fmt: skip
        return resized[0, :, :rows, :cols].permute(1, 2, 0)

    def resized(factor: torch.Tensor, length: int) -> torch.Tensor:
        if length == factor.shape[1]:
            return factor[0]
        return F.interpolate(factor.permute(0, 2, 1), size=length, mode="linear", align_corners=False)[0].T

    lengths = (max(rows, cols),) * 2 if embeds.pos_embed_ar_preserving else (rows, cols)
    return resized(embeds.pos_embed_y, lengths[0])[:rows, None] + resized(embeds.pos_embed_x, lengths[1])[None, :cols]


@pytest.mark.parametrize("kind", ["learned", "factorized"])
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, MJPNaFlexVit) and isinstance(model.embeds, MJPNaFlexEmbeds)
    checks.assert_token_path_state(model, patch_size=4, grid=(4, 4), fused=True)  # a linear embedding: fused
    images, batch = _images(), _naflex_batch()
    model.eval(), plain.eval()
    with torch.no_grad():
        for inputs in (images, _images(size=(8, 24)), batch):
            torch.testing.assert_close(model(inputs), plain(inputs), rtol=0, atol=0)
    model.train()
    for inputs in (images, batch):
        model.zero_grad()
        model(inputs).logsumexp(-1).mean().backward()  # the output alone: DAL rides on it
        checks.assert_every_parameter_has_a_grad(model)
        checks.assert_state_learned(model.mjp)
        tables = [model.embeds.pos_embed] if kind == "learned" else [model.embeds.pos_embed_y, model.embeds.pos_embed_x]
        assert all(table.grad.abs().sum() > 0 for table in tables)
        assert torch.isfinite(model.mjp_aux_loss())
    model.eval()
    with torch.no_grad():
        for inputs in (images, batch):
            expected = plain(inputs)
            with model.mjp_eval(ratio=0.5, seed=0):
                jigsawed = model(inputs)
            assert model.mjp.last_jigsaw.mask.any() and (jigsawed - expected).abs().max() > 1e-3
            torch.testing.assert_close(model(inputs), expected, rtol=0, atol=0)  # outside mjp_eval: timm's again


@pytest.mark.parametrize("kind", list(MODELS))
def test_training_without_a_jigsaw_is_timms_training_forward(kind):
    """prob 0: MJP engaged (unk_embed kept in the graph, DAL attached) but no jigsaw: the tokens are timm's, exactly
    (MJP's copy of timm's embedding and timm's own position term)."""
    plain = _plain(kind).train()
    model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=0.0).train()
    inputs = [_images(), _images(size=(12, 20))] + ([_naflex_batch()] if kind in DICT_KINDS else [])
    for batch in inputs:
        torch.testing.assert_close(model(batch), plain(batch), rtol=0, atol=0)
        assert model.mjp.last_jigsaw is None and model.mjp.last_dal_loss is not None
    model(inputs[-1]).sum().backward()
    assert not checks.missing_grads(model)


@pytest.mark.parametrize("kind", ["learned", "factorized"])
def test_the_naflex_step_against_a_pure_torch_oracle(kind):
    """Inside mjp_eval, on a batch of mixed grids with padding: each valid token shows the patch its jigsaw names
    plus ``unk_embed`` where masked, else timm's position row of its own grid; padding tokens are untouched (no
    position term: timm adds none there); each sample's jigsaw is the sampler's draw on its own grid (the samples of
    one grid drawn together, in order of first appearance)."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    batch = _naflex_batch()
    patches, coord, valid = batch["patches"], batch["patch_coord"], batch["patch_valid"]
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got, grid = model.embeds(patches, patch_coord=coord, patch_valid=valid)
        jigsaw = model.mjp.last_jigsaw
    assert grid is None
    embeds = model.embeds
    with torch.no_grad():
        tokens = F.linear(patches, embeds.proj.weight, embeds.proj.bias)
        position = torch.zeros_like(tokens)
        for index, (rows, cols) in enumerate(_grids(batch)):
            table = _table_at(embeds, rows, cols)
            position[index, : rows * cols] = table[coord[index, : rows * cols, 0], coord[index, : rows * cols, 1]]
    mask, perm = jigsaw.mask, jigsaw.perm
    moved = tokens.gather(1, perm.unsqueeze(-1).expand_as(tokens))
    expected = moved + torch.where(mask.unsqueeze(-1), model.mjp.unk_embed.expand_as(tokens), position)
    prefix = embeds.reg_token.expand(len(SIZES), -1, -1)
    torch.testing.assert_close(got, torch.cat((prefix, expected), dim=1), rtol=1e-5, atol=1e-6)
    # The jigsaw: padding never masked nor moved; each sample's the sampler's draw on its grid.
    positions = torch.arange(mask.shape[1]).expand_as(perm)
    assert not mask[~valid].any() and torch.equal(perm[~valid], positions[~valid])
    groups: dict[tuple[int, int], list[int]] = {}
    for index, grid_size in enumerate(_grids(batch)):
        groups.setdefault(grid_size, []).append(index)
    offset = 0
    for (rows, cols), members in groups.items():
        drawn = sample_jigsaw(len(members), (rows, cols), 0.5, seed=3, offset=offset, min_block=1, backend="torch")
        offset += len(members)
        for row, index in enumerate(members):
            torch.testing.assert_close(mask[index, : rows * cols], drawn.mask[row], rtol=0, atol=0)
            torch.testing.assert_close(perm[index, : rows * cols], drawn.perm[row], rtol=0, atol=0)
        assert drawn.mask.any()


def test_the_jigsaw_follows_the_coordinates_not_the_sequence_order():
    """A coordinate-based position term (``grid_sample``): the same batch with each sample's patches in another
    order gives each coordinate the same output token (the jigsaw is drawn on the grid, carried by ``patch_coord``)."""
    model = mjp_timm.convert(_plain("learned_grid_sample_cls"), **SETTINGS).eval()
    batch = _naflex_batch()
    shuffled = {key: value.clone() for key, value in batch.items()}
    generator = torch.Generator().manual_seed(5)
    orders = []
    for index in range(len(SIZES)):
        count = int(batch["patch_valid"][index].sum())
        order = torch.cat((torch.randperm(count, generator=generator), torch.arange(count, batch["patches"].shape[1])))
        orders.append(order)
        for key in shuffled:
            shuffled[key][index] = batch[key][index][order]
    with torch.no_grad():
        with model.mjp_eval(ratio=0.5, seed=7):
            straight = model.embeds(batch["patches"], batch["patch_coord"], batch["patch_valid"])[0]
        with model.mjp_eval(ratio=0.5, seed=7):
            reordered = model.embeds(shuffled["patches"], shuffled["patch_coord"], shuffled["patch_valid"])[0]
    assert model.mjp.last_jigsaw.mask.any()
    for index, order in enumerate(orders):
        torch.testing.assert_close(reordered[index, 1:], straight[index, 1:][order], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["learned", "factorized"])
def test_dal_counts_the_table_grid_samples_unmasked_rows_only(kind):
    """DAL regresses the stored table's rows over the rows that the samples of the table's grid left unmasked (the
    samples of other grids keep every row; padding is no row); the attached loss and a recomputed one agree."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).train()
    batch = _naflex_batch()
    model(batch)
    attached = model.mjp_aux_loss()  # the attached loss, handed out once
    recomputed = model.mjp_aux_loss()
    expected_mask = torch.zeros(len(SIZES), 16, dtype=torch.bool)
    for index, grid_size in enumerate(_grids(batch)):
        if grid_size == (4, 4):
            expected_mask[index] = model.mjp.last_jigsaw.mask[index, :16]
    assert expected_mask.any()
    embeds = model.embeds
    if kind == "learned":
        table = embeds.pos_embed.reshape(1, 16, 32)
    else:
        table = (embeds.pos_embed_y[:, :, None] + embeds.pos_embed_x[:, None]).reshape(1, 16, 32)
    expected = dal_loss(table, model.mjp.dal_regressor, (4, 4), mask=expected_mask, backend="torch")
    torch.testing.assert_close(attached, expected)
    torch.testing.assert_close(recomputed, expected)
    expected.backward()  # the factorized table's two factors both learn from DAL
    tables = [embeds.pos_embed] if kind == "learned" else [embeds.pos_embed_y, embeds.pos_embed_x]
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in tables)
    # A batch with no sample on the table's grid: every row counted, as for images of another size.
    other = _naflex_batch([(8, 20), (12, 8)])
    model(other)
    model.mjp_aux_loss()
    unmasked = dal_loss(table.detach(), model.mjp.dal_regressor, (4, 4), backend="torch")
    torch.testing.assert_close(model.mjp_aux_loss(), unmasked)


def test_image_input_at_and_off_the_table_grid():
    """Image input: one draw for the batch's grid; DAL masks the rows only when that grid is the table's."""
    model = mjp_timm.convert(_plain("learned"), **SETTINGS).train()
    table = model.embeds.pos_embed.reshape(1, 16, 32)
    for size, masked in (((16, 16), True), ((8, 32), False)):  # 4x4, and 2x8: as many positions, another grid
        model(_images(size=size))
        jigsaw = model.mjp.last_jigsaw
        assert jigsaw.mask.shape == (2, 16) and jigsaw.mask.any()
        mask = jigsaw.mask if masked else None
        expected = dal_loss(table, model.mjp.dal_regressor, (4, 4), mask=mask, backend="torch")
        torch.testing.assert_close(model.mjp_aux_loss(), expected)


def test_the_naive_shuffle_keeps_the_rows_of_where_the_patches_land():
    model = mjp_timm.convert(_plain("learned"), unk=False, **SETTINGS).eval()
    assert model.mjp.unk_embed is None
    batch = _naflex_batch()
    with torch.no_grad():
        plain_tokens = model.embeds(batch["patches"], batch["patch_coord"], batch["patch_valid"])[0]
        with model.mjp_eval(ratio=0.5, seed=1):
            got = model.embeds(batch["patches"], batch["patch_coord"], batch["patch_valid"])[0]
        jigsaw = model.mjp.last_jigsaw
        tokens = F.linear(batch["patches"], model.embeds.proj.weight, model.embeds.proj.bias)
    assert jigsaw.mask.any()
    position = plain_tokens[:, 4:] - tokens  # timm's position term of each slot
    moved = tokens.gather(1, jigsaw.perm.unsqueeze(-1).expand_as(tokens))
    torch.testing.assert_close(got[:, 4:], moved + position, rtol=1e-5, atol=1e-5)


def test_naflex_jigsaw_of_a_batch_with_an_empty_sample():
    sampler = mjp_timm.convert(_plain("learned"), **SETTINGS).mjp.sampler
    batch = _naflex_batch([(16, 16), (8, 8)])
    batch["patch_valid"][1] = False  # a sample of padding only: nothing drawn, nothing moved
    jigsaw, dal_mask = naflex_jigsaw(sampler, batch["patch_coord"], batch["patch_valid"], (4, 4))
    assert jigsaw.mask[0].any() and not jigsaw.mask[1].any()
    assert torch.equal(jigsaw.perm[1], torch.arange(jigsaw.perm.shape[1]))
    assert torch.equal(dal_mask[0], jigsaw.mask[0, :16]) and not dal_mask[1].any()


def test_bad_input_is_refused_by_name():
    model = mjp_timm.convert(_plain("learned"), **SETTINGS).train()
    batch = _naflex_batch([(16, 16), (8, 20)])
    patches, coord, valid = batch["patches"], batch["patch_coord"], batch["patch_valid"]
    with pytest.raises(TypeError, match="patch_coord must be an integer tensor"):
        model(patches, patch_coord=coord.float(), patch_valid=valid)
    with pytest.raises(ValueError, match=r"patch_coord must have shape \[B, N, 2\]"):
        model(patches, patch_coord=coord[:, :-1], patch_valid=valid)
    with pytest.raises(TypeError, match="patch_valid must be a bool tensor"):
        model(patches, patch_coord=coord, patch_valid=valid.long())
    with pytest.raises(ValueError, match=r"patch_valid must have shape \[B, N\]"):
        model(patches, patch_coord=coord, patch_valid=valid[:1])
    doubled = coord.clone()
    doubled[1, 1] = doubled[1, 0]  # two valid patches at one position of sample 1's grid
    with pytest.raises(ValueError, match="valid patches of sample 1 do not hold each position of its 2x5 grid"):
        model(patches, patch_coord=doubled, patch_valid=valid)
    negative = coord.clone()
    negative[0, 0, 1] = -1
    with pytest.raises(ValueError, match="coordinates must be >= 0"):
        model(patches, patch_coord=negative, patch_valid=valid)
    with pytest.raises(ValueError, match=r"fused_patch_embed=True: embeds.proj is a Conv2d over images"):
        mjp_timm.convert(_plain("learned_conv"), fused_patch_embed=True)
    with pytest.raises(ValueError, match=r"pixel_jigsaw=True: model .*NaFlexVit.* token path covers"):
        mjp_timm.convert(_plain("learned"), pixel_jigsaw=True)


def test_a_naflexvit_without_a_table_gets_the_pixel_jigsaw():
    plain = _plain("learned", pos_embed="none").eval()
    model = mjp_timm.convert(copy.deepcopy(plain), dal=None, **SETTINGS)
    assert isinstance(model, mjp_timm.MJPPixelModel) and model.mjp.unk_embed is None
    images = _images()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("kind", ["learned", "factorized"])
def test_fx_feature_extraction(kind):
    """timm's FX tracer keeps the embedding module as one leaf call (timm registers NaFlexEmbeds so): MJP runs
    inside it when the graph runs."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    train_nodes, eval_nodes = get_graph_node_names(model)
    assert "embeds" in train_nodes and "embeds" in eval_nodes
    images = _images()
    extractor = create_feature_extractor(model, return_nodes={eval_nodes[-1]: "out", "norm": "norm"})
    with torch.no_grad():
        features = extractor(images)
        torch.testing.assert_close(features["out"], model(images), rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5, seed=2):
            jigsawed = extractor(images)["out"]
        with model.mjp_eval(ratio=0.5, seed=2):
            torch.testing.assert_close(jigsawed, model(images), rtol=0, atol=0)
    assert model.mjp.last_jigsaw.mask.any() and features["norm"].shape == (2, 4 + 16, 32)
    model.train()
    out = create_feature_extractor(model, return_nodes=[train_nodes[-1]])(images)[train_nodes[-1]]
    out.sum().backward()
    assert model.mjp.last_jigsaw.mask.any() and model.mjp.unk_embed.grad is not None


@pytest.mark.parametrize("kind", ["learned", "factorized"])
def test_forward_intermediates(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images, batch = _images(), _naflex_batch()
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(images, indices=1)
        expected_final, expected = plain.forward_intermediates(images, indices=1)
        torch.testing.assert_close(final, expected_final, rtol=0, atol=0)
        torch.testing.assert_close(intermediates, expected, rtol=0, atol=0)
        assert intermediates[0].shape == (2, 32, 4, 4)
        got = model.forward_intermediates(batch, indices=1, output_fmt="NLC", output_dict=True)
        want = plain.forward_intermediates(batch, indices=1, output_fmt="NLC", output_dict=True)
        torch.testing.assert_close(got["image_intermediates"], want["image_intermediates"], rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5, seed=1):
            jigsawed = model.forward_intermediates(batch, indices=1, output_fmt="NLC", output_dict=True)
    assert (jigsawed["image_intermediates"][0] - want["image_intermediates"][0]).abs().max() > 1e-3
    assert torch.equal(jigsawed["patch_valid"], batch["patch_valid"])


@pytest.mark.parametrize("kind", ["learned", "factorized"])
def test_features_only(kind):
    name, keywords = MODELS[kind]
    torch.manual_seed(0)
    wrapper = timm.create_model(name, pretrained=False, features_only=True, out_indices=(0,), **{**TINY, **keywords})
    model = checks.assert_features_only(wrapper, _images(), SETTINGS, shape=(2, 32, 4, 4), min_change=1e-3)
    assert isinstance(model.model.embeds, MJPNaFlexEmbeds)


@pytest.mark.parametrize("kind", ["learned", "factorized"])
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    batch = _naflex_batch()
    checks.assert_checkpoints_both_ways(plain, model, lambda: _plain(kind), batch)
    # a kept DAL loss and jigsaw: a copy or pickle must not carry the graph
    checks.assert_pickles_and_copies(model, batch, _check_clone, backward=True)


def _check_clone(clone: torch.nn.Module) -> None:
    assert clone.embeds.__dict__["_mjp_model"] is clone  # the clone's embedding reads the clone's state


# The fused embedding (issue 40 item 1): the linear projection of the patch rows, the jigsaw, the position term and the
# prefix as one op (mjp_fast/ops/gathered_patch_embed.py).


def _fused_pair(kind: str, backend: str | None = None, **overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same NaFlexVit converted fused and unfused, with the same MJP state (unk_embed, DAL regressor, seed)."""
    plain = _plain(kind, **overrides)
    fused = mjp_timm.convert(copy.deepcopy(plain), backend=backend, **SETTINGS)
    unfused = mjp_timm.convert(copy.deepcopy(plain), backend=backend, fused_patch_embed=False, **SETTINGS)
    assert runs_fused(fused) and not runs_fused(unfused)
    unfused.mjp.load_state_dict(fused.mjp.state_dict())
    with torch.no_grad():
        fused.mjp.unk_embed.normal_()
        unfused.mjp.unk_embed.copy_(fused.mjp.unk_embed)
    return fused, unfused


def _step_and_grads(model: torch.nn.Module, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(inputs)
    out.logsumexp(-1).mean().backward()  # DAL rides on the output
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _counting_fused_op(monkeypatch) -> list[int]:
    """Counts the calls of the fused op from the front end."""
    calls = []
    original = naflex_front_end.gathered_patch_embed_step

    def counted(*arguments, **keywords):
        calls.append(1)
        return original(*arguments, **keywords)

    monkeypatch.setattr(naflex_front_end, "gathered_patch_embed_step", counted)
    return calls


@pytest.mark.parametrize("kind", [*DICT_KINDS, "learned_no_bias"])
@pytest.mark.parametrize("backend", [None, "triton"], ids=["automatic", "triton"])
def test_fused_and_unfused_steps_agree_in_outputs_and_gradients(kind, backend, monkeypatch):
    """Images and a mixed-grid NaFlex dict with padding, training and mjp_eval: the same jigsaws (one seed), the same
    tokens and every parameter's gradient. The automatic backend on the CPU runs the op's torch computation, the
    unfused step's arithmetic: its tokens equal bit for bit, its gradients within float rounding (the unfused step of
    image input runs the position step's kernels, whose sums over the batch take another order). The Triton kernels
    sum the GEMM in another order: float tolerance."""
    if backend == "triton" and "triton" not in backends_for("cpu"):
        pytest.skip("needs the triton backend (the interpreter here)")
    name = "learned" if kind == "learned_no_bias" else kind
    overrides = dict(pre_norm=True) if kind == "learned_no_bias" else {}  # timm's CLIP setting: no projection bias
    fused, unfused = _fused_pair(name, backend, **overrides)
    if kind == "learned_no_bias":
        assert fused.embeds.proj.bias is None
    calls = _counting_fused_op(monkeypatch)
    exact = dict(rtol=0, atol=0) if backend is None else dict(rtol=1e-4, atol=1e-5)
    close = dict(rtol=1e-5, atol=1e-7) if backend is None else exact
    for inputs in (_images(), _naflex_batch()):
        fused.train(), unfused.train()
        got, got_grads = _step_and_grads(fused, inputs)
        expected, expected_grads = _step_and_grads(unfused, inputs)
        assert fused.mjp.last_jigsaw.mask.any()
        assert torch.equal(fused.mjp.last_jigsaw.perm, unfused.mjp.last_jigsaw.perm)
        torch.testing.assert_close(got, expected, **exact)
        assert got_grads.keys() == expected_grads.keys() and not checks.missing_grads(fused)
        for parameter, grad in got_grads.items():
            torch.testing.assert_close(
                grad, expected_grads[parameter], **close, msg=lambda m, parameter=parameter: f"{parameter}: {m}"
            )
        fused.eval(), unfused.eval()
        with torch.no_grad():
            with fused.mjp_eval(ratio=0.5, seed=3), unfused.mjp_eval(ratio=0.5, seed=3):
                torch.testing.assert_close(fused(inputs), unfused(inputs), **exact)
            torch.testing.assert_close(fused(inputs), unfused(inputs), rtol=0, atol=0)  # eval: timm's, both
    assert len(calls) == 4  # two training steps and two mjp_eval forwards ran the op; eval did not


def test_the_fused_step_under_autocast_is_timms_arithmetic():
    """bfloat16 autocast on the CPU: the op takes the operands as autocast gives them to timm's nn.Linear, so the
    fused step (automatic backend: the op's torch computation) equals the unfused one bit for bit, in its dtype;
    the float32 register tokens promote the output as timm's cat does."""
    fused, unfused = _fused_pair("learned")
    batch = _naflex_batch()
    outputs = []
    for model in (fused, unfused):
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tokens, _ = model.embeds(batch["patches"], batch["patch_coord"], batch["patch_valid"])
        outputs.append(tokens)
    assert outputs[0].dtype == outputs[1].dtype == torch.float32  # the float32 register tokens promote
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    fused.embeds.reg_token = None  # no prefix: the tokens keep the autocast dtype
    unfused.embeds.reg_token = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = fused.embeds(batch["patches"], batch["patch_coord"], batch["patch_valid"])
        expected, _ = unfused.embeds(batch["patches"], batch["patch_coord"], batch["patch_valid"])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(embed_proj_type="conv"), r"embeds.proj is a Conv2d over images"),
        ("input norm", r"embeds has an input norm \(LayerNorm\) before its projection"),
        (dict(embed_norm_layer="layernorm"), r"embeds has a norm layer \(LayerNorm\) after its projection"),
    ],
)
def test_runs_fused_where_the_embedding_can_fuse_and_true_says_why_not(overrides, reason, monkeypatch):
    if overrides == "input norm":  # timm's NaFlexVit config does not pass input_norm_layer on: set as timm makes it
        plain = _plain("learned")
        plain.embeds.norm_input = torch.nn.LayerNorm(48)
    else:
        plain = _plain("learned", **overrides)
    with pytest.raises(ValueError, match=f"fused_patch_embed=True: {reason}"):
        mjp_timm.convert(copy.deepcopy(plain), fused_patch_embed=True)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).train()  # automatic: unfused, and says so
    assert not runs_fused(model)
    calls = _counting_fused_op(monkeypatch)
    model(_images()).sum().backward()
    assert not calls and model.mjp.last_jigsaw.mask.any()
    assert runs_fused(mjp_timm.convert(_plain("learned"), fused_patch_embed=True))
    assert not runs_fused(mjp_timm.convert(_plain("learned"), fused_patch_embed=False))


def test_variable_size_patches_through_the_interpolator_take_the_unfused_step(monkeypatch):
    """5-D patches of another size than the projection's go through timm's patch interpolator: that call is
    embedded unfused (the op is not called) and gives the unfused model's tokens."""
    fused, unfused = _fused_pair("learned", enable_patch_interpolator=True)
    batch = _naflex_batch([(16, 16), (8, 8)])
    rows = batch["patches"].reshape(2, -1, 4, 4, 3)
    big = F.interpolate(rows.flatten(0, 1).permute(0, 3, 1, 2), size=(6, 6), mode="bilinear")
    patches = big.permute(0, 2, 3, 1).reshape(2, -1, 6, 6, 3)
    calls = _counting_fused_op(monkeypatch)
    with torch.no_grad(), fused.mjp_eval(ratio=0.5, seed=2), unfused.mjp_eval(ratio=0.5, seed=2):
        got = fused.embeds(patches, batch["patch_coord"], batch["patch_valid"])[0]
        expected = unfused.embeds(patches, batch["patch_coord"], batch["patch_valid"])[0]
    assert not calls and fused.mjp.last_jigsaw.mask.any()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# Issue 40 item 5: timm's model checks (tests/test_models.py style) on a registered mjp_ NaFlexVit, MJP on.
REGISTERED = {
    "naflexvit_base_patch16_gap": TINY,
    "naflexvit_base_patch16_parfac_gap": TINY,
}
MJP = dict(mjp_ratio=0.5, mjp_prob=1.0)


def _create(base: str, **keywords) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(register(base), pretrained=False, **{**REGISTERED[base], **MJP, **keywords})


@pytest.mark.parametrize("base", list(REGISTERED))
def test_registered_forward_and_backward_reach_every_parameter(base):
    model = _create(base).train()
    assert model.pretrained_cfg["architecture"] == f"mjp_{base}" and isinstance(model, MJPNaFlexVit)
    for inputs in (_images(), _naflex_batch()):
        model.zero_grad()
        out = model(inputs)
        assert out.shape == (len(out), 5) and torch.isfinite(out).all()
        out.mean().backward()
        assert not checks.missing_grads(model), checks.missing_grads(model)
        assert model.mjp.last_dal_loss is not None


@pytest.mark.parametrize("base", list(REGISTERED))
def test_registered_forward_features_head_and_intermediates(base):
    model = _create(base).eval()
    images = _images()
    with torch.no_grad():
        features = model.forward_features(images)
        torch.testing.assert_close(model.forward_head(features), model(images))
        final, intermediates = model.forward_intermediates(images, indices=1)
    assert len(intermediates) == 1 and intermediates[0].shape == (2, 32, 4, 4)
    torch.testing.assert_close(final, features)


@pytest.mark.parametrize("base", list(REGISTERED))
def test_registered_features_only(base):
    model = _create(base, features_only=True, out_indices=(0,)).train()
    features = model(_images())
    assert len(features) == len(model.feature_info.channels()) == 1
    for feature, channels, reduction in zip(features, model.feature_info.channels(), model.feature_info.reduction()):
        assert feature.shape == (2, channels, 16 // reduction, 16 // reduction)
    sum(feature.mean() for feature in features).backward()
    assert model.model.mjp.unk_embed.grad is not None


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("base", list(REGISTERED))
def test_registered_fx_feature_extractor_equals_eager(base):
    model = _create(base).eval()
    _, eval_nodes = get_graph_node_names(model)
    extractor = create_feature_extractor(model, return_nodes=[eval_nodes[-1]])
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(extractor(images)[eval_nodes[-1]], model(images))
