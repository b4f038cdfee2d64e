"""ImageNet-A, -R, -O (mjp_fast/evaluate/natural.py): their trees in the published layout (DIR/<wnid>/*.jpg) built
in tmp_path from real ImageNet images (../shared/data/imagenet-samples) under the real WordNet ids of a handful of
ImageNet-A/O classes; a 1000-class model's logits restricted to a set's classes; `mjp eval --imagenet-a/-r/-o` end
to end on a tiny checkpoint; bad trees and models without the classes as one line and exit code 2."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.metrics import average_precision_score, roc_auc_score
from torch import nn

from mjp_fast.cli import main
from mjp_fast.evaluate.natural import (
    evaluate_natural_sets,
    imagenet_1k_wnids,
    model_class_wnids,
    open_natural_sets,
    read_subset_folder,
    release_coverage,
    subset_columns,
    subset_logits,
)
from mjp_fast.evaluate.releases import IMAGENET_A_WNIDS, IMAGENET_O_WNIDS, IMAGENET_R_WNIDS
from mjp_fast.train.config import load_config
from mjp_fast.train.data import eval_loader, eval_transform, set_transform
from mjp_fast.train.loop import train
from mjp_fast.train.readers import folder_images
from tests.evaluate.authors_reference import fpr_at_recall_authors
from tests.train.helpers import CIFAR10, REPO_ROOT, tiny_overrides

IMAGENET = REPO_ROOT.parent / "shared" / "data" / "imagenet-samples"

# Real WordNet ids. ImageNet-A's 200 classes include the first five; ImageNet-O's folders include harvestman,
# candle and manhole cover. Tench (ImageNet-1k class 0) is in neither.
BULLFROG, ALLIGATOR, HARVESTMAN, FLAMINGO, CANDLE = "n01641577", "n01698640", "n01770081", "n02007558", "n02948072"
MANHOLE, TENCH = "n03717622", "n01440764"


def _samples() -> list[Path]:
    if not IMAGENET.is_dir():
        pytest.skip(f"ImageNet samples not found at {IMAGENET}")
    return sorted(IMAGENET.glob("*.JPEG"))


def make_tree(root: Path, counts: dict[str, int]) -> Path:
    """``root/<wnid>/<k>.jpg``: links to real ImageNet images (the wnid's own sample first), and a README.txt as
    the releases have."""
    samples = _samples()
    others = iter(samples * 10)
    for wnid, count in counts.items():
        folder = root / wnid
        folder.mkdir(parents=True)
        own = [path for path in samples if path.name.startswith(wnid)]
        for number in range(count):
            source = own[0] if number == 0 and own else next(others)
            os.symlink(source, folder / f"{number}.jpg")
    (root / "README.txt").write_text("a release's README\n")
    return root


class FixedLogits(nn.Module):
    """A stand-in for a 1000-class ImageNet model: fixed logits at some classes (0 elsewhere), plus ten times the
    image's mean at ``bright_class``."""

    def __init__(self, levels: dict[int, float], bright_class: int | None = None) -> None:
        super().__init__()
        self.num_classes = 1000
        self.levels, self.bright_class = levels, bright_class

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(len(images), 1000)
        for index, level in self.levels.items():
            logits[:, index] = level
        if self.bright_class is not None:
            logits[:, self.bright_class] += 10 * images.float().mean(dim=(1, 2, 3))
        return logits


TRANSFORM = eval_transform(32, "bicubic", 1.0)
MEAN, STD = torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0.25, 0.25, 0.25])


def _loader(dataset):
    return eval_loader(dataset, 4, 0)


def _val_loader(root: Path, wnids: list[str]):
    """An ImageNet validation split of 1000 classes, of which the tree holds ``wnids``: targets are 1k indices."""
    index = {wnid: position for position, wnid in enumerate(imagenet_1k_wnids())}
    dataset = folder_images(root, {wnid: index[wnid] for wnid in sorted(wnids)}, 0)
    set_transform(dataset, TRANSFORM)
    return _loader(dataset)


