"""The robustness rows of ``mjp eval``'s printed tables: the model and the baseline beside the paper's numbers."""

from mjp_fast.evaluate.common_corruptions import corruption_table, stored_coverage
from mjp_fast.evaluate.natural import release_coverage
from mjp_fast.evaluate.releases import IMAGENET_A_WNIDS, IMAGENET_O_WNIDS
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
    # the mean CE against the baseline is named apart from the paper's relative mCE
    against = "| ImageNet-C mean CE against the baseline (%, baseline = 100; not the relative mCE) ↓ | "
    assert f"{against}{100 * 50 / 60:.2f} | 100.00 | - | - |" in lines
    assert "| ImageNet-A top-1 (%) ↑ | 20.50 | 19.00 | 19.20 | 21.60 |" in lines
    assert "| ImageNet-A AURRA (%) ↑ | 30.25 | - | 25.10 | 29.80 |" in lines
    assert "| ImageNet-A calibration error, RMS, the authors' calib_err (%) ↓ | 40.00 | - | - | - |" in lines
    assert "| ImageNet-O AUPR (%) ↑ | 23.00 | - | 20.90 | 22.60 |" in lines
    assert not any(line.startswith("| ImageNet-R") or line.startswith("| CIFAR-10-C") for line in lines)
    assert robustness_rows({"top1": 50.0}) == [] and stored_corruption_rows({"top1": 50.0}) == []
    stored = stored_corruption_rows(results)
    assert "| gaussian_noise | noise | 50.00 | 50.00 | 50.00 | 50.00 | 50.00 | 50.00 | " in "\n".join(stored)
    assert f"ImageNet-C mCE (AlexNet = 100): {mce:.2f}" in stored


def test_rows_of_a_partial_set_are_marked_with_what_it_lacks_and_the_precision_is_said():
    # 2 of the 15 corruptions on 4 images a pass; the 4 extras: the mean over 19 is marked too
    imagenet_c = corruption_table({"fog": [50.0] * 5, "snow": [40.0] * 5}, reference={"fog": 80.0, "snow": 80.0})
    imagenet_c.update(dir="/c", images=4, precision="float32", **stored_coverage(imagenet_c, 4, 50_000))
    results = {
        "imagenet_c": imagenet_c,
        # ImageNet-A: 10 of its 200 classes, scored 10-way
        "imagenet_a": {
            "top1": 60.0,
            "aurra": 70.0,
            "calibration_rms": None,
            "images": 40,
            "precision": "float32",
            **release_coverage("imagenet_a", IMAGENET_A_WNIDS[:10], 40),
        },
        # ImageNet-O: the whole release, in bfloat16
        "imagenet_o": {
            "aupr": 23.0,
            "auroc": 61.0,
            "fpr95": 88.0,
            "images_out": 2_000,
            "images_in": 10_000,
            "precision": "bfloat16",
            **release_coverage("imagenet_o", IMAGENET_O_WNIDS, 2_000, 10_000),
        },
    }
    lines = robustness_rows(results)
    assert "| ImageNet-C mCE (%, AlexNet = 100) ↓ (partial set†) | 56.25 | - | 54.60 | 51.60 |" in lines
    assert "| ImageNet-A top-1 (%) ↑ (partial set†) | 60.00 | - | 19.20 | 21.60 |" in lines
    assert "| ImageNet-A calibration error, RMS, the authors' calib_err (%) ↓ (partial set†) | - | - | - | - |" in lines
    assert "| ImageNet-O AUPR (%) ↑ | 23.00 | - | 20.90 | 22.60 |" in lines  # the whole release: not marked
    assert "| ImageNet-O AUROC (%) ↑ | 61.00 | - | - | - |" in lines
    assert "| ImageNet-O FPR at 95% recall (%) ↓ | 88.00 | - | - | - |" in lines
    assert (
        "† ImageNet-C is not the whole release (13 of the 15 corruptions missing (gaussian_noise, shot_noise, "
        "impulse_noise, ...); 4 of the 4 extra corruptions missing; 4 of its 50,000 images a pass): its marked rows "
        "are not comparable with published numbers"
    ) in lines
    assert (
        "† ImageNet-A is not the whole release (190 of its 200 classes missing; 40 of its 7,500 images): its marked "
        "rows are not comparable with published numbers"
    ) in lines
    assert not any(line.startswith("† ImageNet-O") for line in lines)
    assert (
        lines[-1]
        == "precision: float32: ImageNet-C, ImageNet-A; bfloat16: ImageNet-O (the authors evaluate in float32)"
    )
