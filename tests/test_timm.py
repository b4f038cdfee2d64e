import copy
import json
import os
import subprocess
import sys

import pytest
import timm
import torch

import mjp_fast
import mjp_fast.timm as mjp_timm

from .conftest import backends_for

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


def tiny_vit(**kwargs):
    return timm.models.VisionTransformer(**{**TINY, **kwargs})


VARIANTS = {
    "class_token": dict(),
    "no_class_token": dict(class_token=False, global_pool="avg"),
    "registers": dict(reg_tokens=2),
    "no_embed_class": dict(no_embed_class=True),
    "registers_no_embed_class": dict(reg_tokens=1, no_embed_class=True),
    "dynamic_img_size": dict(dynamic_img_size=True),
}


@pytest.mark.parametrize("fused", [False, None], ids=["unfused", "fused_if_standard"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_converted_model_in_eval_mode_is_the_plain_model(variant, fused):
    torch.manual_seed(0)
    plain = tiny_vit(**VARIANTS[variant]).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0, fused_patch_embed=fused)
    assert isinstance(model, timm.models.VisionTransformer)
    images = torch.randn(3, 3, 32, 32)
    # timm's own Conv2d: the same numbers; the fused patch embedding sums its GEMM in another order.
    exact = {} if mjp_timm.is_fused(model.patch_embed) else dict(rtol=0, atol=0)
    assert mjp_timm.is_fused(model.patch_embed) == (fused is None)  # dynamic_img_size too: the table resampled
    torch.testing.assert_close(model(images), plain(images), **exact)
    torch.testing.assert_close(model.forward_features(images), plain.forward_features(images), **exact)
    features = model.forward_features(images)
    torch.testing.assert_close(model.forward_head(features), plain.forward_head(features))
    ours = model.forward_intermediates(images, indices=1)
    theirs = plain.forward_intermediates(images, indices=1)
    torch.testing.assert_close(ours[0], theirs[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_jigsaws_patch_tokens_only(variant):
    torch.manual_seed(0)
    model = mjp_timm.convert(tiny_vit(**VARIANTS[variant]), ratio=0.5, prob=1.0, dal="linear")
    images = torch.randn(2, 3, 32, 32)
    # The tokens after the position embedding, against the definition: shuffled patch tokens with UNK where
    # masked, prefix tokens untouched. (A fused patch_embed passes the images on to _pos_embed, which embeds them.)
    tokens = model._pos_embed(model.patch_embed(images))
    jigsaw = model.mjp.last_jigsaw
    assert jigsaw is not None and jigsaw.mask.any()
    flat = model.patch_embed.proj(images).flatten(2).transpose(1, 2)
    prefix = 0 if model.no_embed_class else model.num_prefix_tokens
    pos = model.pos_embed[:, prefix:]
    expected = flat.gather(1, jigsaw.perm[..., None].expand(-1, -1, 32))
    expected = expected + torch.where(jigsaw.mask[..., None], model.mjp.unk_embed, pos)
    torch.testing.assert_close(tokens[:, model.num_prefix_tokens :], expected)
    if model.cls_token is not None:
        expected_cls = model.cls_token + (model.pos_embed[:, :1] if not model.no_embed_class else 0)
        torch.testing.assert_close(tokens[:, :1], expected_cls.expand(2, -1, -1))


def test_training_step_reaches_unk_embed_and_the_dal_regressor():
    model = mjp_timm.convert(tiny_vit(), ratio=0.5, prob=1.0, dal="nonlinear")
    loss = model(torch.randn(4, 3, 32, 32)).logsumexp(-1).mean() + 0.01 * model.mjp_aux_loss()
    loss.backward()
    assert model.mjp.unk_embed.grad is not None and model.mjp.unk_embed.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mjp.dal_regressor.parameters())
    assert model.pos_embed.grad.abs().sum() > 0
    assert "mjp.unk_embed" in model.no_weight_decay() and "pos_embed" in model.no_weight_decay()
    assert model.mjp.sampler.samples_seen == 4


def test_aux_loss_is_zero_without_dal():
    model = mjp_timm.convert(tiny_vit(), dal=None)
    model(torch.randn(1, 3, 32, 32))
    assert model.mjp_aux_loss().item() == 0.0


def test_checkpoints_load_both_ways():
    plain = tiny_vit().eval()
    model = mjp_timm.convert(tiny_vit(), ratio=0.3, prob=1.0).eval()
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(key.startswith("mjp.") for key in missing)
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(images), plain(images))
    back = tiny_vit().eval()
    missing, unexpected = back.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(key.startswith("mjp.") for key in unexpected)
    torch.testing.assert_close(back(images), model(images))


def test_resumed_model_draws_the_same_jigsaws():
    model = mjp_timm.convert(tiny_vit(), ratio=0.5, prob=1.0)
    model(torch.randn(2, 3, 32, 32))
    state = copy.deepcopy(model.state_dict())
    model(torch.randn(2, 3, 32, 32))
    resumed = mjp_timm.convert(tiny_vit(), ratio=0.5, prob=1.0)
    resumed.load_state_dict(state)
    resumed(torch.randn(2, 3, 32, 32))
    assert torch.equal(resumed.mjp.last_jigsaw.perm, model.mjp.last_jigsaw.perm)


def test_mjp_eval_repeats_jigsaws_and_restores_training_mode():
    model = mjp_timm.convert(tiny_vit(), ratio=0.5, prob=0.5)
    images = torch.randn(3, 3, 32, 32)
    with model.mjp_eval(ratio=0.5, seed=1):
        assert not model.training
        first = model(images)
    with model.mjp_eval(ratio=0.5, seed=1):
        second = model(images)
    assert model.training
    torch.testing.assert_close(first, second)
    model.eval()
    assert not torch.allclose(first, model(images))


def test_dynamic_image_size_and_set_input_size():
    model = mjp_timm.convert(tiny_vit(dynamic_img_size=True), ratio=0.5, prob=1.0, dal="linear")
    model(torch.randn(2, 3, 48, 40))
    assert model.mjp.last_jigsaw.mask.shape == (2, 30)  # the sampler follows the actual grid
    assert torch.isfinite(model.mjp_aux_loss())
    fixed = mjp_timm.convert(tiny_vit(), ratio=0.5, prob=1.0)
    fixed.set_input_size(img_size=(48, 48))
    assert fixed(torch.randn(1, 3, 48, 48)).shape == (1, 5)
    assert fixed.mjp.last_jigsaw.mask.shape == (1, 36)


def test_pixel_space_jigsaw_on_resnet():
    torch.manual_seed(0)
    plain = timm.create_model("resnet18", pretrained=False, num_classes=4).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0, dal=None, patch_size=8)
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(images), plain(images))
    model.train()
    plain.train()
    out = model(images)
    jigsaw = model.mjp.last_jigsaw
    assert jigsaw is not None and jigsaw.mask.shape == (2, 16)
    from mjp_fast import jigsaw_images

    torch.testing.assert_close(out, plain(jigsaw_images(images, jigsaw, 8)))
    assert model.mjp_aux_loss().item() == 0.0


