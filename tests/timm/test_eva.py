"""MJP for timm's ``Eva`` (mjp_fast/timm/eva.py) and the rotary identity it gives shuffled positions
(mjp_fast/ops/rope_identity.py)."""

import copy
import itertools

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models.eva import Eva

import mjp_fast
import mjp_fast.timm as mjp_timm
from mjp_fast.timm.eva import MJPEva

TINY = dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5)

# name -> (timm model name, or None for timm's Eva class itself; extra keyword arguments)
MODELS = {
    "eva02": ("eva02_tiny_patch14_224", {}),  # absolute table (with the class token's row) + cat rope
    "rope": ("vit_small_patch16_rope_224", {}),  # cat rope only
    "rope_ape": ("vit_small_patch16_rope_ape_224", {}),  # + absolute table, no_embed_class
    "rope_mixed": ("vit_small_patch16_rope_mixed_224", {}),  # learnable per-block rope [depth, H, N, E]
    "rope_mixed_ape": ("vit_small_patch16_rope_mixed_ape_224", {}),
    "dinov3": ("vit_small_patch16_dinov3", {}),  # dinov3 rope, class + 4 register tokens, dynamic_img_size
    "rope_reg4_gap": ("vit_betwixt_patch16_rope_reg4_gap_256", {}),  # 4 register tokens, no class token
    "mrope": (None, dict(use_abs_pos_emb=False, use_rot_pos_emb=True, rope_type="mrope", num_reg_tokens=1)),
}
WITH_TABLE = {"eva02", "rope_ape", "rope_mixed_ape"}
MIXED = {"rope_mixed", "rope_mixed_ape"}
BACKENDS = [name for name in ("torch", "cpu") if name in mjp_fast.available_backends()]


def make(key, **overrides):
    torch.manual_seed(0)
    name, extra = MODELS[key]
    kwargs = {**TINY, **extra, **overrides}
    if name is None:
        try:
            return Eva(**kwargs)
        except TypeError as error:  # timm 1.0.29 (the GPU image's) passes its mrope rotary embedding an argument
            if key == "mrope":  # that it does not take: timm's own Eva fails to build there
                pytest.skip(f"timm {timm.__version__} cannot build its mrope Eva: {error}")
            raise
    return timm.create_model(name, pretrained=False, **kwargs)


def convert(plain, **kwargs):
    settings = dict(ratio=0.5, prob=1.0)
    return mjp_timm.convert(copy.deepcopy(plain), **{**settings, **kwargs})


