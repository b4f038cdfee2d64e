"""The fused MJP patch embedding on the timm path: ``convert(fused_patch_embed=...)`` and ``fast_patch_embed``.

The reference is timm's own path: its Conv2d ``PatchEmbed``, then the tokens moved and the position term added
(``fused_patch_embed=False``), with the pure-PyTorch backend. Fused and reference models are fresh copies of one
plain model with the same MJP state, so they draw the same jigsaws.
"""

import copy
import functools

import pytest
import timm
import torch
from timm.layers import PatchEmbed
from torch import nn

import mjp_fast
import mjp_fast.timm as mjp_timm

SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=5)
VARIANTS = {
    "class_token": dict(),
    "no_class_token": dict(class_token=False, global_pool="avg"),
    "registers": dict(reg_tokens=2),
    "no_embed_class": dict(no_embed_class=True),
}
# The CPU GEMM sums in another order than timm's convolution; the gradients are sums over the batch and tokens.
FLOAT32 = dict(rtol=1e-4, atol=1e-5)
# the tests below run on CPU tensors: triton there only in the interpreter
HAS_TRITON = "triton" in mjp_fast.available_backends() and mjp_fast.backend.runs_on("triton", torch.device("cpu"))


def small_vit(**kwargs) -> timm.models.VisionTransformer:
    return timm.create_model("vit_tiny_patch16_224", **{**SMALL, **kwargs})


def fused_and_reference(plain, backend="cpu", **settings):
    """The fused MJP model and timm's unfused path with the same weights and MJP state (so the same jigsaws)."""
    settings = {**dict(ratio=0.5, prob=1.0, dal=None), **settings}
    fused = mjp_timm.convert(copy.deepcopy(plain), backend=backend, **settings)
    reference = mjp_timm.convert(copy.deepcopy(plain), backend="torch", fused_patch_embed=False, **settings)
    reference.load_state_dict(fused.state_dict())
    assert mjp_timm.is_fused(fused.patch_embed) and not mjp_timm.is_fused(reference.patch_embed)
    return fused, reference


def step(model, images, weights):
    """One forward and backward; returns the output and every parameter's gradient (None where it has none)."""
    model.zero_grad(set_to_none=True)
    out = model(images)
    (out * weights).sum().backward()
    return out, {name.removeprefix("_orig_mod."): parameter.grad for name, parameter in model.named_parameters()}


def assert_same_step(fused, reference, images, **tolerance):
    weights = torch.randn(images.shape[0], reference.num_classes)
    out, grads = step(fused, images, weights)
    expected_out, expected_grads = step(reference, images, weights)
    torch.testing.assert_close(out, expected_out, **tolerance)
    # Against a plain timm model, MJP's own parameters (eval mode: none used) have no gradient.
    assert all(grads[name] is None for name in grads.keys() - expected_grads.keys())
    for name, grad in grads.items():
        if name not in expected_grads:
            continue
        if expected_grads[name] is None:
            assert grad is None, name
        else:
            torch.testing.assert_close(grad, expected_grads[name], **tolerance, msg=lambda m, name=name: f"{name}: {m}")
    return grads


# --- Numerics: fused equals timm's path, training (jigsaw) and eval ---------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_training_step_equals_the_unfused_one(variant):
    torch.manual_seed(0)
    fused, reference = fused_and_reference(small_vit(**VARIANTS[variant]))
    for _ in range(2):  # two steps: the sampler's stream moves on alike
        grads = assert_same_step(fused, reference, torch.randn(3, 3, 32, 32), **FLOAT32)
        jigsaw, expected_jigsaw = fused.mjp.last_jigsaw, reference.mjp.last_jigsaw
        assert jigsaw is not None and bool(jigsaw.mask.any())  # the DAL loss reads this mask
        assert torch.equal(jigsaw.mask, expected_jigsaw.mask) and torch.equal(jigsaw.perm, expected_jigsaw.perm)
    assert grads["mjp.unk_embed"].abs().sum() > 0 and grads["pos_embed"].abs().sum() > 0
    assert grads["patch_embed.proj.weight"].abs().sum() > 0
    assert fused.mjp.sampler.samples_seen == reference.mjp.sampler.samples_seen == 6


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_eval_equals_the_plain_model(variant):
    torch.manual_seed(0)
    plain = small_vit(**VARIANTS[variant])
    fused, reference = fused_and_reference(plain)
    fused.eval(), reference.eval(), plain.eval()
    images = torch.randn(3, 3, 32, 32)
    assert_same_step(fused, plain, images, **FLOAT32)
    assert fused.mjp.last_jigsaw is None
    with fused.mjp_eval(ratio=0.5, seed=2), reference.mjp_eval(ratio=0.5, seed=2):  # the consistency protocol
        assert_same_step(fused, reference, images, **FLOAT32)
        assert torch.equal(fused.mjp.last_jigsaw.perm, reference.mjp.last_jigsaw.perm)