@pytest.mark.parametrize("name", mjp_timm.REGISTERED_BASES)
def test_every_registered_name_creates_offline(name):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    model = timm.create_model(
        f"mjp_{name}",
        pretrained=False,
        mjp_ratio=0.2,
        mjp_prob=1.0,
        mjp_dal="linear",
        num_classes=3,
        img_size=64,
        drop_path_rate=0.1,
    )
    assert isinstance(model, mjp_timm.MJPVisionTransformer)
    assert model.mjp.sampler.ratio == 0.2 and model.num_classes == 3
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)


def test_register_any_timm_model():
    name = mjp_timm.register("vit_tiny_patch16_224")
    assert name == "mjp_vit_tiny_patch16_224" and timm.is_model(name)
    assert mjp_timm.register("vit_tiny_patch16_224") == name  # twice: the same registration
    model = timm.create_model(name, pretrained=False, img_size=32, mjp_ratio=0.25, mjp_prob=1.0, num_classes=2)
    assert isinstance(model, mjp_timm.MJPVisionTransformer) and model.mjp.sampler.ratio == 0.25
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 2)
    with pytest.raises(ValueError, match="base must be a timm model name"):
        mjp_timm.register("vit_no_such_model")
    with pytest.raises(TypeError, match="base"):
        mjp_timm.register(3)


