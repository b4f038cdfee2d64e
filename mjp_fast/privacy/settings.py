"""The paper's privacy settings, run on a batch of client images, one image (one client update) at a time.

Every image ``x`` gets one jigsaw (mask and permutation) from :func:`mjp_fast.sample_jigsaw`; ``x~`` is ``x``
jigsawed in pixel space. Three client updates are attacked per image, and each reconstruction is compared with
one or two references:

=============  =================================================  ==============
setting        gradients attacked                                 compared with
=============  =================================================  ==============
``a``          of ``x``                                           ``x``
``b``          of ``x~``, masked positions given ``unk_embed``    ``x~``
``c``          of ``x~``, masked positions given ``unk_embed``    ``x``
``no_unk_b``   of ``x~``, ``pos_embed`` everywhere (ablation)     ``x~``
``no_unk_c``   of ``x~``, ``pos_embed`` everywhere (ablation)     ``x``
=============  =================================================  ==============
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mjp_fast.ops import jigsaw_images
from mjp_fast.privacy.metrics import METRICS, reconstruction_metrics
from mjp_fast.privacy.model import PrivacyViT, client_gradients
from mjp_fast.sampler import Jigsaw, sample_jigsaw

SETTINGS = ("a", "b", "c", "no_unk_b", "no_unk_c")
SETTING_DESCRIPTIONS = {
    "a": "gradients of x, compared with x",
    "b": "gradients of jigsawed x~ with UNK, compared with x~",
    "c": "gradients of jigsawed x~ with UNK, compared with x",
    "no_unk_b": "gradients of x~ shuffled without UNK, compared with x~",
    "no_unk_c": "gradients of x~ shuffled without UNK, compared with x",
}
# setting -> (which client update was attacked, which reference it is compared with)
SETTING_SOURCES = {
    "a": ("plain", "original"),
    "b": ("unk", "jigsawed"),
    "c": ("unk", "original"),
    "no_unk_b": ("no_unk", "jigsawed"),
    "no_unk_c": ("no_unk", "original"),
}
UPDATES = ("plain", "unk", "no_unk")

# Photos shipped inside scikit-image's wheel (no download): name -> loader.
SAMPLE_PHOTOS: dict[str, Callable[[], np.ndarray]] = {
    "astronaut": lambda: _skimage("astronaut"),
    "camera": lambda: _skimage("camera"),
    "chelsea": lambda: _skimage("chelsea"),
    "coffee": lambda: _skimage("coffee"),
    "hubble_deep_field": lambda: _skimage("hubble_deep_field"),
    "immunohistochemistry": lambda: _skimage("immunohistochemistry"),
    "motorcycle": lambda: _skimage("stereo_motorcycle")[0],
    "rocket": lambda: _skimage("rocket"),
}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm")


def _skimage(name: str):
    import skimage.data

    return getattr(skimage.data, name)()


def square_picture(picture: Image.Image | np.ndarray, size: int) -> torch.Tensor:
    """The centred square of a picture, resized (Lanczos) to ``size``: float64 ``[3, size, size]`` in [0, 1]."""
    if isinstance(picture, np.ndarray):
        picture = Image.fromarray(picture)
    picture = picture.convert("RGB")
    side = min(picture.size)
    left, top = (picture.width - side) // 2, (picture.height - side) // 2
    picture = picture.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.LANCZOS)
    return torch.from_numpy(np.asarray(picture, dtype=np.float64) / 255).permute(2, 0, 1).contiguous()


def load_images(
    directory: str | Path | None = None, size: int = 64, max_images: int | None = None
) -> tuple[list[str], torch.Tensor]:
    """Client images: the image files of ``directory`` (sorted by name), or scikit-image's sample photos.

    Returns:
        The names and float64 ``[B, 3, size, size]`` in [0, 1].
    """
    if directory is None:
        names = list(SAMPLE_PHOTOS)[:max_images]
        pictures = [square_picture(SAMPLE_PHOTOS[name](), size) for name in names]
    else:
        folder = Path(directory)
        if not folder.is_dir():
            raise ValueError(f"images: {str(directory)!r} is not a folder")
        files = sorted(path for path in folder.iterdir() if path.suffix.lower() in IMAGE_SUFFIXES)[:max_images]
        if not files:
            raise ValueError(f"images: no image files ({', '.join(IMAGE_SUFFIXES)}) in {str(directory)!r}")
        names, pictures = [], []
        for path in files:
            try:
                with Image.open(path) as opened:
                    pictures.append(square_picture(opened, size))
            except OSError as error:
                raise ValueError(f"images: cannot read {str(path)!r} as a picture ({error})") from None
            names.append(path.stem)
    return names, torch.stack(pictures)


@dataclass
class ImageAttack:
    """One client image and what the attack recovered from each of its updates.

    Attributes:
        name: the image's name.
        original: ``x [C, H, W]`` in [0, 1].
        jigsawed: ``x~ [C, H, W]``.
        mask: bool ``[N]``, the masked (shuffled) positions.
        reconstructions: ``{"plain" | "unk" | "no_unk": [C, H, W]}``, clipped to [0, 1].
        seconds: ``{update: seconds}`` spent computing that update's gradients and attacking them.
    """

    name: str
    original: torch.Tensor
    jigsawed: torch.Tensor
    mask: torch.Tensor
    reconstructions: dict[str, torch.Tensor]
    seconds: dict[str, float]

    def reference(self, which: str) -> torch.Tensor:
        return self.original if which == "original" else self.jigsawed


Attack = Callable[[PrivacyViT, Mapping[str, torch.Tensor]], torch.Tensor]


def run_settings(
    model: PrivacyViT,
    images: torch.Tensor,
    attack: Attack,
    *,
    ratio: float = 0.5,
    seed: int = 0,
    names: Sequence[str] | None = None,
    labels: Sequence[int] | None = None,
    jigsaw: Jigsaw | None = None,
) -> list[ImageAttack]:
    """Attacks the three client updates of every image.

    Args:
        model: the client's model; its dtype is the gradients' dtype (float64 for the analytic attack).
        images: ``[B, C, H, W]`` in [0, 1].
        attack: ``attack(model, gradients) -> [1, C, H, W]``, e.g. :func:`~mjp_fast.privacy.april.april_attack`.
        ratio: the jigsaw ratio.
        seed: the jigsaw sampler's seed (image ``i`` uses stream ``i``).
        names: one name per image (default ``image0``, ...).
        labels: each image's class (default ``i mod num_classes``).
        jigsaw: use this ``Jigsaw`` ``[B, N]`` instead of sampling one.
    """
    batch = images.shape[0]
    names = list(names) if names is not None else [f"image{i}" for i in range(batch)]
    num_classes = model.head.out_features
    labels = list(labels) if labels is not None else [i % num_classes for i in range(batch)]
    if len(names) != batch or len(labels) != batch:
        raise ValueError(f"names and labels must have one entry per image ({batch})")
    if jigsaw is None:
        jigsaw = sample_jigsaw(batch, model.grid_size, ratio, seed=seed)
    shuffled = jigsaw_images(images, jigsaw, model.patch_size)
    results = []
    for index in range(batch):
        image = images[index : index + 1]
        single = Jigsaw(jigsaw.mask[index : index + 1], jigsaw.perm[index : index + 1])
        updates = {"plain": (None, True), "unk": (single, True), "no_unk": (single, False)}
        reconstructions, seconds = {}, {}
        for update, (client_jigsaw, use_unk) in updates.items():
            start = time.perf_counter()
            gradients = client_gradients(model, image, labels[index], client_jigsaw, use_unk=use_unk)
            recovered = attack(model, gradients)
            seconds[update] = time.perf_counter() - start
            reconstructions[update] = recovered.detach().reshape(image.shape[1:]).double().clamp(0, 1).cpu()
        results.append(
            ImageAttack(
                names[index],
                image[0].double().cpu(),
                shuffled[index].double().cpu(),
                jigsaw.mask[index].cpu(),
                reconstructions,
                seconds,
            )
        )
    return results


def setting_metrics(
    attacks: Sequence[ImageAttack], metrics: tuple[str, ...] = METRICS
) -> dict[str, dict[str, torch.Tensor]]:
    """``{setting: {metric: [B] per-image values}}`` for the five settings."""
    table = {}
    for setting, (update, reference) in SETTING_SOURCES.items():
        recovered = torch.stack([attack.reconstructions[update] for attack in attacks])
        references = torch.stack([attack.reference(reference) for attack in attacks])
        table[setting] = reconstruction_metrics(recovered, references, metrics)
    return table


def summarize(per_image: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, dict[str, float]]:
    """The mean over images of every metric of every setting."""
    return {
        setting: {metric: float(values.mean()) for metric, values in metrics.items()}
        for setting, metrics in per_image.items()
    }
