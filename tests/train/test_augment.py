"""The recipe's augmentations on real images: timm's RandAugment must not kill a run on any allowed Pillow."""

from __future__ import annotations

import random

import numpy as np
import PIL
import pytest
from PIL import Image, ImageOps
from timm.data import auto_augment, create_transform

from mjp_fast.train.augment import augment_ops, pillow_safe, posterize
from mjp_fast.train.config import TrainConfig
from mjp_fast.train.data import train_transform
from tests.train.helpers import CIFAR10, REPO_ROOT

IMAGENET = REPO_ROOT.parent / "shared" / "data" / "imagenet-samples"
PILLOW_REFUSES_ZERO_BITS = int(PIL.__version__.split(".")[0]) >= 13


def _cifar_images(count: int) -> list[Image.Image]:
    if not CIFAR10.is_dir():
        pytest.skip(f"real CIFAR-10 not found at {CIFAR10}")
    files = sorted((CIFAR10 / "train").glob("*/*.jpg"))[:: max(1, 50_000 // count)][:count]
    return [Image.open(path).convert("RGB") for path in files]


def _imagenet_images() -> list[Image.Image]:
    if not IMAGENET.is_dir():
        pytest.skip(f"ImageNet samples not found at {IMAGENET}")
    images = []
    for path in sorted(IMAGENET.glob("*.JPEG")):
        with Image.open(path) as image:
            image = image.convert("RGB")
            image.thumbnail((320, 320))  # decoding once and shrinking keeps the test fast; crops come after
            images.append(image)
    return images


def _count_posterize_bits(transform) -> list[int]:
    """Wraps every posterize op of ``transform`` so that the bits it is asked for are recorded."""
    asked: list[int] = []
    for op in augment_ops(transform):
        if op.aug_fn is posterize:

            def recording(image, bits, inner=op.aug_fn, **kwargs):
                asked.append(bits)
                return inner(image, bits, **kwargs)

            op.aug_fn = recording
    return asked


@pytest.mark.parametrize("bits", range(1, 9))
def test_posterize_matches_pillow_for_one_to_eight_bits(bits):
    image = _cifar_images(4)[1]
    expected = image if bits == 8 else ImageOps.posterize(image, bits)
    assert np.array_equal(np.asarray(posterize(image, bits)), np.asarray(expected))


@pytest.mark.parametrize("bits", [0, -1, -3])
def test_posterize_with_no_bits_left_is_black(bits):
    image = _cifar_images(4)[2]
    assert np.asarray(image).any()
    for mode in ("RGB", "L", "P"):
        source = image.convert(mode)
        result = posterize(source, bits)
        assert result.mode == mode and result.size == source.size
        assert not np.asarray(result.convert("RGB")).any(), mode


def test_posterize_names_an_unsupported_mode():
    with pytest.raises(ValueError, match="image: .*mode 'RGBA'"):
        posterize(Image.new("RGBA", (4, 4)), 0)


def test_full_magnitude_posterize_on_a_real_image():
    """The recipe's PosterizeIncreasing at magnitude 10 asks for 0 bits: timm's op alone fails on Pillow 13."""
    image = _cifar_images(4)[0]
    op = auto_augment.AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)
    if PILLOW_REFUSES_ZERO_BITS:
        with pytest.raises(ValueError, match="bits"):
            op(image)
    pillow_safe([op])
    assert op.aug_fn is posterize
    assert not np.asarray(op(image)).any()


@pytest.mark.parametrize(
    "policy", ["rand-m9-mstd0.5-inc1", "rand-m15-mmax20-mstd0.5-inc1", "original", "v0", "augmix-m5-w4-d2"]
)
def test_every_policy_gets_the_safe_posterize(policy):
    transform = pillow_safe(create_transform(32, is_training=True, auto_augment=policy))
    ops = augment_ops(transform)
    posterizing = [op for op in ops if "Posterize" in op.name]
    assert ops and posterizing
    assert all(op.aug_fn is posterize for op in posterizing)
    assert not any(op.aug_fn is auto_augment.posterize for op in ops)
    assert pillow_safe(transform) is transform  # twice changes nothing more


def test_default_training_transform_on_many_thousand_cifar_images():
    """The default recipe's transform, drawn 20,000 times over real CIFAR-10 images, as a loader worker would."""
    config = TrainConfig()
    assert config.auto_augment == "rand-m9-mstd0.5-inc1"
    images = _cifar_images(2_000)
    transform = train_transform(config, 32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    asked = _count_posterize_bits(transform)
    random.seed(0)
    for step in range(20_000):
        output = transform(images[step % len(images)])
        assert output.shape == (3, 32, 32)
    # Posterize runs in about 1 call in 15; about 1 in 2,000 calls asks for 0 bits (the old crash).
    assert len(asked) > 500
    assert 0 in asked


def test_default_training_transform_on_imagenet_samples():
    """The same at 224 px on the real ImageNet samples (two of them grayscale), every image many times."""
    images = _imagenet_images()
    transform = train_transform(TrainConfig(), 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    asked = _count_posterize_bits(transform)
    random.seed(1)
    for step in range(3_000):
        output = transform(images[step % len(images)])
        assert output.shape == (3, 224, 224)
    assert asked and min(asked) >= 0