BACKENDS = ["cpu", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs the interpreter"))]


@pytest.mark.parametrize("dal", ["linear", "nonlinear"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_image_gradients_and_the_dal_loss_match(backend, dal):
    # the loop's explicit mjp_aux_loss(): on triton the embedding and the DAL loss are one node (its loss claimed)
    torch.manual_seed(0)
    fused, reference = fused_and_reference(small_vit(reg_tokens=1), backend=backend, dal=dal)
    images = torch.randn(2, 3, 32, 32, requires_grad=True)
    grads = []
    for model in (fused, reference):
        images.grad = None
        loss = model(images).square().mean() + model.mjp_aux_loss()
        loss.backward()
        parameters = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
        grads.append({"loss": loss.detach(), "images": images.grad.clone(), **parameters})
    assert grads[0].keys() == grads[1].keys()
    # every gradient: the table's with DAL's share counted once at the loop's weight, the regressor's too
    assert grads[0]["pos_embed"].any() and any(grads[0][name].any() for name in grads[0] if "dal_regressor" in name)
    for name, expected in grads[1].items():
        torch.testing.assert_close(grads[0][name], expected, **FLOAT32, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the interpreter runs its kernels on the CPU)")
@pytest.mark.parametrize("dal", [None, "nonlinear", "linear"])
@pytest.mark.parametrize("variant", ["class_token", "no_embed_class"])
def test_triton_backend_equals_the_unfused_path(variant, dal):
    # with DAL in training, the embedding and the DAL loss run as one node (its backward adds DAL's share of the
    # table's gradient into the embedding's): every gradient, the regressor's too, as timm's path with the torch one
    torch.manual_seed(0)
    plain = small_vit(**VARIANTS[variant], embed_dim=16)
    fused, reference = fused_and_reference(plain, backend="triton", dal=dal)
    images = torch.randn(2, 3, 32, 32)
    grads = assert_same_step(fused, reference, images, **FLOAT32)
    if dal is not None:
        assert grads["mjp.dal_regressor.net.weight" if dal == "linear" else "mjp.dal_regressor.net.2.weight"].any()
    fused.eval(), reference.eval()
    assert_same_step(fused, reference, images, **FLOAT32)


def _relative_error(value, reference):
    return ((value.float() - reference.float()).norm() / reference.float().norm()).item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_autocast_bfloat16_dtypes_and_error(mode, backend):
    # triton: autocast's bfloat16 rounding done in the kernels' loads (compute_dtype), the float32 weight's gradient
    # returned as it is; with the DAL loss of the training step in the same node
    torch.manual_seed(0)
    fused, reference = fused_and_reference(small_vit(reg_tokens=1), backend=backend, dal="nonlinear")
    getattr(fused, mode)(), getattr(reference, mode)()
    images = torch.randn(4, 3, 32, 32)
    counter = reference.mjp.sampler.sample_counter.clone()
    # The float32 reference of the tokens after the position embedding, then the same jigsaws under autocast.
    exact = reference._pos_embed(reference.patch_embed(images))
    reference.mjp.sampler.sample_counter.copy_(counter)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tokens = fused._pos_embed(fused.patch_embed(images))
        expected = reference._pos_embed(reference.patch_embed(images))
        out, expected_out = fused(images), reference(images)
    # As timm's: a bfloat16 convolution plus a float32 table gives float32 tokens.
    assert tokens.dtype == expected.dtype == torch.float32
    assert out.dtype == expected_out.dtype
    assert _relative_error(tokens, exact) <= 2 * _relative_error(expected, exact) + 1e-4
    # Everything after the embedding runs in bfloat16 alike: the outputs agree within bfloat16 tolerance.
    torch.testing.assert_close(out.float(), expected_out.float(), rtol=2e-2, atol=2e-2)
    (out.float().square().mean()).backward()
    (expected_out.float().square().mean()).backward()
    for name in ("patch_embed.proj.weight", "pos_embed", "cls_token", "mjp.unk_embed"):
        grad, expected_grad = fused.get_parameter(name).grad, reference.get_parameter(name).grad
        if expected_grad is None:
            assert grad is None or not grad.any(), name
            continue
        assert grad.dtype == expected_grad.dtype == torch.float32, name
        assert _relative_error(grad, expected_grad) < 3e-2, name


# --- What stays as it is: parameters, state dict, checkpoints, timm's entry points ------------------------------


def test_state_dict_is_the_plain_models_plus_mjp():
    plain = small_vit(reg_tokens=1)
    fused = mjp_timm.convert(copy.deepcopy(plain))
    assert mjp_timm.is_fused(fused.patch_embed) and isinstance(fused.patch_embed.proj, nn.Conv2d)
    keys = list(fused.state_dict())
    assert [key for key in keys if not key.startswith("mjp.")] == list(plain.state_dict())
    assert {key for key in keys if key.startswith("mjp.")} >= {"mjp.unk_embed", "mjp.sampler.sample_counter"}
    assert [name for name, _ in fused.named_parameters() if not name.startswith("mjp.")] == [
        name for name, _ in plain.named_parameters()
    ]


def test_unfused_checkpoint_loads_into_a_fused_model(tmp_path):
    torch.manual_seed(0)
    unfused = mjp_timm.convert(small_vit(), ratio=0.5, prob=1.0, fused_patch_embed=False)
    unfused(torch.randn(2, 3, 32, 32))  # the sampler's counter moves: it is in the checkpoint
    torch.save(unfused.state_dict(), tmp_path / "mjp.pth")
    fused = mjp_timm.convert(small_vit(), ratio=0.5, prob=1.0)
    fused.load_state_dict(torch.load(tmp_path / "mjp.pth"))  # strict: the same keys
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(fused.eval()(images), unfused.eval()(images), **FLOAT32)
    fused.train(), unfused.train()
    torch.testing.assert_close(fused(images), unfused(images), **FLOAT32)  # the same jigsaws, resumed
    assert torch.equal(fused.mjp.last_jigsaw.perm, unfused.mjp.last_jigsaw.perm)
    # A plain timm checkpoint, and the whole pickled model.
    plain = small_vit().eval()
    missing, unexpected = fused.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all(key.startswith("mjp.") for key in missing)
    torch.testing.assert_close(fused.eval()(images), plain(images), **FLOAT32)
    torch.save(fused, tmp_path / "model.pth")
    loaded = torch.load(tmp_path / "model.pth", weights_only=False)
    assert type(loaded.patch_embed) is mjp_timm.FusedPatchEmbed
    torch.testing.assert_close(loaded(images), plain(images), **FLOAT32)


def test_registered_models_fuse_and_take_the_keyword():
    tiny = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3)
    model = timm.create_model("mjp_deit_tiny_patch16_224", **tiny)
    assert mjp_timm.is_fused(model.patch_embed)
    off = timm.create_model("mjp_deit_tiny_patch16_224", mjp_fused_patch_embed=False, **tiny)
    assert type(off.patch_embed) is PatchEmbed
    # any image size (dynamic_img_size): fused too, the table resampled per call
    dynamic = timm.create_model("mjp_deit_tiny_patch16_224", mjp_fused_patch_embed=True, dynamic_img_size=True, **tiny)
    assert mjp_timm.is_fused(dynamic.patch_embed)
    assert dynamic.eval()(torch.randn(1, 3, 24, 40)).shape == (1, 3)


def test_forward_intermediates_and_features_only_on_a_fused_model():
    torch.manual_seed(0)
    tiny = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2)
    mjp = timm.create_model("mjp_deit_tiny_patch16_224", features_only=True, out_indices=(1, 2), **tiny)
    plain = timm.create_model("deit_tiny_patch16_224", features_only=True, out_indices=(1, 2), **tiny)
    plain.load_state_dict(mjp.state_dict(), strict=False)
    assert mjp_timm.is_fused(mjp.model.patch_embed)
    images = torch.randn(2, 3, 32, 32)
    mjp.eval(), plain.eval()
    for ours, theirs in zip(mjp(images), plain(images), strict=True):
        torch.testing.assert_close(ours, theirs, **FLOAT32)
    model, plain_model = mjp.model, plain.model
    final, intermediates = model.forward_intermediates(images, indices=2, return_prefix_tokens=True)
    expected_final, expected_intermediates = plain_model.forward_intermediates(
        images, indices=2, return_prefix_tokens=True
    )
    torch.testing.assert_close(final, expected_final, **FLOAT32)
    for (ours, our_prefix), (theirs, their_prefix) in zip(intermediates, expected_intermediates, strict=True):
        torch.testing.assert_close(ours, theirs, **FLOAT32)
        torch.testing.assert_close(our_prefix, their_prefix, **FLOAT32)
    mjp.train()
    mjp.mjp.sampler.prob = 1.0
    features = mjp(images)
    assert [tuple(f.shape) for f in features] == [(2, 32, 4, 4)] * 2
    assert mjp.mjp.last_jigsaw is not None and bool(mjp.mjp.last_jigsaw.mask.any())


def test_set_input_size_on_a_fused_model():
    torch.manual_seed(0)
    fused, reference = fused_and_reference(small_vit())
    for model in (fused, reference):
        model.set_input_size(img_size=(48, 40))
    assert_same_step(fused, reference, torch.randn(2, 3, 48, 40), **FLOAT32)
    assert fused.mjp.last_jigsaw.mask.shape == (2, 30)
    with pytest.raises(AssertionError, match="Input height"):  # timm's message for a wrong size
        fused(torch.randn(2, 3, 32, 40))


# --- FX tracing and torch.compile ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_fx_symbolic_trace_and_feature_extraction(mode):
    from timm.models import create_feature_extractor

    torch.manual_seed(0)
    model = mjp_timm.convert(small_vit(depth=2), ratio=0.5, prob=1.0)
    getattr(model, mode)()
    graph = torch.fx.symbolic_trace(model)
    nodes = list(graph.graph.nodes)
    assert any(node.op == "call_module" and node.target == "mjp" for node in nodes) == (mode == "train")
    # Without MJP's jigsaw, the fused embedding is one call of its own.
    fused = mjp_timm.fused.fused_patch_embed
    fused_calls = [node for node in nodes if node.op == "call_function" and node.target is fused]
    assert len(fused_calls) == (mode == "eval")
    assert not any(node.op == "call_module" and node.target == "patch_embed.proj" for node in nodes)
    images = torch.randn(2, 3, 32, 32)
    counter = model.mjp.sampler.sample_counter.clone()
    traced = graph(images)
    extractor = create_feature_extractor(model, return_nodes={"blocks.1": "mid", "norm": "out"})
    model.mjp.sampler.sample_counter.copy_(counter)
    features = extractor(images)
    model.mjp.sampler.sample_counter.copy_(counter)  # the same jigsaws again, now from the model itself
    expected = model(images)
    torch.testing.assert_close(traced, expected, rtol=0, atol=0)
    torch.testing.assert_close(model.forward_head(features["out"]), expected, rtol=0, atol=0)


def test_fx_traces_a_plain_model_after_fast_patch_embed():
    model = mjp_timm.fast_patch_embed(small_vit()).eval()
    graph = torch.fx.symbolic_trace(model)
    assert any(node.target is mjp_timm.fused.fused_patch_embed for node in graph.graph.nodes)
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(graph(images), model(images), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_compiled_fused_model_matches_eager(mode):
    torch.manual_seed(0)
    model = mjp_timm.convert(small_vit(reg_tokens=1), ratio=0.5, prob=1.0, dal=None, backend="cpu")
    getattr(model, mode)()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for _ in range(2):  # the second step: the same graph, the sampler's stream moved on
        images = torch.randn(2, 3, 32, 32)
        grads = assert_same_step(compiled, eager, images)
        if mode == "train":
            assert torch.equal(model.mjp.last_jigsaw.perm, eager.mjp.last_jigsaw.perm)
    assert grads["patch_embed.proj.weight"].abs().sum() > 0


# --- Non-standard patch embeddings: today's path, and a named refusal ---------------------------------------------


class _ScaledPatchEmbed(PatchEmbed):
    def forward(self, x):
        return super().forward(x) * 2.0


def _overlapping_proj(model):
    # Overlapping patches (kernel 12, stride 8, padding 2) on the same 4x4 grid: a valid model the fused op cannot run.
    model.patch_embed.proj = nn.Conv2d(3, SMALL["embed_dim"], kernel_size=12, stride=8, padding=2)
    return model


NON_STANDARD = {
    "norm": (lambda: small_vit(embed_layer=functools.partial(PatchEmbed, norm_layer=nn.LayerNorm)), "norm layer"),
    "stride_not_kernel": (lambda: _overlapping_proj(small_vit()), r"stride \(8, 8\) != kernel size \(12, 12\)"),
    "forward_overridden": (lambda: small_vit(embed_layer=_ScaledPatchEmbed), "overrides PatchEmbed.forward"),
    "strict_img_size": (
        lambda: small_vit(embed_layer=functools.partial(PatchEmbed, strict_img_size=False)),
        "strict_img_size=False without dynamic_img_size",
    ),
    "dynamic_img_pad": (lambda: small_vit(dynamic_img_pad=True), "dynamic_img_pad=True without dynamic_img_size"),
}


@pytest.mark.parametrize("case", NON_STANDARD)
def test_non_standard_embeddings_keep_timms_path_and_refuse_fusing(case):
    build, reason = NON_STANDARD[case]
    torch.manual_seed(0)
    plain = build().eval()
    embed_class = type(plain.patch_embed)
    model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0)
    assert type(model.patch_embed) is embed_class  # automatic: today's path, the same numbers as timm's
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model.eval()(images), plain(images), rtol=0, atol=0)
    model.train()(images)
    assert model.mjp.last_jigsaw is not None
    with pytest.raises(ValueError, match=f"fused_patch_embed=True: .*{reason}"):
        mjp_timm.convert(copy.deepcopy(plain), fused_patch_embed=True)
    with pytest.raises(ValueError, match=f"cannot be fused: .*{reason}"):
        mjp_timm.fast_patch_embed(plain)
    assert type(plain.patch_embed) is embed_class and type(plain) is timm.models.VisionTransformer  # untouched