def test_imagenet_1k_wnids_come_from_timm_in_the_standard_order():
    wnids = imagenet_1k_wnids()
    assert len(wnids) == 1000 and wnids == sorted(wnids) and len(set(wnids)) == 1000
    assert wnids[0] == TENCH and wnids[999] == "n15075141"
    labels = (IMAGENET / "labels.csv").read_text().splitlines()[1:] if IMAGENET.is_dir() else []
    for line in labels:  # the samples' file: class index (timm order) and wnid
        _, index, wnid = line.split(",")
        assert wnids[int(index)] == wnid


def test_model_class_wnids():
    assert model_class_wnids([BULLFROG, HARVESTMAN], 2, "--imagenet-a", "ImageNet-A") == [BULLFROG, HARVESTMAN]
    # a 1000-class model whose data does not name its classes by wnid: ImageNet-1k's order
    assert model_class_wnids([str(i) for i in range(1000)], 1000, "--imagenet-a", "ImageNet-A") == imagenet_1k_wnids()
    assert model_class_wnids(None, 1000, "--imagenet-o", "ImageNet-O")[:2] == [TENCH, "n01443537"]
    with pytest.raises(ValueError) as error:
        model_class_wnids(["airplane", "automobile", "cat"], 3, "--imagenet-r", "ImageNet-R")
    assert str(error.value).startswith(
        "--imagenet-r: the model's 3 classes (airplane, automobile, cat) are not ImageNet-1k classes"
    )


def test_subset_columns_finds_each_class_by_wnid_and_names_the_missing_ones():
    columns = subset_columns([BULLFROG, HARVESTMAN], [HARVESTMAN, TENCH, BULLFROG], "--imagenet-a", "ImageNet-A")
    assert columns.tolist() == [2, 0]
    with pytest.raises(
        ValueError, match=rf"^--imagenet-a: the model has no output for 1 of the 2 ImageNet-A classes \({FLAMINGO}\)"
    ):
        subset_columns([BULLFROG, FLAMINGO], [HARVESTMAN, BULLFROG], "--imagenet-a", "ImageNet-A")


def test_a_1000_class_models_logits_are_restricted_to_the_sets_classes(tmp_path):
    # Tench (outside ImageNet-A) gets the largest logit, then alligator, then flamingo: restricted to the set's
    # three classes every image is predicted alligator, so the accuracy is alligator's share of the images.
    index = {wnid: position for position, wnid in enumerate(imagenet_1k_wnids())}
    counts = {BULLFROG: 2, ALLIGATOR: 3, FLAMINGO: 4}
    tree = make_tree(tmp_path / "imagenet-a", counts)
    model = FixedLogits({index[TENCH]: 100.0, index[ALLIGATOR]: 50.0, index[FLAMINGO]: 40.0})
    val = _val_loader(make_tree(tmp_path / "val", {TENCH: 1, HARVESTMAN: 1}), [TENCH, HARVESTMAN])
    sets = open_natural_sets(
        {"imagenet_a": tree, "imagenet_r": tree}, classes=None, num_classes=1000, val_loader=val, make_loader=_loader
    )
    assert sets[0].columns.tolist() == [index[BULLFROG], index[ALLIGATOR], index[FLAMINGO]]
    results = evaluate_natural_sets(sets, model, device="cpu", mean=MEAN, std=STD)
    assert results["imagenet_a"]["top1"] == pytest.approx(100 * 3 / 9)
    r = results["imagenet_r"]
    assert (r["top1"], r["images"], r["classes"]) == (pytest.approx(100 * 3 / 9), 9, 3)
    # the validation split has no image of these classes: no ImageNet-200 pass
    assert r["imagenet_200_top1"] is None and r["top1_drop"] is None and r["imagenet_200_images"] == 0
    assert sets[1].passes == 1
    assert results["imagenet_a"]["images"] == 9 and results["imagenet_a"]["classes"] == 3
    logits, targets = subset_logits(model, sets[0].loader, sets[0].columns, device="cpu", mean=MEAN, std=STD)
    assert torch.equal(logits, torch.tensor([[0.0, 50.0, 40.0]]).expand(9, 3))
    assert targets.tolist() == [0] * 2 + [1] * 3 + [2] * 4
    assert model(torch.zeros(1, 3, 32, 32)).argmax().item() == index[TENCH]  # unrestricted: tench
    # every image answered with the same confidence: AURRA is the accuracy
    assert results["imagenet_a"]["aurra"] == pytest.approx(100 * 3 / 9)
    # the authors' calibration error leaves out the last bin of 100: 9 images leave none to sum
    assert results["imagenet_a"]["calibration_rms"] is None


