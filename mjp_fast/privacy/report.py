"""The privacy report: a Markdown table, a JSON object and a PNG grid of the reconstructions."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from mjp_fast.privacy.metrics import HIGHER_IS_PRIVATE, METRICS
from mjp_fast.privacy.settings import SETTING_DESCRIPTIONS, SETTINGS, ImageAttack

COLUMN_TITLES = {"mse": "MSE", "psnr": "PSNR (dB)", "ssim": "SSIM", "fft2d": "FFT2D", "lpips": "LPIPS"}
GRID_COLUMNS = (
    ("original", "x"),
    ("jigsawed", "x~ (jigsawed)"),
    ("plain", "from grad(x)"),
    ("unk", "from grad(x~), UNK"),
    ("no_unk", "from grad(x~), no UNK"),
)
GAP = 6
CAPTION_HEIGHT = 14
BACKGROUND = (255, 255, 255)
TEXT_COLOR = (20, 20, 20)
OUTLINE_COLOR = (255, 0, 255)


def _format(metric: str, value: float) -> str:
    if math.isnan(value):
        return "nan"
    return f"{value:.2f}" if metric == "psnr" else f"{value:.4f}"


def markdown_table(summary: Mapping[str, Mapping[str, float]], *, title: str | None = None) -> str:
    """One row per setting, one column per metric (means over images), arrows pointing to "more private"."""
    metrics = [metric for metric in METRICS if any(metric in row for row in summary.values())]
    arrows = {metric: "↑" if HIGHER_IS_PRIVATE[metric] else "↓" for metric in metrics}
    header = ["setting", "what", *(f"{COLUMN_TITLES[m]} {arrows[m]}" for m in metrics)]
    lines = [] if title is None else [title, ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---" for _ in header) + "|")
    for setting in [s for s in SETTINGS if s in summary] + [s for s in summary if s not in SETTINGS]:
        row = summary[setting]
        cells = [f"`{setting}`", SETTING_DESCRIPTIONS.get(setting, "")]
        cells += [_format(metric, row[metric]) if metric in row else "" for metric in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Arrows point to more privacy (a worse reconstruction). Means over images; PSNR per image, then averaged."
    )
    return "\n".join(lines) + "\n"


def write_json(summary: Mapping[str, Mapping[str, float]], path: str | Path) -> None:
    """Writes ``{setting: {metric: mean}}`` as JSON (non-finite values as null)."""
    clean = {
        setting: {metric: (value if math.isfinite(value) else None) for metric, value in row.items()}
        for setting, row in summary.items()
    }
    Path(path).write_text(json.dumps(clean, indent=2) + "\n")


def _to_pixels(image: torch.Tensor, scale: int) -> Image.Image:
    array = (image.detach().double().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
    picture = Image.fromarray(array)
    return picture.resize((picture.width * scale, picture.height * scale), Image.Resampling.NEAREST)


def save_grid(attacks: Sequence[ImageAttack], path: str | Path, *, patch_size: int, scale: int = 2) -> Path:
    """One row per image: the original, the jigsawed image (masked patches outlined), each reconstruction.

    Columns are ``max(panel width, widest caption)`` wide, panels at their left edge.

    Args:
        attacks: from :func:`~mjp_fast.privacy.settings.run_settings`.
        path: the PNG to write.
        patch_size: to outline the masked patches.
        scale: each pixel becomes ``scale x scale`` pixels.
    """
    if not attacks:
        raise ValueError("attacks is empty: nothing to draw")
    channels, height, width = attacks[0].original.shape
    panel_w, panel_h = width * scale, height * scale
    font = ImageFont.load_default()
    # A column is as wide as its panel or the widest caption, whichever is wider: at CIFAR's 32 px the captions
    # are wider than the panels and would run into one another.
    caption_w = max(math.ceil(font.getlength(title)) for _, title in GRID_COLUMNS)
    column_w = max(panel_w, caption_w)
    columns = len(GRID_COLUMNS)
    canvas = Image.new(
        "RGB",
        (GAP + columns * (column_w + GAP), CAPTION_HEIGHT + GAP + len(attacks) * (panel_h + GAP)),
        BACKGROUND,
    )
    draw = ImageDraw.Draw(canvas)
    for column, (_, title) in enumerate(GRID_COLUMNS):
        draw.text((GAP + column * (column_w + GAP), 2), title, fill=TEXT_COLOR, font=font)
    cols = width // patch_size
    for row, attack in enumerate(attacks):
        top = CAPTION_HEIGHT + GAP + row * (panel_h + GAP)
        for column, (key, _) in enumerate(GRID_COLUMNS):
            image = attack.reference(key) if key in ("original", "jigsawed") else attack.reconstructions[key]
            left = GAP + column * (column_w + GAP)
            canvas.paste(_to_pixels(image, scale), (left, top))
            if key == "jigsawed":
                step = patch_size * scale
                for position in torch.nonzero(attack.mask).flatten().tolist():
                    y, x = divmod(position, cols)
                    box = (left + x * step, top + y * step, left + (x + 1) * step - 1, top + (y + 1) * step - 1)
                    draw.rectangle(box, outline=OUTLINE_COLOR)
    path = Path(path)
    canvas.save(path, format="PNG")
    return path
