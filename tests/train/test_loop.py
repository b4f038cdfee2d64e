"""The training loop on real CIFAR-10 images: outputs, checkpoints, exact resumption, schedules, divergence."""

import contextlib
import json
import math
import re
import sys
import types

import pytest
import torch
from PIL import Image
from timm.loss import SoftTargetCrossEntropy
from torch.optim.optimizer import register_optimizer_step_post_hook

from mjp_fast.cli import main
from mjp_fast.train import build, curves, loop
from mjp_fast.train.checkpoint import load_checkpoint, load_model
from mjp_fast.train.config import load_config
from mjp_fast.train.loop import TrainingDiverged, count_parameters, dal_weight_at, describe_model, plural, train
from tests.train.helpers import tiny_overrides


def _config(cifar_tree, output, **changes):
    return load_config(None, tiny_overrides(data=str(cifar_tree), output=str(output), **changes))


class _Interrupt(Exception):
    pass


@contextlib.contextmanager
def _killed_after(steps: int, error: type[BaseException] = _Interrupt):
    """Within this context a run dies (raises ``error``) in its optimizer step number ``steps + 1``: after step
    ``steps`` and anything that step saved, before the next one can save. A hook of torch's own on every optimizer's
    step: the loop keeps nothing for tests."""
    taken = 0

    def hook(optimizer, args, kwargs):
        nonlocal taken
        taken += 1
        if taken > steps:
            raise error(f"stopped after step {steps}")

    handle = register_optimizer_step_post_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_tiny_run_end_to_end(cifar_tree, tmp_path):
    config = _config(cifar_tree, tmp_path / "run")
    result = train(config)
    output = tmp_path / "run"
    names = ["best.pt", "config.yaml", "curves.png", "last.pt", "metrics.jsonl"]
    assert sorted(path.name for path in output.iterdir()) == names
    with Image.open(output / "curves.png") as image:  # a PNG that decodes
        image.load()
        assert image.format == "PNG" and image.width > 200
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [record["epoch"] for record in records] == [1, 2]
    assert records == result.history
    # the jigsaw is off during the warm-up epoch and on after it; DAL is on throughout
    assert [record["mjp_prob"] for record in records] == [0.0, 0.5]
    assert all(math.isfinite(record["train_loss"]) and record["dal_loss"] > 0 for record in records)
    for key in ("top1", "top5", "consistency", "diff_norm", "pos_mae_1d", "pos_mae_2d"):
        assert result.final[key] is not None and math.isfinite(result.final[key])
    assert 0 <= result.final["top1"] <= result.final["top5"] <= 100

    checkpoint = load_checkpoint(output / "last.pt")
    assert checkpoint["model_name"] == "mjp_vit_tiny_patch16_224"
    assert checkpoint["model_kwargs"]["mjp_ratio"] == 0.25 and checkpoint["model_kwargs"]["num_classes"] == 3
    for key in ("optimizer", "scheduler", "rng", "config", "metrics", "epoch", "step"):
        assert key in checkpoint
    assert checkpoint["finished"] and checkpoint["epoch"] == 2 and checkpoint["batch_in_epoch"] == 0
    assert set(checkpoint["rng"]) == {"python", "numpy", "torch", "cuda"}
    # the resolved config: the learning rate, classes, input size and jigsaw start are filled in
    saved = load_config(output / "config.yaml")
    assert (saved.num_classes, saved.img_size, saved.mjp_from_epoch, saved.lr) == (3, 16, 1, 1e-3)
    # the jigsaw stream advanced by the jigsawed epoch's samples only (prob 0 in warm-up draws nothing)
    model, _ = load_model(output / "last.pt")
    assert int(model.mjp.sampler.sample_counter) == records[1]["step"] * 8 - records[0]["step"] * 8
    # a finished run resumed does nothing
    again = train(config, resume=True)
    assert again.history == result.history


