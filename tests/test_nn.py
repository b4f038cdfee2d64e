import importlib

import pytest
import torch

import mjp_fast
from mjp_fast.ops.patch_embed import mjp_patch_embed_ref


def make_module(**kwargs):
    arguments = dict(img_size=32, patch_size=8, in_chans=3, embed_dim=16, ratio=0.5, prob=1.0, seed=3, min_block=2)
    arguments.update(kwargs)
    return mjp_fast.MJPPatchEmbed(**arguments)


def test_training_mode_jigsaws_each_sample_and_eval_mode_is_plain():
    module = make_module()
    images = torch.randn(4, 3, 32, 32)
    tokens = module(images)
    assert tokens.shape == (4, 16, 16)
    jigsaw = module.last_jigsaw
    assert jigsaw is not None and jigsaw.mask.any(1).all()
    expected = mjp_patch_embed_ref(
        images, module.proj.weight, module.proj.bias, module.pos_embed, module.unk_embed, jigsaw
    )
    torch.testing.assert_close(tokens, expected)
    module.eval()
    plain = module(images)
    assert module.last_jigsaw is None
    torch.testing.assert_close(plain, module.proj(images).flatten(2).transpose(1, 2) + module.pos_embed)


def test_counter_gives_fresh_jigsaws_and_resumes_the_same_stream():
    module = make_module()
    images = torch.randn(3, 3, 32, 32)
    module(images)
    first = module.last_jigsaw
    module(images)
    second = module.last_jigsaw
    assert module.samples_seen == 6
    assert not torch.equal(first.mask, second.mask)
    # the counter feeds the sampler's offset
    assert torch.equal(second.perm, mjp_fast.sample_jigsaw(3, 4, 0.5, seed=3, offset=3, min_block=2).perm)
    state = {name: value.clone() for name, value in module.state_dict().items()}  # state_dict aliases buffers
    module(images)
    third = module.last_jigsaw
    resumed = make_module()
    resumed.load_state_dict(state)
    assert resumed.samples_seen == 6
    resumed(images)
    assert torch.equal(resumed.last_jigsaw.mask, third.mask) and torch.equal(resumed.last_jigsaw.perm, third.perm)


def test_jigsaw_eval_repeats_the_same_jigsaws_for_the_same_seed():
    module = make_module().eval()
    images = torch.randn(2, 3, 32, 32)
    with module.jigsaw_eval(ratio=0.5, seed=7):
        a = module(images)
        mask_a = module.last_jigsaw.mask
    with module.jigsaw_eval(ratio=0.5, seed=7):
        b = module(images)
    torch.testing.assert_close(a, b)
    assert mask_a.any()
    assert not torch.allclose(a, module(images))  # outside the context: plain again


def test_prob_zero_or_ratio_zero_skips_sampling():
    for kwargs in (dict(prob=0.0), dict(ratio=0.0)):
        module = make_module(**kwargs)
        module(torch.randn(2, 3, 32, 32))
        assert module.last_jigsaw is None


def test_dal_loss_reaches_every_parameter():
    module = make_module(dal="nonlinear")
    tokens = module(torch.randn(2, 3, 32, 32))
    loss = tokens.square().mean() + module.dal_loss()
    loss.backward()
    for name, parameter in module.named_parameters():
        assert parameter.grad is not None, name
    assert module.unk_embed.grad.abs().sum() > 0
    assert "unk_embed" in module.no_weight_decay()


def test_without_dal_the_loss_is_a_float32_zero_as_a_timm_models_aux_loss():
    module = make_module().to(torch.float64)  # the zero is float32 whatever the parameters' dtype
    module(torch.randn(2, 3, 32, 32, dtype=torch.float64))
    loss = module.dal_loss()
    assert loss.dtype == torch.float32 and loss.shape == () and loss.item() == 0.0
    assert loss.device == module.pos_embed.device and not loss.requires_grad
    timm = pytest.importorskip("timm")
    mjp_timm = pytest.importorskip("mjp_fast.timm")
    model = mjp_timm.convert(timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1), dal=None)
    aux = model.mjp_aux_loss()
    assert (aux.dtype, aux.shape, aux.item()) == (loss.dtype, loss.shape, loss.item())


def test_timm_patch_embed_weights_load():
    timm_layers = pytest.importorskip("timm.layers")
    timm_embed = timm_layers.PatchEmbed(img_size=32, patch_size=8, in_chans=3, embed_dim=16)
    module = make_module()
    missing, unexpected = module.load_state_dict(timm_embed.state_dict(), strict=False)
    assert not unexpected and set(missing) == {"pos_embed", "unk_embed", "sampler.sample_counter"}
    images = torch.randn(2, 3, 32, 32)
    module.eval()
    torch.testing.assert_close(module(images), timm_embed(images) + module.pos_embed)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(ratio=2.0), ValueError, "ratio"),
        (dict(prob=-1.0), ValueError, "prob"),
        (dict(img_size=30), ValueError, "img_size"),
        (dict(patch_size=0), ValueError, "patch_size"),
        (dict(dal="quadratic"), ValueError, "dal must be None, 'none' or one of"),  # the core's check names dal
        (dict(backend="fastest"), ValueError, "backend must be None or one of"),
        (dict(seed=-1), ValueError, "seed"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, words):
    with pytest.raises(error, match=words):
        make_module(**kwargs)