def test_imagenet_o_scores_its_images_against_the_validation_images_of_its_classes(tmp_path):
    index = {wnid: position for position, wnid in enumerate(imagenet_1k_wnids())}
    out_tree = make_tree(tmp_path / "imagenet-o", {HARVESTMAN: 3, CANDLE: 2, MANHOLE: 2})
    val_counts = {HARVESTMAN: 2, CANDLE: 1, TENCH: 3, BULLFROG: 2}  # tench and bullfrog: not ImageNet-O classes
    val_root = make_tree(tmp_path / "val", val_counts)
    model = FixedLogits({index[TENCH]: 30.0}, bright_class=index[HARVESTMAN])
    sets = open_natural_sets(
        {"imagenet_o": out_tree},
        classes=None,
        num_classes=1000,
        val_loader=_val_loader(val_root, list(val_counts)),
        make_loader=_loader,
    )
    results = evaluate_natural_sets(sets, model, device="cpu", mean=MEAN, std=STD)["imagenet_o"]
    assert results["images_out"] == 7 and results["images_in"] == 3

    # The same scores computed image by image: the negative max-softmax over ImageNet-O's three classes' logits.
    columns = [index[HARVESTMAN], index[CANDLE], index[MANHOLE]]

    def score(path: Path) -> float:
        with Image.open(path) as image:
            pixels = TRANSFORM(image.convert("RGB")).float().div(255).unsqueeze(0)
        logits = model((pixels - MEAN.view(1, 3, 1, 1)) / STD.view(1, 3, 1, 1))[:, columns].double()
        return -float(logits.softmax(dim=1).max())

    out_scores = [score(path) for path in sorted(out_tree.glob("n*/*.jpg"))]
    in_scores = [score(path) for wnid in (HARVESTMAN, CANDLE) for path in sorted((val_root / wnid).glob("*.jpg"))]
    assert len(set(out_scores + in_scores)) > 5  # the scores differ from image to image
    labels = [1] * 7 + [0] * 3
    assert results["aupr"] == pytest.approx(100 * average_precision_score(labels, out_scores + in_scores), rel=1e-6)
    # the two measures the authors print beside it: AUROC and the FPR at 95% recall of ImageNet-O's images
    assert results["auroc"] == pytest.approx(100 * roc_auc_score(labels, out_scores + in_scores), rel=1e-6)
    expected_fpr = fpr_at_recall_authors(np.array(out_scores), np.array(in_scores))
    assert results["fpr95"] == pytest.approx(100 * expected_fpr, abs=1e-9)
    # 3 of the release's 200 classes, 7 of its 2,000 images, 3 of the authors' 10,000 negatives: partial
    assert results["partial"] is True and results["missing_classes"] == 197 and results["extra_classes"] == []
    assert results["missing_images"] == 2000 - 7 and results["release_images_in"] == 10_000