@pytest.mark.parametrize(
    "stop_step, checkpoint_steps, saved_step, workers",
    [(5, 2, 4, 0), (5, 2, 4, 1), (7, 0, 6, 0)],
    ids=["within-an-epoch", "within-an-epoch-loader-process", "at-an-epoch-boundary"],
)
def test_resume_matches_an_uninterrupted_run(cifar_tree, tmp_path, stop_step, checkpoint_steps, saved_step, workers):
    # RandAugment, random erasing, mixup/cutmix, drop-path, repeated augmentation and MJP all on: every random
    # draw must come back the same after the restart. With a loader process, the samples' seeds do not touch the
    # main process's generators (with none, each sample's seed resets them): mixup and drop-path then draw from the
    # generators the checkpoint saved.
    changes = {"auto_augment": "rand-m9-mstd0.5-inc1", "reprob": 0.25, "mixup": 0.8, "cutmix": 1.0, "workers": workers}
    reference = train(_config(cifar_tree, tmp_path / "straight", **changes))

    interrupted = _config(cifar_tree, tmp_path / "resumed", checkpoint_steps=checkpoint_steps, **changes)
    with _killed_after(stop_step), pytest.raises(_Interrupt):
        train(interrupted)
    saved = load_checkpoint(tmp_path / "resumed" / "last.pt")
    # killed after step stop_step: the run loses what came after its last checkpoint, no more
    assert saved["step"] == saved_step and not saved["finished"]
    resumed = train(interrupted, resume=True)

    straight_state = load_checkpoint(tmp_path / "straight" / "last.pt")["state_dict"]
    resumed_state = load_checkpoint(tmp_path / "resumed" / "last.pt")["state_dict"]
    assert straight_state.keys() == resumed_state.keys()
    for key in straight_state:
        torch.testing.assert_close(resumed_state[key], straight_state[key], rtol=0, atol=0, msg=key)
    timing = ("train_images_per_second", "epoch_seconds", "eval_seconds")
    strip = lambda records: [{k: v for k, v in record.items() if k not in timing} for record in records]
    assert strip(resumed.history) == strip(reference.history)
    lines = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # no duplicated epoch records


def test_output_folder_with_a_run_needs_resume(cifar_tree, tmp_path):
    config = _config(cifar_tree, tmp_path / "run", epochs=1, warmup_epochs=0, max_train_samples=16)
    train(config)
    with pytest.raises(Exception, match="already holds a run"):
        train(config)


def test_baseline_is_a_plain_timm_model(cifar_tree, tmp_path):
    result = train(_config(cifar_tree, tmp_path / "base", mjp=False, epochs=1, warmup_epochs=0))
    checkpoint = load_checkpoint(tmp_path / "base" / "last.pt")
    assert checkpoint["model_name"] == "vit_tiny_patch16_224"
    assert not any(key.startswith("mjp") for key in checkpoint["model_kwargs"])
    assert not any(key.startswith("mjp.") for key in checkpoint["state_dict"])
    assert result.history[0]["dal_loss"] is None and result.final["consistency"] is not None