# Run in a fresh interpreter: in this one, other tests have imported mjp_fast.timm already.
PLAIN_IMPORT = """
import json, sys

import mjp_fast  # nothing else of mjp_fast
import timm

model = timm.create_model("mjp_deit_tiny_patch16_224", img_size=32, num_classes=2, mjp_prob=1.0)
print(json.dumps({
    "registered": timm.list_models("mjp_*"),
    "pretrained": timm.list_pretrained("mjp_deit_small_patch16_224.*"),
    "model": type(model).__module__ + "." + type(model).__name__,
    "exports": {name: getattr(mjp_fast, name) is getattr(sys.modules["mjp_fast.timm"], name)
                for name in ("convert", "fast_patch_embed")},
    "all": mjp_fast.__all__,
}))
"""


def test_import_mjp_fast_alone_registers_the_models_and_exports_convert():
    result = subprocess.run(
        [sys.executable, "-c", PLAIN_IMPORT], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert set(found["registered"]) >= {f"mjp_{base}" for base in mjp_timm.REGISTERED_BASES}
    assert found["pretrained"] == [f"mjp_{name}" for name in timm.list_pretrained("deit_small_patch16_224.*")]
    assert found["model"].startswith("mjp_fast.timm.") and "MJP" in found["model"]
    assert found["exports"] == {"convert": True, "fast_patch_embed": True}
    assert {"convert", "fast_patch_embed"} <= set(found["all"])


@pytest.mark.parametrize("unk", [True, False], ids=["unk", "naive_shuffle"])
def test_compiled_model_has_no_graph_break(unk):
    if not _has_triton():
        pytest.skip("needs the triton backend (interpreter) for an on-device sampler")
    model = mjp_timm.convert(tiny_vit(depth=1), ratio=0.5, prob=1.0, dal="linear", backend="triton", unk=unk)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(compiled(images), reference(images))


def _has_triton():
    # its test runs on CPU tensors: triton there only in the interpreter
    return "triton" in mjp_fast.available_backends() and mjp_fast.backend.runs_on("triton", torch.device("cpu"))


def test_ddp_step():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(mjp_timm.convert(tiny_vit(), ratio=0.5, prob=1.0))
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        assert model.module.mjp.unk_embed.grad is not None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "target, kwargs, error, words",
    [
        (torch.nn.Linear(3, 3), {}, TypeError, "supports timm"),
        ("vit", dict(ratio=1.5), ValueError, "ratio"),
        ("vit", dict(prob=-0.5), ValueError, "prob"),
        ("vit", dict(dal="cubic"), ValueError, "dal"),
        ("converted", {}, ValueError, "already"),
    ],
)
def test_bad_conversions_are_named(target, kwargs, error, words):
    if target == "vit":
        target = tiny_vit()
    elif target == "resnet":
        target = timm.create_model("resnet18", pretrained=False)
    elif target == "converted":
        target = mjp_timm.convert(tiny_vit())
    with pytest.raises(error, match=words):
        mjp_timm.convert(target, **kwargs)


# --- timm conventions: features_only, forward_intermediates, FX, pretrained configs, mjp_dal="none" -------------

TINY_DEIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2)


def _mjp_and_plain(name="deit_tiny_patch16_224", **kwargs):
    """An MJP model and the plain timm model with the same weights (the MJP model's extra ones aside)."""
    torch.manual_seed(0)
    mjp = timm.create_model(f"mjp_{name}", **kwargs)
    plain = timm.create_model(name, **kwargs)
    missing, unexpected = plain.load_state_dict(mjp.state_dict(), strict=False)
    assert not missing and all(key.startswith("mjp.") or ".mjp." in key for key in unexpected)
    return mjp, plain


