"""The robustness rows of ``mjp eval``'s printed tables: the model and the baseline beside the paper's numbers."""

from mjp_fast.evaluate.common_corruptions import corruption_table
from mjp_fast.evaluate.robustness_table import robustness_rows, stored_corruption_rows


def test_rows_show_every_benchmark_present_beside_the_paper():
    imagenet_c = corruption_table(
        {"gaussian_noise": [50.0] * 5}, reference={"gaussian_noise": 88.6428}, baseline={"gaussian_noise": [60.0] * 5}
    )
    results = {
        "imagenet_c": {"dir": "/c", "images": 4, **imagenet_c},
        "imagenet_a": {"top1": 20.5, "aurra": 30.25, "calibration_rms": 40.0, "baseline": {"top1": 19.0}},
        "imagenet_o": {"aupr": 23.0},
    }
    lines = robustness_rows(results)
    assert lines[1] == "| robustness | model | baseline | paper DeiT-S | paper DeiT-S + MJP |"
    mce, baseline_mce = 100 * 50 / 88.6428, 100 * 60 / 88.6428
    assert f"| ImageNet-C mCE (%, AlexNet = 100) ↓ | {mce:.2f} | {baseline_mce:.2f} | 54.60 | 51.60 |" in lines
    assert f"| ImageNet-C mCE relative to the baseline (%) ↓ | {100 * 50 / 60:.2f} | 100.00 | - | - |" in lines
    assert "| ImageNet-A top-1 (%) ↑ | 20.50 | 19.00 | 19.20 | 21.60 |" in lines
    assert "| ImageNet-A AURRA (%) ↑ | 30.25 | - | 25.10 | 29.80 |" in lines
    assert "| ImageNet-A calibration error, RMS (%) ↓ | 40.00 | - | - | - |" in lines
    assert "| ImageNet-O AUPR (%) ↑ | 23.00 | - | 20.90 | 22.60 |" in lines
    assert not any(line.startswith("| ImageNet-R") or line.startswith("| CIFAR-10-C") for line in lines)
    assert robustness_rows({"top1": 50.0}) == [] and stored_corruption_rows({"top1": 50.0}) == []
    stored = stored_corruption_rows(results)
    assert "| gaussian_noise | noise | 50.00 | 50.00 | 50.00 | 50.00 | 50.00 | 50.00 | " in "\n".join(stored)
    assert f"ImageNet-C mCE (AlexNet = 100): {mce:.2f}" in stored
