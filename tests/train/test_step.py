"""One training step alone (:class:`mjp_fast.train.step.TrainStep`) on a tiny MJP ViT: losses and gradients against
the same sums done by hand (the step's DAL loss attached to the model's output, the hand's explicit), accumulation,
clipping, AMP, the fp16 scaler, a compiled forward, DDP's no_sync and the divergence watch."""

import contextlib
import copy
import math

import pytest
import torch
from torch import nn

from mjp_fast.train import loop
from mjp_fast.train.config import load_config
from mjp_fast.train.loop import StepLosses, TrainingDiverged, TrainStep
from mjp_fast.train.models import create_model, model_spec
from tests.train.helpers import tiny_overrides

BATCH = 4
CLASSES = 3


def _tiny(**changes):
    """A tiny config (no drop-path: a forward depends on the jigsaw stream only) and its MJP ViT in train mode."""
    config = load_config(None, tiny_overrides(**{"drop_path": 0.0, "mjp_prob": 1.0, **changes}))
    torch.manual_seed(0)
    model = create_model(*model_spec(config, CLASSES))
    return config, model.train()


def _batch(seed: int = 0):
    """Images float32 ``[4, 3, 16, 16]`` and class indices int64 ``[4]``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 3, 16, 16, generator=generator), torch.tensor([0, 1, 2, 0])


def _step(model, config, optimizer=None, **changes) -> TrainStep:
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainStep(model, model, optimizer, nn.CrossEntropyLoss(), config, **changes)


def _run(step: TrainStep, images, targets, *, update=True, dal_weight=0.01, tally=None, batch_index=0, index=0):
    if tally is None:
        tally = loop._StepTally(images.device)
    return step(images, targets, dal_weight=dal_weight, update=update, tally=tally, batch_index=batch_index, step=index)


def _by_hand(model, images, targets, dal_weight, accum_steps=1) -> StepLosses:
    """The step's losses from the model's own forward and ``mjp_aux_loss``; backward on ``total / accum_steps``."""
    loss = nn.CrossEntropyLoss()(model(images), targets)
    dal = model.mjp_aux_loss()
    total = loss + dal_weight * dal
    (total / accum_steps).backward()
    return StepLosses(loss, dal, dal_weight)


def _parameters(model) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in model.parameters()]


def test_losses_and_gradients_are_the_classification_plus_weighted_dal_done_by_hand():
    config, model = _tiny(accum_steps=2)
    twin = copy.deepcopy(model)  # the same weights and the same place in the jigsaw stream
    images, targets = _batch()
    losses = _run(_step(model, config), images, targets, update=False, dal_weight=0.3)
    expected = _by_hand(twin, images, targets, dal_weight=0.3, accum_steps=2)

    assert losses.dal is not None and float(losses.dal.detach()) > 0.1  # so the weight moves the total
    torch.testing.assert_close(losses.loss, expected.loss)
    torch.testing.assert_close(losses.dal, expected.dal)
    torch.testing.assert_close(losses.total, expected.total)
    torch.testing.assert_close(losses.total, losses.loss + 0.3 * losses.dal)
    # the backward trained the same total, divided by accum_steps (the DAL part attached to the model's output)
    _assert_same_grads(model, twin)
    assert model.pos_embed.grad.abs().sum() > 0


def _assert_same_grads(model, twin, **tolerance):
    for (name, parameter), twin_parameter in zip(model.named_parameters(), twin.parameters(), strict=True):
        if twin_parameter.grad is None:
            assert parameter.grad is None, name
        else:
            torch.testing.assert_close(parameter.grad, twin_parameter.grad, msg=name, **tolerance)


def test_the_step_trains_dal_attached_to_the_output_without_calling_mjp_aux_loss(monkeypatch):
    config, model = _tiny(accum_steps=4)
    twin = copy.deepcopy(model)
    images, targets = _batch()
    buffer = model.mjp.dal_weight
    # the attached path: the backward is of the classification loss; the DAL loss is read without a graph
    monkeypatch.setattr(model, "mjp_aux_loss", lambda: pytest.fail("the attached path needs no mjp_aux_loss"))
    losses = _run(_step(model, config), images, targets, update=False, dal_weight=0.2)
    expected = _by_hand(twin, images, targets, dal_weight=0.2, accum_steps=4)
    assert model.mjp_dal_weight == pytest.approx(0.2 / 4) and model.mjp.dal_weight is buffer
    assert not losses.dal.requires_grad
    torch.testing.assert_close(losses.dal, expected.dal.detach())
    torch.testing.assert_close(losses.total, expected.total.detach())
    _assert_same_grads(model, twin)
    assert model.mjp.dal_regressor.net[0].weight.grad.abs().sum() > 0


def test_a_compiled_forward_trains_the_same():
    # compile=true: the model's forward compiled (aot_eager here: tracing, functionalization and autograd on the CPU)
    config, model = _tiny()
    twin = copy.deepcopy(model)
    step = TrainStep(model, torch.compile(model, backend="aot_eager"), torch.optim.SGD(model.parameters(), lr=0.1),
                     nn.CrossEntropyLoss(), config)  # fmt: skip
    for seed, weight in ((0, 0.3), (1, 0.1)):  # a new weight: the same graph reads the buffer in place
        images, targets = _batch(seed)
        losses = _run(step, images, targets, update=False, dal_weight=weight)
        expected = _by_hand(twin, images, targets, dal_weight=weight)
        torch.testing.assert_close(losses.dal, expected.dal.detach())
    _assert_same_grads(model, twin, rtol=1e-4, atol=1e-6)


def test_the_dal_weight_changes_the_total_and_the_position_gradient_only_through_dal():
    config, model = _tiny()
    images, targets = _batch()
    results = []
    for weight in (0.0, 1.0):
        trial = copy.deepcopy(model)
        losses = _run(_step(trial, config), images, targets, update=False, dal_weight=weight)
        results.append((losses, trial.pos_embed.grad.clone(), trial.head.weight.grad.clone()))
    (light, light_pos, light_head), (heavy, heavy_pos, heavy_head) = results
    torch.testing.assert_close(light.total, light.loss)
    torch.testing.assert_close(heavy.total - light.total, heavy.dal)
    assert not torch.allclose(heavy_pos, light_pos)  # DAL regresses positions from the position embedding
    torch.testing.assert_close(heavy_head, light_head)  # and does not reach the classifier


def test_without_dal_the_total_is_the_classification_loss():
    config, model = _tiny(mjp_dal="none")
    losses = _run(_step(model, config), *_batch(), dal_weight=5.0)
    assert losses.dal is None
    assert torch.equal(losses.total, losses.loss)


def test_an_update_steps_every_parameter_with_a_gradient_and_clears_the_gradients():
    config, model = _tiny(clip_grad=None)
    before = _parameters(model)
    step = _step(model, config)

    _run(step, *_batch(0), update=False)
    assert all(torch.equal(now, then) for now, then in zip(model.parameters(), before, strict=True))
    gradients = {
        name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None
    }
    assert {"pos_embed", "head.weight", "patch_embed.proj.weight"} <= set(gradients)

    _run(step, *_batch(1), update=True)
    assert all(parameter.grad is None for parameter in model.parameters())
    for (name, parameter), then in zip(model.named_parameters(), before, strict=True):
        if name in gradients:
            assert not torch.equal(parameter.detach(), then), name


def test_gradients_accumulate_over_micro_batches_as_their_mean():
    config, model = _tiny(accum_steps=3, clip_grad=None)
    twin = copy.deepcopy(model)
    before = _parameters(model)
    step = _step(model, config, torch.optim.SGD(model.parameters(), lr=0.5))
    for seed, update in ((0, False), (1, False), (2, True)):
        _run(step, *_batch(seed), update=update)
    for seed in range(3):  # plain SGD by hand: minus lr times the mean of the three gradients
        _by_hand(twin, *_batch(seed), dal_weight=0.01, accum_steps=3)
    for (name, parameter), then, twin_parameter in zip(
        model.named_parameters(), before, twin.parameters(), strict=True
    ):
        expected = then if twin_parameter.grad is None else then - 0.5 * twin_parameter.grad
        torch.testing.assert_close(parameter.detach(), expected, msg=name)


def _update_of(model, config, **changes) -> list[torch.Tensor]:
    """The parameter changes of one plain SGD step (lr 1) on batch 0."""
    before = _parameters(model)
    step = _step(model, config, torch.optim.SGD(model.parameters(), lr=1.0), **changes)
    _run(step, *_batch(0))
    return [parameter.detach() - then for parameter, then in zip(model.parameters(), before, strict=True)]


def _norm(tensors) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(tensor) for tensor in tensors])))


def test_gradients_are_clipped_by_norm_and_by_value_as_configured():
    config, model = _tiny(clip_grad=None)
    unclipped = _norm(_update_of(copy.deepcopy(model), config))
    assert unclipped > 0.01  # so clipping to 1e-3 has something to do

    clipped = _norm(_update_of(copy.deepcopy(model), config.replace(clip_grad=1e-3, clip_mode="norm")))
    assert clipped == pytest.approx(1e-3, rel=1e-3)

    by_value = _update_of(copy.deepcopy(model), config.replace(clip_grad=1e-4, clip_mode="value"))
    assert max(float(change.abs().max()) for change in by_value) == pytest.approx(1e-4, rel=1e-3)


def test_the_scaler_unscales_before_clipping_and_steps_as_without_it():
    config, model = _tiny(clip_grad=1e-3)
    plain = _update_of(copy.deepcopy(model), config)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaled = _update_of(copy.deepcopy(model), config, scaler=scaler)
    for without, with_scaler in zip(plain, scaled, strict=True):
        torch.testing.assert_close(with_scaler, without, rtol=1e-4, atol=1e-9)
    assert scaler.get_scale() == 2.0**10  # finite gradients: the scale stays (no growth within the interval)


class _NanLoss(nn.Module):
    def forward(self, logits, targets):
        return nn.functional.cross_entropy(logits, targets) * float("nan")


def test_the_scaler_skips_the_step_of_a_non_finite_loss():
    config, model = _tiny()
    before = _parameters(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step = TrainStep(model, model, optimizer, _NanLoss(), config, scaler=scaler)
    _run(step, *_batch())
    assert all(torch.equal(now, then) for now, then in zip(model.parameters(), before, strict=True))
    assert scaler.get_scale() == 2.0**9  # backed off for the next step
    assert all(parameter.grad is None for parameter in model.parameters())


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, torch.bfloat16), (None, torch.float32)])
def test_the_forward_runs_under_autocast_of_the_amp_dtype(dtype, expected):
    config, model = _tiny()
    seen = []
    model.head.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    losses = _run(_step(model, config, amp_dtype=dtype), *_batch())
    assert seen == [expected]
    assert math.isfinite(float(losses.total.detach()))


def test_the_tally_sums_each_batch_and_records_the_first_non_finite_loss(tmp_path):
    config, model = _tiny()
    tally = loop._StepTally(torch.device("cpu"))
    first = _run(_step(model, config), *_batch(0), tally=tally, batch_index=0, index=0)
    reading = tally.read()
    assert not reading.diverged
    assert reading.sums["samples"] == BATCH
    assert reading.sums["loss"] == pytest.approx(BATCH * float(first.loss.detach()))
    assert reading.sums["dal"] == pytest.approx(BATCH * float(first.dal.detach()))

    bad = TrainStep(model, model, torch.optim.SGD(model.parameters(), lr=0.1), _NanLoss(), config)
    _run(bad, *_batch(1), tally=tally, batch_index=4, index=7)
    _run(bad, *_batch(2), tally=tally, batch_index=5, index=8)  # a later bad batch does not replace the first
    reading = tally.read()
    assert reading.diverged
    total, loss, dal, batch_index, index = reading.first_bad
    assert math.isnan(total) and math.isnan(loss) and math.isfinite(dal) and (batch_index, index) == (4, 7)
    pattern = r"the loss became nan at epoch 2, batch 4, step 7 \(classification nan, DAL .*noticed at batch 5\)"
    with pytest.raises(TrainingDiverged, match=pattern):
        loop._check_divergence(reading, 1, "at batch 5", True, tmp_path / "last.pt", 1e-3)


class _FakeDistributed(nn.Module):
    """Stands in for DDP's wrapper: records, per forward, whether it ran inside ``no_sync``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.unsynced = False
        self.forwards: list[bool] = []

    def forward(self, images):
        self.forwards.append(self.unsynced)
        return self.module(images)

    @contextlib.contextmanager
    def no_sync(self):
        self.unsynced = True
        try:
            yield
        finally:
            self.unsynced = False


@pytest.mark.parametrize("ddp", [True, False])
def test_under_ddp_gradients_sync_at_updates_only_and_unk_embed_stays_in_the_graph(ddp):
    config, model = _tiny(accum_steps=3)
    model.mjp.sampler.prob = 0.0  # the jigsaw is off (warm-up): nothing uses unk_embed
    wrapper = _FakeDistributed(model)
    step = TrainStep(
        model, wrapper, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), config, ddp=ddp
    )
    _run(step, *_batch(0), update=False)
    unk_gradient = model.mjp.unk_embed.grad
    _run(step, *_batch(1), update=False)
    _run(step, *_batch(2), update=True)
    assert wrapper.forwards == ([True, True, False] if ddp else [False, False, False])
    # The model keeps unk_embed in the output's graph with a zero gradient (its true one), DDP or not: DDP would
    # fail a step that leaves a parameter out.
    assert unk_gradient is not None and not unk_gradient.any()
