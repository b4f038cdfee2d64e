"""The jigsaw in pixel space: move whole patches of the image as a jigsaw says.

``out[b, :, patch n] = images[b, :, patch perm[b, n]]``: the picture that ``mjp_patch_embed`` embeds without
ever making it. For showing jigsaws, for models without absolute position embeddings (CNNs, Swin), and for the
privacy evaluation's settings.
"""

from __future__ import annotations

import torch

from mjp_fast._validate import check_int, check_tensor
from mjp_fast.ops.permute import permute_rows
from mjp_fast.sampler.jigsaw import Jigsaw, check_jigsaw


def _check_args(images: object, jigsaw: object, patch_size: object, *, validate: bool) -> tuple[int, int, Jigsaw]:
    images = check_tensor("images", images, ndims=(4,))
    patch_size = check_int("patch_size", patch_size, minimum=1)
    _, _, height, width = images.shape
    if height % patch_size or width % patch_size:
        raise ValueError(f"images: height {height} and width {width} must be multiples of patch_size {patch_size}")
    rows, cols = height // patch_size, width // patch_size
    if jigsaw is None:
        raise TypeError("jigsaw must be a Jigsaw(mask, perm), got None")
    jigsaw = check_jigsaw(jigsaw, images.shape[0], rows * cols, images.device, validate=validate)
    return rows, cols, jigsaw


def jigsaw_images_ref(images: torch.Tensor, jigsaw: Jigsaw, patch_size: int) -> torch.Tensor:
    """Oracle: cut the image into ``[B, N, C, P, P]`` patches, gather them, glue them back.

    The contract of :func:`jigsaw_images` with ``validate=False`` (no check of the perm's values): a ``perm`` entry
    outside ``[0, N)`` gives a zero patch and sends no gradient back (:mod:`mjp_fast._validate`).

    Args:
        images: ``[B, C, H, W]`` of any dtype; jigsaw ``Jigsaw(mask [B, N], perm [B, N])``; ``H``, ``W``
            multiples of ``patch_size``.

    Returns:
        ``[B, C, H, W]``, the jigsawed images.
    """
    rows, cols, jigsaw = _check_args(images, jigsaw, patch_size, validate=False)
    batch, channels, height, width = images.shape
    patch, num_positions = patch_size, rows * cols
    patches = images.reshape(batch, channels, rows, patch, cols, patch).permute(0, 2, 4, 1, 3, 5)
    patches = patches.reshape(batch, num_positions, channels, patch, patch)
    in_range = ((jigsaw.perm >= 0) & (jigsaw.perm < num_positions)).reshape(batch, num_positions, 1, 1, 1)
    # gather refuses an index outside [0, N): such an entry reads patch 0 here, and its patch is zeroed below.
    index = torch.where(in_range, jigsaw.perm.reshape(in_range.shape), 0).expand_as(patches)
    gathered = patches.gather(1, index)
    shuffled = torch.where(in_range, gathered, torch.zeros((), dtype=images.dtype, device=images.device))
    shuffled = shuffled.reshape(batch, rows, cols, channels, patch, patch)
    return shuffled.permute(0, 3, 1, 4, 2, 5).reshape(batch, channels, height, width)


def _jigsaw_images_torch(images: torch.Tensor, perm: torch.Tensor, rows: int, cols: int, patch: int) -> torch.Tensor:
    batch, channels, height, width = images.shape
    patches = images.reshape(batch, channels, rows, patch, cols, patch).permute(0, 2, 4, 1, 3, 5)
    patches = patches.reshape(batch, rows * cols, channels * patch * patch)
    shuffled = permute_rows(patches, perm).reshape(batch, rows, cols, channels, patch, patch)
    return shuffled.permute(0, 3, 1, 4, 2, 5).reshape(batch, channels, height, width)


def jigsaw_images(
    images: torch.Tensor,
    jigsaw: Jigsaw,
    patch_size: int,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Applies a jigsaw to images in pixel space.

    Pure data movement, one ``index_select`` of whole patches on any device: there is no kernel to choose, so
    unlike the other operations it takes no ``backend``.

    Args:
        images: ``[B, C, H, W]`` of any dtype (uint8 pictures too); ``H`` and ``W`` multiples of ``patch_size``.
        jigsaw: ``Jigsaw(mask [B, N], perm [B, N])`` for the grid ``(H / patch_size, W / patch_size)``.
        patch_size: P.
        validate: check that ``jigsaw.perm`` permutes exactly the masked positions (a host sync on a GPU). Without
            the check, an out-of-range entry gives a zero patch and the gradient is the gather's, never another
            sample's pixels: :mod:`mjp_fast._validate` says what ``validate=False`` guarantees.

    Returns:
        ``[B, C, H, W]``: patch ``n`` of the result is patch ``perm[b, n]`` of the input. Differentiable.
    """
    rows, cols, jigsaw = _check_args(images, jigsaw, patch_size, validate=validate)
    return _jigsaw_images_torch(images, jigsaw.perm, rows, cols, patch_size)