def test_models_without_position_embeddings_refuse_fusing():
    vit = small_vit(pos_embed="none", class_token=False, global_pool="avg")
    with pytest.raises(ValueError, match="no absolute position embeddings"):
        mjp_timm.convert(copy.deepcopy(vit), dal=None, fused_patch_embed=True)
    with pytest.raises(ValueError, match="no absolute position embeddings"):
        mjp_timm.fast_patch_embed(vit)
    resnet = timm.create_model("resnet18", num_classes=2)
    with pytest.raises(ValueError, match="not a timm VisionTransformer"):
        mjp_timm.convert(resnet, dal=None, fused_patch_embed=True)
    with pytest.raises(TypeError, match="VisionTransformer"):
        mjp_timm.fast_patch_embed(resnet)
    assert type(mjp_timm.convert(resnet, dal=None)) is mjp_timm.MJPResNet  # automatic: nothing to fuse


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda model: mjp_timm.convert(model, fused_patch_embed="yes"), TypeError, "fused_patch_embed"),
        (lambda model: mjp_timm.convert(model, backend="gpu"), ValueError, "backend"),
        (lambda model: mjp_timm.fast_patch_embed(model, backend="gpu"), ValueError, "backend"),
    ],
)
def test_bad_arguments_are_named(call, error, words):
    with pytest.raises(error, match=words):
        call(small_vit())