def test_features_only_behaves_like_the_base_model():
    images = torch.randn(2, 3, 32, 32)
    mjp, plain = _mjp_and_plain(features_only=True, out_indices=(1, 2), **TINY_DEIT)
    assert type(mjp).__name__ == "MJPFeatureGetterNet" and isinstance(mjp, type(plain))
    assert mjp.feature_info.channels() == plain.feature_info.channels()
    mjp.eval(), plain.eval()
    for ours, theirs in zip(mjp(images), plain(images), strict=True):
        torch.testing.assert_close(ours, theirs)  # the fused patch embedding sums in another order
    mjp.train()
    mjp.mjp.sampler.prob = 1.0
    mjp(images)
    assert mjp.mjp.last_jigsaw is not None and bool(mjp.mjp.last_jigsaw.mask.any())
    assert mjp.mjp_aux_loss().requires_grad  # the wrapped model's DAL loss
    with mjp.mjp_eval(ratio=0.5, seed=3):
        assert not mjp.training and not mjp.model.training
        shuffled = mjp(images)
    assert mjp.training and not torch.equal(shuffled[0], plain(images)[0])


def test_forward_intermediates_behaves_like_the_base_model():
    images = torch.randn(2, 3, 32, 32)
    mjp, plain = _mjp_and_plain(**TINY_DEIT)
    mjp.eval(), plain.eval()
    final, intermediates = mjp.forward_intermediates(images, indices=2)
    expected_final, expected_intermediates = plain.forward_intermediates(images, indices=2)
    torch.testing.assert_close(final, expected_final)  # the fused patch embedding sums in another order
    for ours, theirs in zip(intermediates, expected_intermediates, strict=True):
        torch.testing.assert_close(ours, theirs)
    mjp.train()
    mjp.mjp.sampler.prob = 1.0
    mjp.forward_intermediates(images, indices=1, intermediates_only=True)
    assert mjp.mjp.last_jigsaw is not None


def test_features_only_of_a_pixel_space_model():
    images = torch.randn(2, 3, 64, 64)
    mjp_timm.register("resnet18")
    mjp, plain = _mjp_and_plain("resnet18", features_only=True, out_indices=(2, 3), num_classes=0)
    assert list(mjp._modules)[0] == "mjp"  # the jigsaw runs before the first layer
    mjp.eval(), plain.eval()
    for ours, theirs in zip(mjp(images), plain(images), strict=True):
        assert torch.equal(ours, theirs)
    mjp.train(), plain.train()
    mjp.mjp.sampler.prob = 1.0
    mjp(images)
    jigsaw = mjp.mjp.last_jigsaw
    assert jigsaw is not None and jigsaw.mask.shape == (2, 16)  # 64 px / patch 16 = a 4x4 grid
    assert float(mjp.mjp_aux_loss()) == 0.0


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_fx_feature_extraction_in_eval_and_train_mode(mode):
    from timm.models import create_feature_extractor, get_graph_node_names

    images = torch.randn(2, 3, 32, 32)
    model = timm.create_model("mjp_deit_tiny_patch16_224", mjp_prob=1.0, **TINY_DEIT)
    getattr(model, mode)()
    train_nodes, eval_nodes = get_graph_node_names(model)
    assert ("mjp" in train_nodes) and ("mjp" not in eval_nodes)  # MJP is one node, present in training only
    extractor = create_feature_extractor(model, return_nodes={"blocks.1": "mid", "norm": "out"})
    counter = model.mjp.sampler.sample_counter.clone()
    features = extractor(images)
    model.mjp.sampler.sample_counter.copy_(counter)  # the same jigsaws again, now from the model itself
    seen = []
    hook = model.blocks[1].register_forward_hook(lambda module, inputs, output: seen.append(output))
    expected = model(images)
    hook.remove()
    assert features["out"].shape == (2, 17, 32)
    assert torch.allclose(features["mid"], seen[0], atol=1e-6)
    assert torch.allclose(model.forward_head(features["out"]), expected, atol=1e-6)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_torch_fx_symbolic_trace_in_eval_and_train_mode(mode):
    images = torch.randn(2, 3, 32, 32)
    model = timm.create_model("mjp_deit_tiny_patch16_224", mjp_prob=1.0, **TINY_DEIT)
    getattr(model, mode)()
    graph = torch.fx.symbolic_trace(model)
    assert any(node.op == "call_module" and node.target == "mjp" for node in graph.graph.nodes) == (mode == "train")
    counter = model.mjp.sampler.sample_counter.clone()
    traced = graph(images)
    jigsaw = model.mjp.last_jigsaw
    model.mjp.sampler.sample_counter.copy_(counter)
    assert torch.allclose(traced, model(images), atol=1e-6)
    if mode == "train":
        assert jigsaw is not None and torch.equal(jigsaw.perm, model.mjp.last_jigsaw.perm)
        assert int(model.mjp.sampler.sample_counter) == int(counter) + 2