def test_nan_loss_stops_the_run(cifar_tree, tmp_path, monkeypatch):
    class NanLoss(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

        def forward(self, logits, targets):
            return logits.sum() * float("nan")

    monkeypatch.setattr(build, "SoftTargetCrossEntropy", NanLoss)  # the recipe's loss with mixup
    with pytest.raises(TrainingDiverged, match=r"the loss became nan at epoch 1, batch 0, step 0"):
        train(_config(cifar_tree, tmp_path / "nan"))


class _NanAtBatch(SoftTargetCrossEntropy):
    """The recipe's loss (with mixup), NaN on one training batch only: the run diverges there."""

    bad_call = 2
    calls = 0

    def forward(self, logits, targets):
        loss = super().forward(logits, targets)
        type(self).calls += 1
        return loss * float("nan") if type(self).calls - 1 == self.bad_call else loss


@pytest.mark.parametrize(
    "checkpoint_steps, noticed, saved_step",
    [(2, "at batch 3", 2), (0, "at the end of epoch 1", None)],
    ids=["at-a-checkpoint", "at-the-epoch-end"],
)
def test_a_diverged_run_writes_no_checkpoint_after_the_bad_loss(
    cifar_tree, tmp_path, monkeypatch, checkpoint_steps, noticed, saved_step
):
    # The loss is read back only at log intervals (none here after batch 0), checkpoints and the epoch's end: the
    # NaN of batch 2 goes unnoticed for a step, but never into a checkpoint (6 batches, one step each).
    monkeypatch.setattr(_NanAtBatch, "calls", 0)
    monkeypatch.setattr(build, "SoftTargetCrossEntropy", _NanAtBatch)
    config = _config(
        cifar_tree, tmp_path / "nan", epochs=1, warmup_epochs=0, log_interval=1000, checkpoint_steps=checkpoint_steps
    )
    pattern = rf"the loss became nan at epoch 1, batch 2, step 2 \(classification nan, DAL .*noticed {noticed}\)"
    with pytest.raises(TrainingDiverged, match=pattern):
        train(config)
    last = tmp_path / "nan" / "last.pt"
    assert not (tmp_path / "nan" / "best.pt").exists()
    if saved_step is None:
        assert not last.exists()
        return
    saved = load_checkpoint(last)
    assert saved["step"] == saved_step and saved["batch_in_epoch"] == saved_step and not saved["finished"]
    assert all(torch.isfinite(value).all() for value in saved["state_dict"].values() if value.is_floating_point())
    running = saved["running"]
    assert running["samples"] == 8 * saved_step and math.isfinite(running["loss"]) and math.isfinite(running["dal"])


def _count_host_reads(monkeypatch) -> list[int]:
    """Counts the reads of tensors back to the host made by the training loop's own code (not timm's or torch's,
    nor evaluation's)."""
    from mjp_fast.train import records, run, step, tally

    loop_files = {module.__file__ for module in (loop, build, records, run, step, tally)}
    count = [0]
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            if sys._getframe(1).f_code.co_filename in loop_files:
                count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return count


def test_the_loop_reads_losses_back_only_at_log_intervals(cifar_tree, tmp_path, monkeypatch):
    # On a GPU each read back waits for the queue to drain: the loop must not read once per step.
    log_interval = 5
    reads, steps = [], []
    for samples in (4, 48):
        count = _count_host_reads(monkeypatch)
        result = train(
            _config(
                cifar_tree,
                tmp_path / f"run{samples}",
                epochs=1,
                warmup_epochs=0,
                batch_size=2,
                max_train_samples=samples,
                log_interval=log_interval,
            )
        )
        monkeypatch.undo()
        reads.append(count[0])
        steps.append(result.history[0]["step"])
    assert steps[1] - steps[0] >= 20
    assert reads[0] > 0  # the counter sees the loop's reads (at the epoch's end at least)
    # more steps add reads only at the log intervals among them, not one (or three) per step
    assert reads[1] - reads[0] <= (steps[1] - steps[0]) / log_interval, (reads, steps)


def test_dal_weight_decays_along_a_cosine():
    config = load_config("digits")
    assert dal_weight_at(config, 0, 100) == pytest.approx(0.01)
    assert dal_weight_at(config, 50, 100) == pytest.approx(0.0075)
    assert dal_weight_at(config, 100, 100) == pytest.approx(0.005)
    assert dal_weight_at(config, 25, 100) == pytest.approx(0.005 + 0.005 * 0.5 * (1 + math.cos(math.pi / 4)))


def test_gradient_accumulation_and_sgd(cifar_tree, tmp_path):
    result = train(_config(cifar_tree, tmp_path / "accum", accum_steps=3, opt="sgd", epochs=1, warmup_epochs=0))
    # 48 images, batch 8: 6 micro-batches, 2 optimizer steps
    assert result.history[0]["step"] == 2


def test_header_words_name_what_trains():
    import timm

    plain = timm.create_model("deit_tiny_patch16_224", pretrained=False)
    assert describe_model("deit_tiny_patch16_224", {"num_classes": 1000}, plain) == (
        "deit_tiny_patch16_224, patch 16 (14x14 grid), 224 px"
    )
    kwargs = {"img_size": 16, "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 4}
    small = timm.create_model("deit_tiny_patch16_224", pretrained=False, num_classes=10, **kwargs)
    assert describe_model("deit_tiny_patch16_224", kwargs, small) == (
        "deit_tiny_patch16_224 with embed_dim=64, depth=2, num_heads=4, patch 4 (4x4 grid), 16 px"
    )
    assert (plural(1, "epoch"), plural(0, "epoch"), plural(30, "epoch")) == ("1 epoch", "0 epochs", "30 epochs")
    assert count_parameters(5_717_416) == "5.72 M parameters" and count_parameters(3_914) == "3.9 k parameters"


def test_a_callers_process_group_outlives_train_and_compare(cifar_tree, tmp_path, monkeypatch):
    """``train`` joins a group that its caller set up and leaves it alone: only the group's creator destroys it."""
    import torch.distributed as dist

    from mjp_fast.train.compare import train_compare

    # WORLD_SIZE > 1 sends train() to the process group; the caller's group has one rank, so nothing waits.
    monkeypatch.setenv("WORLD_SIZE", "2")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        train(_config(cifar_tree, tmp_path / "run", epochs=1, warmup_epochs=0, max_train_samples=16))
        assert dist.is_initialized()
        train_compare(_config(cifar_tree, tmp_path / "compare", epochs=1, warmup_epochs=0, max_train_samples=16))
        assert dist.is_initialized()
        assert (tmp_path / "compare" / "summary.json").is_file()
    finally:
        dist.destroy_process_group()


# The loop's own work per batch beyond a plain step (forward, loss, backward, clipping, optimizer), counted in
# dispatched operators (on a GPU most are one kernel launch each): issue 21's aim is at most 3. Today: the DAL
# weight's fill (it follows a cosine every step) and the tally's fold, about 12 operators per 32 batches.
BOOKKEEPING_CEILING = 3.0
METADATA_ONLY = {"detach", "view", "alias", "lift_fresh"}


@pytest.mark.parametrize("mjp", [False, True])
def test_the_loops_bookkeeping_per_batch_is_at_most_three_operators(tmp_path, mjp):
    from timm.utils import dispatch_clip_grad

    from tests.harness.host_cost import OpCounter

    config = load_config(
        None, tiny_overrides(output=str(tmp_path), mjp=mjp, mixup=0.0, cutmix=0.0, drop_path=0.0, mjp_prob=1.0)
    )
    run = loop._build_run(config, loop.Distributed(), tmp_path, None)
    images, targets = next(iter(run.loader))
    step, batches = run.train_step, 64  # two folds of the tally
    run.model.train()

    def by_hand() -> None:  # timm's train.py's step on the same model, optimizer and loss
        loss = step.criterion(run.model(images.to(run.context.device)), targets.to(run.context.device))
        loss.backward()
        dispatch_clip_grad(run.model.parameters(), config.clip_grad, mode=config.clip_mode)
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step_update(num_updates=1)

    def in_the_loop(tally: loop._StepTally) -> None:
        for index in range(batches):
            run._train_batch(images, targets, index, True, tally)
        tally.read()  # the fold of the last batches is the loop's work too (a read only at log intervals)

    in_the_loop(loop._StepTally(run.context.device))  # warm caches: the extension, the optimizer's state
    with OpCounter() as loop_ops:
        in_the_loop(loop._StepTally(run.context.device))
    with OpCounter() as hand_ops:
        for _ in range(batches):
            by_hand()
    # operators that only make a tensor's metadata (a detached reference kept for the tally, a view) launch nothing
    launching = [sum(n for name, n in ops.counts.items() if name not in METADATA_ONLY) for ops in (loop_ops, hand_ops)]
    extra = (launching[0] - launching[1]) / batches
    assert extra <= BOOKKEEPING_CEILING, (extra, dict(loop_ops.counts - hand_ops.counts))


def test_sync_debug_needs_a_cuda_device(tmp_path):
    config = load_config(None, tiny_overrides(output=str(tmp_path), sync_debug=True, device="cpu"))
    with pytest.raises(ValueError, match="sync_debug=true needs a CUDA device"):
        train(config)


def test_sync_debug_makes_every_batch_after_the_first_strict_and_the_loops_reads_lenient(tmp_path, monkeypatch):
    # No GPU here: torch.cuda's switch is recorded instead, with what runs under each mode.
    config = load_config(
        None, tiny_overrides(output=str(tmp_path), log_interval=2, checkpoint_steps=3, max_train_samples=48)
    )
    run = loop._build_run(config, loop.Distributed(), tmp_path, None)
    run.config = run.config.replace(sync_debug=True)  # past the device check, which needs CUDA
    mode, events = [0], []

    def set_mode(value):
        mode[0] = 0 if value in (0, "default") else value
        events.append(("mode", mode[0]))

    def recording(name, function):
        def wrapper(*args, **kwargs):
            events.append((name, mode[0]))
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    monkeypatch.setattr(run, "_train_batch", recording("batch", run._train_batch))
    monkeypatch.setattr(loop._StepTally, "read", recording("read", loop._StepTally.read))
    monkeypatch.setattr(run, "_save", recording("save", run._save))
    run.fit()
    batches = [strict for name, strict in events if name == "batch"]
    assert len(batches) == 2 * run.batches_per_epoch
    assert batches[0] == 0 and all(strict == "error" for strict in batches[1:])
    assert all(strict == 0 for name, strict in events if name in ("read", "save"))
    assert [name for name, _ in events].count("read") >= 6 and mode[0] == 0


def test_sync_debug_is_lifted_while_a_batch_compiles_and_set_back_after(tmp_path, monkeypatch):
    # A recompilation at a later batch (the H200's `mjp train compile=true sync_debug=true`, 2026-11-28: Inductor's
    # constant folding read a device value while compiling at batch 2): torch's compilation callbacks lift the error
    # mode for the compile, nested ones included, and the batch's own work after it is strict again.
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    config = load_config(None, tiny_overrides(output=str(tmp_path), max_train_samples=48))
    run = loop._build_run(config, loop.Distributed(), tmp_path, None)
    run.config = run.config.replace(sync_debug=True)  # past the device check, which needs CUDA
    mode, seen = [0], []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda value: mode.__setitem__(0, value or 0))
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode[0])
    batch = run._train_batch

    def compiling_batch(*args, **kwargs):
        seen.append(("before", mode[0]))
        with callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "0/0"):
            seen.append(("compiling", mode[0]))
            with callback_handler.install_callbacks(CallbackTrigger.LAZY_BACKWARD, "0/0"):
                seen.append(("nested", mode[0]))
            seen.append(("compiling", mode[0]))
        seen.append(("after", mode[0]))
        return batch(*args, **kwargs)

    monkeypatch.setattr(run, "_train_batch", compiling_batch)
    callbacks = (list(callback_handler.start_callbacks), list(callback_handler.end_callbacks))
    run.fit()
    strict = seen[5:10]  # the second batch: the first is never strict
    assert strict == [("before", "error"), ("compiling", 0), ("nested", 0), ("compiling", 0), ("after", "error")]
    assert mode[0] == 0  # the loop's reads and the end of the run: lenient
    # the callbacks live for a strict batch only
    assert (callback_handler.start_callbacks, callback_handler.end_callbacks) == callbacks


