"""The DAL loss attached to a timm MJP model's output: a backward of the output alone trains DAL, in any loop.

timm's own model-test rule (after ``model(x).sum().backward()`` in training mode every parameter that requires a
gradient has one) holds with DAL on; the attached gradients equal those of the explicit ``loss + w * aux`` (same
seed, same jigsaws); ``mjp_aux_loss()`` added by a loop replaces the attached weight instead of doubling it; eval
mode attaches nothing. The same on every backend, fused or not, under torch.fx, timm's feature extraction, its
``features_only`` wrappers and torch.compile.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import timm
import torch
from torch import nn

import mjp_fast
import mjp_fast.timm as mjp_timm
from mjp_fast.timm.schedule import dal_weight_cosine
from tests.conftest import backends_for

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
TINY_DEIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=5)
BACKENDS = backends_for("cpu")


def _model(backend: str | None = None, fused: bool | None = None, dal: str | None = "nonlinear", **kwargs) -> nn.Module:
    """A tiny MJP ViT in training mode: every sample jigsawed (prob 1), the paper's nonlinear DAL."""
    torch.manual_seed(0)
    settings = dict(ratio=0.5, prob=1.0, dal=dal, min_block=2, backend=backend, fused_patch_embed=fused)
    vit = timm.models.VisionTransformer(**{**TINY, **kwargs.pop("vit", {})})
    return mjp_timm.convert(vit, **{**settings, **kwargs}).train()


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(3, 3, 32, 32, generator=generator), torch.tensor([0, 3, 1])


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _without_grad(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]


def _assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **tolerance) -> None:
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, msg=lambda message, name=name: f"{name}: {message}", **tolerance)


def _reference_dal(model: nn.Module) -> torch.Tensor:
    """The DAL loss of the model's last forward from the public function on the torch backend (the old explicit
    loss: a graph of its own, nothing attached)."""
    prefix = 0 if model.no_embed_class else model.num_prefix_tokens
    grid = tuple(model.patch_embed.grid_size)
    mask = model.mjp.last_jigsaw.mask if model.mjp.last_jigsaw is not None else None
    patch_rows = model.pos_embed[:, prefix:]
    return mjp_fast.dal_loss(patch_rows, model.mjp.dal_regressor, grid, mask, backend="torch")


# --- timm's model-test rule: every parameter gets its gradient from the output ------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dal", ["nonlinear", "linear", "pca"])
def test_a_backward_of_the_output_alone_reaches_every_parameter(backend, fused, dal):
    model = _model(backend, fused, dal)
    assert mjp_timm.is_fused(model.patch_embed) == fused
    model(_batch()[0]).sum().backward()
    assert _without_grad(model) == []
    regressor = [name for name in _grads(model) if name.startswith("mjp.dal_regressor.")]
    assert regressor and all(_grads(model)[name].abs().sum() > 0 for name in regressor)
    assert model.mjp.unk_embed.grad.abs().sum() > 0  # prob 1: masked positions took unk_embed


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("off", ["prob_0", "ratio_0"])
def test_dal_trains_while_the_jigsaw_is_off(fused, off):
    # prob 0 (the loop's warm-up) or ratio 0 (the paper's DAL-only row): no jigsaw, DAL still attached, every stored
    # position regressed. unk_embed takes no part in such a forward: its gradient is zero, and it comes from the
    # output, as every other parameter's (DDP needs no find_unused_parameters).
    model = _model(fused=fused, **({"prob": 0.0} if off == "prob_0" else {"ratio": 0.0}))
    assert not model.mjp.sampler.active and model.mjp.engaged
    model(_batch()[0]).sum().backward()
    assert _without_grad(model) == []
    assert not model.mjp.unk_embed.grad.any()
    assert model.mjp.last_jigsaw is None
    torch.testing.assert_close(model.mjp.last_dal_loss, _reference_dal(model).detach())


