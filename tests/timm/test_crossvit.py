"""MJP's token path for timm's CrossViT (mjp_fast/timm/crossvit.py, issue 40 item 1): both branches' tables, each
with its own ``unk_embed`` and DAL, one jigsaw carried to both grids; convert, eval equal to timm's, a training step
whose output alone reaches every parameter, ``mjp_eval``, the jigsaw against pure-torch expectations, the fused
embedding, FX, ``forward_intermediates``, ``features_only``, checkpoints both ways, pickling, and the refusals."""

from __future__ import annotations

import copy
import math

import pytest
import timm
import torch
from timm.layers import create_feature_extractor
from timm.models.crossvit import CrossVit, scale_image

import mjp_fast.timm as mjp_timm
from mjp_fast import jigsaw_images
from mjp_fast.sampler.jigsaw import Jigsaw
from mjp_fast.timm.crossvit import (
    CarriedJigsawSampler,
    CrossVitDrawSampler,
    CrossVitMJPPatchEmbed,
    MJPCrossVit,
    branch_geometry,
    carry_jigsaw,
)
from tests.conftest import backends_for
from tests.timm import front_end_checks as checks

SMALL = dict(embed_dim=[16, 32], depth=[[1, 1, 0], [1, 1, 0]], num_heads=[2, 2], mlp_ratio=[2, 2, 1], num_classes=5)
MODELS = {
    # timm's geometry: 12-pixel patches on the input, 16-pixel ones on the input resized to 224/240 of it
    # (72 -> 67 pixels: a 6x6 and a 4x4 grid, whose cells do not align)
    "tiny": ("crossvit_tiny_240", dict(img_size=72, **SMALL)),
    # multi-conv embeddings, both branches on the 48-pixel input: a 4x4 and a 3x3 grid
    "dagger": ("crossvit_9_dagger_240", dict(img_size=48, img_scale=(1.0, 1.0), **SMALL)),
    # CrossVit's default patches (8, 16) on one image: an 8x8 grid made of the 4x4 grid's cells, 2x2 each
    "aligned": (None, dict(img_size=64, img_scale=(1.0, 1.0), patch_size=(8, 16), **SMALL)),
}
SETTINGS = dict(ratio=0.5, prob=1.0, min_block=1)


def _plain(kind: str, **overrides) -> CrossVit:
    name, keywords = MODELS[kind]
    torch.manual_seed(0)
    keywords = {**keywords, **overrides}
    if name is None:
        keywords = {key: tuple(map(tuple, v)) if key == "depth" else v for key, v in keywords.items()}
        return CrossVit(**keywords)
    return timm.create_model(name, pretrained=False, **keywords)


def _images(kind: str, batch: int = 2) -> torch.Tensor:
    size = MODELS[kind][1]["img_size"]
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def _tables(model: CrossVit) -> list[torch.Tensor]:
    return [model.pos_embed_0, model.pos_embed_1]


def _states(model: MJPCrossVit) -> list:
    return [model.mjp, model.mjp.branch_1]


def _branch_tokens(model: CrossVit, images: torch.Tensor, branch: int) -> torch.Tensor:
    """What timm adds the table to, for one branch: the class token, then the patch tokens ``[B, 1 + N_b, D_b]``."""
    scaled = scale_image(images, model.img_size_scaled[branch], model.crop_scale)
    cls_token = (model.cls_token_0 if branch == 0 else model.cls_token_1).expand(images.shape[0], -1, -1)
    return torch.cat((cls_token, model.patch_embed[branch](scaled)), dim=1)


