"""``mjp eval --imagenet-c``: small trees in ImageNet-C's published layout, made of links to real ImageNet images
(../shared/data/imagenet-samples), the mCE against hand arithmetic, and the one-line errors."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mjp_fast.cli import main
from mjp_fast.evaluate.common_corruptions import BENCHMARK, corruption_table
from mjp_fast.evaluate.imagenet_c import open_imagenet_c
from mjp_fast.train.config import ConfigError
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
    printed = captured.out
    assert (
        f"| ImageNet-C mCE (%, AlexNet = 100) ↓ | {table['mce']:.2f} | {table['baseline']['mce']:.2f} | 54.60 | 51.60 |"
        in printed
    )
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
