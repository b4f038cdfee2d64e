"""timm's auto-augment policies made safe on every Pillow the package allows.

timm's ``PosterizeIncreasing`` (RandAugment's ``inc1`` policies, the DeiT recipe's ``rand-m9-mstd0.5-inc1``) maps
magnitude 10 to "keep 0 bits", and with ``magnitude_max`` above 10 to fewer than 0. Magnitudes are drawn from a
normal distribution around 9 (std 0.5) and clipped to 10, so about one call in 2,000 asks for 0 bits. Pillow up
to 12.2 kept 0 bits by masking every bit (a black image); Pillow 13.0 raises ``ValueError: bits must be between
or equal to 1 and 8``, which kills a data-loader worker and the training run with it.

:func:`pillow_safe` walks a transform built by timm and gives each posterize operation :func:`posterize`, which
keeps Pillow's own result for 1 to 8 bits and the old black image for 0 bits or fewer: the augmentation DeiT and
the paper trained with. Nothing in timm is modified globally; only the transform passed in changes.
"""

from __future__ import annotations

from typing import Any

from PIL import Image, ImageOps
from timm.data import auto_augment

# The function timm's AugmentOp calls for Posterize, PosterizeIncreasing and PosterizeOriginal.
_TIMM_POSTERIZE = auto_augment.posterize
# Where timm keeps sub-transforms: Compose.transforms, RandAugment.ops / AugMixAugment.ops (AugmentOp lists),
# AutoAugment.policy (a list of sub-policies, each a list of AugmentOp).
_CHILD_ATTRIBUTES = ("transforms", "ops", "policy")


def posterize(image: Image.Image, bits_to_keep: int, **_: Any) -> Image.Image:
    """Keeps the ``bits_to_keep`` most significant bits of every channel of ``image``.

    Args:
        image: an ``L``, ``RGB`` or ``P`` image (what Pillow's posterize accepts).
        bits_to_keep: any integer. 8 or more returns ``image``; 1 to 7 is ``PIL.ImageOps.posterize``; 0 or fewer
            masks every bit (every channel becomes 0), as Pillow did before it began to refuse such values.
        _: the fill colour and resampling keywords timm passes to every operation (unused here).
    """
    bits = int(bits_to_keep)
    if bits >= 8:
        return image
    if bits >= 1:
        return ImageOps.posterize(image, bits)
    if image.mode in ("L", "RGB"):
        return image.point([0] * (256 * len(image.getbands())))
    if image.mode == "P":
        # Pillow posterizes a palette image through its palette: masking every bit blackens every entry.
        black = image.copy()
        black.putpalette([0] * 768)
        return black
    raise ValueError(f"image: posterize takes L, RGB or P images, got mode {image.mode!r}")


def augment_ops(transform: Any) -> list[auto_augment.AugmentOp]:
    """Every timm ``AugmentOp`` inside ``transform``, each once, in the order the transform holds them.

    Args:
        transform: a transform from ``timm.data.create_transform`` (a torchvision ``Compose`` holding timm's
            ``RandAugment``, ``AutoAugment`` or ``AugMixAugment``), or any of those alone.
    """
    found: list[auto_augment.AugmentOp] = []
    seen: set[int] = set()
    pending = [transform]
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, (list, tuple)):
            pending.extend(reversed(node))
            continue
        if isinstance(node, auto_augment.AugmentOp):
            found.append(node)
        for name in _CHILD_ATTRIBUTES:
            child = getattr(node, name, None)
            if isinstance(child, (list, tuple)):
                pending.append(child)
    return found


def pillow_safe(transform: Any) -> Any:
    """Replaces timm's posterize by :func:`posterize` in every auto-augment operation inside ``transform``.

    Args:
        transform: as :func:`augment_ops`.

    Returns:
        ``transform`` itself, changed in place (for chaining). Applying it twice changes nothing more.
    """
    for op in augment_ops(transform):
        if op.aug_fn is _TIMM_POSTERIZE:
            op.aug_fn = posterize
    return transform


__all__ = ["augment_ops", "pillow_safe", "posterize"]