@pytest.mark.parametrize("kind", list(MODELS))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, MJPCrossVit) and all(isinstance(e, CrossVitMJPPatchEmbed) for e in model.patch_embed)
    assert isinstance(model.mjp, mjp_timm.MJPState) and isinstance(model.mjp.sampler, CrossVitDrawSampler)
    assert isinstance(model.mjp.branch_1.sampler, CarriedJigsawSampler)
    for state, dim in zip(_states(model), (16, 32), strict=True):
        assert state.unk_embed.shape == (dim,) and state.dal_regressor is not None
    assert {"mjp.unk_embed", "mjp.branch_1.unk_embed", "pos_embed_0", "pos_embed_1"} <= model.no_weight_decay()
    assert model.mjp.patch_size == model.patch_embed[0].patch_size[0]
    assert model.mjp.branch_1.patch_size == model.patch_embed[1].patch_size[0]
    images = _images(kind)
    expected = checks.assert_eval_equals_timm(model, plain, images)
    model.train()
    model(images).logsumexp(-1).mean().backward()  # the output alone: both branches' DAL rides on it
    checks.assert_every_parameter_has_a_grad(model)
    assert model.mjp.sampler.samples_seen == 2  # one draw for both branches
    for state, table in zip(_states(model), _tables(model), strict=True):
        checks.assert_state_learned(state)
        assert table.grad[:, 1:].abs().sum() > 0
    aux = model.mjp_aux_loss()
    expected_aux = model.mjp.last_dal_loss + model.mjp.branch_1.last_dal_loss
    torch.testing.assert_close(aux.detach(), expected_aux)
    model.eval()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=0):
        jigsawed, features = model(images), model.forward_features(images)
    assert all(state.last_jigsaw.mask.any() for state in _states(model))
    assert not torch.equal(jigsawed, expected)
    with torch.no_grad():
        for got, plain_features in zip(features, plain.forward_features(images), strict=True):
            assert (got - plain_features).abs().max() > 1e-2  # both branches' tokens move
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)  # outside mjp_eval: timm's again
        with model.mjp_eval(seed=5):
            again = model(images)
        with model.mjp_eval(seed=5):
            torch.testing.assert_close(model(images), again, rtol=0, atol=0)  # the same seed, the same jigsaws


