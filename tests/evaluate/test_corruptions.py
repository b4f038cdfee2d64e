"""The on-the-fly corruptions: shapes, ranges, determinism, hand-checked cases, and CE/mCE."""

import pytest
import torch

from mjp_fast.evaluate.corruptions import (
    CORRUPTIONS,
    contrast,
    corrupt,
    corruption_errors,
    disk_kernel,
    motion_kernels,
    pixelate,
    resolve_corruptions,
)


def _images(size=32, batch=2):
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("size", [32, 72], ids=["cifar-constants", "imagenet-constants"])
@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_every_corruption_keeps_shape_and_range_and_grows_with_severity(name, size):
    images = _images(size)
    distances = []
    for severity in (1, 3, 5):
        first = corrupt(images, name, severity, torch.Generator().manual_seed(1))
        again = corrupt(images, name, severity, torch.Generator().manual_seed(1))
        assert first.shape == images.shape and first.dtype == images.dtype
        assert first.min() >= 0 and first.max() <= 1
        torch.testing.assert_close(first, again)  # the same seed, the same corrupted images
        distances.append((first - images).abs().mean().item())
    assert distances[0] > 0
    assert distances[2] >= distances[0] * 0.99  # severity 5 is no milder than severity 1


def test_contrast_by_hand():
    image = torch.tensor([0.0, 1.0]).view(1, 1, 1, 2).expand(1, 3, 1, 2)
    # mean 0.5; severity 1 scales the deviation by 0.4 (ImageNet-C) or 0.75 (CIFAR-10-C)
    torch.testing.assert_close(contrast(image, 1, None, "imagenet")[0, 0, 0], torch.tensor([0.3, 0.7]))
    torch.testing.assert_close(contrast(image, 1, None)[0, 0, 0], torch.tensor([0.125, 0.875]))


def test_pixelate_by_hand():
    constant = torch.full((1, 3, 10, 10), 0.25)
    torch.testing.assert_close(pixelate(constant, 5, None), constant)
    image = torch.arange(16.0).view(1, 1, 4, 4).expand(1, 3, 4, 4) / 16
    out = pixelate(image, 2, None, "imagenet")  # severity 2: half the side, so 2x2 blocks of their mean
    expected_block = image[0, 0, :2, :2].mean()
    assert torch.allclose(out[0, 0, :2, :2], expected_block.expand(2, 2))


def test_kernels_are_normalized():
    assert disk_kernel(3.0, 0.1).sum().item() == pytest.approx(1.0)
    small = disk_kernel(0.3, 0.4)  # CIFAR-10-C severity 1: the center pixel, smoothed by a 3x3 Gaussian
    assert small.shape == (17, 17) and small[8, 8] == small.max() and small[8, 9] > 0 and small[8, 10] == 0
    kernels = motion_kernels(5, 2.0, torch.tensor([0.0, 30.0]))
    torch.testing.assert_close(kernels.sum(dim=(1, 2)), torch.ones(2))
    # angle 0: eleven taps on a horizontal line from the center (index 11) to the right
    assert kernels[0, 11, 11:].sum() == pytest.approx(1.0) and kernels[0, 11, 11] == kernels[0].max()


def test_mce_by_hand():
    model = {"gaussian_noise": [10.0, 20.0], "contrast": [30.0, 30.0]}
    baseline = {"gaussian_noise": [20.0, 40.0], "contrast": [20.0, 40.0]}
    result = corruption_errors(model, baseline)
    assert result["ce"] == {"gaussian_noise": 50.0, "contrast": 100.0}
    assert result["mce"] == 75.0
    # a baseline without errors on a corruption gives it no CE
    perfect = corruption_errors({"contrast": [5.0]}, {"contrast": [0.0]})
    assert perfect == {"ce": {"contrast": None}, "mce": None}


def test_names_and_families():
    assert resolve_corruptions(["noise"]) == ["gaussian_noise", "shot_noise", "impulse_noise"]
    assert resolve_corruptions(["contrast", "digital"]) == ["contrast", "pixelate", "jpeg_compression"]
    assert resolve_corruptions(["all"]) == list(CORRUPTIONS)
    with pytest.raises(ValueError, match="unknown corruption 'fog'"):
        resolve_corruptions(["fog"])
    with pytest.raises(ValueError, match="severity must be in 1..5"):
        corrupt(_images(), "contrast", 6, torch.Generator())
