"""Building a run (:func:`build_run`): datasets and loaders, the model, timm's optimizer, schedule, Mixup and
losses, the forward that trains (compiled, DDP-wrapped), and the checkpoint it resumes from."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
from timm.data import Mixup, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.scheduler.scheduler import Scheduler
from torch import nn
from torch.utils.data import DataLoader, Dataset

from mjp_fast._model_geometry import input_size
from mjp_fast.train.config import ConfigError, TrainConfig
from mjp_fast.train.data import (
    DeviceNormalize,
    SeededEpochSampler,
    build_datasets,
    default_workers,
    draw_seed,
    eval_loader,
    eval_transform,
    seed_everything,
    set_transform,
    train_loader,
    train_transform,
)
from mjp_fast.train.device import amp_dtype, normalizes_on_device
from mjp_fast.train.distributed import Distributed
from mjp_fast.train.models import create_model, is_mjp_model, model_spec
from mjp_fast.train.records import count_parameters, describe_model, plural
from mjp_fast.train.resume import restore_checkpoint
from mjp_fast.train.run import Run
from mjp_fast.train.step import TrainStep


def build_run(config: TrainConfig, context: Distributed, output: Path, state: dict[str, Any] | None) -> Run:
    """Builds the datasets, model, optimizer, schedule and losses of a run, and restores ``state`` (a checkpoint;
    None: a new run) into them.

    The order is the random streams': the generators are seeded before the datasets and the model (whose
    initialization draws from them); a run resumed within an epoch gets its checkpoint's generator states back when
    its training batches start (:meth:`Run._set_generators`), after everything that draws.
    """
    device = context.device
    if config.sync_debug and device.type != "cuda":
        raise ConfigError(f"sync_debug=true needs a CUDA device (it is torch.cuda.set_sync_debug_mode), got {device}")
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    seed_everything(draw_seed(config.seed, context.rank))
    train_set, val_set, classes = build_datasets(config)
    num_classes = config.num_classes or len(classes)
    model_name, model_kwargs = model_spec(config, num_classes)
    model = create_model(model_name, model_kwargs)
    if config.mjp and not is_mjp_model(model):  # pragma: no cover - model_spec always names an MJP model
        raise ConfigError(f"model {model_name} is not an MJP model")
    data_config = _data_config(config, model)
    global_batch = config.batch_size * context.world_size * config.accum_steps
    lr = config.lr if config.lr is not None else config.lr_base * global_batch / 512
    config = _resolve_config(config, model, data_config, num_classes, lr)
    on_device = normalizes_on_device(config, device)  # the loader's transform and the step's normalization agree
    loader, sampler, val_loader = _build_loaders(config, context, train_set, val_set, input_size(model), on_device)

    model.to(device)
    optimizer = _build_optimizer(config, model)
    batches_per_epoch = len(loader)
    updates_per_epoch = math.ceil(batches_per_epoch / config.accum_steps)
    scheduler, total_epochs = _build_scheduler(config, optimizer, updates_per_epoch)
    dtype = amp_dtype(config, device)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    mixup, criterion = _build_mixup_and_criterion(config, num_classes)
    start = restore_checkpoint(
        state, model_name, model, optimizer, scheduler, scaler, config, batches_per_epoch, context, output
    )

    ddp = context.world_size > 1
    forward_model = _wrap_for_training(model, config, context)
    header = None
    if state is None:  # a resumed run says where it resumes instead (see restore_checkpoint)
        parameters = count_parameters(sum(parameter.numel() for parameter in model.parameters()))
        header = (
            f"mjp train: {describe_model(model_name, model_kwargs, model)} ({parameters}, "
            f"{num_classes} classes) on {len(train_set)} training / {len(val_set)} validation images; "
            f"{plural(total_epochs, 'epoch')} x {plural(updates_per_epoch, 'step')}, global batch {global_batch}, "
            f"lr {lr:.2e}, {device}{f' x {context.world_size}' if ddp else ''}; output {output}"
        )
    return Run(
        config=config,
        context=context,
        output=output,
        model_name=model_name,
        model_kwargs=model_kwargs,
        model=model,
        train_step=TrainStep(model, forward_model, optimizer, criterion, config, dtype, scaler, ddp),
        scheduler=scheduler,
        mixup=mixup,
        normalize=DeviceNormalize(config.mean, config.std, config, device) if on_device else None,
        loader=loader,
        sampler=sampler,
        val_loader=val_loader,
        batches_per_epoch=batches_per_epoch,
        total_epochs=total_epochs,
        total_steps=updates_per_epoch * total_epochs,
        start=start,
        header=header,
        show_progress=_progress_enabled(config, context),
    )


def _progress_enabled(config: TrainConfig, context: Distributed) -> bool:
    if not context.is_main or config.progress == "off":
        return False
    return config.progress == "on" or sys.stderr.isatty()


def _resolve_config(
    config: TrainConfig, model: nn.Module, data_config: dict, num_classes: int, lr: float
) -> TrainConfig:
    return config.replace(
        num_classes=num_classes,
        img_size=input_size(model),
        lr=lr,
        mean=[float(value) for value in data_config["mean"]],
        std=[float(value) for value in data_config["std"]],
        crop_pct=float(data_config["crop_pct"]),
        mjp_seed=config.seed if config.mjp_seed is None else config.mjp_seed,
        mjp_from_epoch=config.warmup_epochs if config.mjp_from_epoch is None else config.mjp_from_epoch,
    )


def _data_config(config: TrainConfig, model: nn.Module) -> dict[str, Any]:
    """timm's data config of ``model`` (mean, std, crop_pct, ...), with the values the config sets; a one-channel
    mean and std are repeated for three channels (the images are RGB)."""
    data_config = resolve_data_config(
        {
            key: value
            for key, value in {"mean": config.mean, "std": config.std, "crop_pct": config.crop_pct}.items()
            if value is not None
        },
        model=model,
    )
    if len(data_config["mean"]) == 1:
        data_config["mean"], data_config["std"] = data_config["mean"] * 3, data_config["std"] * 3
    return data_config


def _build_loaders(
    config: TrainConfig, context: Distributed, train_set: Dataset, val_set: Dataset, img_size: int, on_device: bool
) -> tuple[DataLoader, SeededEpochSampler, DataLoader]:
    """Sets the datasets' transforms (``on_device``: the training one gives uint8, see :func:`normalizes_on_device`);
    returns the training loader, its sampler and the validation loader (this rank's shards)."""
    mean, std = tuple(config.mean), tuple(config.std)
    set_transform(train_set, train_transform(config, img_size, mean, std, on_device=on_device))
    set_transform(val_set, eval_transform(img_size, config.interpolation, config.crop_pct))
    pin = context.device.type == "cuda"
    loader, sampler = train_loader(config, train_set, rank=context.rank, world_size=context.world_size, pin_memory=pin)
    workers = config.workers if config.workers is not None else default_workers(context.world_size)
    val_loader = eval_loader(
        val_set,
        config.eval_batch_size or 2 * config.batch_size,
        workers,
        rank=context.rank,
        world_size=context.world_size,
        pin_memory=pin,
    )
    return loader, sampler, val_loader


def _build_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """timm's optimizer ``config.opt`` over ``model`` at the peak ``config.lr``. Raises ConfigError for a bad name
    or setting."""
    optimizer_kwargs: dict[str, Any] = {"momentum": config.momentum}
    if config.opt_eps is not None:
        optimizer_kwargs["eps"] = config.opt_eps
    try:
        return create_optimizer_v2(
            model, opt=config.opt, lr=config.lr, weight_decay=config.weight_decay, **optimizer_kwargs
        )
    except (ValueError, AssertionError, TypeError) as error:
        raise ConfigError(f"opt={config.opt!r}: {str(error).splitlines()[0]}") from None


def _build_scheduler(
    config: TrainConfig, optimizer: torch.optim.Optimizer, updates_per_epoch: int
) -> tuple[Scheduler | None, int]:
    """timm's schedule ``config.sched``, stepped per optimizer step, and the run's epochs (cooldown included).
    ``sched=none``: no schedule. Raises ConfigError for a bad name or setting."""
    try:
        return create_scheduler_v2(
            optimizer,
            sched=config.sched,
            num_epochs=config.epochs,
            warmup_epochs=config.warmup_epochs,
            warmup_lr=config.warmup_lr,
            min_lr=config.min_lr,
            cooldown_epochs=config.cooldown_epochs,
            step_on_epochs=False,
            updates_per_epoch=updates_per_epoch,
        )
    except (ValueError, AssertionError) as error:
        raise ConfigError(f"sched={config.sched!r}: {str(error).splitlines()[0]}") from None


def _build_mixup_and_criterion(config: TrainConfig, num_classes: int) -> tuple[Mixup | None, nn.Module]:
    """Mixup/CutMix (None when off) and the classification loss that fits its targets: soft-target cross-entropy
    after mixing (which smooths the labels itself), else label smoothing or plain cross-entropy."""
    if config.mixing:
        mixup = Mixup(
            mixup_alpha=config.mixup,
            cutmix_alpha=config.cutmix,
            prob=config.mixup_prob,
            switch_prob=config.mixup_switch_prob,
            mode=config.mixup_mode,
            label_smoothing=config.smoothing,
            num_classes=num_classes,
        )
        return mixup, SoftTargetCrossEntropy()
    if config.smoothing > 0:
        return None, LabelSmoothingCrossEntropy(smoothing=config.smoothing)
    return None, nn.CrossEntropyLoss()


def _wrap_for_training(model: nn.Module, config: TrainConfig, context: Distributed) -> nn.Module:
    """What runs the training forward: ``model`` compiled (``compile=true``) and DDP-wrapped (several ranks)."""
    forward_model = model
    if config.compile:
        forward_model = torch.compile(forward_model, mode=config.compile_mode)
    if context.world_size > 1:
        device = context.device
        forward_model = nn.parallel.DistributedDataParallel(
            forward_model, device_ids=[device.index] if device.type == "cuda" else None
        )
    return forward_model