def _carry_ref(jigsaw: Jigsaw, source, target) -> Jigsaw:
    """The carry of the module docstring, written as loops over one sample at a time: a target token is masked where
    the centre of its image region lies in a masked source cell; it wants the target patch nearest its centre moved
    as its cell moved; the masked tokens, in the order of the patches they want (then of their positions), take the
    masked patches in position order."""
    (rows, cols), (source_rows, source_cols) = target.grid, source.grid
    masks, perms = [], []
    for mask, perm in zip(jigsaw.mask.tolist(), jigsaw.perm.tolist(), strict=True):
        wanted = {}
        for i in range(rows):
            for j in range(cols):
                y = target.origin[0] + (i + 0.5) * target.step[0]
                x = target.origin[1] + (j + 0.5) * target.step[1]
                cell_row = math.floor((y - source.origin[0]) / source.step[0])
                cell_col = math.floor((x - source.origin[1]) / source.step[1])
                if not (0 <= cell_row < source_rows and 0 <= cell_col < source_cols):
                    continue
                cell = cell_row * source_cols + cell_col
                if not mask[cell]:
                    continue
                came_row, came_col = divmod(perm[cell], source_cols)
                want_row = round(i + (came_row - cell_row) * source.step[0] / target.step[0])
                want_col = round(j + (came_col - cell_col) * source.step[1] / target.step[1])
                want_row, want_col = min(max(want_row, 0), rows - 1), min(max(want_col, 0), cols - 1)
                wanted[i * cols + j] = want_row * cols + want_col
        masked = sorted(wanted)
        by_want = sorted(masked, key=lambda position: (wanted[position], position))
        moved = list(range(rows * cols))
        for position, patch in zip(by_want, masked, strict=True):
            moved[position] = patch
        masks.append([position in wanted for position in range(rows * cols)])
        perms.append(moved)
    return Jigsaw(torch.tensor(masks), torch.tensor(perms))


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_step_of_each_branch_is_its_unk_on_its_table_of_its_jigsawed_tokens(kind):
    """Inside mjp_eval, each branch's tokens (what timm's blocks get) are its jigsawed patch tokens plus its own
    ``unk_embed`` at its masked positions and its table's rows elsewhere, the class token and row untouched; the
    jigsaw is drawn on the coarser grid (branch 1's) and carried to branch 0's as a loop reference carries it."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    images = _images(kind, batch=3)
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got = [model.pos_drop(_branch_tokens(model, images, b) + table) for b, table in enumerate(_tables(model))]
        jigsaws = [state.last_jigsaw for state in _states(model)]
    geometries = [branch_geometry(model, branch) for branch in range(2)]
    assert model.mjp.sampler.grid_size == geometries[1].grid  # the draw: on branch 1's coarser grid
    expected_jigsaw = _carry_ref(jigsaws[1], geometries[1], geometries[0])
    assert torch.equal(jigsaws[0].mask, expected_jigsaw.mask) and torch.equal(jigsaws[0].perm, expected_jigsaw.perm)
    for branch, (state, table, jigsaw) in enumerate(zip(_states(model), _tables(model), jigsaws, strict=True)):
        assert jigsaw.mask.any()
        patch = model.patch_embed[branch].patch_size[0]
        scaled = scale_image(images, model.img_size_scaled[branch], model.crop_scale)
        rows, cols = geometries[branch].grid
        scaled = scaled[..., : rows * patch, : cols * patch]  # the pixels timm's grid covers (it floors)
        with torch.no_grad():
            jigsawed = jigsaw_images(scaled, jigsaw, patch)
            full = torch.zeros(images.shape[0], 3, *model.img_size_scaled[branch])
            full[..., : rows * patch, : cols * patch] = jigsawed
            tokens = model.patch_embed[branch](full)  # eval: timm's embedding of the jigsawed images
        mask = jigsaw.mask.unsqueeze(-1)
        rows_of_table = table[:, 1:].expand_as(tokens)
        expected = tokens + torch.where(mask, state.unk_embed.expand_as(tokens), rows_of_table)
        torch.testing.assert_close(got[branch][:, 1:], expected, rtol=1e-5, atol=1e-5)
        cls_token = model.cls_token_0 if branch == 0 else model.cls_token_1
        torch.testing.assert_close(got[branch][:, :1], (cls_token + table[:, :1]).expand(3, -1, -1))


def test_aligned_grids_move_the_same_image_regions_in_both_branches():
    """Where branch 0's 8-pixel cells make up branch 1's 16-pixel ones on the same image, the carried jigsaw is
    exact: each 16-pixel cell's 2x2 block of 8-pixel tokens moves as one, so both branches' jigsawed images are the
    same pixels."""
    model = mjp_timm.convert(_plain("aligned"), **SETTINGS).eval()
    images = _images("aligned", batch=4)
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=7):
        model(images)
    fine, coarse = model.mjp.last_jigsaw, model.mjp.branch_1.last_jigsaw
    assert coarse.mask.any() and not coarse.mask.all()
    assert torch.equal(jigsaw_images(images, fine, 8), jigsaw_images(images, coarse, 16))
    expanded = coarse.mask.reshape(4, 4, 1, 4, 1).expand(4, 4, 2, 4, 2).reshape(4, 64)
    assert torch.equal(fine.mask, expanded)


def test_carry_of_unaligned_grids_keeps_the_masked_fraction():
    """timm's geometry (a 20x20 and a 14x14 grid, crossvit_*_240): the carried mask hides about the same share of
    the image as the draw (within the border tokens), and the perm permutes exactly the masked positions."""
    model = _plain("tiny", img_size=240)
    source, target = branch_geometry(model, 1), branch_geometry(model, 0)
    assert source.grid == (14, 14) and target.grid == (20, 20)
    sampler = mjp_timm.MJPState(source.grid, None, patch_size=16, ratio=0.4, prob=1.0, seed=0, dal=None).sampler
    draw = sampler(8, torch.device("cpu"))
    carried = carry_jigsaw(draw, source, target)
    reference = _carry_ref(draw, source, target)
    assert torch.equal(carried.mask, reference.mask) and torch.equal(carried.perm, reference.perm)
    drawn, kept = draw.mask.float().mean(1), carried.mask.float().mean(1)
    assert (drawn - kept).abs().max() < 0.08
    positions = torch.arange(400)
    assert torch.equal(torch.where(carried.mask, positions, carried.perm), positions.expand(8, -1))
    assert torch.equal(carried.perm.sort(dim=1).values, positions.expand(8, -1))


def test_fused_and_unfused_embeddings_agree():
    plain = _plain("tiny")
    fused = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    unfused = mjp_timm.convert(copy.deepcopy(plain), fused_patch_embed=False, **SETTINGS)
    assert mjp_timm.convert.__globals__["runs_fused"](fused) and not unfused.patch_embed[0].__dict__["_mjp_fused"]
    unfused.mjp.load_state_dict(fused.mjp.state_dict())  # the same unk_embeds and DAL regressors, both branches
    images = _images("tiny")
    fused.eval(), unfused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(images), unfused(images), rtol=0, atol=0)  # eval: timm's embedding, both
        with fused.mjp_eval(ratio=0.5, seed=4), unfused.mjp_eval(ratio=0.5, seed=4):
            got, expected = fused.forward_features(images), unfused.forward_features(images)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    fused.train(), unfused.train()  # the same sampler seed: the same jigsaws, the same step
    torch.testing.assert_close(fused(images), unfused(images), rtol=1e-4, atol=1e-5)
    for got_state, expected_state in zip(_states(fused), _states(unfused), strict=True):
        torch.testing.assert_close(got_state.last_dal_loss, expected_state.last_dal_loss)


def test_multi_conv_is_jigsawed_in_pixels_and_refuses_fusion():
    plain = _plain("dagger")
    with pytest.raises(ValueError, match=r"fused_patch_embed=True: patch_embed\[0\] is a multi-conv embedding"):
        mjp_timm.convert(copy.deepcopy(plain), fused_patch_embed=True)
    model = mjp_timm.convert(plain, **SETTINGS)
    assert not model.patch_embed[0].__dict__["_mjp_fused"] and model.patch_embed[1].__dict__["_mjp_pixels"]


def test_a_multi_conv_branch_needs_whole_patches():
    # 50 pixels: timm's 12-pixel multi-conv stem gives the 4x4 grid of its table, from 50x50 pixels, which are not
    # whole 12-pixel patches for the pixel jigsaw
    with pytest.raises(ValueError, match=r"branch 0's images are 50x50 pixels, not whole 12-pixel patches"):
        mjp_timm.convert(_plain("dagger", img_size=50))


def test_a_table_that_is_not_the_grid_is_refused():
    # 48 pixels resized to 224/240: 44, a 2x2 grid of 16-pixel patches, but timm's own count, 44 // 16 * 44 // 16,
    # gives pos_embed_1 5 patch rows: timm's forward fails on it too
    with pytest.raises(ValueError, match=r"pos_embed_1 has 6 rows, not the class row and the 2x2 grid"):
        mjp_timm.convert(_plain("dagger", img_scale=(1.0, 224 / 240)))


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("kind", ["tiny", "dagger"])
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(kind, training):
    model = mjp_timm.convert(_plain(kind), **SETTINGS).train(training)
    images = _images(kind)
    # timm's marks: scale_image (CrossViT's resize, whose size check is control flow) one call, MJP's states calls
    graph = torch.fx.GraphModule(model, checks.TimmLeafTracer(notrace_functions=True).trace(model))
    targets = [node.target for node in graph.graph.nodes if node.op == "call_module"]
    assert ("mjp" in targets and "mjp.branch_1" in targets) == training  # MJP: nodes of a graph traced in training
    with torch.no_grad():
        if training:
            out = graph(images)
            assert out.shape == (2, 5) and all(state.last_jigsaw.mask.any() for state in _states(model))
        else:
            torch.testing.assert_close(graph(images), model(images), rtol=0, atol=0)
    extractor = create_feature_extractor(model, return_nodes={"norm.0": "small", "norm.1": "large"})
    with torch.no_grad():
        features = extractor(images)
    assert features["small"].shape[-1] == 16 and features["large"].shape[-1] == 32


def test_forward_intermediates():
    plain = _plain("tiny").eval()
    if not hasattr(plain, "forward_intermediates"):
        pytest.skip(f"timm {timm.__version__}'s CrossVit has no forward_intermediates")
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images("tiny")
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(images)
        expected_final, expected = plain.forward_intermediates(images)
        for got, want in zip(final + intermediates, expected_final + expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        # branch-major: the 2 blocks of branch 0 (6x6, width 16), then of branch 1 (4x4, width 32)
        assert [tuple(t.shape) for t in intermediates] == [(2, 16, 6, 6)] * 2 + [(2, 32, 4, 4)] * 2
        with model.mjp_eval(ratio=0.5, seed=1):
            jigsawed = model.forward_intermediates(images, intermediates_only=True)
        assert all(not torch.allclose(got, want) for got, want in zip(jigsawed, expected, strict=True))
    model.train()
    _, intermediates = model.forward_intermediates(images)
    sum(t.square().mean() for t in intermediates).backward()
    assert all(state.unk_embed.grad is not None and state.last_dal_loss is not None for state in _states(model))


def test_features_only():
    name, keywords = MODELS["tiny"]
    torch.manual_seed(0)
    try:
        wrapper = timm.create_model(name, pretrained=False, features_only=True, out_indices=(1, 3), **keywords)
    except RuntimeError as error:  # timm 1.0.29: "features_only not implemented for Vision Transformer models."
        pytest.skip(f"timm {timm.__version__} builds no features_only {name}: {error}")
    plain = copy.deepcopy(wrapper).eval()
    model = mjp_timm.convert(wrapper, **SETTINGS).eval()
    assert model.mjp is model.model.mjp and isinstance(model.model, MJPCrossVit)
    images = _images("tiny")
    with torch.no_grad():
        expected = plain(images)
        for got, want in zip(model(images), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5):
            jigsawed = model(images)
    assert [tuple(t.shape) for t in jigsawed] == [(2, 16, 6, 6), (2, 32, 4, 4)]
    assert all(not torch.allclose(got, want) for got, want in zip(jigsawed, expected, strict=True))
    model.train()
    sum(feature.square().mean() for feature in model(images)).backward()
    assert all(state.unk_embed.grad is not None for state in _states(model.model))


@pytest.mark.parametrize("kind", ["tiny", "dagger"])
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images(kind)
    checks.assert_checkpoints_both_ways(plain, model, lambda: _plain(kind), images)  # both branches' unk_embed drawn
    assert {"mjp.unk_embed", "mjp.branch_1.unk_embed"} <= set(model.state_dict()) - set(plain.state_dict())
    reloaded = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    reloaded.load_state_dict(model.state_dict())  # MJP -> MJP: both branches' states
    loaded, copied = checks.assert_pickles_and_copies(model, images, _check_clone)
    with torch.no_grad():
        with model.mjp_eval(seed=2):
            expected = model(images)
        for clone in (loaded, copied, reloaded):
            with clone.mjp_eval(seed=2):
                assert torch.equal(clone(images), expected)


def _check_clone(clone: torch.nn.Module) -> None:
    assert all(embed.__dict__["_mjp_model"] is clone for embed in clone.patch_embed)
    assert clone.mjp.branch_1.sampler.source is clone.mjp.sampler


def test_dal_weight_warm_up_and_settings():
    model = mjp_timm.convert(_plain("tiny"), **SETTINGS)
    model.mjp_dal_weight = 0.25
    assert [state.get_dal_weight() for state in _states(model)] == [0.25, 0.25] and model.mjp_dal_weight == 0.25
    model.mjp.sampler.prob = 0.0  # a warm-up: no jigsaw, yet every parameter still gets a gradient from the output
    images = _images("tiny")
    model(images).logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(state.last_jigsaw is None for state in _states(model))
    plain = mjp_timm.convert(_plain("tiny"), dal=None, unk=False, **SETTINGS)
    assert all(state.unk_embed is None and state.dal_regressor is None for state in _states(plain))
    assert not any(name.startswith("mjp") for name in plain.no_weight_decay())
    plain(images).sum().backward()
    assert plain.mjp_aux_loss() == 0 and plain.mjp.branch_1.last_jigsaw.mask.any()


def test_bad_input_clear_errors():
    with pytest.raises(ValueError, match=r"pixel_jigsaw=True: model .*CrossVit.* token path covers"):
        mjp_timm.convert(_plain("tiny"), pixel_jigsaw=True)
    three = _plain("tiny")
    three.num_branches = 3
    with pytest.raises(ValueError, match="a CrossVit with 3 branches"):
        mjp_timm.convert(three)
    short = _plain("tiny")
    short.pos_embed_1 = torch.nn.Parameter(torch.zeros(1, 10, 32))
    with pytest.raises(ValueError, match=r"pos_embed_1 has 10 rows, not the class row and the 4x4 grid"):
        mjp_timm.convert(short)
    model = mjp_timm.convert(_plain("tiny"), **SETTINGS)
    with pytest.raises(ValueError, match="already an MJP model"):
        mjp_timm.convert(model)
    with pytest.raises(AssertionError, match=r"Input height \(64\) doesn't match model \(72\)"):
        model.patch_embed[0](torch.randn(2, 3, 64, 72))  # the fused embedding checks the size as timm's does
    with torch.no_grad(), model.mjp_eval():
        with pytest.raises(RuntimeError, match="branch 1's jigsaw is carried from the draw of branch 0's step"):
            model.patch_embed[1](torch.randn(2, 3, 67, 67))
    with pytest.raises(ValueError, match=r"grid_size: a CrossViT branch's jigsaw is of its grid \(6, 6\)"):
        model.mjp.sampler(2, torch.device("cpu"), (3, 3))


@pytest.mark.parametrize("fused", [True, False])
def test_every_backend_takes_the_same_step(fused):
    """The class row goes in as the prefix (the kernels' layout): each backend's training step, fused or not, gives
    the torch backend's tokens, DAL losses and gradients."""
    images = _images("tiny")
    results = {}
    for backend in backends_for("cpu"):
        model = mjp_timm.convert(_plain("tiny"), backend=backend, fused_patch_embed=fused, **SETTINGS)
        out = model(images)
        out.logsumexp(-1).mean().backward()
        grads = [
            model.pos_embed_0.grad,
            model.pos_embed_1.grad,
            model.mjp.unk_embed.grad,
            model.mjp.branch_1.unk_embed.grad,
        ]
        results[backend] = (out, [state.last_dal_loss for state in _states(model)], grads)
    expected = results.pop("torch")
    for backend, got in results.items():
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=lambda m, b=backend: f"{b}: {m}")