# --- fast_patch_embed ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["class_token", "no_class_token", "registers", "no_embed_class"])
def test_fast_patch_embed_on_a_plain_model(variant):
    torch.manual_seed(0)
    plain = small_vit(**VARIANTS[variant])
    fast = mjp_timm.fast_patch_embed(copy.deepcopy(plain))
    assert isinstance(fast, type(plain)) and type(fast) is mjp_timm.FusedVisionTransformer
    assert type(fast.patch_embed) is mjp_timm.FusedPatchEmbed
    state, plain_state = fast.state_dict(), plain.state_dict()
    assert list(state) == list(plain_state) and all(torch.equal(state[k], plain_state[k]) for k in state)
    images = torch.randn(3, 3, 32, 32, requires_grad=True)
    assert_same_step(fast, plain, images, **FLOAT32)
    fast.eval(), plain.eval()
    assert_same_step(fast, plain, images, **FLOAT32)
    assert mjp_timm.fast_patch_embed(fast) is fast and type(fast) is mjp_timm.FusedVisionTransformer  # idempotent
    torch.testing.assert_close(fast(images), plain(images), **FLOAT32)
    # A plain checkpoint loads strictly both ways.
    plain.load_state_dict(fast.state_dict())
    fast.load_state_dict(plain.state_dict())