def test_imagenet_r_reports_the_imagenet_200_accuracy_and_the_drop(tmp_path):
    # The model answers harvestman on bright images, tench (outside the set) otherwise: restricted to the set's
    # classes, a dark image's answer is the first of the set's classes with the largest logit (0 for all but
    # harvestman), computed here image by image; the ImageNet-200 is the validation images of those classes.
    index = {wnid: position for position, wnid in enumerate(imagenet_1k_wnids())}
    r_counts, val_counts = {BULLFROG: 2, HARVESTMAN: 3}, {BULLFROG: 2, HARVESTMAN: 3, TENCH: 2}
    tree, val_root = make_tree(tmp_path / "imagenet-r", r_counts), make_tree(tmp_path / "val", val_counts)
    model = FixedLogits({index[TENCH]: 30.0}, bright_class=index[HARVESTMAN])
    sets = open_natural_sets(
        {"imagenet_r": tree},
        classes=None,
        num_classes=1000,
        val_loader=_val_loader(val_root, list(val_counts)),
        make_loader=_loader,
    )
    assert sets[0].passes == 2
    passes = []
    results = evaluate_natural_sets(
        sets, model, device="cpu", mean=MEAN, std=STD, pass_done=lambda *args: passes.append(args[:2])
    )["imagenet_r"]
    columns = [index[BULLFROG], index[HARVESTMAN]]

    def right(path: Path, target: int) -> bool:
        with Image.open(path) as image:
            pixels = TRANSFORM(image.convert("RGB")).float().div(255).unsqueeze(0)
        return int(model((pixels - MEAN.view(1, 3, 1, 1)) / STD.view(1, 3, 1, 1))[:, columns].argmax()) == target

    def accuracy(root: Path) -> float:
        hits = [
            right(path, target)
            for target, wnid in enumerate((BULLFROG, HARVESTMAN))
            for path in (root / wnid).glob("*.jpg")
        ]
        return 100 * sum(hits) / len(hits)

    assert results["top1"] == pytest.approx(accuracy(tree)) and results["images"] == 5
    assert results["imagenet_200_top1"] == pytest.approx(accuracy(val_root)) and results["imagenet_200_images"] == 5
    assert results["top1_drop"] == pytest.approx(accuracy(val_root) - accuracy(tree))  # ImageNet-200 - ImageNet-R
    assert results["imagenet_200_classes"] == 2 and results["imagenet_200_partial"] is True
    assert [description for description, _ in passes] == ["ImageNet-R", "ImageNet-R ImageNet-200"]
    assert passes[1][1] == {"top1": pytest.approx(accuracy(val_root)), "images": 5}


def test_a_partial_release_is_marked_and_the_whole_one_is_not():
    # ImageNet-A as released: its 200 classes, 7,500 images
    whole = release_coverage("imagenet_a", IMAGENET_A_WNIDS, 7_500)
    assert whole == {
        "partial": False,
        "release_classes": 200,
        "missing_classes": 0,
        "extra_classes": [],
        "release_images": 7_500,
        "missing_images": 0,
    }
    # 10 class folders: scored 10-way, so marked; 201 folders (one not ImageNet-A's): 201-way, marked
    ten = release_coverage("imagenet_a", IMAGENET_A_WNIDS[:10], 7_500)
    assert ten["partial"] is True and ten["missing_classes"] == 190
    more = release_coverage("imagenet_a", [*IMAGENET_A_WNIDS, TENCH], 7_500)
    assert more["partial"] is True and more["missing_classes"] == 0 and more["extra_classes"] == [TENCH]
    # all the classes, fewer images (a partial download, --max-images)
    fewer = release_coverage("imagenet_r", IMAGENET_R_WNIDS, 1_000)
    assert fewer["partial"] is True and fewer["missing_images"] == 29_000
    # ImageNet-O: its negatives are 50 validation images of each of its 200 classes
    assert release_coverage("imagenet_o", IMAGENET_O_WNIDS, 2_000, 10_000)["partial"] is False
    assert release_coverage("imagenet_o", IMAGENET_O_WNIDS, 2_000, 9_999)["partial"] is True