def test_mjp_dal_none_through_create_model():
    model = timm.create_model("mjp_deit_tiny_patch16_224", mjp_dal="none", **TINY_DEIT)
    assert model.mjp.dal_regressor is None
    assert not any("dal_regressor" in key for key in model.state_dict())
    assert float(model.mjp_aux_loss()) == 0.0
    default = timm.create_model("mjp_deit_tiny_patch16_224", **TINY_DEIT)
    assert default.mjp.dal_regressor is not None  # the paper's nonlinear DAL
    assert (
        timm.create_model("mjp_deit_tiny_patch16_224", mjp_dal="linear", **TINY_DEIT).mjp.dal_regressor.kind == "linear"
    )
    with pytest.raises(ValueError, match="dal must be"):
        timm.create_model("mjp_deit_tiny_patch16_224", mjp_dal="quadratic", **TINY_DEIT)


def test_registered_names_look_like_timm_models():
    assert set(timm.list_models("mjp_*")) >= {f"mjp_{base}" for base in mjp_timm.REGISTERED_BASES}
    pretrained = timm.list_pretrained("mjp_deit_small_patch16_224.*")
    assert pretrained == [f"mjp_{name}" for name in timm.list_pretrained("deit_small_patch16_224.*")]
    model = timm.create_model("mjp_deit_tiny_patch16_224", **TINY_DEIT)
    base_cfg = timm.create_model("deit_tiny_patch16_224", **TINY_DEIT).pretrained_cfg
    assert model.default_cfg is model.pretrained_cfg
    assert model.pretrained_cfg["architecture"] == "mjp_deit_tiny_patch16_224"
    assert {k: v for k, v in model.pretrained_cfg.items() if k != "architecture"} == {
        k: v for k, v in base_cfg.items() if k != "architecture"
    }
    assert timm.is_model_pretrained("mjp_deit_tiny_patch16_224")


@pytest.mark.parametrize("name", ["mjp_deit_tiny_patch16_224", "mjp_deit_tiny_patch16_224.fb_in1k"])
def test_pretrained_loads_the_base_weights_offline(tmp_path, name):
    torch.manual_seed(1)
    path = tmp_path / "deit_tiny.pth"
    torch.save(timm.create_model("deit_tiny_patch16_224").state_dict(), path)
    overlay = dict(file=str(path))
    base = timm.create_model("deit_tiny_patch16_224", pretrained=True, pretrained_cfg_overlay=overlay, num_classes=10)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=10)
    state, base_state = model.state_dict(), base.state_dict()
    for key, value in base_state.items():
        if not key.startswith("head."):  # a new head for 10 classes, as timm gives the base model
            assert torch.equal(state[key], value), key
    assert state["head.weight"].shape == (10, 192)
    assert {key for key in state if key not in base_state} == {key for key in state if key.startswith("mjp.")}
    assert "mjp.unk_embed" in state
    fresh = timm.create_model(name, num_classes=10)  # not pretrained: other weights
    assert not torch.equal(fresh.state_dict()["pos_embed"], base_state["pos_embed"])


# --- The ablation variants' options: unk=False (naive shuffle), dal_reduction, no position embeddings -------------


