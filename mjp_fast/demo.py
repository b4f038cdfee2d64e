"""``mjp demo``: a real photo beside jigsawed copies of itself, one per mask ratio, in one PNG.

Each jigsaw is sampled with :func:`mjp_fast.sample_jigsaw` (one call per ratio, batch 1, so every panel depends on
``seed`` and its own ratio only) and applied with :func:`mjp_fast.jigsaw_images`. The masked positions, whose
patches were shuffled among themselves, are outlined; a caption under each panel gives the ratio and the number
of masked patches.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from mjp_fast import backend as backend_module
from mjp_fast._atomic import write_atomically
from mjp_fast.ops import jigsaw_images
from mjp_fast.sampler import sample_jigsaw

# Photos that scikit-image ships inside its package: no download needed.
BUILTIN_IMAGES = ("astronaut", "chelsea", "coffee", "rocket")

GAP = 8  # pixels around and between panels
BACKGROUND = (255, 255, 255)
TEXT_COLOR = (20, 20, 20)
OUTLINE_COLOR = (255, 0, 255)  # magenta: rare in photos, visible on white, black and skin tones alike


@dataclass(frozen=True)
class JigsawPanel:
    """One jigsawed copy of the picture.

    Attributes:
        ratio: the mask ratio asked for.
        target: ``floor(ratio * N)``, the number of positions the sampler aims at.
        masked: the number of masked positions (may be below ``target``, as in BEiT's sampler).
        moved: masked positions that show another patch than their own (a shuffle can leave some in place).
        pixels: uint8 ``[S, S, 3]``, the jigsawed picture.
        mask: bool ``[rows, cols]``.
    """

    ratio: float
    target: int
    masked: int
    moved: int
    pixels: np.ndarray
    mask: np.ndarray

    @property
    def num_positions(self) -> int:
        return self.mask.size

    def summary(self) -> str:
        return (
            f"ratio {self.ratio:g}: {self.masked} of {self.num_positions} patches masked "
            f"(target {self.target}), {self.moved} moved"
        )


def check_geometry(size: int, patch_size: int) -> None:
    """``size`` and ``patch_size`` are positive ints and ``size`` is a multiple of ``patch_size``."""
    for name, value in (("size", size), ("patch_size", patch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if size % patch_size:
        raise ValueError(f"size must be a multiple of patch_size: got size {size} and patch_size {patch_size}")


def load_picture(source: str, size: int) -> np.ndarray:
    """Loads a built-in scikit-image photo by name, or an image file, as a centered square of ``size`` pixels.

    Args:
        source: one of :data:`BUILTIN_IMAGES`, or a path to any image file Pillow reads.
        size: the side of the result in pixels.

    Returns:
        uint8 ``[size, size, 3]`` RGB.
    """
    if source in BUILTIN_IMAGES:
        import skimage.data

        picture = Image.fromarray(getattr(skimage.data, source)())
    else:
        path = Path(source)
        if not path.is_file():
            names = ", ".join(BUILTIN_IMAGES)
            raise ValueError(f"image must be one of {names} or a path to an image file; {source!r} is neither")
        try:
            with Image.open(path) as opened:
                picture = opened.convert("RGB")
        except OSError as error:
            raise ValueError(f"image: cannot read {source!r} as a picture ({error})") from None
    picture = picture.convert("RGB")
    side = min(picture.size)
    if side < 1:
        raise ValueError(f"image: {source!r} is empty ({picture.size[0]}x{picture.size[1]} pixels)")
    left, top = (picture.width - side) // 2, (picture.height - side) // 2
    picture = picture.crop((left, top, left + side, top + side))
    picture = picture.resize((size, size), Image.Resampling.LANCZOS)
    return np.asarray(picture, dtype=np.uint8)


def jigsaw_panels(
    picture: np.ndarray,
    ratios: Sequence[float],
    *,
    patch_size: int = 16,
    seed: int = 0,
    backend: str | None = None,
) -> list[JigsawPanel]:
    """Samples and applies one jigsaw per ratio.

    Args:
        picture: uint8 ``[S, S, 3]`` with ``S`` a multiple of ``patch_size``.
        ratios: mask ratios in [0, 1].
        patch_size: the side of a patch in pixels.
        seed: the sampler's seed; every panel uses stream 0, so adding a ratio does not change the others.
        backend: the sampler's, ``torch``, ``cpu`` or ``cuda`` (default: the fastest available on the CPU).

    Returns:
        One :class:`JigsawPanel` per ratio, in order.
    """
    size = picture.shape[0]
    if picture.ndim != 3 or picture.shape[1] != size or picture.shape[2] != 3 or picture.dtype != np.uint8:
        raise ValueError(f"picture must be uint8 [S, S, 3], got {picture.dtype} {list(picture.shape)}")
    check_geometry(size, patch_size)
    grid = size // patch_size
    images = torch.tensor(picture).permute(2, 0, 1)[None]  # [1, 3, S, S] uint8, a copy: PIL arrays are read-only
    panels = []
    for ratio in ratios:
        jigsaw = sample_jigsaw(1, grid, ratio, seed=seed, backend=backend)
        shuffled = jigsaw_images(images, jigsaw, patch_size)
        mask, perm = jigsaw.mask[0], jigsaw.perm[0]
        moved = int((perm != torch.arange(perm.numel())).sum())
        panels.append(
            JigsawPanel(
                ratio=float(ratio),
                target=math.floor(float(ratio) * grid * grid),
                masked=int(mask.sum()),
                moved=moved,
                pixels=shuffled[0].permute(1, 2, 0).contiguous().numpy(),
                mask=mask.reshape(grid, grid).numpy(),
            )
        )
    return panels


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has one fixed bitmap font
        return ImageFont.load_default()


def _fitting_font(lines: list[str], width: int, size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """The largest font, at most ``size`` pixels, in which every line fits in ``width`` pixels."""
    while True:
        font = _font(size)
        if size <= 6 or all(font.getlength(line) <= width for line in lines):
            return font
        size -= 1


def caption_height(size: int) -> int:
    """Pixels under each panel for its two caption lines."""
    return 2 * _line_height(size) + GAP


def _line_height(size: int) -> int:
    return max(8, min(18, size // 14)) + 4


def demo_canvas_size(size: int, num_ratios: int) -> tuple[int, int]:
    """Width and height in pixels of the demo image for ``num_ratios`` jigsaws of ``size`` pixels."""
    panels = 1 + num_ratios
    return panels * size + (panels + 1) * GAP, GAP + size + caption_height(size)


def _outline_masked(draw: ImageDraw.ImageDraw, mask: np.ndarray, x0: int, patch_size: int) -> None:
    width = max(1, patch_size // 16)
    for row, col in zip(*np.nonzero(mask), strict=True):
        left, top = x0 + int(col) * patch_size, GAP + int(row) * patch_size
        right, bottom = left + patch_size - 1, top + patch_size - 1
        draw.rectangle((left, top, right, bottom), outline=OUTLINE_COLOR, width=width)


def render_demo(picture: np.ndarray, panels: list[JigsawPanel], patch_size: int) -> Image.Image:
    """Lays out the original and the jigsawed panels in a row, masked patches outlined, captions underneath."""
    size = picture.shape[0]
    grid = size // patch_size
    canvas = Image.new("RGB", demo_canvas_size(size, len(panels)), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    captions = [("original", f"{grid}x{grid} patches of {patch_size}px")]
    captions += [(f"ratio {panel.ratio:g}", f"{panel.masked}/{panel.num_positions} masked") for panel in panels]
    font = _fitting_font([line for caption in captions for line in caption], size, _line_height(size) - 4)
    tiles = [picture] + [panel.pixels for panel in panels]
    for index, (tile, caption) in enumerate(zip(tiles, captions, strict=True)):
        x0 = GAP + index * (size + GAP)
        canvas.paste(Image.fromarray(tile), (x0, GAP))
        if index > 0:
            _outline_masked(draw, panels[index - 1].mask, x0, patch_size)
        for line_index, line in enumerate(caption):
            y = GAP + size + GAP // 2 + line_index * _line_height(size)
            draw.text((x0 + size / 2, y), line, fill=TEXT_COLOR, font=font, anchor="ma")
    return canvas


def save_png_atomically(image: Image.Image, path: Path) -> None:
    """Writes ``image`` as PNG to a temporary file beside ``path``, then renames it: no half-written file.

    The file gets the permissions of a plain write (see :func:`mjp_fast._atomic.write_atomically`).
    """
    with write_atomically(path) as stream:
        image.save(stream, format="PNG")


def run_demo(args: argparse.Namespace) -> int:
    """Runs ``mjp demo`` with parsed arguments (see :mod:`mjp_fast.cli`); prints the output path and a summary.

    Raises:
        ValueError: an argument that cannot work (unknown image, size not a multiple of the patch size,
            unavailable backend, output not a .png file).
    """
    out = Path(args.png)
    if out.suffix.lower() != ".png":
        raise ValueError(f"--png must be a .png path, got {str(out)!r}")
    check_geometry(args.size, args.patch_size)
    chosen = backend_module.resolve_backend(args.backend, torch.device("cpu"))
    picture = load_picture(args.image, args.size)
    panels = jigsaw_panels(picture, list(args.ratios), patch_size=args.patch_size, seed=args.seed, backend=chosen)
    canvas = render_demo(picture, panels, args.patch_size)
    save_png_atomically(canvas, out)
    grid = args.size // args.patch_size
    print(f"wrote {out} ({canvas.width}x{canvas.height} pixels)")
    print(
        f"image {args.image}, {args.size}x{args.size} pixels, {grid}x{grid} patches, seed {args.seed}, backend {chosen}"
    )
    for panel in panels:
        print(f"  {panel.summary()}")
    return 0