def test_the_release_classes_are_the_authors():
    # 200 ImageNet-1k classes each; the sets of the tests' trees are among them
    known = set(imagenet_1k_wnids())
    for wnids in (IMAGENET_A_WNIDS, IMAGENET_R_WNIDS, IMAGENET_O_WNIDS):
        assert len(wnids) == len(set(wnids)) == 200 and set(wnids) <= known and list(wnids) == sorted(wnids)
    assert {BULLFROG, ALLIGATOR, HARVESTMAN, FLAMINGO} <= set(IMAGENET_A_WNIDS)
    assert {HARVESTMAN, CANDLE, MANHOLE} <= set(IMAGENET_O_WNIDS) and TENCH not in IMAGENET_A_WNIDS


def test_timms_found_no_images_is_a_value_error_naming_the_option(tmp_path, monkeypatch):
    # the tree check counts the images first; should timm's reader still find none, its RuntimeError is one line
    from mjp_fast.train import readers

    def found_none(root, *args, **kwargs):
        raise RuntimeError(f"Found 0 images in subfolders of {root}")

    tree = make_tree(tmp_path / "imagenet-a", {BULLFROG: 1})
    val = _val_loader(make_tree(tmp_path / "val", {TENCH: 1}), [TENCH])
    monkeypatch.setattr(readers, "folder_images", found_none)
    with pytest.raises(ValueError, match=rf"^--imagenet-a: {re.escape(repr(str(tree)))} holds no images$"):
        open_natural_sets({"imagenet_a": tree}, classes=None, num_classes=1000, val_loader=val, make_loader=_loader)


def test_imagenet_o_needs_validation_images_of_its_classes(tmp_path):
    out_tree = make_tree(tmp_path / "imagenet-o", {HARVESTMAN: 1})
    val = _val_loader(make_tree(tmp_path / "val", {TENCH: 2}), [TENCH])
    with pytest.raises(ValueError, match="^--imagenet-o: the validation split has no images of ImageNet-O's 1 classes"):
        open_natural_sets({"imagenet_o": out_tree}, classes=None, num_classes=1000, val_loader=val, make_loader=_loader)


def _layout_error(tmp_path: Path, case: str) -> tuple[Path, str]:
    """A bad tree and the start of its error."""
    root = tmp_path / "imagenet-a"
    if case == "missing":
        return root, f"--imagenet-a: folder {str(root)!r} does not exist"
    if case == "archive":
        archive = tmp_path / "imagenet-a.tar"
        archive.write_bytes(b"not unpacked")
        return archive, f"--imagenet-a: {str(archive)!r} is a file, not a folder (unpack it first: tar -xf)"
    if case == "flat":  # images straight in the folder
        root.mkdir()
        os.symlink(_samples()[0], root / "0.jpg")
        return root, f"--imagenet-a: folder {str(root)!r} has no class folders; expected the ImageNet-A release"
    if case == "nested":  # the folder above the release
        make_tree(root / "imagenet-a", {BULLFROG: 1})
        return root, f"--imagenet-a: folder {str(root)!r} holds folders not named by a WordNet id (imagenet-a)"
    if case == "names":
        make_tree(root, {BULLFROG: 1, "bullfrog": 1})
        return root, f"--imagenet-a: folder {str(root)!r} holds folders not named by a WordNet id (bullfrog)"
    if case == "unknown":
        make_tree(root, {BULLFROG: 1, "n99999999": 1})
        return (
            root,
            f"--imagenet-a: folder {str(root)!r} holds folders whose names are not ImageNet-1k WordNet ids: n99999999",
        )
    if case == "directories":  # class folders holding only folders named like images (timm found 0 images)
        for wnid in (BULLFROG, ALLIGATOR):
            (root / wnid / "0.jpg").mkdir(parents=True)
            os.symlink(_samples()[0], root / wnid / "0.jpg" / "inner.jpg")
        return root, f"--imagenet-a: folder {str(root / BULLFROG)!r} holds no images"
    assert case == "empty"
    make_tree(root, {BULLFROG: 1})
    (root / ALLIGATOR).mkdir()
    (root / ALLIGATOR / "notes.txt").write_text("no image here")
    return root, f"--imagenet-a: folder {str(root / ALLIGATOR)!r} holds no images"


