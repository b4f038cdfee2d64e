"""``mjp eval --imagenet-c``: small trees in ImageNet-C's published layout, made of links to real ImageNet images
(../shared/data/imagenet-samples), the mCE against hand arithmetic, and the one-line errors."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mjp_fast.cli import main
from mjp_fast.evaluate.common_corruptions import ALL_CORRUPTIONS, BENCHMARK, corruption_table, stored_coverage
from mjp_fast.evaluate.imagenet_c import (
    ALEXNET_CLEAN_ERROR,
    ALEXNET_ERROR,
    ALEXNET_MEAN_ERROR_FRACTION,
    open_imagenet_c,
)
from mjp_fast.train.config import ConfigError
from tests.evaluate.authors_reference import relative_mce_authors, unnormalized_mean_authors
from tests.evaluate.corruption_helpers import ConstantClassifier, link, measure, train_tiny

SAMPLES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "imagenet-samples"
# Three real classes and their images (one each in the sample set).
WNIDS = ("n01440764", "n01530575", "n01601694")


@pytest.fixture(scope="module")
def images() -> dict[str, Path]:
    if not SAMPLES.is_dir():
        pytest.skip(f"ImageNet samples not found at {SAMPLES}")
    return {wnid: next(SAMPLES.glob(f"{wnid}_*.JPEG")) for wnid in WNIDS}


def make_tree(
    root: Path, images: dict[str, Path], counts: dict[str, Callable[[int], dict[str, int]]], severities=(1, 2, 3, 4, 5)
) -> Path:
    """``root/<corruption>/<severity>/<wnid>/k.JPEG``: ``counts[corruption](severity)`` gives the number of images
    of each WordNet id (a dict), all links to that class's real image."""
    for corruption, count in counts.items():
        for severity in severities:
            for wnid, number in count(severity).items():
                for k in range(number):
                    link(images[wnid], root / corruption / str(severity) / wnid / f"{k}.JPEG")
    return root


def test_mce_against_hand_arithmetic(images, tmp_path):
    # Severity s of gaussian_noise holds 1 image of the first class and s of the second; contrast 2 and s. A model
    # that always answers the first class errs on s of 1 + s (2 + s) images; one that answers the second, on 1 (2).
    counts = {
        "gaussian_noise": lambda s: {WNIDS[0]: 1, WNIDS[1]: s},
        "contrast": lambda s: {WNIDS[0]: 2, WNIDS[1]: s},
        "saturate": lambda s: {WNIDS[0]: 1, WNIDS[1]: 1},  # an extra: reported, outside the mCE
    }
    sets = open_imagenet_c(make_tree(tmp_path / "c", images, counts), list(WNIDS))
    assert list(sets.sources) == ["gaussian_noise", "contrast", "saturate"] and sets.crop_pct == 1.0
    errors = measure(ConstantClassifier(3, 0), sets)
    baseline = measure(ConstantClassifier(3, 1), sets)
    assert errors["gaussian_noise"] == pytest.approx([100 * s / (1 + s) for s in range(1, 6)])
    assert errors["contrast"] == pytest.approx([100 * s / (2 + s) for s in range(1, 6)])
    table = corruption_table(errors, reference=sets.reference, baseline=baseline)

    gaussian_mean = 100 * (1 / 2 + 2 / 3 + 3 / 4 + 4 / 5 + 5 / 6) / 5  # 71.0
    contrast_mean = 100 * (1 / 3 + 2 / 4 + 3 / 5 + 4 / 6 + 5 / 7) / 5
    # AlexNet's mean errors on these two (Hendrycks & Dietterich): 88.6428% and 85.3204%
    gaussian_ce, contrast_ce = 100 * gaussian_mean / 88.6428, 100 * contrast_mean / 85.3204
    assert gaussian_mean == pytest.approx(71.0)
    assert table["mean_error"]["gaussian_noise"] == pytest.approx(gaussian_mean)
    assert table["ce"] == pytest.approx({"gaussian_noise": gaussian_ce, "contrast": contrast_ce})
    assert table["mce"] == pytest.approx((gaussian_ce + contrast_ce) / 2)
    assert table["mean_corruption_error"] == pytest.approx((gaussian_mean + contrast_mean) / 2)
    assert table["families"] == {"noise": ["gaussian_noise"], "digital": ["contrast"], "extra": ["saturate"]}
    assert table["corruptions_in_mce"] == ["gaussian_noise", "contrast"] and len(table["missing"]) == 13
    assert "saturate" not in table["ce"] and table["mean_error"]["saturate"] == pytest.approx(50.0)
    # against the baseline: 100 * sum of the model's errors / sum of the baseline's, per corruption
    versus_gaussian = 100 * sum(s / (1 + s) for s in range(1, 6)) / sum(1 / (1 + s) for s in range(1, 6))
    versus_contrast = 100 * sum(s / (2 + s) for s in range(1, 6)) / sum(2 / (2 + s) for s in range(1, 6))
    assert table["ce_vs_baseline"]["gaussian_noise"] == pytest.approx(versus_gaussian)
    assert table["mce_vs_baseline"] == pytest.approx((versus_gaussian + versus_contrast) / 2)
    assert table["ce_vs_baseline"]["saturate"] == pytest.approx(100.0)
    baseline_gaussian = 100 * sum(1 / (1 + s) for s in range(1, 6)) / 5
    assert table["baseline"]["ce"]["gaussian_noise"] == pytest.approx(100 * baseline_gaussian / 88.6428)


