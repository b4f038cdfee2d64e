"""Datasets and the seeded sampler: fixed splits, augmentations that depend on (seed, epoch, position) only."""

import pytest
import torch

from mjp_fast.train.config import ConfigError, load_config
from mjp_fast.train.data import DigitsDataset, build_datasets, resolve_split, train_loader, train_transform
from tests.train.helpers import tiny_overrides


def test_digits_split_is_fixed_and_stratified():
    train, val = DigitsDataset("train"), DigitsDataset("val")
    assert (len(train), len(val)) == (1437, 360)
    assert sorted(set(val.targets)) == list(range(10))
    assert DigitsDataset("val").targets == val.targets
    image, label = train[0]
    assert image.size == (8, 8) and image.mode == "RGB" and label == train.targets[0]


def _batches(config, dataset, epoch, start=0):
    loader, sampler = train_loader(config, dataset, rank=0, world_size=1, pin_memory=False)
    sampler.set_epoch(epoch, start=start)
    return [(images.clone(), targets.clone()) for images, targets in loader]


def test_augmentations_depend_on_epoch_and_position_not_on_workers(cifar_tree):
    config = load_config(None, tiny_overrides(data=str(cifar_tree), auto_augment="rand-m9-mstd0.5-inc1", reprob=0.25))
    train, _, classes = build_datasets(config)
    assert classes == ["airplane", "automobile", "cat"] and len(train) == 48
    train.transform = train_transform(config, 16, (0.5,) * 3, (0.5,) * 3)
    in_process = _batches(config, train, epoch=1)
    with_workers = _batches(config.replace(workers=2), train, epoch=1)
    assert len(in_process) == 6
    for (a, la), (b, lb) in zip(in_process, with_workers):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert torch.equal(la, lb)
    # resuming at batch 2 of the epoch draws exactly the remaining batches
    resumed = _batches(config, train, epoch=1, start=2 * config.batch_size)
    for (a, _), (b, _) in zip(in_process[2:], resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # another epoch: another order and other augmentations
    assert not torch.equal(_batches(config, train, epoch=2)[0][0], in_process[0][0])


@pytest.mark.parametrize("auto_augment", [None, "rand-m9-mstd0.5-inc1"])
def test_a_zero_colour_jitter_adds_no_transform(auto_augment):
    """timm adds a ColorJitter for a strength of 0 that changes nothing but costs time per image (about 30% of
    the digits preset's) and draws from torch's generator: the training transform leaves it out."""
    from torchvision.transforms import ColorJitter

    def jitters(strength):
        config = load_config("digits", [f"color_jitter={strength}"], auto_augment=auto_augment)
        transform = train_transform(config, 16, (0.5,) * 3, (0.5,) * 3)
        return [step for step in transform.transforms if isinstance(step, ColorJitter)]

    assert jitters(0.0) == []
    # RandAugment turns timm's colour jitter off whatever its strength; without it a strength gives one ColorJitter
    assert len(jitters(0.4)) == (0 if auto_augment else 1)


def test_split_resolution(cifar_tree, tmp_path):
    assert resolve_split(cifar_tree, "auto", validation=True).name == "test"
    with pytest.raises(ConfigError, match="has no .*/val or .*/validation or .*/test folder"):
        resolve_split(tmp_path, "auto", validation=True)
    config = load_config(None, tiny_overrides(data=str(cifar_tree), max_train_samples=10, max_val_samples=5))
    train, val, _ = build_datasets(config)
    assert (len(train), len(val)) == (10, 5)
    # a fixed subset of a class-sorted folder still spans the classes
    assert len({train[i][1] for i in range(10)}) > 1
