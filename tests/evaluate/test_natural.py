"""ImageNet-A, -R, -O (mjp_fast/evaluate/natural.py): their trees in the published layout (DIR/<wnid>/*.jpg) built
in tmp_path from real ImageNet images (../shared/data/imagenet-samples) under the real WordNet ids of a handful of
ImageNet-A/O classes; a 1000-class model's logits restricted to a set's classes; `mjp eval --imagenet-a/-r/-o` end
to end on a tiny checkpoint; bad trees and models without the classes as one line and exit code 2."""

import json
import os
from pathlib import Path

import pytest
import torch
from PIL import Image
from sklearn.metrics import average_precision_score
from torch import nn

from mjp_fast.cli import main
from mjp_fast.evaluate.natural import (
    evaluate_natural_sets,
    imagenet_1k_wnids,
    model_class_wnids,
    open_natural_sets,
    read_subset_folder,
    subset_columns,
    subset_logits,
)
from mjp_fast.train.config import load_config
from mjp_fast.train.data import eval_loader, eval_transform, set_transform
from mjp_fast.train.loop import train
from mjp_fast.train.readers import folder_images
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
    assert results["imagenet_r"] == {"top1": pytest.approx(100 * 3 / 9), "images": 9, "classes": 3}
    assert results["imagenet_a"]["images"] == 9 and results["imagenet_a"]["classes"] == 3
    logits, targets = subset_logits(model, sets[0].loader, sets[0].columns, device="cpu", mean=MEAN, std=STD)
    assert torch.equal(logits, torch.tensor([[0.0, 50.0, 40.0]]).expand(9, 3))
    assert targets.tolist() == [0] * 2 + [1] * 3 + [2] * 4
    assert model(torch.zeros(1, 3, 32, 32)).argmax().item() == index[TENCH]  # unrestricted: tench
    # every image answered with the same confidence: AURRA is the accuracy, the calibration error the gap to it
    confidence = 1 / (1 + torch.tensor(-50.0, dtype=torch.float64).exp() + torch.tensor(-10.0).double().exp())
    assert results["imagenet_a"]["aurra"] == pytest.approx(100 * 3 / 9)
    assert results["imagenet_a"]["calibration_rms"] == pytest.approx(100 * (float(confidence) - 3 / 9))


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
    expected = average_precision_score([1] * 7 + [0] * 3, out_scores + in_scores)
    assert results["aupr"] == pytest.approx(100 * expected, rel=1e-6)


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
    assert case == "empty"
    make_tree(root, {BULLFROG: 1})
    (root / ALLIGATOR).mkdir()
    (root / ALLIGATOR / "notes.txt").write_text("no image here")
    return root, f"--imagenet-a: folder {str(root / ALLIGATOR)!r} holds no images"


LAYOUT_CASES = ["missing", "archive", "flat", "nested", "names", "unknown", "empty"]


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
    err = capsys.readouterr().err
    results = json.loads((tmp_path / "eval.json").read_text())
    a, r, o = results["imagenet_a"], results["imagenet_r"], results["imagenet_o"]
    assert a["images"] == 6 and a["classes"] == 2 and a["dir"] == str(trees["a"])
    assert r["images"] == 6 and r["classes"] == 3
    assert o["images_out"] == 3 and o["images_in"] == 8  # the 8 validation images of harvestman
    for value in (a["top1"], a["aurra"], a["calibration_rms"], r["top1"], o["aupr"]):
        assert 0 <= value <= 100
    for top1 in (a["top1"], r["top1"]):  # a share of 6 images
        assert top1 * 6 / 100 == pytest.approx(round(top1 * 6 / 100))
    for part in (a, r, o):
        baseline = part.pop("baseline")
        assert part.pop("baseline_checkpoint") == str(wnid_checkpoint)
        assert baseline == pytest.approx({key: value for key, value in part.items() if key != "dir"})
    # one line per pass: clean, then A, R, O and O's in-distribution images, for the model and the baseline
    lines = [line for line in err.splitlines() if line.startswith("eval [")]
    assert len(lines) == 9, lines
    assert lines[1].startswith(f"eval [2/9] ImageNet-A: top-1 {a['top1']:.2f}% on 6 images (")
    assert lines[3].startswith("eval [4/9] ImageNet-O: 3 images (")
    assert lines[4].startswith("eval [5/9] ImageNet-O in-distribution: 8 images (")
    assert lines[8].startswith("eval [9/9] baseline ImageNet-O in-distribution: 8 images (")


def _eval_error(capsys, *arguments: str) -> str:
    assert main(["eval", "--no-plots", *arguments]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mjp eval: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip().removeprefix("mjp eval: error: ")


@pytest.mark.parametrize("case", ["flat", "nested", "unknown", "empty"])
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