def test_a_timm_train_py_loop_trains_the_regressor():
    # timm's train.py: criterion(model(x), y).backward(), optimizer.step(); nothing about DAL.
    from timm.loss import LabelSmoothingCrossEntropy
    from timm.optim import create_optimizer_v2

    model = timm.create_model("mjp_deit_tiny_patch16_224", mjp_prob=1.0, mjp_ratio=0.5, **TINY_DEIT).train()
    optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-2, weight_decay=0.05)
    criterion = LabelSmoothingCrossEntropy(0.1)
    before = {name: p.detach().clone() for name, p in model.mjp.dal_regressor.named_parameters()}
    losses = []
    for step in range(3):
        images, targets = _batch(step)
        criterion(model(images), targets).backward()
        losses.append(float(model.mjp.last_dal_loss))
        optimizer.step()
        optimizer.zero_grad()
    for name, parameter in model.mjp.dal_regressor.named_parameters():
        assert not torch.equal(parameter.detach(), before[name]), name
    assert all(math.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("prob", [1.0, 0.0], ids=["jigsaw_on", "jigsaw_off"])
def test_ddp_without_find_unused_parameters_trains_dal_from_the_output_alone(prob):
    # DDP refuses the next step when a parameter got no gradient in the last one (find_unused_parameters=False, the
    # default): three steps of a loop that back-propagates only the criterion, as timm's train.py under torchrun,
    # with the jigsaw on, and off (warm-up: unk_embed takes no part, and gets its zero gradient from the output).
    import socket

    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = _model(prob=prob)
        wrapped = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        before = model.mjp.dal_regressor.net[0].weight.detach().clone()
        for step in range(3):
            images, targets = _batch(step)
            nn.CrossEntropyLoss()(wrapped(images), targets).backward()
            assert _without_grad(model) == []
            optimizer.step()
            optimizer.zero_grad()
        assert not torch.equal(model.mjp.dal_regressor.net[0].weight.detach(), before)
    finally:
        dist.destroy_process_group()


# --- attached == explicit ---------------------------------------------------------------------------------------


def _three(backend=None, fused=None, **kwargs):
    """Three copies of one model, at the same place of the jigsaw stream: the same jigsaws."""
    model = _model(backend, fused, **kwargs)
    return model, copy.deepcopy(model), copy.deepcopy(model)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_attached_only_equals_explicit_only(backend, fused):
    weight = 0.3  # large enough that DAL's share of pos_embed's gradient shows
    attached, explicit, reference = _three(backend, fused)
    images, targets = _batch()
    criterion = nn.CrossEntropyLoss()

    attached.mjp_dal_weight = weight
    criterion(attached(images), targets).backward()

    loss = criterion(explicit(images), targets) + weight * explicit.mjp_aux_loss()  # replaces the attached 0.01
    loss.backward()

    reference.mjp_dal_weight = 0.0  # the old world: nothing attached, the loss from the public function
    (criterion(reference(images), targets) + weight * _reference_dal(reference)).backward()

    for model in (explicit, reference):
        assert torch.equal(model.mjp.last_jigsaw.perm, attached.mjp.last_jigsaw.perm)
    _assert_same_grads(_grads(attached), _grads(explicit))
    _assert_same_grads(_grads(attached), _grads(reference), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(attached.mjp.last_dal_loss, explicit.mjp.last_dal_loss)


def test_the_explicit_loss_used_twice_or_back_propagated_twice_counts_each_time():
    images, targets = _batch()
    criterion = nn.CrossEntropyLoss()

    def grads_of(run) -> dict[str, torch.Tensor]:
        model = _model()
        model.mjp_dal_weight = 0.05
        run(model)
        return _grads(model)

    def reference(model, weight: float, repeats: int = 1) -> None:
        model.mjp_dal_weight = 0.0
        total = criterion(model(images), targets) + weight * _reference_dal(model)
        for _ in range(repeats):
            total.backward(retain_graph=True)

    def same_loss_twice(model):  # one tensor in two terms
        out = model(images)
        aux = model.mjp_aux_loss()
        (criterion(out, targets) + 0.2 * aux + 0.3 * aux).backward()

    def two_calls(model):  # the second call computes the loss again: a loss of its own
        out = model(images)
        first, second = model.mjp_aux_loss(), model.mjp_aux_loss()
        assert first.grad_fn.name() != second.grad_fn.name()
        torch.testing.assert_close(first, second)
        (criterion(out, targets) + 0.2 * first + 0.3 * second).backward()

    def retained(model):  # the same total back-propagated twice
        total = criterion(model(images), targets) + 0.5 * model.mjp_aux_loss()
        total.backward(retain_graph=True)
        total.backward()

    def separate_backwards(model):  # linear: the output's backward, then the loss's own
        out = model(images)
        aux = model.mjp_aux_loss()
        criterion(out, targets).backward(retain_graph=True)  # the graphs share the DAL node: keep it for the next
        (0.5 * aux).backward()

    _assert_same_grads(grads_of(same_loss_twice), grads_of(lambda model: reference(model, 0.5)), rtol=1e-4, atol=1e-6)
    _assert_same_grads(grads_of(two_calls), grads_of(lambda model: reference(model, 0.5)), rtol=1e-4, atol=1e-6)
    _assert_same_grads(grads_of(retained), grads_of(lambda model: reference(model, 0.5, 2)), rtol=1e-4, atol=1e-6)
    _assert_same_grads(
        grads_of(separate_backwards), grads_of(lambda model: reference(model, 0.5)), rtol=1e-4, atol=1e-6
    )


def test_mjp_aux_loss_read_for_logging_leaves_the_attached_path_in_effect():
    logged, plain = _three()[:2]
    images, targets = _batch()
    out = logged(images)
    aux = logged.mjp_aux_loss()  # read, never back-propagated
    nn.CrossEntropyLoss()(out, targets).backward()
    nn.CrossEntropyLoss()(plain(images), targets).backward()
    _assert_same_grads(_grads(logged), _grads(plain))
    assert logged.mjp.dal_regressor.net[0].weight.grad.abs().sum() > 0
    torch.testing.assert_close(aux.detach(), logged.mjp.last_dal_loss)
    assert not logged.mjp.last_dal_loss.requires_grad


def test_weight_zero_gives_the_plain_gradients():
    model, without_dal = _model(), _model(dal=None)
    # the same weights, the regressor aside, and the same place in the jigsaw stream
    assert without_dal.load_state_dict(model.state_dict(), strict=False).missing_keys == []
    model.mjp_dal_weight = 0.0
    images = _batch()[0]
    model(images).sum().backward()
    without_dal(images).sum().backward()
    grads = _grads(model)
    regressor = {name: grads.pop(name) for name in list(grads) if name.startswith("mjp.dal_regressor.")}
    assert regressor and all(not grad.any() for grad in regressor.values())  # reached, at weight 0
    _assert_same_grads(grads, _grads(without_dal))


def test_eval_mode_and_no_grad_attach_nothing():
    model = _model()
    images = _batch()[0]
    model(images).sum().backward()
    assert model.mjp.last_dal_loss is not None
    model.zero_grad(set_to_none=True)
    model.eval()
    model(images).sum().backward()
    assert model.mjp.last_dal_loss is None  # forgotten: not of the last forward
    assert model.mjp.dal_regressor.net[0].weight.grad is None
    with model.mjp_eval(ratio=0.5, seed=0):  # jigsawed, still eval: nothing attached
        model(images).sum().backward()
    assert model.mjp.last_jigsaw is not None and model.mjp.last_dal_loss is None
    assert model.mjp.dal_regressor.net[0].weight.grad is None
    model.train()
    with torch.no_grad():
        model(images)
    assert model.mjp.last_dal_loss is None
    # nothing kept: mjp_aux_loss computes the loss itself, as before
    torch.testing.assert_close(model.mjp_aux_loss(), _reference_dal(model))


# --- the weight: mjp_dal_weight, convert, create_model, the schedule -------------------------------------------


def test_mjp_dal_weight_is_a_checked_buffer_outside_the_state_dict():
    model = _model()
    buffer = model.mjp.dal_weight
    assert model.mjp_dal_weight == pytest.approx(0.01) and buffer.dtype == torch.float32 and buffer.dim() == 0
    model.mjp_dal_weight = 0.25
    assert model.mjp.dal_weight is buffer and float(buffer) == 0.25  # filled in place
    model.mjp_dal_weight = 1  # an int is a number
    assert model.mjp_dal_weight == 1.0
    assert not any("dal_weight" in key for key in model.state_dict())
    for bad, error in (("0.1", TypeError), (True, TypeError), (None, TypeError), (-0.1, ValueError),
                       (float("nan"), ValueError), (float("inf"), ValueError)):  # fmt: skip
        with pytest.raises(error, match="mjp_dal_weight"):
            model.mjp_dal_weight = bad
    assert model.mjp_dal_weight == 1.0
    converted = mjp_timm.convert(timm.models.VisionTransformer(**TINY), dal_weight=0.02)
    assert converted.mjp_dal_weight == pytest.approx(0.02)
    with pytest.raises(ValueError, match="dal_weight"):
        mjp_timm.convert(timm.models.VisionTransformer(**TINY), dal_weight=-1.0)
    created = timm.create_model("mjp_deit_tiny_patch16_224", mjp_dal_weight=0.03, **TINY_DEIT)
    assert created.mjp_dal_weight == pytest.approx(0.03)
    features = timm.create_model("mjp_deit_tiny_patch16_224", features_only=True, mjp_dal_weight=0.04, **TINY_DEIT)
    assert features.mjp_dal_weight == pytest.approx(0.04)
    features.mjp_dal_weight = 0.5
    assert features.model.mjp_dal_weight == 0.5


def test_a_model_mid_training_deep_copies_and_pickles_without_the_kept_loss(tmp_path):
    # the kept loss has a graph (deepcopy refuses such tensors) and belongs to this model's last step only
    model = _model()
    model(_batch()[0])
    assert model.mjp.last_dal_loss is not None
    for copied in (copy.deepcopy(model), _saved_and_loaded(model, tmp_path / "model.pt")):
        assert copied.mjp.last_dal_loss is None and copied.mjp_aux_loss().grad_fn is not None
        assert torch.equal(copied.mjp.last_jigsaw.perm, model.mjp.last_jigsaw.perm)
        copied(_batch()[0]).sum().backward()
        assert _without_grad(copied) == []
    assert model.mjp.last_dal_loss is not None  # the original keeps its own


def _saved_and_loaded(model: nn.Module, path) -> nn.Module:
    torch.save(model, path)
    return torch.load(path, weights_only=False)


def test_a_model_pickled_before_the_weight_existed_attaches_at_the_default():
    model, fresh = _three()[:2]
    del model.mjp._buffers["dal_weight"], model.mjp.__dict__["coordinates_grid"]  # as saved by an older version
    images, targets = _batch()
    nn.CrossEntropyLoss()(model(images), targets).backward()
    nn.CrossEntropyLoss()(fresh(images), targets).backward()
    _assert_same_grads(_grads(model), _grads(fresh))
    assert model.mjp_dal_weight == pytest.approx(0.01)
    assert not any("dal_weight" in key for key in model.state_dict())


def test_the_schedule_drives_the_model_weight_along_the_loops_cosine():
    from mjp_fast.train.config import load_config
    from mjp_fast.train.loop import dal_weight_at

    model = _model()
    buffer = model.mjp.dal_weight
    schedule = mjp_timm.DALWeightSchedule(model, 0.01, 0.005, total_updates=100)
    assert model.mjp_dal_weight == pytest.approx(0.01)
    config = load_config(None, {})
    for update in (0, 25, 50, 100, 150):
        schedule.step_update(update)
        assert model.mjp_dal_weight == pytest.approx(dal_weight_at(config, update, 100))
        assert schedule.weight_at(update) == dal_weight_cosine(0.01, 0.005, update, 100)
    assert model.mjp.dal_weight is buffer
    accumulating = mjp_timm.DALWeightSchedule(model, 0.01, 0.005, total_updates=100, accum_steps=4)
    assert model.mjp_dal_weight == pytest.approx(0.0025)
    accumulating.step_update(100)
    assert model.mjp_dal_weight == pytest.approx(0.00125)
    with pytest.raises(ValueError, match="end"):
        mjp_timm.DALWeightSchedule(model, 0.01, -1.0, total_updates=10)
    with pytest.raises(TypeError, match="MJP model"):
        mjp_timm.DALWeightSchedule(nn.Linear(2, 2), 0.01, 0.005, total_updates=10)


# --- the same rule under torch.fx, feature extraction, features_only and torch.compile --------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_fx_graphs_train_dal_through_their_one_mjp_node(fused):
    from timm.models import create_feature_extractor

    model = _model(fused=fused)
    counter = model.mjp.sampler.sample_counter.clone()
    images = _batch()[0]
    model(images).sum().backward()
    expected = _grads(model)

    graph = torch.fx.symbolic_trace(model)
    mjp_nodes = [node for node in graph.graph.nodes if node.op == "call_module" and node.target.startswith("mjp")]
    assert [node.target for node in mjp_nodes] == ["mjp"]
    model.zero_grad(set_to_none=True)
    model.mjp.sampler.sample_counter.copy_(counter)
    graph(images).sum().backward()
    assert _without_grad(graph) == []
    _assert_same_grads(_grads(model), expected)

    extractor = create_feature_extractor(model, return_nodes={"blocks.1": "mid", "norm": "out"})
    model.zero_grad(set_to_none=True)
    model.mjp.sampler.sample_counter.copy_(counter)
    features = extractor(images)
    model.forward_head(features["out"]).sum().backward()
    _assert_same_grads(_grads(model), expected)


def test_features_only_wrappers_train_dal_from_their_features():
    model = timm.create_model(
        "mjp_deit_tiny_patch16_224", features_only=True, out_indices=(0, 1), mjp_prob=1.0, mjp_ratio=0.5, **TINY_DEIT
    ).train()
    features = model(_batch()[0])
    sum(feature.sum() for feature in features).backward()
    assert model.model.mjp.dal_regressor.net[0].weight.grad.abs().sum() > 0
    assert model.mjp.last_dal_loss is not None
    torch.testing.assert_close(model.mjp_aux_loss().detach(), model.mjp.last_dal_loss)


COMPILED = [name for name in BACKENDS if name in ("cpu", "triton")]


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("backend", COMPILED)
def test_compiled_models_attach_the_same_loss(backend, fused):
    eager = _model(backend, fused, dal="linear")
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for step in range(2):  # the second step: the same graph, the stream moved on, a new weight read in place
        images, targets = _batch(step)
        for net, owner in ((eager, eager), (compiled, model)):  # eager first: the step's host caches are filled
            owner.mjp_dal_weight = 0.1 * (step + 1)
            with torch.compiler.set_stance("fail_on_recompile") if step else contextlib.nullcontext():
                nn.CrossEntropyLoss()(net(images), targets).backward()
        torch.testing.assert_close(model.mjp.last_dal_loss, eager.mjp.last_dal_loss)
    assert _without_grad(model) == []
    _assert_same_grads(_grads(model), _grads(eager), rtol=1e-4, atol=1e-6)
    # the explicit loss through a compiled forward replaces the attached weight too
    for net, owner in ((compiled, model), (eager, eager)):
        owner.zero_grad(set_to_none=True)
        out = net(_batch(2)[0])
        (out.sum() + 0.5 * owner.mjp_aux_loss()).backward()
    _assert_same_grads(_grads(model), _grads(eager), rtol=1e-4, atol=1e-6)


# --- other inputs: another input size, the naive shuffle --------------------------------------------------------


def test_another_input_size_regresses_the_stored_table():
    model = _model(dal="linear", vit=dict(dynamic_img_size=True))
    model(torch.randn(2, 3, 48, 40)).sum().backward()  # a 6x5 grid: the stored table is 4x4
    assert model.mjp.last_jigsaw.mask.shape == (2, 30)
    expected = mjp_fast.dal_loss(model.pos_embed[:, 1:], model.mjp.dal_regressor, (4, 4), None, backend="torch")
    torch.testing.assert_close(model.mjp.last_dal_loss, expected.detach())
    assert model.mjp.dal_regressor.net.weight.grad.abs().sum() > 0

    fixed = _model(dal="linear")
    fixed.set_input_size(img_size=(48, 48))  # the table itself is now 6x6: DAL regresses the new grid
    fixed(torch.randn(1, 3, 48, 48)).sum().backward()
    mask = fixed.mjp.last_jigsaw.mask
    expected = mjp_fast.dal_loss(fixed.pos_embed[:, 1:], fixed.mjp.dal_regressor, (6, 6), mask, backend="torch")
    torch.testing.assert_close(fixed.mjp.last_dal_loss, expected.detach())


def test_the_naive_shuffle_attaches_dal_over_the_unmasked_positions():
    model = _model(unk=False)
    model(_batch()[0]).sum().backward()
    assert model.mjp.unk_embed is None and _without_grad(model) == []
    torch.testing.assert_close(model.mjp.last_dal_loss, _reference_dal(model).detach())