def test_normalizing_on_the_device_gives_the_batches_of_the_loader_that_normalizes(tmp_path):
    # auto is on for CUDA only: forced on here, the loader gives uint8 and the step normalizes; random erasing off, so
    # the two paths must give the same float batches (each sample's augmentation has its own seed).
    batches = {}
    for setting in ("on", "off"):
        config = load_config(
            None, tiny_overrides(output=str(tmp_path / setting), reprob=0.0, normalize_on_device=setting)
        )
        run = loop._build_run(config, loop.Distributed(), tmp_path / setting, None)
        run.sampler.set_epoch(0)
        images, _ = next(iter(run.loader))
        assert images.dtype == (torch.uint8 if setting == "on" else torch.float32)
        batches[setting] = run.normalize(images) if run.normalize is not None else images
    torch.testing.assert_close(batches["on"], batches["off"], rtol=1e-5, atol=1e-5)
    assert not loop.normalizes_on_device(config.replace(normalize_on_device="auto"), torch.device("cpu"))
    assert loop.normalizes_on_device(config.replace(normalize_on_device="auto"), torch.device("cuda", 0))


def test_records_time_training_and_evaluation_apart(tmp_path):
    # timm reports them apart: train_images_per_second and epoch_seconds are the training batches' alone
    config = load_config(
        None, tiny_overrides(output=str(tmp_path), epochs=3, eval_interval=2, max_train_samples=48, max_val_samples=16)
    )
    history = train(config).history
    assert [record["eval_seconds"] is None for record in history] == [True, False, False]
    for record in history:
        assert record["epoch_seconds"] > 0 and record["train_images_per_second"] > 0
        assert record["eval_seconds"] is None or record["eval_seconds"] > 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["eval_seconds"] is None for line in lines] == [True, False, False]