LAYOUT_CASES = ["missing", "archive", "flat", "nested", "names", "unknown", "empty", "directories"]


@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_a_bad_tree_is_one_clear_line(tmp_path, case):
    root, message = _layout_error(tmp_path, case)
    with pytest.raises(ValueError) as error:
        read_subset_folder(root, "--imagenet-a", "ImageNet-A")
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)
    if case == "nested":
        assert str(error.value).endswith(f"did you mean {str(root / 'imagenet-a')!r}?")


def test_the_release_layout_is_read(tmp_path):
    root = make_tree(tmp_path / "imagenet-a", {ALLIGATOR: 2, BULLFROG: 3})
    folder = read_subset_folder(root, "--imagenet-a", "ImageNet-A")
    assert folder.wnids == [BULLFROG, ALLIGATOR] and folder.images == 5 and folder.root == root


# --- mjp eval end to end ---------------------------------------------------------------------------------------

MODEL_CLASSES = (BULLFROG, ALLIGATOR, HARVESTMAN)


@pytest.fixture(scope="module")
def wnid_checkpoint(tmp_path_factory):
    """A tiny MJP run on real CIFAR-10 images foldered under three ImageNet-A wnids (one also ImageNet-O's)."""
    if not CIFAR10.is_dir():
        pytest.skip(f"real CIFAR-10 not found at {CIFAR10}")
    data = tmp_path_factory.mktemp("wnid-data")
    for split, count in (("train", 16), ("test", 8)):
        for wnid, name in zip(MODEL_CLASSES, ("airplane", "automobile", "cat"), strict=True):
            (data / split / wnid).mkdir(parents=True)
            for image in sorted((CIFAR10 / split / name).iterdir())[:count]:
                os.symlink(image, data / split / wnid / image.name)
    overrides = tiny_overrides(data=str(data), output=str(tmp_path_factory.mktemp("run")), mjp=True, epochs=1)
    return train(load_config(None, overrides + ["warmup_epochs=0"])).checkpoint


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("natural")
    return {
        "a": make_tree(root / "imagenet-a", {BULLFROG: 3, ALLIGATOR: 3}),
        "r": make_tree(root / "imagenet-r", {BULLFROG: 2, ALLIGATOR: 2, HARVESTMAN: 2}),
        "o": make_tree(root / "imagenet-o", {HARVESTMAN: 3}),
    }