def test_family_folders_and_a_1000_class_model(images, tmp_path):
    # DIR/<family>/<corruption>/... (the release's tars by family) is read too; a 1000-class model whose class
    # names are not WordNet ids is taken in ImageNet-1k's order: labels.csv gives each sample's index independently.
    root = make_tree(tmp_path / "c" / "noise", images, {"shot_noise": lambda s: {wnid: 1 for wnid in WNIDS}}).parent
    sets = open_imagenet_c(root, [f"class {index}" for index in range(1000)], 1000)
    assert list(sets.sources) == ["shot_noise"] and sets.missing == [name for name in BENCHMARK if name != "shot_noise"]
    with (SAMPLES / "labels.csv").open() as file:
        expected = {row["wnid"]: int(row["class_index"]) for row in csv.DictReader(file)}
    dataset = sets.sources["shot_noise"][2]()
    targets = sorted(dataset.reader[index][1] for index in range(len(dataset)))
    assert targets == sorted(expected[wnid] for wnid in WNIDS)


def _all_errors(extras: bool = True) -> dict[str, list[float]]:
    """Top-1 errors (%) at the five severities of all 15 corruptions (and the 4 extra ones), made up and distinct."""
    names = ALL_CORRUPTIONS if extras else BENCHMARK
    return {
        name: [30.0 + 3 * index + 5 * severity + 0.25 * index * severity for severity in range(5)]
        for index, name in enumerate(names)
    }


def test_relative_mce_and_the_mean_over_19_are_the_authors():
    errors = _all_errors()
    table = corruption_table(
        errors, reference=ALEXNET_ERROR, clean_error=21.5, reference_clean_error=ALEXNET_CLEAN_ERROR
    )
    fractions = {name: [error / 100 for error in by_severity] for name, by_severity in errors.items()}
    in_mce = {name: fractions[name] for name in BENCHMARK}
    # AlexNet's clean error in the authors' mCE spreadsheet: 0.4348 (torchvision's AlexNet: 56.522% top-1)
    assert ALEXNET_CLEAN_ERROR == pytest.approx(43.48)
    expected = relative_mce_authors(in_mce, 0.215, ALEXNET_MEAN_ERROR_FRACTION, 0.4348)
    assert table["relative_mce"] == pytest.approx(expected, rel=1e-12)
    assert len(table["relative_ce"]) == 15 and table["clean_error"] == 21.5
    # the authors' test.py averages the 15 and the 4 extra ones; the mCE's unnormalized mean, the 15
    assert table["mean_corruption_error_with_extras"] == pytest.approx(100 * unnormalized_mean_authors(fractions))
    assert table["mean_corruption_error"] == pytest.approx(100 * unnormalized_mean_authors(in_mce))
    assert table["mean_corruption_error"] != pytest.approx(table["mean_corruption_error_with_extras"])
    assert table["missing"] == [] and table["missing_extras"] == [] and table["missing_corruptions"] == 0
    # without the clean errors, or without a reference (CIFAR-10-C), no relative mCE
    assert corruption_table(errors, reference=ALEXNET_ERROR)["relative_mce"] is None
    assert corruption_table(errors, clean_error=21.5)["relative_mce"] is None