def test_a_single_branch_crossvit():
    torch.manual_seed(0)
    plain = CrossVit(
        img_size=32, img_scale=(1.0,), patch_size=(8,), embed_dim=(16,), depth=((1, 0),), num_heads=(2,),
        mlp_ratio=(2, 1), num_classes=3,
    ).eval()  # fmt: skip
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    assert not hasattr(model.mjp, "branch_1") and model.mjp.sampler.grid_size == (4, 4)
    assert {"mjp.unk_embed"} <= model.no_weight_decay()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)
        with model.mjp_eval(seed=1):
            assert not torch.equal(model(images), plain(images))
    model.train()
    model(images).logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert torch.isfinite(model.mjp_aux_loss())


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_masked_position_gives_its_table_row_no_gradient(kind):
    """Without DAL, a position masked in every sample is ``unk_embed``'s, not its table row's: its row gets no
    gradient, each unmasked one does (the hook's ``- table`` cancels timm's ``+ table`` in the backward too)."""
    model = mjp_timm.convert(_plain(kind), dal=None, **SETTINGS)
    model(_images(kind, batch=1)).logsumexp(-1).mean().backward()
    for state, table in zip(_states(model), _tables(model), strict=True):
        mask = state.last_jigsaw.mask[0]
        assert mask.any() and not mask.all()
        row_grads = table.grad[0, 1:].abs().sum(-1)
        assert torch.all(row_grads[mask] == 0) and torch.all(row_grads[~mask] > 0)
        assert table.grad[0, 0].abs().sum() > 0  # the class row: timm's add


def test_a_crossvit_built_on_the_meta_device_converts_and_both_branches_keep_the_dal_weight():
    """Built on the meta device (weights loaded later with assign=True), a CrossViT converts with no read back of a
    value; each branch's state carries the DAL weight convert was given."""
    with torch.device("meta"):
        meta = timm.create_model("crossvit_tiny_240", pretrained=False)
    converted = mjp_timm.convert(meta, dal_weight=0.3)
    assert converted.mjp.branch_1.dal_weight.device.type == "meta"
    model = mjp_timm.convert(timm.create_model("crossvit_tiny_240", pretrained=False), dal_weight=0.3)
    assert model.mjp.get_dal_weight() == pytest.approx(0.3)
    assert model.mjp.branch_1.get_dal_weight() == pytest.approx(0.3)
