"""A quick proxy for ImageNet-C, not ImageNet-C: corruptions in its style (Hendrycks and Dietterich, 2019), made on
the fly on batches (``mjp eval --corruptions``).

Their errors compare models measured here with each other, never with published ImageNet-C or CIFAR-10-C numbers:
those come from the stored benchmark images (``mjp eval --imagenet-c`` / ``--cifar10-c``,
:mod:`mjp_fast.evaluate.imagenet_c`, :mod:`mjp_fast.evaluate.cifar10_c`), with the AlexNet-normalized mCE.

Nine corruptions in three families, five severities each, on ``[B, 3, H, W]`` float images in ``[0, 1]`` on any
device. The constants are those of the ImageNet-C code for images larger than 64 pixels (they were made for
224-pixel images) and those of its CIFAR-10-C variant for smaller ones (``scale="auto"``; force one with
``scale="imagenet"`` or ``"cifar"``):

| family | corruption | ImageNet-C, severity 1 .. 5 | CIFAR-10-C, severity 1 .. 5 |
|---|---|---|---|
| noise | gaussian_noise (std) | .08 .12 .18 .26 .38 | .04 .06 .08 .09 .10 |
| noise | shot_noise (Poisson, photons per unit) | 60 25 12 5 3 | 500 250 100 75 50 |
| noise | impulse_noise (salt-and-pepper fraction) | .03 .06 .09 .17 .27 | .01 .02 .03 .05 .07 |
| blur | defocus_blur (radius, blur) | (3,.1) (4,.5) (6,.5) (8,.5) (10,.5) | (.3,.4) (.4,.5) (.5,.6) (1,.2) (1.5,.1) |
| blur | motion_blur (radius, sigma) | (10,3) (15,5) (15,8) (15,12) (20,15) | (6,1) (6,1.5) (6,2) (8,2) (9,2.5) |
| blur | gaussian_blur (sigma) | 1 2 3 4 6 | .4 .6 .7 .8 1 |
| digital | contrast (factor around the channel mean) | .4 .3 .2 .1 .05 | .75 .5 .4 .3 .15 |
| digital | pixelate (side fraction, box down, nearest up) | .6 .5 .4 .3 .25 | .95 .9 .85 .75 .65 |
| digital | jpeg_compression (quality) | 25 18 15 10 7 | 80 65 58 50 40 |

The definitions follow ImageNet-C's: the defocus kernel is a disk on a 17x17 grid smoothed by a small Gaussian,
the motion kernel a one-sided Gaussian-weighted line at an angle drawn in [-45, 45] degrees, the Gaussian blur is
truncated at 4 sigma. Borders are reflected where ImageNet-C's libraries replicate or reflect them, so numbers are
comparable between models measured here, not digit for digit with published ImageNet-C tables (which are made
from the stored ImageNet-C images).

The ``imagecorruptions`` package (PyPI) implements the original set, image by image on the CPU with OpenCV and
NumPy; it was not used as a dependency because it pulls OpenCV and numba in and runs one NumPy image at a time,
where these run on the whole batch on the evaluation device.

Randomness comes from a ``torch.Generator`` the caller seeds, so every model is measured on the same corrupted
images.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from mjp_fast.evaluate.common_corruptions import relative_ce

SEVERITIES = (1, 2, 3, 4, 5)
SCALES = ("auto", "imagenet", "cifar")
CIFAR_MAX_SIZE = 64

CONSTANTS = {
    "imagenet": {
        "gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38),
        "shot_noise": (60.0, 25.0, 12.0, 5.0, 3.0),
        "impulse_noise": (0.03, 0.06, 0.09, 0.17, 0.27),
        "defocus_blur": ((3.0, 0.1), (4.0, 0.5), (6.0, 0.5), (8.0, 0.5), (10.0, 0.5)),
        "motion_blur": ((10, 3.0), (15, 5.0), (15, 8.0), (15, 12.0), (20, 15.0)),
        "gaussian_blur": (1.0, 2.0, 3.0, 4.0, 6.0),
        "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
        "pixelate": (0.6, 0.5, 0.4, 0.3, 0.25),
        "jpeg_compression": (25, 18, 15, 10, 7),
    },
    "cifar": {
        "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),
        "shot_noise": (500.0, 250.0, 100.0, 75.0, 50.0),
        "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),
        "defocus_blur": ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1.0, 0.2), (1.5, 0.1)),
        "motion_blur": ((6, 1.0), (6, 1.5), (6, 2.0), (8, 2.0), (9, 2.5)),
        "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),
        "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),
        "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),
        "jpeg_compression": (80, 65, 58, 50, 40),
    },
}


def constants_for(images: torch.Tensor, scale: str = "auto") -> dict:
    """The constant table for ``images``: CIFAR-10-C's up to 64 pixels, ImageNet-C's above (``scale="auto"``)."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
    if scale == "auto":
        scale = "cifar" if min(images.shape[-2:]) <= CIFAR_MAX_SIZE else "imagenet"
    return CONSTANTS[scale]