def _naive_shuffle_reference(model, images, jigsaw):
    """The definition of the naive shuffle, from the oracle: the patch tokens moved by ``perm``, each position with
    its own ``pos_embed[n]`` (no position gets an unknown embedding: the oracle sees no mask bit set)."""
    from mjp_fast import Jigsaw
    from mjp_fast.ops.pos_embed import mjp_pos_embed_ref

    flat = model.patch_embed.proj(images).flatten(2).transpose(1, 2)
    prefix = 0 if model.no_embed_class else model.num_prefix_tokens
    pos = model.pos_embed[0, prefix:]
    no_mask = Jigsaw(torch.zeros_like(jigsaw.mask), jigsaw.perm)
    return mjp_pos_embed_ref(flat, pos, pos.new_zeros(pos.shape[-1]), no_mask)


@pytest.mark.parametrize("fused", [False, None], ids=["unfused", "fused_if_standard"])
def test_unk_false_moves_patches_and_keeps_each_position_embedding(backend_device, fused):
    backend, device = backend_device
    torch.manual_seed(0)
    model = mjp_timm.convert(
        tiny_vit().to(device), ratio=0.5, prob=1.0, dal="linear", unk=False, backend=backend, fused_patch_embed=fused
    )
    model.mjp_dal_weight = 0.0  # the tokens' backward without the attached DAL loss: the position step's gradients
    assert model.mjp.unk_embed is None and not model.mjp.use_unk
    assert not any("unk_embed" in key for key in model.state_dict())
    assert not any("unk" in name for name, _ in model.named_parameters())
    assert "mjp.unk_embed" not in model.no_weight_decay() and "pos_embed" in model.no_weight_decay()
    images = torch.randn(3, 3, 32, 32, device=device)
    tokens = model._pos_embed(model.patch_embed(images))
    jigsaw = model.mjp.last_jigsaw
    # the real mask is kept (the DAL loss and evaluation read it), and the jigsaw moved some patches
    assert jigsaw.mask.any() and not torch.equal(jigsaw.perm, torch.arange(16, device=device).expand(3, -1))
    expected = _naive_shuffle_reference(model, images, jigsaw)
    torch.testing.assert_close(tokens[:, 1:], expected)
    torch.testing.assert_close(tokens[:, :1], (model.cls_token + model.pos_embed[:, :1]).expand(3, -1, -1))

    # Gradients reach pos_embed at every position, as through the reference, and the DAL loss leaves out the
    # positions the jigsaw masked.
    # The patches' gradients go back to where the jigsaw took them from (proj.weight's gradient sums them).
    weights = torch.randn_like(tokens)
    (tokens[:, 1:] * weights[:, 1:]).sum().backward()
    ours = model.pos_embed.grad.clone(), model.patch_embed.proj.weight.grad.clone()
    model.zero_grad()
    (_naive_shuffle_reference(model, images, jigsaw) * weights[:, 1:]).sum().backward()
    torch.testing.assert_close(ours[0], model.pos_embed.grad)
    torch.testing.assert_close(ours[1], model.patch_embed.proj.weight.grad)
    assert bool((ours[0][0, 1:].abs().sum(-1) > 0).all())
    aux = model.mjp_aux_loss()
    expected_aux = mjp_fast_dal_loss(model.pos_embed[0, 1:], model.mjp.dal_regressor, (4, 4), jigsaw.mask)
    torch.testing.assert_close(aux, expected_aux)
    assert not torch.allclose(aux, mjp_fast_dal_loss(model.pos_embed[0, 1:], model.mjp.dal_regressor, (4, 4), None))


def mjp_fast_dal_loss(*args, **kwargs):
    from mjp_fast import dal_loss

    return dal_loss(*args, backend="torch", **kwargs)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_unk_false_model_sees_what_a_plain_model_sees_of_a_jigsawed_image(fused):
    # The naive shuffle is the plain model on the pixel-jigsawed image: the same numbers whichever way it is made.
    from mjp_fast import jigsaw_images

    torch.manual_seed(0)
    plain = tiny_vit().eval()
    model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0, unk=False, fused_patch_embed=fused)
    images = torch.randn(2, 3, 32, 32)
    with model.mjp_eval(ratio=0.5, seed=4):
        shuffled = model(images)
    jigsaw = model.mjp.last_jigsaw
    assert jigsaw is not None and jigsaw.mask.any()
    torch.testing.assert_close(shuffled, plain(jigsaw_images(images, jigsaw, 8)))
    torch.testing.assert_close(model(images), plain(images))  # eval mode: the plain model