def test_mjp_eval_measures_imagenet_a_r_o_with_a_baseline(wnid_checkpoint, trees, tmp_path, capsys):
    arguments = ["eval", "--checkpoint", str(wnid_checkpoint), "--output", str(tmp_path), "--no-plots"]
    sets = ["--imagenet-a", str(trees["a"]), "--imagenet-r", str(trees["r"]), "--imagenet-o", str(trees["o"])]
    # the checkpoint as its own baseline: the baseline's results must be the model's
    assert main([*arguments, *sets, "--baseline", str(wnid_checkpoint)]) == 0
    captured = capsys.readouterr()
    err, printed = captured.err, captured.out
    results = json.loads((tmp_path / "eval.json").read_text())
    # a few classes of each release: its rows marked in the printed table, with what the set lacks
    assert f"| ImageNet-A top-1 (%) ↑ (partial set†) | {results['imagenet_a']['top1']:.2f} |" in printed
    assert "| ImageNet-O AUROC (%) ↑ (partial set†) | " in printed
    assert "| ImageNet-O FPR at 95% recall (%) ↓ (partial set†) | " in printed
    assert "| ImageNet-200 top-1, ImageNet-R's classes (%) ↑ (partial set†) | " in printed
    assert "† ImageNet-A is not the whole release (198 of its 200 classes missing; 6 of its 7,500 images)" in printed
    a, r, o = results["imagenet_a"], results["imagenet_r"], results["imagenet_o"]
    assert a["images"] == 6 and a["classes"] == 2 and a["dir"] == str(trees["a"])
    assert r["images"] == 6 and r["classes"] == 3
    assert o["images_out"] == 3 and o["images_in"] == 8  # the 8 validation images of harvestman
    assert r["imagenet_200_images"] == 24 and r["imagenet_200_classes"] == 3  # the validation images of its classes
    assert r["top1_drop"] == pytest.approx(r["imagenet_200_top1"] - r["top1"])
    for value in (a["top1"], a["aurra"], r["top1"], r["imagenet_200_top1"], o["aupr"], o["auroc"], o["fpr95"]):
        assert 0 <= value <= 100
    assert a["calibration_rms"] is None  # 6 images: no bin of 100 to sum, by the authors' definition
    for top1 in (a["top1"], r["top1"]):  # a share of 6 images
        assert top1 * 6 / 100 == pytest.approx(round(top1 * 6 / 100))
    # a few classes of each release: partial, in the JSON and the printed table; measured in float32
    assert (a["partial"], a["missing_classes"], a["extra_classes"], o["missing_classes"]) == (True, 198, [], 199)
    # the tests' ImageNet-R tree borrows ImageNet-A classes: none of ImageNet-R's 200
    assert (r["missing_classes"], r["extra_classes"]) == (200, sorted([BULLFROG, ALLIGATOR, HARVESTMAN]))
    assert a["missing_images"] == 7500 - 6 and o["release_images_in"] == 10_000
    assert a["precision"] == r["precision"] == o["precision"] == "float32"
    for part in (a, r, o):
        baseline = part.pop("baseline")
        assert part.pop("baseline_checkpoint") == str(wnid_checkpoint)
        own = {key: value for key, value in part.items() if key not in ("dir", "precision")}
        assert baseline.pop("extra_classes") == own.pop("extra_classes") and baseline == pytest.approx(own)
    # one line per pass: clean, then A, R, R's ImageNet-200, O and O's in-distribution images, for the model and
    # the baseline
    lines = [line for line in err.splitlines() if line.startswith("eval [")]
    assert len(lines) == 11, lines
    assert lines[1].startswith(f"eval [2/11] ImageNet-A: top-1 {a['top1']:.2f}% on 6 images (")
    assert lines[3].startswith(
        f"eval [4/11] ImageNet-R ImageNet-200: top-1 {r['imagenet_200_top1']:.2f}% on 24 images ("
    )
    assert lines[4].startswith("eval [5/11] ImageNet-O: 3 images (")
    assert lines[5].startswith("eval [6/11] ImageNet-O in-distribution: 8 images (")
    assert lines[10].startswith("eval [11/11] baseline ImageNet-O in-distribution: 8 images (")