def _convolve(images: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """Depthwise 2D correlation with reflected borders; ``kernel`` ``[k, k]`` or ``[B, k, k]`` (one per image)."""
    batch, channels, height, width = images.shape
    size = kernel.shape[-1]
    pad = size // 2
    padded = images
    while pad > 0:  # reflect padding is limited to the image size: pad in steps
        step = min(pad, height - 1, width - 1)
        if step <= 0:
            padded = F.pad(padded, (pad, pad, pad, pad), mode="replicate")
            break
        padded = F.pad(padded, (step, step, step, step), mode="reflect")
        pad -= step
        height, width = padded.shape[-2:]
    if kernel.dim() == 2:
        weight = kernel.to(images).expand(channels, 1, size, size)
        return F.conv2d(padded, weight, groups=channels)
    weight = kernel.to(images).repeat_interleave(channels, dim=0).unsqueeze(1)  # [B*C, 1, k, k]
    folded = padded.reshape(1, batch * channels, *padded.shape[-2:])
    out = F.conv2d(folded, weight, groups=batch * channels)
    return out.reshape(batch, channels, *out.shape[-2:])


def gaussian_kernel(sigma: float, truncate: float = 4.0) -> torch.Tensor:
    """A normalized 2D Gaussian, radius ``int(truncate * sigma + 0.5)`` (scikit-image's ``gaussian``)."""
    reach = max(int(truncate * sigma + 0.5), 1)
    coordinates = torch.arange(-reach, reach + 1, dtype=torch.float64)
    line = torch.exp(-(coordinates**2) / (2 * max(sigma, 1e-6) ** 2))
    kernel = line.view(-1, 1) * line.view(1, -1)
    return (kernel / kernel.sum()).float()


def disk_kernel(radius: float, alias_blur: float = 0.1) -> torch.Tensor:
    """ImageNet-C's defocus kernel: a normalized disk on a 17x17 grid (wider for radii above 8), smoothed by a
    3x3 (5x5) Gaussian of sigma ``alias_blur``."""
    reach = 8 if radius <= 8 else int(math.ceil(radius))
    coordinates = torch.arange(-reach, reach + 1, dtype=torch.float64)
    disk = ((coordinates.view(-1, 1) ** 2 + coordinates.view(1, -1) ** 2) <= radius**2).double()
    disk = disk / disk.sum()
    smooth_reach = 1 if radius <= 8 else 2
    offsets = torch.arange(-smooth_reach, smooth_reach + 1, dtype=torch.float64)
    line = torch.exp(-(offsets**2) / (2 * max(alias_blur, 1e-6) ** 2))
    smooth = line.view(-1, 1) * line.view(1, -1)
    smooth = smooth / smooth.sum()
    blurred = F.conv2d(disk[None, None], smooth[None, None], padding=smooth_reach)[0, 0]
    return (blurred / blurred.sum()).float()


def motion_kernels(radius: int, sigma: float, angles_degrees: torch.Tensor) -> torch.Tensor:
    """``[B, k, k]``: ImageNet-C's motion blur as kernels, one per angle: ``2 * radius + 1`` taps along the angle,
    weighted by a Gaussian of ``sigma`` over the tap index, each kernel summing to 1."""
    width = 2 * int(radius) + 1
    taps = torch.arange(width, dtype=torch.float64)
    weights = torch.exp(-(taps**2) / (2 * max(sigma, 1e-6) ** 2))
    weights = weights / weights.sum()
    size = 2 * width + 1
    center = width
    kernels = torch.zeros(len(angles_degrees), size, size, dtype=torch.float64)
    for index, angle in enumerate(angles_degrees.tolist()):
        sin, cos = math.sin(math.radians(angle)), math.cos(math.radians(angle))
        for tap in range(width):
            shift_y = -math.ceil(tap * sin - 0.5)
            shift_x = -math.ceil(tap * cos - 0.5)
            # the blurred image adds the image shifted by (shift_y, shift_x): out[h, w] += k * x[h - dy, w - dx]
            kernels[index, center - shift_y, center - shift_x] += weights[tap]
    return (kernels / kernels.sum(dim=(1, 2), keepdim=True)).float()


def gaussian_noise(images: torch.Tensor, severity: int, generator: torch.Generator, scale: str = "auto"):
    std = constants_for(images, scale)["gaussian_noise"][severity - 1]
    noise = torch.randn(images.shape, generator=generator, device=images.device, dtype=images.dtype)
    return (images + std * noise).clamp(0, 1)


def shot_noise(images: torch.Tensor, severity: int, generator: torch.Generator, scale: str = "auto"):
    photons = constants_for(images, scale)["shot_noise"][severity - 1]
    return (torch.poisson(images * photons, generator=generator) / photons).clamp(0, 1)


def impulse_noise(images: torch.Tensor, severity: int, generator: torch.Generator, scale: str = "auto"):
    amount = constants_for(images, scale)["impulse_noise"][severity - 1]
    draw = torch.rand(images.shape, generator=generator, device=images.device, dtype=images.dtype)
    salt = torch.rand(images.shape, generator=generator, device=images.device, dtype=images.dtype) < 0.5
    return torch.where(draw < amount, salt.to(images.dtype), images)


def defocus_blur(images: torch.Tensor, severity: int, generator: torch.Generator, scale: str = "auto"):
    radius, alias_blur = constants_for(images, scale)["defocus_blur"][severity - 1]
    return _convolve(images, disk_kernel(radius, alias_blur)).clamp(0, 1)


def gaussian_blur(images: torch.Tensor, severity: int, generator: torch.Generator, scale: str = "auto"):
    sigma = constants_for(images, scale)["gaussian_blur"][severity - 1]
    return _convolve(images, gaussian_kernel(sigma)).clamp(0, 1)


def motion_blur(images: torch.Tensor, severity: int, generator: torch.Generator, scale: str = "auto"):
    radius, sigma = constants_for(images, scale)["motion_blur"][severity - 1]
    angles = torch.rand(images.shape[0], generator=generator, device=images.device) * 90 - 45
    return _convolve(images, motion_kernels(radius, sigma, angles.cpu())).clamp(0, 1)


def contrast(images: torch.Tensor, severity: int, generator: torch.Generator, scale: str = "auto"):
    factor = constants_for(images, scale)["contrast"][severity - 1]
    mean = images.mean(dim=(-2, -1), keepdim=True)
    return ((images - mean) * factor + mean).clamp(0, 1)


def pixelate(images: torch.Tensor, severity: int, generator: torch.Generator, scale: str = "auto"):
    height, width = images.shape[-2:]
    fraction = constants_for(images, scale)["pixelate"][severity - 1]
    small = (max(int(height * fraction), 1), max(int(width * fraction), 1))
    reduced = F.interpolate(images, size=small, mode="area")
    return F.interpolate(reduced, size=(height, width), mode="nearest")


def jpeg_compression(images: torch.Tensor, severity: int, generator: torch.Generator, scale: str = "auto"):
    quality = constants_for(images, scale)["jpeg_compression"][severity - 1]
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    decoded = []
    for picture in pixels:  # Pillow's encoder, as ImageNet-C
        buffer = io.BytesIO()
        Image.fromarray(picture).save(buffer, format="JPEG", quality=quality)
        buffer.seek(0)
        with Image.open(buffer) as image:
            decoded.append(torch.from_numpy(np.asarray(image.convert("RGB")).copy()))
    return torch.stack(decoded).permute(0, 3, 1, 2).to(images.device, images.dtype) / 255.0


CorruptionFunction = Callable[..., torch.Tensor]

CORRUPTIONS: dict[str, tuple[str, CorruptionFunction]] = {
    "gaussian_noise": ("noise", gaussian_noise),
    "shot_noise": ("noise", shot_noise),
    "impulse_noise": ("noise", impulse_noise),
    "defocus_blur": ("blur", defocus_blur),
    "motion_blur": ("blur", motion_blur),
    "gaussian_blur": ("blur", gaussian_blur),
    "contrast": ("digital", contrast),
    "pixelate": ("digital", pixelate),
    "jpeg_compression": ("digital", jpeg_compression),
}
FAMILIES = ("noise", "blur", "digital")


def resolve_corruptions(names: list[str] | tuple[str, ...]) -> list[str]:
    """Expands ``all`` and family names (noise, blur, digital); refuses unknown names."""
    chosen: list[str] = []
    for name in names:
        if name == "all":
            expanded = list(CORRUPTIONS)
        elif name in FAMILIES:
            expanded = [corruption for corruption, (family, _) in CORRUPTIONS.items() if family == name]
        elif name in CORRUPTIONS:
            expanded = [name]
        else:
            known = ", ".join(["all", *FAMILIES, *CORRUPTIONS])
            raise ValueError(f"unknown corruption {name!r}; known: {known}")
        chosen.extend(corruption for corruption in expanded if corruption not in chosen)
    return chosen


def corrupt(
    images: torch.Tensor, name: str, severity: int, generator: torch.Generator, scale: str = "auto"
) -> torch.Tensor:
    """``images`` ``[B, 3, H, W]`` in [0, 1] with corruption ``name`` at ``severity`` (1..5); ``scale``: which
    constant table (``auto``: by image size)."""
    if name not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {name!r}; known: {', '.join(CORRUPTIONS)}")
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be in 1..5, got {severity}")
    return CORRUPTIONS[name][1](images, severity, generator, scale)


def corruption_errors(
    model_errors: dict[str, list[float]], baseline_errors: dict[str, list[float]]
) -> dict[str, dict[str, float | None] | float | None]:
    """The proxy's corruption error against a baseline, as ImageNet-C's CE with the baseline in AlexNet's place:
    for each corruption, ``100 * sum_s E_model / sum_s E_baseline`` over the severities
    (:func:`~mjp_fast.evaluate.common_corruptions.relative_ce`); mCE is their mean.

    Args:
        model_errors, baseline_errors: corruption -> top-1 error (percent) at each severity.

    Returns:
        ``{"ce": {corruption: CE}, "mce": mean CE}``; a corruption on which the baseline makes no error at all has
        no CE (None) and is left out of the mean (None when no corruption has one).
    """
    ce = {name: relative_ce(errors, baseline_errors[name]) for name, errors in model_errors.items()}
    defined = [value for value in ce.values() if value is not None]
    return {"ce": ce, "mce": sum(defined) / len(defined) if defined else None}