def _interrupt_line(err: str) -> str:
    """The interrupt's message: stderr's last line, and its only one about the interrupt (notes may come first)."""
    assert err.endswith("\n") and err.count("mjp train: interrupted") == 1, err
    return err.splitlines()[-1]


def _train_arguments(cifar_tree, output, **changes) -> list[str]:
    return ["train", "--data", str(cifar_tree), "--output", str(output), *tiny_overrides(**changes)]


def test_ctrl_c_before_the_first_checkpoint_says_nothing_can_be_resumed(cifar_tree, tmp_path, capsys):
    output = tmp_path / "run"
    arguments = _train_arguments(cifar_tree, output, epochs=1, warmup_epochs=0)
    with _killed_after(2, KeyboardInterrupt):
        assert main(arguments) == 130
    err = capsys.readouterr().err
    assert _interrupt_line(err) == (
        f"mjp train: interrupted in epoch 1/1, before the run's first checkpoint: nothing to resume in {output}; "
        "running the same command again starts the run over. Checkpoints are written at the end of each epoch, and "
        "with checkpoint_steps=N also every N optimizer steps within one"
    )
    assert not (output / "last.pt").exists()
    # the advice holds: --resume has nothing to resume, the same command starts over
    assert main(["train", "--output", str(output), "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert main(arguments) == 0


def test_ctrl_c_after_a_checkpoint_names_the_folder_and_where_the_run_resumes(cifar_tree, tmp_path, capsys):
    output = tmp_path / "run with space"  # the command is quoted for the shell
    arguments = _train_arguments(cifar_tree, output, epochs=2, checkpoint_steps=2)
    with _killed_after(9, KeyboardInterrupt):  # 6 steps an epoch: the last checkpoint is step 8, epoch 2's second
        assert main(arguments) == 130
    err = capsys.readouterr().err
    assert _interrupt_line(err) == (
        f"mjp train: interrupted in epoch 2/2; {output}/last.pt is kept (resumes at epoch 2, batch 2): continue with "
        f"mjp train --output '{output}' --resume"
    )
    assert main(["train", "--output", str(output), "--resume"]) == 0
    assert "resuming" in capsys.readouterr().out


def test_ctrl_c_clears_the_progress_bar_before_the_message(cifar_tree, tmp_path, capsys):
    arguments = _train_arguments(cifar_tree, tmp_path / "run", epochs=1, warmup_epochs=0, progress="on")
    with _killed_after(2, KeyboardInterrupt):
        assert main(arguments) == 130
    err = capsys.readouterr().err
    bar, message = err.split("mjp train: interrupted", 1)
    assert "epoch 1/1" in bar  # the bar was drawn ...
    assert bar.endswith(("\r", "\n"))  # ... and cleared: the message starts its own line


_LOG_LINE = re.compile(
    r"epoch +(\d+)/(\d+)  batch +(\d+)/(\d+)  loss (\S+) \(mean (\S+)\)  lr (\S+)  (\d+) img/s  ETA (\d+:\d\d:\d\d)"
)


def test_without_a_progress_bar_a_line_every_log_interval(cifar_tree, tmp_path, capsys):
    # progress=auto and stderr captured (not a terminal): no bar, log lines instead, at the reads the loop makes
    result = train(_config(cifar_tree, tmp_path / "lines", progress="auto", log_interval=2))
    out = capsys.readouterr().out
    lines = [_LOG_LINE.fullmatch(line) for line in out.splitlines() if line.startswith("epoch") and "batch" in line]
    assert all(lines), out
    assert [(int(m[1]), int(m[3])) for m in lines] == [(e, b) for e in (1, 2) for b in (1, 3, 5)]  # 6 batches each
    assert all(m[2] == "2" and m[4] == "6" and int(m[8]) > 0 for m in lines)
    for match in lines:
        assert math.isfinite(float(match[5])) and 0 < float(match[7]) <= 1e-3
    # the first line of an epoch has one batch: its mean is its loss; the epoch's mean is the record's loss
    assert lines[0][5] == lines[0][6] and lines[3][5] == lines[3][6]
    assert abs(float(lines[5][6]) - result.history[1]["train_loss"]) < 0.5
    # each line follows its epoch's batches: epoch 1's lines come before epoch 1's record line
    assert out.index("epoch   1/2  batch 5/6") < out.index("epoch   1/2  loss ") < out.index("epoch   2/2  batch 1/6")


def test_the_progress_bar_replaces_the_log_lines(cifar_tree, tmp_path, capsys):
    train(_config(cifar_tree, tmp_path / "bar", progress="on", log_interval=2, epochs=1, warmup_epochs=0))
    captured = capsys.readouterr()
    assert not any(_LOG_LINE.search(line) for line in captured.out.splitlines())
    assert "epoch 1/1" in captured.err and "img" in captured.err  # tqdm's bar, on stderr


def test_curves_are_redrawn_during_a_run_only_after_a_while(cifar_tree, tmp_path, monkeypatch):
    drawn = []
    original = curves.write_curves

    def recording(histories, path, title=""):
        drawn.append((path.name, {name: len(history) for name, history in histories.items()}))
        return original(histories, path, title)

    monkeypatch.setattr(curves, "write_curves", recording)
    config = _config(cifar_tree, tmp_path / "slow", epochs=3, max_train_samples=16)
    train(config)  # short epochs: drawn once, at the end
    assert drawn == [("curves.png", {"slow": 3})]
    drawn.clear()
    monkeypatch.setattr(curves, "REFRESH_SECONDS", 0.0)  # as if every epoch took longer than the refresh time
    train(config.replace(output=str(tmp_path / "fast")))
    assert drawn == [("curves.png", {"fast": 1}), ("curves.png", {"fast": 2}), ("curves.png", {"fast": 3})]


def test_tensorboard_gets_every_numeric_value_of_each_epochs_record(cifar_tree, tmp_path, monkeypatch):
    # tensorboard is not installed here: a stand-in SummaryWriter records what the loop writes
    writers = []

    class RecordingWriter:
        def __init__(self, log_dir):
            self.log_dir, self.scalars, self.closed = log_dir, {}, False
            writers.append(self)

        def add_scalar(self, tag, value, step):
            self.scalars[tag, step] = value

        def flush(self):
            pass

        def close(self):
            self.closed = True

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = RecordingWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    result = train(_config(cifar_tree, tmp_path / "board", tensorboard=True))
    (writer,) = writers
    assert writer.log_dir == str(tmp_path / "board" / "tensorboard") and writer.closed
    expected = {
        (key, record["epoch"]): value
        for record in result.history
        for key, value in record.items()
        if isinstance(value, (int, float)) and key != "epoch"
    }
    assert writer.scalars == expected
    assert {("train_loss", 1), ("train_loss", 2), ("lr", 2), ("top1", 2)} <= set(writer.scalars)


def test_tensorboard_without_the_package_is_a_config_error(cifar_tree, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails, as when not installed
    with pytest.raises(ValueError, match=r"tensorboard=true needs the tensorboard package"):
        train(_config(cifar_tree, tmp_path / "board", tensorboard=True))
