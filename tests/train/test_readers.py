"""The sources ``mjp train`` and ``mjp eval`` read (folders, ``hfds/``, ``wds/`` through timm's readers) and the
policy for unreadable images: named, counted per epoch, refused past ``max_bad_images``, with or without
``cache_images``; exact resume and fixed subsets on each source that allows them."""

import io
import json
import shutil
import tarfile

import datasets
import numpy as np
import pytest
import torch
import webdataset  # noqa: F401 - timm's wds reader needs it: fail here, not as a skipped reader

from mjp_fast.cli import main
from mjp_fast.train.config import ConfigError, load_config
from mjp_fast.train.data import (
    InMemoryImageDataset,
    build_datasets,
    clear_image_cache,
    eval_loader,
    eval_transform,
    set_transform,
    train_loader,
    train_transform,
)
from mjp_fast.train.readers import parse_source
from tests.train.helpers import CIFAR10, tiny_overrides

CLASSES = ("cat", "dog")


def _cifar_files(split, per_class):
    if not CIFAR10.is_dir():
        pytest.skip(f"real CIFAR-10 not found at {CIFAR10}")
    return [
        (path, label)
        for label, name in enumerate(CLASSES)
        for path in sorted((CIFAR10 / split / name).iterdir())[:per_class]
    ]


def _copy_tree(root, train_per_class=8, test_per_class=4):
    """An ImageFolder tree of copies (the tests below break some of its files)."""
    for split, count in (("train", train_per_class), ("test", test_per_class)):
        for path, label in _cifar_files(split, count):
            folder = root / split / CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, folder / path.name)
    return root