def test_a_partial_imagenet_c_is_marked():
    whole = corruption_table(_all_errors(), reference=ALEXNET_ERROR)
    assert stored_coverage(whole, 50_000, 50_000) == {
        "partial": False,
        "partial_with_extras": False,
        "release_images": 50_000,
        "missing_images": 0,
    }
    # the 15 without the extras: the mCE is the published one, the mean over 19 is not
    fifteen = stored_coverage(corruption_table(_all_errors(extras=False), reference=ALEXNET_ERROR), 50_000, 50_000)
    assert fifteen["partial"] is False and fifteen["partial_with_extras"] is True
    # 2 of the 15: an "mCE" over 2
    two = corruption_table({name: _all_errors()[name] for name in ("fog", "snow")}, reference=ALEXNET_ERROR)
    assert two["missing_corruptions"] == 13 and stored_coverage(two, 50_000, 50_000)["partial"] is True
    # all of them on fewer images a pass (--max-images)
    assert stored_coverage(whole, 5_000, 50_000) == {
        "partial": True,
        "partial_with_extras": True,
        "release_images": 50_000,
        "missing_images": 45_000,
    }


@pytest.mark.parametrize(
    "case, message",
    [
        ("no folder", "--imagenet-c: folder '{root}' does not exist"),
        ("empty", "--imagenet-c: '{root}' holds none of ImageNet-C's corruption folders (gaussian_noise, "),
        ("one corruption", "(it looks like one corruption's folder: name the folder above it)"),
        ("missing severity", "--imagenet-c: '{root}/fog/4' is missing: each corruption needs its five severity "),
        ("not a wnid", "--imagenet-c: '{root}/fog/1/tench' is not a WordNet-id folder (n and 8 digits"),
        ("no class folders", "--imagenet-c: '{root}/fog/2' holds no class folders: expected --imagenet-c DIR/"),
        ("unknown wnid", "--imagenet-c: the model has no output for 1 of the 2 WordNet ids of '{root}' (n01601694)"),
        ("cifar model", "--imagenet-c: the model's 3 classes (airplane, automobile, cat) are not ImageNet-1k classes"),
    ],
)
def test_layout_errors_are_one_line_naming_the_option(images, tmp_path, case, message):
    root = tmp_path / "c"
    classes = list(WNIDS[:2])
    if case == "empty":
        root.mkdir()
    elif case == "one corruption":
        make_tree(tmp_path, images, {"c": lambda s: {WNIDS[0]: 1}})
    elif case != "no folder":
        extra = WNIDS[2] if case == "unknown wnid" else WNIDS[1]
        make_tree(
            root,
            images,
            {"fog": lambda s: {WNIDS[0]: 1, extra: 1}},
            (1, 2, 3, 5) if case == "missing severity" else (1, 2, 3, 4, 5),
        )
        if case == "not a wnid":
            link(images[WNIDS[0]], root / "fog" / "1" / "tench" / "0.JPEG")
        if case == "no class folders":
            for folder in (root / "fog" / "2").iterdir():
                for image in folder.iterdir():
                    image.rename(root / "fog" / "2" / f"{folder.name}-{image.name}")
                folder.rmdir()
        if case == "cifar model":
            classes = ["airplane", "automobile", "cat"]
    with pytest.raises(ValueError) as raised:
        open_imagenet_c(root, classes)
    text = str(raised.value)
    assert message.format(root=root) in text and "\n" not in text


def test_a_severity_without_images_fails_when_its_pass_comes(images, tmp_path):
    root = make_tree(tmp_path / "c", images, {"fog": lambda s: {WNIDS[0]: 1}})
    for image in (root / "fog" / "3" / WNIDS[0]).iterdir():
        image.unlink()
    sets = open_imagenet_c(root, list(WNIDS))
    with pytest.raises(ConfigError, match=r"--imagenet-c: '.*/fog/3' holds no images"):
        sets.sources["fog"][2]()


@pytest.fixture(scope="module")
def imagenet_runs(images, tmp_path_factory):
    """A tiny MJP model and a tiny baseline trained on a 3-class tree of real ImageNet images named by WordNet id,
    and an ImageNet-C tree of two corruptions and an extra over the same classes."""
    root = tmp_path_factory.mktemp("imagenet")
    for wnid, image in images.items():
        for k in range(4):
            link(image, root / "data" / "train" / wnid / f"{k}.JPEG")
        for k in range(2):
            link(image, root / "data" / "val" / wnid / f"{k}.JPEG")
    every = {wnid: 2 for wnid in WNIDS}
    make_tree(
        root / "c", images, {"gaussian_noise": lambda s: every, "contrast": lambda s: every, "spatter": lambda s: every}
    )
    return {
        "mjp": train_tiny(root / "data", root / "runs" / "mjp", mjp=True),
        "baseline": train_tiny(root / "data", root / "runs" / "baseline", mjp=False),
        "tree": root / "c",
    }