def identity_row(width, dtype=torch.float32):
    return torch.cat((torch.zeros(width // 2, dtype=dtype), torch.ones(width // 2, dtype=dtype)))


# ----------------------------------------------------------------------------------------------------------------
# The models
# ----------------------------------------------------------------------------------------------------------------


def expected_pos_embed(plain, images, jigsaw, unk_embed, unk=True):
    """``(tokens, rope)`` of an MJP Eva from the definition, with timm's plain model's embedding and tables: the patch
    tokens moved by ``perm``; with ``unk``, ``unk_embed`` instead of the table row where masked (added to the moved
    token without a table) and the identity rotation at the masked rows of a batched rotary table; without, every
    position's own row and rotation."""
    plain = plain.eval()
    tokens = plain.patch_embed(images)
    batch, dim = tokens.shape[0], tokens.shape[-1]
    tokens = tokens.reshape(batch, -1, dim)
    _, rope = plain._pos_embed(plain.patch_embed(images))
    moved = tokens.gather(1, jigsaw.perm[..., None].expand_as(tokens))
    prefix = [token.expand(batch, -1, -1) for token in (plain.cls_token, plain.reg_token) if token is not None]
    prefix = torch.cat(prefix, dim=1) if prefix else tokens[:, :0]
    if plain.pos_embed is not None:
        rows = 0 if plain.no_embed_class else plain.num_prefix_tokens
        table = plain.pos_embed[:, rows:]
        moved = moved + (torch.where(jigsaw.mask[..., None], unk_embed, table) if unk else table)
        if rows:
            prefix = prefix + plain.pos_embed[:, :rows]
    elif unk:  # RoPE only: the shuffled tokens are marked by unk_embed
        moved = moved + torch.where(jigsaw.mask[..., None], unk_embed, torch.zeros_like(unk_embed))
    if rope is not None and unk:
        mixed = rope.dim() == 4
        table = (rope[:, None].repeat(1, batch, 1, 1, 1) if mixed else rope[None, None].repeat(batch, 1, 1, 1)).clone()
        by_sample = table.permute(1, 3, 0, 2, 4) if mixed else table.permute(0, 2, 1, 3)  # [B, N, ..., E]
        by_sample[jigsaw.mask] = identity_row(rope.shape[-1], rope.dtype)
        rope = table
    return torch.cat((prefix, moved), dim=1), rope


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [False, None], ids=["timm_conv", "fused_where_standard"])
@pytest.mark.parametrize("key", MODELS)
def test_training_pos_embed_equals_the_definition(key, fused, backend):
    plain = make(key)
    model = convert(plain, fused_patch_embed=fused, backend=backend)
    assert isinstance(model, MJPEva) and isinstance(model, Eva)
    assert mjp_timm.is_fused(model.patch_embed) == (fused is None and key in WITH_TABLE)
    images = torch.randn(3, 3, 32, 32)
    tokens, rope = model._pos_embed(model.patch_embed(images))
    jigsaw = model.mjp.last_jigsaw
    assert jigsaw is not None and jigsaw.mask.any()
    expected_tokens, expected_rope = expected_pos_embed(plain, images, jigsaw, model.mjp.unk_embed)
    assert "mjp.unk_embed" in model.state_dict()  # with a table or without (the marker of a shuffled token)
    torch.testing.assert_close(tokens, expected_tokens)
    assert torch.equal(rope, expected_rope)
    batch_dim = 1 if key in MIXED else 0
    assert rope.shape[batch_dim] == 3


@pytest.mark.parametrize("key", ["eva02", "rope", "rope_mixed"])
def test_naive_shuffle_moves_tokens_and_keeps_every_rotation(key):
    plain = make(key)
    model = convert(plain, unk=False, fused_patch_embed=False)
    images = torch.randn(2, 3, 32, 32)
    tokens, rope = model._pos_embed(model.patch_embed(images))
    jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.any() and model.mjp.unk_embed is None
    expected_tokens, expected_rope = expected_pos_embed(plain, images, jigsaw, None, unk=False)
    torch.testing.assert_close(tokens, expected_tokens)
    assert torch.equal(rope, expected_rope)  # timm's own table, unbatched


@pytest.mark.parametrize("key", MODELS)
def test_training_step(key):
    model = convert(make(key))
    loss = model(torch.randn(4, 3, 32, 32)).logsumexp(-1).mean() + 0.01 * model.mjp_aux_loss()
    loss.backward()
    assert model.mjp.last_jigsaw.mask.any() and model.mjp.sampler.samples_seen == 4
    assert model.patch_embed.proj.weight.grad.abs().sum() > 0
    assert model.mjp.unk_embed.grad.abs().sum() > 0
    if key in WITH_TABLE:
        assert model.pos_embed.grad.abs().sum() > 0
        assert all(p.grad.abs().sum() > 0 for p in model.mjp.dal_regressor.parameters())
        assert "mjp.unk_embed" in model.no_weight_decay() and "pos_embed" in model.no_weight_decay()
    else:
        assert model.mjp.dal_regressor is None and float(model.mjp_aux_loss()) == 0.0  # "auto": no DAL
    if key in MIXED:  # the learnable frequencies still learn, through the rows that keep their rotation
        assert model.rope.freqs.grad.abs().sum() > 0 and "rope.freqs" in model.no_weight_decay()


@pytest.mark.parametrize("fused", [False, None], ids=["timm_conv", "fused_where_standard"])
@pytest.mark.parametrize("key", MODELS)
def test_eval_mode_is_timms_model(key, fused):
    plain = make(key).eval()
    model = convert(plain, fused_patch_embed=fused).eval()
    images = torch.randn(2, 3, 32, 32)
    exact = {} if mjp_timm.is_fused(model.patch_embed) else dict(rtol=0, atol=0)
    torch.testing.assert_close(model(images), plain(images), **exact)
    ours, theirs = model.forward_intermediates(images, indices=2), plain.forward_intermediates(images, indices=2)
    torch.testing.assert_close(ours[0], theirs[0], **exact)
    for mine, timms in zip(ours[1], theirs[1], strict=True):
        torch.testing.assert_close(mine, timms, **exact)
    assert model.mjp.last_jigsaw is None


@pytest.mark.parametrize("key", MODELS)
def test_mjp_eval_jigsaws_the_same_way_for_the_same_seed(key):
    model = convert(make(key)).eval()
    images = torch.randn(2, 3, 32, 32)
    plain_features = model.forward_features(images)
    with model.mjp_eval(ratio=0.5, seed=3):
        first = model.forward_features(images)
        mask = model.mjp.last_jigsaw.mask
    with model.mjp_eval(ratio=0.5, seed=3):
        second = model.forward_features(images)
    assert mask.any() and not model.training
    assert torch.equal(first, second) and not torch.allclose(first, plain_features)


def _shuffled_pair_logits(model, images, monkeypatch):
    """Block 0's attention logits ``[B, H, N, N]`` between patch tokens, rows and columns in source-patch order (the
    patch each token shows), and which source patches were shuffled ``[B, N]``: q and k as the real layer gives them
    to scaled_dot_product_attention, after its rope."""
    seen = []
    original = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q, k))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for block in model.blocks:
        block.attn.fused_attn = True
    with torch.no_grad():
        model(images)
    q, k = seen[0]
    prefix = model.num_prefix_tokens
    logits = (q @ k.transpose(-2, -1))[:, :, prefix:, prefix:]
    jigsaw = model.mjp.last_jigsaw
    where = torch.argsort(jigsaw.perm, dim=1)  # where[b, s]: the position that shows source patch s
    index = where[:, None, :, None].expand(-1, logits.shape[1], -1, logits.shape[-1])
    logits = logits.gather(2, index).gather(3, index.transpose(2, 3))
    return logits, jigsaw.mask.gather(1, where), where