def _break(root, count=2):
    """Truncates one JPEG and turns others into text files named .jpg; returns their paths."""
    files = sorted((root / "train").glob("*/*.jpg"))
    broken = [files[3], *files[5 : 5 + 2 * (count - 1) : 2]][:count]
    data = broken[0].read_bytes()
    broken[0].write_bytes(data[: len(data) // 2])
    for path in broken[1:]:
        path.write_text("not an image\n")
    return broken


def _config(data, **changes):
    values = {"repeated_aug": False, "mixup": 0.0, "cutmix": 0.0, **changes}
    return load_config(None, tiny_overrides(data=data, **values))


def _epoch(loader, sampler, epoch, start=0):
    sampler.set_epoch(epoch, start=start)
    return [(images.clone(), targets.clone()) for images, targets in loader]


def _same(batches, others):
    assert len(batches) == len(others)
    for (images, targets), (other_images, other_targets) in zip(batches, others):
        torch.testing.assert_close(images, other_images, rtol=0, atol=0)
        assert torch.equal(targets, other_targets)


def test_data_values_pick_the_reader():
    assert parse_source("/data/imagenet").scheme == ""
    assert parse_source("./wds/folder").scheme == ""  # a folder that happens to be called wds
    assert (parse_source("HFDS/uoft-cs/cifar10").scheme, parse_source("hfds/uoft-cs/cifar10").location) == (
        "hfds",
        "uoft-cs/cifar10",
    )
    assert parse_source("wds//data/shards").location == "/data/shards"
    with pytest.raises(ConfigError, match="tfds/ datasets are not read by mjp"):
        parse_source("tfds/imagenet2012")
    with pytest.raises(ConfigError, match="names no dataset"):
        parse_source("hfds/")


# ---------------------------------------------------------------------------------------------------------------
# unreadable images


@pytest.mark.parametrize("workers, repeated_aug", [(0, False), (2, True)])
def test_unreadable_images_are_named_counted_and_replaced(tmp_path, capfd, workers, repeated_aug):
    root = _copy_tree(tmp_path / "data")
    broken = _break(root)
    config = _config(str(root), workers=workers, repeated_aug=repeated_aug, aug_repeats=2, batch_size=4)
    train, _, _ = build_datasets(config)
    set_transform(train, train_transform(config, 16, (0.5,) * 3, (0.5,) * 3))
    loader, sampler = train_loader(config, train, rank=0, world_size=1, pin_memory=False)
    epochs = [_epoch(loader, sampler, epoch) for epoch in range(5)]  # repeated_aug draws a subset of an epoch
    assert all(images.shape[0] == 4 for batches in epochs for images, _ in batches)  # replaced, not dropped
    err = capfd.readouterr().err
    for path in broken:  # named once each, with the reason, however often drawn (and from loader processes)
        assert err.count(f"unreadable image skipped: {path} (") == 1
    assert "(Truncated File Read)" in err and "(cannot identify image file)" in err
    assert "this epoch skipped" in err and "distinct; max_bad_images=3)" in err
    # the replacement is a function of the index: a run resumed within the epoch draws the same images
    _same(epochs[1][1:], _epoch(loader, sampler, 1, start=4))


def test_past_max_bad_images_the_run_is_refused(tmp_path):
    root = _copy_tree(tmp_path / "data")
    broken = _break(root, count=3)
    config = _config(str(root))
    config.max_bad_images = 2  # the config key (TrainConfig: max_bad_images, default 3)
    train, _, _ = build_datasets(config)
    set_transform(train, train_transform(config, 16, (0.5,) * 3, (0.5,) * 3))
    loader, sampler = train_loader(config, train, rank=0, world_size=1, pin_memory=False)
    with pytest.raises(ConfigError, match=r"3 images could not be read, more than max_bad_images=2: ") as error:
        _epoch(loader, sampler, 0)
    assert all(str(path) in str(error.value) for path in broken)


def test_cache_images_has_the_same_policy(tmp_path, capfd):
    root = _copy_tree(tmp_path / "data")
    broken = _break(root)
    clear_image_cache()
    try:
        cached, _, _ = build_datasets(_config(str(root), cache_images=True))
        err = capfd.readouterr().err
        assert all(err.count(f"unreadable image skipped: {path} (") == 1 for path in broken)
        assert "this decoding skipped 2 unreadable images" in err
        # the cached set draws what the folder draws: the broken image's place holds its replacement
        folder, _, _ = build_datasets(_config(str(root)))
        assert isinstance(cached, InMemoryImageDataset) and len(cached) == len(folder)
        for index in range(len(folder)):
            assert np.array_equal(np.asarray(cached[index][0]), np.asarray(folder[index][0]))
            assert cached[index][1] == folder[index][1]
        clear_image_cache()
        config = _config(str(root), cache_images=True)
        config.max_bad_images = 1
        with pytest.raises(ConfigError, match="2 images could not be read, more than max_bad_images=1"):
            build_datasets(config)
    finally:
        clear_image_cache()


def test_mjp_train_stops_with_exit_code_2_past_the_limit(tmp_path, capsys):
    root = _copy_tree(tmp_path / "data")
    _break(root, count=4)  # one more than the default limit, 3
    overrides = tiny_overrides(epochs=1, warmup_epochs=0, repeated_aug=False, mixup=0.0, cutmix=0.0)
    assert main(["train", "--data", str(root), "--output", str(tmp_path / "run"), *overrides]) == 2
    err = capsys.readouterr().err
    assert "mjp train: error: 4 images could not be read, more than max_bad_images=3" in err


def test_evaluation_names_unreadable_images(tmp_path, capfd):
    root = _copy_tree(tmp_path / "data")
    data = (root / "test" / "dog").glob("*.jpg")
    bad = sorted(data)[1]
    bad.write_text("not an image\n")
    _, val, _ = build_datasets(_config(str(root)))
    set_transform(val, eval_transform(16, "bilinear", 1.0))
    loader = eval_loader(val, 3, 0)
    assert len(loader.dataset) == 8 and sum(len(targets) for _, targets in loader) == 8
    err = capfd.readouterr().err
    assert f"unreadable image skipped: {bad} (cannot identify image file)" in err
    assert "this evaluation skipped 1 unreadable image" in err


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face datasets (hfds/): a dataset saved to disk, read by timm's hfds reader


@pytest.fixture
def hf_folder(tmp_path, monkeypatch):
    """A DatasetDict (train: 12 images per class, test: 4) saved with save_to_disk; datasets' cache in tmp_path."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))})

    def split(name, per_class):
        files = _cifar_files(name, per_class)
        images = [{"bytes": path.read_bytes(), "path": path.name} for path, _ in files]
        return datasets.Dataset.from_dict({"image": images, "label": [label for _, label in files]}, features=features)

    folder = tmp_path / "hf"
    datasets.DatasetDict(train=split("train", 12), test=split("test", 4)).save_to_disk(str(folder))
    return folder


def test_hfds_reads_a_saved_dataset_with_subsets_cache_and_exact_resume(hf_folder):
    data = f"hfds/{hf_folder}"
    config = _config(data, max_train_samples=16, repeated_aug=True, aug_repeats=2, workers=0)
    train, val, classes = build_datasets(config)
    assert classes == list(CLASSES) and (len(train), len(val)) == (16, 8)  # val_split auto: the test split
    labels = [train[index][1] for index in range(len(train))]
    assert set(labels) == {0, 1}  # the fixed subset spans the classes
    first = _cifar_files("test", 4)[0][0]
    assert np.array_equal(
        np.asarray(val[0][0]),
        np.asarray(datasets.Image().decode_example({"bytes": first.read_bytes(), "path": None}).convert("RGB")),
    )
    set_transform(train, train_transform(config, 16, (0.5,) * 3, (0.5,) * 3))
    loader, sampler = train_loader(config, train, rank=0, world_size=1, pin_memory=False)
    epoch = _epoch(loader, sampler, 1)
    _same(epoch[1:], _epoch(loader, sampler, 1, start=8))
    clear_image_cache()
    try:
        cached, _, _ = build_datasets(config.replace(cache_images=True))
        assert isinstance(cached, InMemoryImageDataset) and len(cached) == 16
        train.dataset.transform = None
        assert all(np.array_equal(np.asarray(cached[i][0]), np.asarray(train[i][0])) for i in range(16))
    finally:
        clear_image_cache()
    with pytest.raises(ConfigError, match=r"has no split validation \(its splits: train, test\)"):
        build_datasets(config.replace(val_split="validation"))


# ---------------------------------------------------------------------------------------------------------------
# WebDataset (wds/): tar shards written here, read by timm's wds reader


def _write_shards(root, split, files, shards, broken=()):
    """``shards`` tar shards of ``split`` (sample key: image .jpg and .cls); returns its _info.json entry."""
    names, lengths = [], []
    for shard in range(shards):
        part = files[shard::shards]
        name = f"{split}-{shard:04d}.tar"
        with tarfile.open(root / name, "w") as tar:
            for number, (path, label) in enumerate(part):
                image = b"not an image\n" if (shard, number) in broken else path.read_bytes()
                for extension, data in (("jpg", image), ("cls", str(label).encode())):
                    member = tarfile.TarInfo(f"{split}{shard}_{number:05d}.{extension}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
        names.append(name)
        lengths.append(len(part))
    return {"name": split, "num_samples": sum(lengths), "filenames": names, "shard_lengths": lengths}


@pytest.fixture
def wds_folder(tmp_path):
    """4 training shards of 24 CIFAR images and 2 test shards of 8, described by _info.json."""
    root = tmp_path / "shards"
    root.mkdir()
    splits = {
        "train": _write_shards(root, "train", _cifar_files("train", 12), 4),
        "test": _write_shards(root, "test", _cifar_files("test", 4), 2),
    }
    (root / "_info.json").write_text(json.dumps({"splits": splits}))
    return root


@pytest.mark.parametrize("workers", [0, 2])
def test_wds_streams_are_seeded_per_epoch_and_resume_exactly(wds_folder, workers):
    config = _config(f"wds/{wds_folder}", workers=workers, num_classes=2)
    train, val, classes = build_datasets(config)
    assert classes == ["0", "1"] and len(val) == 8
    set_transform(train, train_transform(config, 16, (0.5,) * 3, (0.5,) * 3))
    loader, sampler = train_loader(config, train, rank=0, world_size=1, pin_memory=False)
    epoch = _epoch(loader, sampler, 1)
    assert len(epoch) == len(loader) >= 3 and all(images.shape == (8, 3, 16, 16) for images, _ in epoch)
    assert set(torch.cat([targets for _, targets in epoch]).tolist()) == {0, 1}
    _same(epoch, _epoch(loader, sampler, 1))  # an epoch's stream is a function of (seed, epoch)...
    assert not torch.equal(_epoch(loader, sampler, 2)[0][0], epoch[0][0])  # ...and another epoch is another
    # resumed at batch 1 (with 2 workers, worker 1's turn: worker 0 hands in a placeholder first)
    _same(epoch[1:], _epoch(loader, sampler, 1, start=config.batch_size))


def test_wds_evaluation_reads_the_split_in_order_and_cuts_it(wds_folder):
    config = _config(f"wds/{wds_folder}", num_classes=2, max_val_samples=5)
    _, val, _ = build_datasets(config, need_train=False)
    set_transform(val, eval_transform(16, "bilinear", 1.0))
    batches = list(eval_loader(val, 3, 0))
    targets = torch.cat([targets for _, targets in batches]).tolist()
    # shard 0 holds the test files 0, 2, 4, 6 (cat, cat, dog, dog), shard 1 the odd ones
    assert targets == [0, 0, 1, 1, 0]
    assert len(eval_loader(val, 3, 0).dataset) == 5


def test_wds_refuses_what_a_stream_cannot_do(wds_folder):
    data = f"wds/{wds_folder}"
    with pytest.raises(ConfigError, match="set num_classes=N"):
        build_datasets(_config(data))
    with pytest.raises(ConfigError, match="cache_images=true decodes a dataset by index"):
        build_datasets(_config(data, num_classes=2, cache_images=True))
    with pytest.raises(ConfigError, match=r"has no split validation \(its splits: train, test\)"):
        build_datasets(_config(data, num_classes=2, val_split="validation"))
    train, _, _ = build_datasets(_config(data, num_classes=2))
    with pytest.raises(ConfigError, match="set repeated_aug=false"):
        train_loader(_config(data, num_classes=2, repeated_aug=True), train, rank=0, world_size=1, pin_memory=False)
    with pytest.raises(ConfigError, match="4 shards for 6 loader processes"):
        train_loader(_config(data, num_classes=2, workers=3), train, rank=0, world_size=2, pin_memory=False)


def test_wds_counts_the_samples_it_cannot_decode(tmp_path, capfd):
    root = tmp_path / "shards"
    root.mkdir()
    splits = {
        "train": _write_shards(root, "train", _cifar_files("train", 8), 2, broken={(0, 1), (1, 2)}),
        "test": _write_shards(root, "test", _cifar_files("test", 2), 1),
    }
    (root / "_info.json").write_text(json.dumps({"splits": splits}))
    config = _config(f"wds/{root}", num_classes=2, workers=0)
    train, _, _ = build_datasets(config)
    set_transform(train, train_transform(config, 16, (0.5,) * 3, (0.5,) * 3))
    loader, sampler = train_loader(config, train, rank=0, world_size=1, pin_memory=False)
    assert all(images.shape[0] == 8 for images, _ in _epoch(loader, sampler, 0))
    err = capfd.readouterr().err
    assert err.count(f"unreadable image skipped: a sample of {root} (") == 2
    assert "this epoch skipped 2 unreadable images" in err
    config.max_bad_images = 1
    loader, sampler = train_loader(config, train, rank=0, world_size=1, pin_memory=False)
    with pytest.raises(ConfigError, match="2 images could not be read, more than max_bad_images=1"):
        _epoch(loader, sampler, 0)


def test_the_loader_iterator_draws_when_made_as_a_dataloader_does(cifar_tree):
    # the training loop makes the iterator, then seeds (or restores) torch's generator: the draw must come first
    config = _config(str(cifar_tree))
    train, _, _ = build_datasets(config)
    loader, sampler = train_loader(config, train, rank=0, world_size=1, pin_memory=False)
    sampler.set_epoch(0)
    torch.manual_seed(0)
    iter(loader)
    after_ours = torch.rand(1)
    torch.manual_seed(0)
    iter(loader.loader)
    assert torch.equal(after_ours, torch.rand(1))