def test_unk_false_through_create_model_and_checkpoints():
    model = timm.create_model("mjp_deit_tiny_patch16_224", mjp_unk=False, mjp_ratio=0.5, mjp_prob=1.0, **TINY_DEIT)
    assert model.mjp.unk_embed is None
    with_unk = timm.create_model("mjp_deit_tiny_patch16_224", **TINY_DEIT)
    assert set(with_unk.state_dict()) - set(model.state_dict()) == {"mjp.unk_embed"}
    missing, unexpected = model.load_state_dict(with_unk.state_dict(), strict=False)
    assert not missing and unexpected == ["mjp.unk_embed"]
    again = timm.create_model("mjp_deit_tiny_patch16_224", mjp_unk=False, **TINY_DEIT)
    again.load_state_dict(model.state_dict())  # strict: the same keys
    images = torch.randn(2, 3, 32, 32)
    loss = model(images).logsumexp(-1).mean() + model.mjp_aux_loss()
    loss.backward()
    assert model.pos_embed.grad.abs().sum() > 0 and model.mjp.last_jigsaw.mask.any()
    model.half()  # the zero row for the kernels follows the model's dtype, and is never saved
    assert model.mjp.unused_unk_row.dtype == torch.float16 and "mjp.unused_unk_row" not in model.state_dict()
    with pytest.raises(TypeError, match="unk must be a bool"):
        timm.create_model("mjp_deit_tiny_patch16_224", mjp_unk="no", **TINY_DEIT)


def test_dal_reduction_sum_is_twice_the_mean():
    torch.manual_seed(0)
    mean = mjp_timm.convert(tiny_vit(), ratio=0.5, prob=1.0, dal="nonlinear")
    assert mean.mjp.dal_scale == 0.5  # the default: the paper's code (F.l1_loss)
    total = mjp_timm.convert(copy.deepcopy(tiny_vit()), ratio=0.5, prob=1.0, dal="nonlinear", dal_reduction="sum")
    total.load_state_dict(mean.state_dict())
    images = torch.randn(2, 3, 32, 32)
    mean(images), total(images)
    assert torch.equal(mean.mjp.last_jigsaw.mask, total.mjp.last_jigsaw.mask)
    torch.testing.assert_close(total.mjp_aux_loss(), 2 * mean.mjp_aux_loss())
    expected = mjp_fast_dal_loss(
        mean.pos_embed[0, 1:], mean.mjp.dal_regressor, (4, 4), mean.mjp.last_jigsaw.mask, reduction="mean"
    )
    torch.testing.assert_close(mean.mjp_aux_loss(), expected)
    assert "dal_scale" not in str(list(total.state_dict()))  # a plain attribute: old checkpoints load as they were
    created = timm.create_model("mjp_deit_tiny_patch16_224", mjp_dal_reduction="sum", **TINY_DEIT)
    assert created.mjp.dal_scale == 1.0
    with pytest.raises(ValueError, match="dal_reduction must be one of mean, sum"):
        mjp_timm.convert(tiny_vit(), dal_reduction="median")


def test_a_model_pickled_before_the_options_existed_still_runs():
    model = mjp_timm.convert(tiny_vit(), ratio=0.5, prob=1.0, dal="linear")
    del model.mjp.__dict__["use_unk"], model.mjp.__dict__["dal_scale"]  # as an object saved by an older version
    assert model.mjp.use_unk and model.mjp.dal_scale == 0.5
    model(torch.randn(1, 3, 32, 32))
    assert torch.isfinite(model.mjp_aux_loss())


