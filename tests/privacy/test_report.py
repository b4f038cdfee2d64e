"""Settings runner, table, JSON and grid (``mjp attack`` end to end: test_cli.py)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from mjp_fast.privacy import METRICS, SETTINGS, april_attack, markdown_table, run_settings, save_grid, write_json
from mjp_fast.privacy.report import CAPTION_HEIGHT, GAP, GRID_COLUMNS
from mjp_fast.privacy.settings import SAMPLE_PHOTOS, load_images


@pytest.fixture(scope="module")
def two_attacks(attack_model, photos):
    names, images = photos
    return run_settings(attack_model, images[:2], april_attack, ratio=0.5, seed=0, names=names[:2])


def test_table_json_and_grid(two_attacks, tmp_path):
    from mjp_fast.privacy import setting_metrics, summarize

    summary = summarize(setting_metrics(two_attacks))
    assert list(summary) == list(SETTINGS)
    table = markdown_table(summary, title="t")
    for setting in SETTINGS:
        assert f"| `{setting}` |" in table
    assert "PSNR (dB) ↓" in table and "LPIPS ↑" in table
    write_json(summary, tmp_path / "out.json")
    loaded = json.loads((tmp_path / "out.json").read_text())
    assert set(loaded) == set(SETTINGS)
    assert loaded["b"]["psnr"] == pytest.approx(summary["b"]["psnr"])
    assert all(set(row) == set(METRICS) for row in loaded.values())
    path = save_grid(two_attacks, tmp_path / "grid.png", patch_size=8, scale=2)
    with Image.open(path) as grid:
        assert grid.size == (GAP + len(GRID_COLUMNS) * (128 + GAP), CAPTION_HEIGHT + GAP + 2 * (128 + GAP))
        pixels = torch.from_numpy(np.array(grid.convert("RGB"))).permute(2, 0, 1).double() / 255
    top, left = CAPTION_HEIGHT + GAP, GAP
    original = pixels[:, top : top + 128 : 2, left : left + 128 : 2]
    torch.testing.assert_close(original, two_attacks[0].original, rtol=0, atol=0.5 / 255 + 1e-9)


def test_run_settings_uses_one_jigsaw_per_image(two_attacks):
    first, second = two_attacks
    assert not torch.equal(first.mask, second.mask)
    assert set(first.reconstructions) == {"plain", "unk", "no_unk"}
    assert all(seconds > 0 for seconds in first.seconds.values())


def test_load_images(tmp_path):
    names, images = load_images(None, 64, max_images=2)
    assert names == list(SAMPLE_PHOTOS)[:2] and images.shape == (2, 3, 64, 64)
    assert images.dtype == torch.float64 and 0 <= float(images.min()) and float(images.max()) <= 1
    with pytest.raises(ValueError, match="no image files"):
        load_images(tmp_path)
    with pytest.raises(ValueError, match="not a folder"):
        load_images(tmp_path / "missing")


def test_grid_captions_do_not_run_into_each_other_on_small_images(tmp_path):
    # CIFAR's 32 px at scale 2 makes 64 px panels, narrower than the longest caption.
    from PIL import ImageFont

    from mjp_fast.privacy.settings import ImageAttack

    image = torch.rand(3, 32, 32, dtype=torch.float64)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[:3] = True
    attack = ImageAttack("x", image, image.flip(-1), mask, {k: image for k in ("plain", "unk", "no_unk")}, {})
    path = save_grid([attack], tmp_path / "small.png", patch_size=8, scale=2)
    widest = max(ImageFont.load_default().getlength(title) for _, title in GRID_COLUMNS)
    assert widest > 64
    with Image.open(path) as grid:
        column_w = (grid.size[0] - GAP) / len(GRID_COLUMNS) - GAP
        assert column_w >= widest
        pixels = torch.from_numpy(np.array(grid.convert("RGB"))).permute(2, 0, 1).double() / 255
    # each panel sits at its column's left edge
    top = CAPTION_HEIGHT + GAP
    for column in range(len(GRID_COLUMNS)):
        left = GAP + column * (int(column_w) + GAP)
        expected = image if column in (0, 2, 3, 4) else image.flip(-1)
        panel = pixels[:, top : top + 64 : 2, left : left + 64 : 2]
        if column != 1:  # the jigsawed panel has the masked patches outlined
            torch.testing.assert_close(panel, expected, rtol=0, atol=0.5 / 255 + 1e-9)