@pytest.mark.parametrize("key", ["rope", "eva02", "rope_mixed", "dinov3"])
def test_attention_between_shuffled_tokens_does_not_depend_on_where_they_sit(key, monkeypatch):
    """Two shuffled patches: their attention logit (q.k after rope) in a real layer is the same in every sample,
    wherever the jigsaw put them; with the naive shuffle (unk=False) it is not."""
    images = torch.randn(1, 3, 32, 32).expand(4, -1, -1, -1)  # one image, four jigsaws
    plain = make(key)
    logits, shuffled, where = _shuffled_pair_logits(convert(plain, dal="none").train(), images, monkeypatch)
    compared = moved = 0
    for first, second in itertools.combinations(range(4), 2):
        both = shuffled[first] & shuffled[second]
        pair = both[:, None] & both[None, :]
        torch.testing.assert_close(logits[first][:, pair], logits[second][:, pair], rtol=1e-5, atol=1e-5)
        compared += int(pair.sum())
        moved += int((where[first] != where[second])[both].sum())
    assert compared > 0 and moved > 0  # the same pairs, at other positions

    logits, shuffled, _ = _shuffled_pair_logits(convert(plain, dal="none", unk=False).train(), images, monkeypatch)
    both = shuffled[0] & shuffled[1]
    pair = both[:, None] & both[None, :]
    assert not torch.allclose(logits[0][:, pair], logits[1][:, pair], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key", ["eva02", "rope", "rope_mixed", "rope_mixed_ape", "dinov3"])
def test_patch_dropout_keeps_each_samples_rotations(key):
    plain = make(key, patch_drop_rate=0.5)
    model = convert(plain, fused_patch_embed=False)
    kept = []
    drop = model.patch_drop.forward
    model.patch_drop.forward = lambda x: (lambda out: kept.append(out[1]) or out)(drop(x))
    images = torch.randn(3, 3, 32, 32)
    tokens, rope = model._pos_embed(model.patch_embed(images))
    _, full_rope = expected_pos_embed(plain, images, model.mjp.last_jigsaw, model.mjp.unk_embed)
    keep = kept[0]  # [B, K] patch positions
    if key in MIXED:  # [depth, B, H, K, E], as timm's patch-dropout path
        index = keep[None, :, None, :, None].expand(full_rope.shape[0], -1, full_rope.shape[2], -1, full_rope.shape[-1])
        expected = full_rope.gather(3, index)
    else:  # [B, 1, K, E]
        expected = full_rope.gather(2, keep[:, None, :, None].expand(-1, 1, -1, full_rope.shape[-1]))
    assert torch.equal(rope, expected)
    assert tokens.shape[1] == model.num_prefix_tokens + keep.shape[1]
    model(images).sum().backward()


@pytest.mark.parametrize("fused", [False, None], ids=["unfused", "fused_where_it_can"])
@pytest.mark.parametrize("key", ["dinov3", "rope_mixed_ape"])
def test_dynamic_img_size_takes_the_grid_of_the_input(key, fused):
    plain = make(key, dynamic_img_size=True)
    model = convert(copy.deepcopy(plain), fused_patch_embed=fused)
    # the one with an absolute table fuses (its table resampled per call); RoPE alone has no table to fuse
    assert mjp_timm.is_fused(model.patch_embed) == (fused is None and plain.pos_embed is not None)
    images = torch.randn(2, 3, 40, 48)  # a 10 x 12 grid
    tokens, rope = model._pos_embed(model.patch_embed(images))
    mask = model.mjp.last_jigsaw.mask
    assert mask.shape == (2, 120) and mask.any()
    assert tokens.shape == (2, model.num_prefix_tokens + 120, 32) and rope.shape[-2] == 120
    loss = model(images).logsumexp(-1).mean() + 0.01 * model.mjp_aux_loss()
    loss.backward()
    model.eval(), plain.eval()
    # timm's own convolution: the same numbers; the fused GEMM sums in another order
    exact = {} if mjp_timm.is_fused(model.patch_embed) else dict(rtol=0, atol=0)
    torch.testing.assert_close(model(images), plain(images), **exact)


@pytest.mark.parametrize("key", ["eva02", "rope", "rope_mixed_ape", "dinov3"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_torch_fx_symbolic_trace(key, mode):
    images = torch.randn(2, 3, 32, 32)
    model = convert(make(key))
    getattr(model, mode)()
    graph = torch.fx.symbolic_trace(model)
    calls = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert sum("_jigsaw_rope" in call for call in calls) == (mode == "train")
    is_mjp = [node.op == "call_module" and node.target == "mjp" for node in graph.graph.nodes]
    assert sum(is_mjp) == (mode == "train")  # MJP is one node of the graph, in training only
    counter = model.mjp.sampler.sample_counter.clone()
    traced = graph(images)
    jigsaw = model.mjp.last_jigsaw
    model.mjp.sampler.sample_counter.copy_(counter)
    torch.testing.assert_close(traced, model(images), rtol=0, atol=1e-6)
    if mode == "train":
        assert jigsaw is not None and torch.equal(jigsaw.perm, model.mjp.last_jigsaw.perm)
        assert int(model.mjp.sampler.sample_counter) == int(counter) + 2


@pytest.mark.parametrize("key", ["eva02", "rope_mixed"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_fx_feature_extraction(key, mode):
    from timm.models import create_feature_extractor, get_graph_node_names

    images = torch.randn(2, 3, 32, 32)
    model = convert(make(key))
    getattr(model, mode)()
    with pytest.warns(UserWarning, match="train mode"):
        train_nodes, eval_nodes = get_graph_node_names(model)
    # MJP: the mjp module, then the rotary table of its jigsaw. Training only.
    jigsaw_nodes = {"mjp", "_jigsaw_rope"}
    assert jigsaw_nodes <= set(train_nodes) and not jigsaw_nodes & set(eval_nodes)
    with pytest.warns(UserWarning, match="train mode"):
        extractor = create_feature_extractor(model, return_nodes={"blocks.1": "mid", "norm": "out"})
    counter = model.mjp.sampler.sample_counter.clone()
    features = extractor(images)
    model.mjp.sampler.sample_counter.copy_(counter)
    seen = []
    hook = model.blocks[1].register_forward_hook(lambda module, inputs, output: seen.append(output))
    expected = model(images)
    hook.remove()
    torch.testing.assert_close(features["mid"], seen[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(model.forward_head(features["out"]), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("key", ["eva02", "rope", "dinov3"])
def test_features_only(key):
    name, extra = MODELS[key]
    kwargs = {**TINY, **extra, "features_only": True, "out_indices": (0, 1)}
    del kwargs["num_classes"]
    torch.manual_seed(0)
    plain = timm.create_model(name, pretrained=False, **kwargs).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0).eval()
    images = torch.randn(2, 3, 32, 32)
    for ours, theirs in zip(model(images), plain(images), strict=True):
        torch.testing.assert_close(ours, theirs)
    model.train()
    features = model(images)
    assert model.mjp.last_jigsaw.mask.any() and features[0].shape == (2, 32, 8, 8)
    sum(feature.sum() for feature in features).add(model.mjp_aux_loss()).backward()


def test_dal_needs_a_position_table():
    plain = make("rope")
    with pytest.warns(
        UserWarning, match="vit_small_patch16_rope_224 .*no absolute position table: it gets the identity"
    ):
        assert convert(plain, dal="linear").mjp.dal_regressor is None
    assert convert(plain).mjp.dal_regressor is None  # convert's default: no DAL for a RoPE-only model
    assert convert(plain, dal="none").mjp.dal_regressor is None
    assert convert(make("eva02")).mjp.dal_regressor is not None


def test_fused_patch_embed_true_says_why_not():
    with pytest.raises(ValueError, match="pos_embed is None"):
        convert(make("rope"), fused_patch_embed=True)
    assert mjp_timm.is_fused(convert(make("eva02"), fused_patch_embed=True).patch_embed)
    # dynamic_img_size (DINOv3's) fuses too: the table resampled per call (tests/timm/test_dynamic_fused.py)
    assert mjp_timm.is_fused(convert(make("dinov3", use_abs_pos_emb=True), fused_patch_embed=True).patch_embed)


@pytest.mark.parametrize("prob", [1.0, 0.0], ids=["jigsawed", "jigsaw_off"])
def test_dal_trains_through_the_output_alone(prob):
    """The state attaches the DAL loss to the tokens (any loop trains DAL), also while the jigsaw is off (prob 0): the
    Eva front end calls it whenever it is engaged, and the rotary table is then timm's own."""
    plain = make("eva02")
    model = convert(plain, prob=prob, fused_patch_embed=False)
    images = torch.randn(2, 3, 32, 32)
    _, rope = model._pos_embed(model.patch_embed(images))
    assert (model.mjp.last_jigsaw is None) == (prob == 0.0)
    if prob == 0.0:
        assert torch.equal(rope, plain.rope.get_embed())
    model(images).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mjp.dal_regressor.parameters())