def test_a_vit_without_position_embeddings_gets_the_pixel_jigsaw():
    from mjp_fast import jigsaw_images

    torch.manual_seed(0)
    plain = tiny_vit(pos_embed="none").eval()
    assert plain.pos_embed is None and plain.cls_token is not None
    model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0, dal=None, unk=False)
    assert isinstance(model, mjp_timm.MJPPixelVisionTransformer) and model.mjp.unk_embed is None
    model.train(), plain.train()
    images = torch.randn(2, 3, 32, 32)
    out = model(images)
    jigsaw = model.mjp.last_jigsaw
    assert jigsaw is not None and jigsaw.mask.shape == (2, 16)
    torch.testing.assert_close(out, plain(jigsaw_images(images, jigsaw, 8)))
    assert float(model.mjp_aux_loss()) == 0.0
    with pytest.warns(UserWarning, match="no absolute position table: it gets the pixel-space jigsaw"):
        assert mjp_timm.convert(tiny_vit(pos_embed="none"), dal="nonlinear").mjp.dal_regressor is None
    created = timm.create_model("mjp_deit_tiny_patch16_224", pos_embed="none", **TINY_DEIT)
    assert created.pos_embed is None and created.mjp.dal_regressor is None  # DAL off by default without them


# The backends whose training forward computes the DAL loss with the position step in one operation.
STEP_WITH_DAL_BACKENDS = [name for name in ("cpu", "triton") if name in backends_for("cpu")]
STEP_WITH_DAL_NODES = {"cpu": "MjpStepFunction", "triton": "_StepWithDALTritonBackward"}


@pytest.mark.parametrize("backend", STEP_WITH_DAL_BACKENDS)
@pytest.mark.parametrize("variant", ["class_token", "registers", "no_embed_class"])
def test_one_operator_for_the_position_step_and_dal_gives_the_separate_operators_values(variant, backend, monkeypatch):
    # On the cpu and triton backends a training forward computes the DAL loss with the position step, in one
    # operator and node (mjp_aux_loss hands that loss out). Outputs, loss and every gradient equal the two
    # operators' and the torch backend's.
    settings = dict(ratio=0.5, prob=1.0, dal="nonlinear", min_block=2, fused_patch_embed=False)
    torch.manual_seed(3)
    base = tiny_vit(**VARIANTS[variant])
    models = {name: mjp_timm.convert(copy.deepcopy(base), backend=chosen, **settings)
              for name, chosen in (("one", backend), ("two", backend), ("torch", "torch"))}  # fmt: skip
    for name in ("two", "torch"):  # the same unk_embed and regressor (convert initialises them at random)
        models[name].load_state_dict(models["one"].state_dict())
    images = torch.randn(3, 3, 32, 32)
    results = {}
    for name, model in models.items():
        model.train()
        with monkeypatch.context() as patched:
            if name == "two":  # the merged operator declines: the two operators run
                patched.setattr(mjp_timm.state, "mjp_position_dal_step", lambda *args, **kwargs: None)
            tokens = model.forward_features(images)
            aux = model.mjp_aux_loss()
        if name == "one":  # the attached loss, handed out to count at the loop's weight (0.5) instead of 0.01
            assert STEP_WITH_DAL_NODES[backend] in aux.grad_fn.next_functions[0][0].name()
            assert model.mjp_aux_loss() is not aux  # handed out once; a second call computes it again
            torch.testing.assert_close(model.mjp_aux_loss(), aux)
        (tokens.square().mean() + 0.5 * aux).backward()
        grads = {key: p.grad.clone() for key, p in model.named_parameters() if p.grad is not None}  # no head
        assert {"pos_embed", "mjp.unk_embed", "mjp.dal_regressor.net.0.weight"} <= grads.keys()
        results[name] = (tokens.detach(), aux.detach(), grads)
    for name in ("two", "torch"):
        torch.testing.assert_close(results["one"][0], results[name][0])
        torch.testing.assert_close(results["one"][1], results[name][1])
        assert results["one"][2].keys() == results[name][2].keys()
        for key, grad in results["one"][2].items():
            torch.testing.assert_close(grad, results[name][2][key], msg=lambda m, key=key: f"{key}: {m}")
