"""The reconstruction metrics of the paper's privacy evaluation, per image, over images in [0, 1].

Every function takes a reconstruction and a reference, ``[B, C, H, W]`` in [0, 1] (clip reconstructions
first: :func:`reconstruction_metrics` does), and returns one value per image ``[B]`` in float64. Averages over
images are taken after the per-image values (PSNR too: the mean of per-image PSNRs).

- ``mse``: mean squared error over pixels and channels. Higher means more privacy.
- ``psnr``: ``10 log10(1 / mse)`` (data range 1), capped at 200 dB (``mse`` floored at 1e-20) so that an exact
  reconstruction stays a finite number. Lower means more privacy.
- ``ssim``: SSIM (Wang et al., 2004) as the paper's evaluation computes it: an 11x11 Gaussian window of sigma
  1.5, ``K1 = 0.01``, ``K2 = 0.03``, data range 1, local statistics by convolution with zero padding of 5
  pixels (so the map has the image's size and its border windows see zeros), averaged over positions and
  channels. Lower means more privacy.
- ``fft2d``: the paper's FFT2D, ``|1 - (sum F_a F_b) / sqrt((sum F_a F_a)(sum F_b F_b))|`` with ``F`` the
  2-D FFTs over (H, W) of every channel, flattened per image, and every product taken WITHOUT complex
  conjugation (scipy's cosine distance applied to complex vectors, as the paper's evaluation does). For real
  images ``sum F_a F_b = H W sum_x a(x) b(-x)`` (indices modulo the size): the metric compares ``a`` with
  the point-reflected ``b``, not the spectra's magnitudes or phases; it is 0 for identical images, and for
  images in [0, 1] the mean colour dominates every sum, so it stays near 0 even for unrelated pictures (the
  paper reports 0.002-0.034). A weak metric: read it beside the others, never alone. Higher means more
  privacy.
- ``lpips``: LPIPS, AlexNet with the v0.1 linear layers (:mod:`mjp_fast.privacy.lpips`). Higher means more
  privacy.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

METRICS = ("mse", "psnr", "ssim", "fft2d", "lpips")
# Whether a larger value means a better-protected image (the paper's arrows).
HIGHER_IS_PRIVATE = {"mse": True, "psnr": False, "ssim": False, "fft2d": True, "lpips": True}
PSNR_MSE_FLOOR = 1e-20

SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def _check_pair(images: torch.Tensor, references: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(images, torch.Tensor) or not isinstance(references, torch.Tensor):
        raise TypeError("images and references must be tensors")
    if images.shape != references.shape or images.dim() != 4:
        raise ValueError(
            f"images and references must be [B, C, H, W] of one shape, got {list(images.shape)} and "
            f"{list(references.shape)}"
        )
    return images.detach().double(), references.detach().double()


def mse(images: torch.Tensor, references: torch.Tensor) -> torch.Tensor:
    """Mean squared error per image ``[B]``."""
    images, references = _check_pair(images, references)
    return (images - references).square().mean(dim=(1, 2, 3))


def psnr(images: torch.Tensor, references: torch.Tensor) -> torch.Tensor:
    """PSNR per image in dB with data range 1, ``[B]``; at most 200 dB."""
    return -10 * torch.log10(mse(images, references).clamp_min(PSNR_MSE_FLOOR))


@functools.lru_cache(maxsize=4)
def _gaussian_window(channels: int) -> torch.Tensor:
    offsets = torch.arange(SSIM_WINDOW, dtype=torch.float64) - (SSIM_WINDOW - 1) / 2
    line = torch.exp(-offsets.square() / (2 * SSIM_SIGMA**2))
    line = line / line.sum()
    return (line[:, None] * line[None, :]).expand(channels, 1, SSIM_WINDOW, SSIM_WINDOW).contiguous()


def ssim(images: torch.Tensor, references: torch.Tensor) -> torch.Tensor:
    """SSIM per image ``[B]`` (11x11 Gaussian window, sigma 1.5, data range 1, zero padding)."""
    images, references = _check_pair(images, references)
    channels = images.shape[1]
    window = _gaussian_window(channels).to(images.device)
    blur = lambda x: F.conv2d(x, window, padding=SSIM_WINDOW // 2, groups=channels)
    mean_a, mean_b = blur(images), blur(references)
    var_a = blur(images * images) - mean_a.square()
    var_b = blur(references * references) - mean_b.square()
    covariance = blur(images * references) - mean_a * mean_b
    c1, c2 = SSIM_K1**2, SSIM_K2**2
    index = ((2 * mean_a * mean_b + c1) * (2 * covariance + c2)) / (
        (mean_a.square() + mean_b.square() + c1) * (var_a + var_b + c2)
    )
    return index.mean(dim=(1, 2, 3))


def fft2d(images: torch.Tensor, references: torch.Tensor) -> torch.Tensor:
    """The paper's FFT2D distance per image ``[B]``: cosine distance of the 2-D FFTs, without conjugation."""
    images, references = _check_pair(images, references)
    spectrum_a = torch.fft.fft2(images).flatten(1)
    spectrum_b = torch.fft.fft2(references).flatten(1)
    # Deliberately no conj() anywhere, norms included: the metric as the paper's evaluation computes it.
    cross = (spectrum_a * spectrum_b).sum(1)
    scale = torch.sqrt((spectrum_a * spectrum_a).sum(1) * (spectrum_b * spectrum_b).sum(1))  # principal root
    # An all-black image has no direction; call it as far as orthogonal spectra (scipy would give NaN).
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.where(scale == 0, torch.ones_like(cross.real), (1 - cross / safe).abs())


def lpips(images: torch.Tensor, references: torch.Tensor) -> torch.Tensor:
    """LPIPS (AlexNet, v0.1) per image ``[B]``; needs ``H, W >= 32`` and 3 channels."""
    from mjp_fast.privacy.lpips import lpips as lpips_distance

    images, references = _check_pair(images, references)
    return lpips_distance(images.float(), references.float()).double()


METRIC_FUNCTIONS = {"mse": mse, "psnr": psnr, "ssim": ssim, "fft2d": fft2d, "lpips": lpips}


def reconstruction_metrics(
    reconstructions: torch.Tensor, references: torch.Tensor, metrics: tuple[str, ...] = METRICS
) -> dict[str, torch.Tensor]:
    """All metrics per image, ``{name: [B] float64}``, after clipping the reconstructions to [0, 1]."""
    unknown = [name for name in metrics if name not in METRIC_FUNCTIONS]
    if unknown:
        raise ValueError(f"unknown metrics {unknown}; known: {list(METRICS)}")
    clipped = reconstructions.detach().double().clamp(0, 1)
    return {name: METRIC_FUNCTIONS[name](clipped, references) for name in metrics}