def test_wrong_image_size_is_named():
    with pytest.raises(ValueError, match="pos_embed"):
        make_module()(torch.randn(2, 3, 40, 40))


def test_unk_false_moves_patches_and_keeps_each_position_embedding():
    module = make_module(unk=False, dal="linear")
    assert module.unk_embed is None and "unk_embed" not in module.state_dict()
    assert module.no_weight_decay() == {"pos_embed"}
    images = torch.randn(4, 3, 32, 32)
    tokens = module(images)
    jigsaw = module.last_jigsaw
    assert jigsaw.mask.any()  # the real mask, kept for the DAL loss
    no_mask = mjp_fast.Jigsaw(torch.zeros_like(jigsaw.mask), jigsaw.perm)
    weight, bias = module.proj.weight, module.proj.bias
    expected = mjp_patch_embed_ref(images, weight, bias, module.pos_embed, torch.zeros(16), no_mask)
    torch.testing.assert_close(tokens, expected)
    tokens.square().mean().backward()
    assert module.pos_embed.grad.abs().sum(-1).gt(0).all()
    expected_dal = mjp_fast.dal_loss(module.pos_embed, module.dal_regressor, (4, 4), jigsaw.mask, backend="torch")
    torch.testing.assert_close(module.dal_loss(), expected_dal)
    # a caller's jigsaw is checked as given: perm must be the identity where its mask is False
    bad = mjp_fast.Jigsaw(torch.zeros_like(jigsaw.mask), jigsaw.perm)
    with pytest.raises(ValueError, match="identity where jigsaw.mask is False"):
        module(images, bad)
    torch.testing.assert_close(module(images, jigsaw), expected)


def test_dal_reduction_sum_is_twice_the_mean():
    torch.manual_seed(0)
    mean = make_module(dal="nonlinear")
    total = make_module(dal="nonlinear", dal_reduction="sum")
    total.load_state_dict(mean.state_dict())
    images = torch.randn(2, 3, 32, 32)
    mean(images), total(images)
    torch.testing.assert_close(total.dal_loss(), 2 * mean.dal_loss())
    with pytest.raises(ValueError, match="dal_reduction"):
        make_module(dal_reduction="median")
    with pytest.raises(TypeError, match="dal_reduction must be a str"):  # issue 25: was "unhashable type: 'list'"
        make_module(dal_reduction=["mean"])
    with pytest.raises(TypeError, match="unk"):
        make_module(unk=None)


def test_fused_layers_are_the_regressors_parameters_and_a_parametrized_one_runs_as_a_module():
    regressor = mjp_fast.DALRegressor(6, "nonlinear")
    w1, b1, w2, b2 = regressor.fused_layers()
    assert w1 is regressor.net[0].weight and b1 is regressor.net[0].bias
    assert w2 is regressor.net[2].weight and b2 is regressor.net[2].bias
    linear = mjp_fast.DALRegressor(6, "linear")
    assert linear.fused_layers() == (None, None, linear.net.weight, linear.net.bias)
    pos = torch.randn(12, 6)
    expected = mjp_fast.dal_loss(pos, regressor, (3, 4))
    # weight becomes a computed property: the fused kernels cannot read it, the module computes the same loss.
    torch.nn.utils.parametrize.register_parametrization(regressor.net[0], "weight", torch.nn.Identity())
    assert regressor.fused_layers() is None
    torch.testing.assert_close(mjp_fast.dal_loss(pos, regressor, (3, 4)), expected)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_dal_loss_runs_on_the_module_backend(backend, monkeypatch):
    core = importlib.import_module("mjp_fast.core")  # where the module's DAL loss calls the operation

    if backend not in mjp_fast.available_backends():
        pytest.skip(f"{backend} is not available")
    seen = []
    unchecked = core.dal_loss_unchecked
    monkeypatch.setattr(
        core,
        "dal_loss_unchecked",
        lambda *args, **kwargs: seen.append(args[4]) or unchecked(*args, **kwargs),
    )
    module = make_module(dal="nonlinear", backend=backend)
    module(torch.randn(2, 3, 32, 32))
    loss = module.dal_loss()
    assert seen == [backend]
    expected = mjp_fast.dal_loss(
        module.pos_embed, module.dal_regressor, (4, 4), module.last_jigsaw.mask, backend="torch"
    )
    torch.testing.assert_close(loss, expected)


def test_dal_regressor_hidden_dim_is_for_the_nonlinear_kind_only():
    DALRegressor = mjp_fast.DALRegressor
    assert DALRegressor(8, "nonlinear", hidden_dim=5).net[0].out_features == 5
    for kind in ("linear", "pca"):
        DALRegressor(8, kind)  # the default works
        with pytest.raises(ValueError, match=f"hidden_dim: the '{kind}' regressor has no hidden layer"):
            DALRegressor(8, kind, hidden_dim=5)