def test_fast_patch_embed_backends_and_bfloat16():
    torch.manual_seed(0)
    plain = small_vit(reg_tokens=1).eval()
    images = torch.randn(2, 3, 32, 32)
    expected = plain(images)
    for backend in ("torch", "cpu"):
        fast = mjp_timm.fast_patch_embed(copy.deepcopy(plain), backend=backend)
        assert fast.patch_embed.fused_backend == backend
        torch.testing.assert_close(fast(images), expected, **FLOAT32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tokens = fast._pos_embed(fast.patch_embed(images))
        expected_tokens = plain._pos_embed(plain.patch_embed(images))
        assert tokens.dtype == expected_tokens.dtype == torch.float32
        torch.testing.assert_close(tokens, expected_tokens, rtol=2e-2, atol=2e-2)
        assert fast(images).dtype == plain(images).dtype


def test_fast_patch_embed_on_an_mjp_model_and_then_convert():
    torch.manual_seed(0)
    plain = small_vit()
    fused, reference = fused_and_reference(plain)
    unfused = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0, dal=None, fused_patch_embed=False)
    unfused.load_state_dict(fused.state_dict())
    assert mjp_timm.fast_patch_embed(unfused) is unfused  # turns the fused path on, jigsaw included
    assert type(unfused) is mjp_timm.MJPVisionTransformer and mjp_timm.is_fused(unfused.patch_embed)
    assert_same_step(unfused, reference, torch.randn(2, 3, 32, 32), **FLOAT32)
    # A plain model fused by fast_patch_embed converts to the MJP version of its timm class, fused or not.
    converted = mjp_timm.convert(mjp_timm.fast_patch_embed(copy.deepcopy(plain)))
    assert type(converted) is mjp_timm.MJPVisionTransformer and mjp_timm.is_fused(converted.patch_embed)
    back = mjp_timm.convert(mjp_timm.fast_patch_embed(copy.deepcopy(plain)), fused_patch_embed=False)
    assert type(back.patch_embed) is PatchEmbed
    # timm's features_only wrapper of a ViT.
    features = timm.create_model("vit_tiny_patch16_224", features_only=True, out_indices=(0,), **SMALL).eval()
    expected = features(torch.ones(1, 3, 32, 32))
    mjp_timm.fast_patch_embed(features)
    assert mjp_timm.is_fused(features.model.patch_embed)
    torch.testing.assert_close(features(torch.ones(1, 3, 32, 32))[0], expected[0], **FLOAT32)
