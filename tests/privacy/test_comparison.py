"""APRIL beside the MJP-aware attack: region PSNRs, intervals, the sweep's structure, batches, the table and curve.

Small model as in test_adaptive.py (16x16, patch 2, width 80, two blocks), real photos averaged down to 16x16.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mjp_fast.cli import main
from mjp_fast.privacy import PrivacyViT
from mjp_fast.privacy.adaptive import fit_patch_prior
from mjp_fast.privacy.comparison import (
    ATTACKERS,
    UPDATES,
    batch_comparison,
    batch_gradients,
    compare_attacks,
    comparison_markdown,
    mean_interval,
    psnr_curve,
    region_psnr,
    write_comparison_json,
)
from mjp_fast.privacy.model import client_gradients

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def small_model() -> PrivacyViT:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return PrivacyViT(img_size=16, patch_size=2, embed_dim=80, depth=2, num_heads=4).double()


@pytest.fixture(scope="module")
def small_images(photos) -> torch.Tensor:
    _, images = photos
    return F.avg_pool2d(images, 4)[:4]


def test_region_psnr_splits_visible_and_masked():
    reference = torch.full((1, 3, 4, 4), 0.5, dtype=torch.float64)
    recovered = reference.clone()
    recovered[..., :2, :2] += 0.1  # position 0 of the 2x2 grid of 2-pixel patches is off by 0.1
    mask = torch.tensor([[True, False, False, False]])
    visible, masked = region_psnr(recovered, reference, mask, 2)
    assert float(visible) == pytest.approx(200.0)  # exact: the floor's cap
    assert float(masked) == pytest.approx(20.0)
    visible, masked = region_psnr(recovered, reference, torch.zeros(1, 4, dtype=torch.bool), 2)
    assert math.isnan(float(masked)) and float(visible) == pytest.approx(-10 * math.log10(0.01 / 4))


def test_mean_interval():
    mean, low, high = mean_interval([1.0, 2.0, 3.0, float("nan"), None])
    assert mean == pytest.approx(2.0)
    assert low == pytest.approx(2 - 4.302652729911275 / math.sqrt(3))  # t(0.975, 2) * sd 1 / sqrt(3)
    assert high == pytest.approx(2 + 4.302652729911275 / math.sqrt(3))
    assert all(math.isnan(value) for value in mean_interval([float("nan")]))
    assert mean_interval([4.0]) == (4.0, 4.0, 4.0)


def test_batch_gradients_of_one_image_are_the_client_gradients(small_model, small_images):
    one = batch_gradients(small_model, small_images[:1], [3])
    reference = client_gradients(small_model, small_images[:1], 3)
    for name, value in reference.items():
        torch.testing.assert_close(one[name], value, rtol=1e-12, atol=1e-18)


def test_compare_attacks_structure_and_the_plain_update(small_model, small_images):
    prior = fit_patch_prior(small_images, 2)
    result = compare_attacks(
        small_model, small_images, [0, 1, 2, 3], prior=prior, ratios=(0.1,), metrics=("mse", "psnr", "ssim")
    )
    for name in ATTACKERS:
        assert min(result["plain"][name]["psnr"]) > 60  # both exact on the plain update
    assert set(result["blind"]) == {"mse", "psnr", "ssim", "psnr_visible", "psnr_masked"}
    entry = result["ratios"]["0.1"]
    assert set(entry["modes"]) == {"per_sample", "shared"}
    for by_update in entry["modes"].values():
        assert by_update["masked_patches"] > 0
        for update in UPDATES:
            for name in ATTACKERS:
                assert len(by_update[update][name]["psnr_masked"]) == 4
    text = comparison_markdown(result)
    assert "APRIL (as published)" in text and "adaptive (knows MJP)" in text and "| 0.1 | batch-shared mask |" in text
    with pytest.raises(ValueError, match="modes"):
        compare_attacks(small_model, small_images, [0, 1, 2, 3], prior=None, modes=("everywhere",))


def test_batches_above_one_defeat_both_attacks(small_model, small_images):
    batches = batch_comparison(small_model, small_images, [0, 1, 2, 3], prior=None, batch_sizes=(1, 2), ratio=0.1)
    one, two = batches["sizes"]["1"], batches["sizes"]["2"]
    assert min(one["plain"]["april"]) > 60 and min(one["plain"]["adaptive"]) > 60
    assert len(two["plain"]["april"]) == 2
    for kind in two.values():
        for scores in kind.values():
            assert max(scores) < 30  # one gradient row per position for two images: nothing is recovered


def test_table_curve_and_json(small_model, small_images, tmp_path):
    result = compare_attacks(
        small_model, small_images[:2], [0, 1], prior=None, ratios=(0.05, 0.2), modes=("shared",), metrics=("psnr",)
    )
    batches = batch_comparison(small_model, small_images[:2], [0, 1], prior=None, batch_sizes=(2,))
    path = psnr_curve(result, tmp_path / "curve.png", title="test")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    saved = write_comparison_json({"comparison": result, "batches": batches}, tmp_path / "c.json")
    loaded = json.loads(saved.read_text())
    text = comparison_markdown(loaded["comparison"], loaded["batches"])  # renders from JSON (NaN as null)
    assert "| 2 | plain model |" in text


def test_mjp_attack_compare(tmp_path, photos, capsys):
    from PIL import Image

    names, images = photos
    folder = tmp_path / "photos"
    folder.mkdir()
    for name, image in zip(names[:2], images[:2], strict=True):
        Image.fromarray((image.permute(1, 2, 0).numpy() * 255).round().astype("uint8")).save(folder / f"{name}.png")
    output = tmp_path / "out"
    arguments = ["attack", "--images", str(folder), "--output", str(output), "--compare", "--compare-ratios", "0.1"]
    assert main([*arguments, "--prior-images", str(folder)]) == 0
    data = json.loads((output / "compare.json").read_text())
    assert set(data["comparison"]["ratios"]) == {"0.1"}
    assert (output / "compare.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "adaptive (knows MJP)" in (output / "compare.md").read_text()
    # refused before any attack runs
    assert main(["attack", "--output", str(tmp_path / "bad"), "--compare", "--attack", "optimization"]) == 2
    assert "--compare needs the analytic attack" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