def _eval_error(capsys, *arguments: str) -> str:
    assert main(["eval", "--no-plots", *arguments]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mjp eval: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip().removeprefix("mjp eval: error: ")


@pytest.mark.parametrize("case", ["flat", "nested", "unknown", "empty", "directories"])
def test_mjp_eval_refuses_a_bad_tree_before_any_pass(wnid_checkpoint, tmp_path, capsys, monkeypatch, case):
    from mjp_fast.evaluate import run as evaluate_run

    def no_evaluation(*args, **kwargs):
        raise AssertionError("the model was evaluated before the tree was checked")

    monkeypatch.setattr(evaluate_run, "_Evaluator", no_evaluation)
    (tmp_path / "trees").mkdir()
    root, message = _layout_error(tmp_path / "trees", case)
    err = _eval_error(
        capsys, "--checkpoint", str(wnid_checkpoint), "--output", str(tmp_path), "--imagenet-a", str(root)
    )
    assert err.startswith(message), err


def test_mjp_eval_refuses_models_without_the_sets_classes(wnid_checkpoint, trees, tmp_path, capsys, cifar_tree):
    arguments = ["--checkpoint", str(wnid_checkpoint), "--output", str(tmp_path)]
    # a class the model was not trained on (flamingo is an ImageNet-A class)
    missing = make_tree(tmp_path / "imagenet-a", {BULLFROG: 1, FLAMINGO: 1})
    err = _eval_error(capsys, *arguments, "--imagenet-a", str(missing))
    assert err.startswith(f"--imagenet-a: the model has no output for 1 of the 2 ImageNet-A classes ({FLAMINGO})")
    # a model of classes that are not ImageNet's (the checkpoint on CIFAR-10 folders: airplane, automobile, cat)
    err = _eval_error(capsys, *arguments, "--data", str(cifar_tree), "--imagenet-o", str(trees["o"]))
    assert err.startswith("--imagenet-o: the model's 3 classes (airplane, automobile, cat) are not ImageNet-1k classes")


def test_mjp_eval_help_names_the_sources(capsys):
    assert main(["eval", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--imagenet-a", "--imagenet-r", "--imagenet-o"):
        assert option in text
    assert "Natural Adversarial Examples" in text and "The Many Faces of Robustness" in text
    assert "hendrycks/natural-adv-examples" in text.replace("natural-adv- examples", "natural-adv-examples")
    assert "hendrycks/imagenet-r" in text and "AURRA" in text and "AUPR" in text


def test_robustness_benchmarks_run_in_float32_where_amp_auto_picks_bfloat16(
    wnid_checkpoint, trees, tmp_path, capsys, monkeypatch
):
    # On CUDA, --amp auto is bfloat16: made so here on the CPU. The clean pass keeps it; ImageNet-A, -R and -O run
    # without autocast (float32), as their authors evaluate; an --amp named explicitly is used for them too.
    from mjp_fast.evaluate import natural
    from mjp_fast.train import device

    monkeypatch.setattr(device, "amp_dtype", lambda config, torch_device: torch.bfloat16)
    used = []
    measured = natural.subset_logits

    def spy(*args, **kwargs):
        used.append(kwargs["amp_dtype"])
        return measured(*args, **kwargs)

    monkeypatch.setattr(natural, "subset_logits", spy)
    arguments = ["eval", "--checkpoint", str(wnid_checkpoint), "--output", str(tmp_path), "--no-plots"]
    arguments += ["--imagenet-a", str(trees["a"]), "--imagenet-o", str(trees["o"])]
    assert main(arguments) == 0
    results = json.loads((tmp_path / "eval.json").read_text())
    assert results["precision"] == "bfloat16" and used == [None, None, None]
    assert results["imagenet_a"]["precision"] == results["imagenet_o"]["precision"] == "float32"
    assert "precision: float32: ImageNet-A, ImageNet-O (the authors evaluate in float32)" in capsys.readouterr().out
    used.clear()
    assert main([*arguments, "--amp", "bf16"]) == 0
    results = json.loads((tmp_path / "eval.json").read_text())
    assert used == [torch.bfloat16] * 3 and results["imagenet_a"]["precision"] == "bfloat16"


def test_require_complete_refuses_a_partial_release_before_any_pass(
    wnid_checkpoint, trees, tmp_path, capsys, monkeypatch
):
    from mjp_fast.evaluate import run as evaluate_run

    def no_evaluation(*args, **kwargs):
        raise AssertionError("the model was evaluated before the sets were checked")

    monkeypatch.setattr(evaluate_run, "_Evaluator", no_evaluation)
    err = _eval_error(
        capsys,
        "--checkpoint",
        str(wnid_checkpoint),
        "--output",
        str(tmp_path),
        "--require-complete",
        "--imagenet-a",
        str(trees["a"]),
    )
    assert err == (
        f"--require-complete: --imagenet-a {str(trees['a'])!r}: 198 of its 200 classes missing, 6 images, not its 7,500"
    )
    assert not (tmp_path / "eval.json").exists()
