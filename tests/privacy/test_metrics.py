"""The paper's reconstruction metrics, checked against independent computations."""

import numpy as np
import pytest
import torch
from scipy import ndimage
from skimage.metrics import peak_signal_noise_ratio

from mjp_fast.privacy.metrics import METRICS, fft2d, mse, psnr, reconstruction_metrics, ssim


@pytest.fixture(scope="module")
def pairs(photos):
    _, images = photos
    generator = torch.Generator().manual_seed(0)
    noisy = (images + 0.1 * torch.randn(images.shape, generator=generator, dtype=images.dtype)).clamp(0, 1)
    return images, noisy


def test_mse_and_psnr_per_image(pairs):
    images, noisy = pairs
    expected = ((images - noisy) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(mse(noisy, images), expected)
    for index in range(images.shape[0]):
        reference = peak_signal_noise_ratio(images[index].numpy(), noisy[index].numpy(), data_range=1)
        assert float(psnr(noisy, images)[index]) == pytest.approx(reference, rel=1e-12)
    assert float(psnr(images, images)[0]) == pytest.approx(200.0)  # capped, finite


def _ssim_numpy(first: np.ndarray, second: np.ndarray) -> float:
    """SSIM with an 11x11 Gaussian (sigma 1.5), zero padding, per channel, averaged: written with scipy."""
    offsets = np.arange(11) - 5
    line = np.exp(-(offsets**2) / (2 * 1.5**2))
    line /= line.sum()
    window = np.outer(line, line)
    blur = lambda x: ndimage.correlate(x, window, mode="constant", cval=0.0)
    values = []
    for a, b in zip(first, second, strict=True):
        mu_a, mu_b = blur(a), blur(b)
        var_a, var_b = blur(a * a) - mu_a**2, blur(b * b) - mu_b**2
        cov = blur(a * b) - mu_a * mu_b
        c1, c2 = 0.01**2, 0.03**2
        index = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
        values.append(index.mean())
    return float(np.mean(values))


def test_ssim_matches_an_independent_computation(pairs):
    images, noisy = pairs
    ours = ssim(noisy, images)
    for index in range(images.shape[0]):
        assert float(ours[index]) == pytest.approx(_ssim_numpy(noisy[index].numpy(), images[index].numpy()), abs=1e-12)
    torch.testing.assert_close(ssim(images, images), torch.ones(images.shape[0], dtype=torch.float64))


def test_fft2d_is_the_unconjugated_cosine_distance(pairs):
    images, noisy = pairs
    ours = fft2d(noisy, images)
    for index in range(images.shape[0]):
        a = np.fft.fft2(noisy[index].numpy()).ravel()
        b = np.fft.fft2(images[index].numpy()).ravel()
        expected = abs(1 - np.dot(a, b) / np.sqrt(np.dot(a, a) * np.dot(b, b)))  # np.dot does not conjugate
        assert float(ours[index]) == pytest.approx(expected, rel=1e-9, abs=1e-14)
        # In pixel space: sum F_a F_b = H W sum_x a(x) b(-x), so it compares a with the point-reflected b.
        a_pixels, b_pixels = noisy[index].numpy(), images[index].numpy()
        reflected = lambda x: np.roll(x[:, ::-1, ::-1], 1, axis=(1, 2))
        spatial = 1 - (a_pixels * reflected(b_pixels)).sum() / np.sqrt(
            (a_pixels * reflected(a_pixels)).sum() * (b_pixels * reflected(b_pixels)).sum()
        )
        assert float(ours[index]) == pytest.approx(abs(spatial), rel=1e-9, abs=1e-14)
    assert float(fft2d(images, images).abs().max()) < 1e-12
    assert float(fft2d(torch.zeros_like(images[:1]), images[:1])) == 1.0


def test_fft2d_is_weak(photos):
    # Two unrelated photos are "close" by FFT2D: the mean colour dominates (documented).
    _, images = photos
    assert float(fft2d(images[:1], images[1:2])) < 0.1
    assert float(psnr(images[:1], images[1:2])) < 15


def test_reconstruction_metrics_clip_and_name_everything(pairs):
    images, _ = pairs
    over = images[:2] * 3 - 1  # out of [0, 1]
    values = reconstruction_metrics(over, images[:2], ("mse", "psnr"))
    torch.testing.assert_close(values["mse"], mse(over.clamp(0, 1), images[:2]))
    with pytest.raises(ValueError, match="unknown metrics"):
        reconstruction_metrics(images, images, ("mae",))
    with pytest.raises(ValueError, match="one shape"):
        mse(images[:1], images[:2])
    assert METRICS == ("mse", "psnr", "ssim", "fft2d", "lpips")
