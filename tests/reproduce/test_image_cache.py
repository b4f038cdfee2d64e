"""cache_images=true (mjp_fast/train/data.py): the same samples as the folder, decoded once per process.

Here because mjp reproduce is what needs it (one decode for all its runs); the data module is its home."""

import numpy as np
import pytest

from mjp_fast.train.config import load_config
from mjp_fast.train.data import InMemoryImageDataset, build_datasets, clear_image_cache, eval_transform, set_transform
from tests.train.helpers import tiny_overrides


def test_cached_folder_gives_the_folder_samples(cifar_tree):
    clear_image_cache()
    overrides = tiny_overrides(data=str(cifar_tree), max_train_samples=20)
    plain_train, plain_val, classes = build_datasets(load_config(None, overrides))
    train, val, cached_classes = build_datasets(load_config(None, [*overrides, "cache_images=true"]))
    assert isinstance(train, InMemoryImageDataset) and isinstance(val, InMemoryImageDataset)
    assert cached_classes == classes and (len(train), len(val)) == (len(plain_train), len(plain_val)) == (20, 24)
    for index in range(len(train)):
        image, target = train[index]
        reference, reference_target = plain_train[index]
        assert target == reference_target and np.array_equal(np.asarray(image), np.asarray(reference))
    # transforms belong to each dataset object, the pixels are shared with the next run's
    set_transform(val, eval_transform(16, "bilinear", 1.0))
    assert tuple(val[0][0].shape) == (3, 16, 16)
    _, again, _ = build_datasets(load_config(None, [*overrides, "cache_images=true"]))
    assert again.pixels is val.pixels and again.transform is None
    assert train.pixels.dtype == np.uint8 and train.pixels.shape == (20, 32, 32, 3)
    clear_image_cache()
    _, fresh, _ = build_datasets(load_config(None, [*overrides, "cache_images=true"]))
    assert fresh.pixels is not val.pixels


def test_cache_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="one entry per image"):
        InMemoryImageDataset(np.zeros((2, 4, 4, 3), np.uint8), [0], ["a"])