def test_eval_cli_on_an_imagenet_c_tree(imagenet_runs, tmp_path, capsys):
    arguments = ["eval", "--checkpoint", str(imagenet_runs["mjp"]), "--imagenet-c", str(imagenet_runs["tree"])]
    arguments += ["--baseline", str(imagenet_runs["baseline"]), "--output", str(tmp_path), "--attention-images", "0"]
    assert main(arguments) == 0
    captured = capsys.readouterr()
    results = json.loads((tmp_path / "eval.json").read_text())
    table = results["imagenet_c"]
    assert table["dir"] == str(imagenet_runs["tree"]) and table["images"] == 6
    assert list(table["error"]) == ["gaussian_noise", "contrast", "spatter"]
    assert all(len(errors) == 5 for errors in table["error"].values())
    assert table["mce"] == pytest.approx(
        (100 * table["mean_error"]["gaussian_noise"] / 88.6428 + 100 * table["mean_error"]["contrast"] / 85.3204) / 2
    )
    assert table["baseline"]["mce"] is not None and table["baseline_checkpoint"] == str(imagenet_runs["baseline"])
    assert table["mce_vs_baseline"] == pytest.approx(
        sum(table["ce_vs_baseline"][name] for name in ("gaussian_noise", "contrast")) / 2
    )
    # the relative mCE from the clean pass's error; the mean over the corruptions present, extras included
    assert table["clean_error"] == pytest.approx(100 - results["top1"])
    assert table["relative_mce"] == pytest.approx(
        relative_mce_authors(
            {name: [error / 100 for error in table["error"][name]] for name in ("gaussian_noise", "contrast")},
            table["clean_error"] / 100,
            ALEXNET_MEAN_ERROR_FRACTION,
            0.4348,
        )
    )
    assert table["mean_corruption_error_with_extras"] == pytest.approx(sum(table["mean_error"].values()) / 3)
    # 2 of the 15 corruptions, 6 of 50,000 images a pass: marked, in the JSON and in the printed table
    assert table["partial"] is True and table["missing_corruptions"] == 13 and table["missing_images"] == 49_994
    assert table["precision"] == "float32" and results["precision"] == "float32"
    printed = captured.out
    mce_row = (
        f"| ImageNet-C mCE (%, AlexNet = 100) ↓ (partial set†) | {table['mce']:.2f} | {table['baseline']['mce']:.2f}"
    )
    assert mce_row + " | 54.60 | 51.60 |" in printed
    assert "† ImageNet-C is not the whole release (13 of the 15 corruptions missing (shot_noise, " in printed
    assert "6 of its 50,000 images a pass): its marked rows are not comparable with published numbers" in printed
    assert (
        "| ImageNet-C relative mCE (%, AlexNet = 100, Eq. 2 of Hendrycks & Dietterich) ↓ (partial set†) | " in printed
    )
    assert (
        "| ImageNet-C mean CE against the baseline (%, baseline = 100; not the relative mCE) ↓ (partial set†) | "
        in printed
    )
    assert "precision: float32: ImageNet-C (the authors evaluate in float32)" in printed
    assert "| spatter | extra (outside the mCE) |" in printed
    assert "the means cover 2 of the 15 corruptions (missing: shot_noise, impulse_noise," in printed
    # 1 clean pass, then 3 corruptions x 5 severities for each model
    assert sum(line.startswith("eval [") for line in captured.err.splitlines()) == 31
    png = tmp_path / "imagenet_c_severity.png"
    assert str(png) in results["plots"] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_cli_refuses_a_tree_with_fewer_severities(imagenet_runs, tmp_path, capsys):
    # fewer severities are refused, not measured: the mCE averages over all five
    tree = tmp_path / "c"
    make_tree(
        tree,
        {wnid: next(SAMPLES.glob(f"{wnid}_*.JPEG")) for wnid in WNIDS},
        {"fog": lambda s: {WNIDS[0]: 1}},
        (1, 2, 3),
    )
    arguments = [
        "eval",
        "--checkpoint",
        str(imagenet_runs["mjp"]),
        "--imagenet-c",
        str(tree),
        "--output",
        str(tmp_path),
    ]
    assert main(arguments) == 2
    err = capsys.readouterr().err
    assert err == (
        f"mjp eval: error: --imagenet-c: {str(tree / 'fog' / '4')!r} is missing: each corruption needs its five "
        "severity folders 1 to 5 (the mCE averages over all five)\n"
    )
    assert not (tmp_path / "eval.json").exists()
