"""``mjp eval --cifar10-c``: tiny arrays in CIFAR-10-C's published layout made from real CIFAR-10 test images
(../shared/data/cifar10), the table against hand arithmetic, and the one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mjp_fast.cli import main
from mjp_fast.evaluate.cifar10_c import CIFAR10_CLASSES, open_cifar10_c
from mjp_fast.evaluate.common_corruptions import BENCHMARK, corruption_table
from tests.evaluate.corruption_helpers import (
    PER_SEVERITY,
    ConstantClassifier,
    cifar_pictures,
    link,
    measure,
    train_tiny,
    write_cifar10_c,
)
from tests.train.helpers import CIFAR10


@pytest.fixture(scope="module")
def pictures() -> dict[int, list[np.ndarray]]:
    if not CIFAR10.is_dir():
        pytest.skip(f"real CIFAR-10 not found at {CIFAR10}")
    return cifar_pictures()


def test_table_against_hand_arithmetic_with_classes_matched_by_name(pictures, tmp_path):
    # The model's classes in reverse order: "airplane" is its output 9. A model that always answers airplane errs
    # on the images of other classes: 3, 2, 1, 0 and 4 of the 4 images at severities 1 to 5. Matched by index
    # instead of name, output 9 (truck) would be wrong everywhere.
    classes = list(reversed(CIFAR10_CLASSES))
    sets = open_cifar10_c(write_cifar10_c(tmp_path / "c", pictures), classes)
    assert list(sets.sources) == ["gaussian_noise", "fog"] and sets.reference is None and sets.crop_pct is None
    errors = measure(ConstantClassifier(10, classes.index("airplane")), sets)
    assert errors == {"gaussian_noise": [75.0, 50.0, 25.0, 0.0, 100.0], "fog": [75.0, 50.0, 25.0, 0.0, 100.0]}
    # a baseline that always answers automobile errs on 3, 3, 3, 4 and 0 of 4
    baseline = measure(ConstantClassifier(10, classes.index("automobile")), sets)
    table = corruption_table(errors, reference=sets.reference, baseline=baseline)
    assert table["ce"] is None and table["mce"] is None  # no published reference errors for CIFAR-10-C
    assert table["mean_error"]["fog"] == pytest.approx((75 + 50 + 25 + 0 + 100) / 5)
    assert table["mean_corruption_error"] == pytest.approx(50.0)
    assert table["baseline"]["mean_corruption_error"] == pytest.approx((75 + 75 + 75 + 100 + 0) / 5)
    assert table["ce_vs_baseline"]["fog"] == pytest.approx(100 * 250 / 325)
    assert table["mce_vs_baseline"] == pytest.approx(100 * 250 / 325)
    assert table["families"] == {"noise": ["gaussian_noise"], "weather": ["fog"]}


def test_labels_of_one_severity_are_read_too(pictures, tmp_path):
    root = write_cifar10_c(tmp_path / "c", pictures, labels=[[0, 1, 2, 3]] * 5, per_severity_labels=True)
    sets = open_cifar10_c(root, list(CIFAR10_CLASSES))
    errors = measure(ConstantClassifier(10, 0), sets)
    assert errors["fog"] == [75.0] * 5
    image, target = sets.sources["fog"][4]()[3]
    assert target == 3 and image.size == (32, 32)  # no transform set: the stored picture itself


def _broken(root: Path, case: str) -> None:
    if case == "no labels":
        (root / "labels.npy").unlink()
    elif case == "no corruption file":
        for path in root.glob("*.npy"):
            if path.name != "labels.npy":
                path.unlink()
    elif case == "4 severities":
        np.save(root / "fog.npy", np.load(root / "fog.npy")[:18])
    elif case == "grayscale":
        np.save(root / "fog.npy", np.load(root / "fog.npy")[..., 0])
    elif case == "float":
        np.save(root / "fog.npy", np.load(root / "fog.npy").astype(np.float32))
    elif case == "labels count":
        np.save(root / "labels.npy", np.zeros(7, np.int64))
    elif case == "labels range":
        np.save(root / "labels.npy", np.full(20, 10, np.int64))
    elif case == "not numpy":
        (root / "fog.npy").write_text("not an array")
    elif case in ("empty labels", "empty corruption"):
        (root / ("labels.npy" if case == "empty labels" else "fog.npy")).write_bytes(b"")
    elif case in ("negative dimension", "negative length"):
        # a header that declares a negative dimension, the data after it intact
        name = "fog.npy" if case == "negative dimension" else "labels.npy"
        stored = (root / name).read_bytes()
        shape = str(np.load(root / name).shape).encode()
        (root / name).write_bytes(stored.replace(shape, shape.replace(b"(", b"(-", 1), 1))


@pytest.mark.parametrize(
    "case, message",
    [
        ("no labels", "--cifar10-c: '{root}/labels.npy' is missing: CIFAR-10-C's labels come in it"),
        ("no corruption file", "--cifar10-c: '{root}' holds none of CIFAR-10-C's corruption files"),
        ("4 severities", "--cifar10-c: '{root}/fog.npy' holds uint8 [18, 32, 32, 3]: CIFAR-10-C's arrays are uint8 "),
        ("grayscale", "--cifar10-c: '{root}/fog.npy' holds uint8 [20, 32, 32]: "),
        ("float", "--cifar10-c: '{root}/fog.npy' holds float32 [20, 32, 32, 3]: "),
        ("labels count", "--cifar10-c: '{root}/labels.npy' has 7 labels for the 20 images of '{root}/fog.npy'"),
        ("labels range", "--cifar10-c: '{root}/labels.npy' holds labels outside 0..9 (from 10 to 10)"),
        ("not numpy", "--cifar10-c: cannot read '{root}/fog.npy' as a NumPy array"),
        ("empty labels", "--cifar10-c: cannot read '{root}/labels.npy' as a NumPy array (No data left in file)"),
        ("empty corruption", "--cifar10-c: cannot read '{root}/fog.npy' as a NumPy array (No data left in file)"),
        ("negative dimension", "--cifar10-c: cannot read '{root}/fog.npy' as a NumPy array ("),
        ("negative length", "--cifar10-c: cannot read '{root}/labels.npy' as a NumPy array ("),
        ("no folder", "--cifar10-c: folder '{root}' does not exist"),
        ("fewer classes", "--cifar10-c: the model's 3 classes (airplane, automobile, cat) lack CIFAR-10's bird, deer,"),
    ],
)
def test_layout_errors_are_one_line_naming_the_option(pictures, tmp_path, case, message):
    root = tmp_path / "c"
    if case != "no folder":
        write_cifar10_c(root, pictures, corruptions=("fog",))
        _broken(root, case)
    classes = ["airplane", "automobile", "cat"] if case == "fewer classes" else list(CIFAR10_CLASSES)
    with pytest.raises(ValueError) as raised:
        open_cifar10_c(root, classes)
    text = str(raised.value)
    assert message.format(root=root) in text and "\n" not in text


@pytest.fixture(scope="module")
def cifar_runs(pictures, tmp_path_factory):
    """A tiny MJP model and a tiny baseline trained on all ten CIFAR-10 classes (links to real images), and a
    CIFAR-10-C set of two corruptions."""
    root = tmp_path_factory.mktemp("cifar10c")
    for name in CIFAR10_CLASSES:
        for split, count in (("train", 3), ("test", 2)):
            for path in sorted((CIFAR10 / split / name).iterdir())[:count]:
                link(path, root / "data" / split / name / path.name)
    return {
        "mjp": train_tiny(root / "data", root / "runs" / "mjp", mjp=True),
        "baseline": train_tiny(root / "data", root / "runs" / "baseline", mjp=False),
        "set": write_cifar10_c(root / "c", pictures),
    }


def test_eval_cli_on_a_cifar10_c_set(cifar_runs, tmp_path, capsys):
    arguments = ["eval", "--checkpoint", str(cifar_runs["mjp"]), "--cifar10-c", str(cifar_runs["set"])]
    arguments += ["--baseline", str(cifar_runs["baseline"]), "--output", str(tmp_path), "--attention-images", "0"]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    results = json.loads((tmp_path / "eval.json").read_text())
    table = results["cifar10_c"]
    assert table["images"] == PER_SEVERITY and table["ce"] is None and table["mce"] is None
    assert table["mean_corruption_error"] == pytest.approx(
        sum(sum(errors) / 5 for errors in table["error"].values()) / 2
    )
    assert table["mce_vs_baseline"] == pytest.approx(sum(table["ce_vs_baseline"].values()) / 2)
    # 2 of the 15 corruptions, 4 of the 10,000 test images a pass: marked as not the release
    assert table["partial"] is True and table["missing_corruptions"] == 13 and table["missing_images"] == 10_000 - 4
    assert table["relative_mce"] is None and table["precision"] == "float32"
    row = f"| CIFAR-10-C mean corruption error (%) ↓ (partial set†) | {table['mean_corruption_error']:.2f} | "
    assert row + f"{table['baseline']['mean_corruption_error']:.2f} | - | - |" in printed
    assert "| CIFAR-10-C mean CE against the baseline (%, baseline = 100) ↓ (partial set†) | " in printed
    assert "† CIFAR-10-C is not the whole release (13 of the 15 corruptions missing" in printed
    assert "| fog | weather |" in printed
    assert (tmp_path / "cifar10_c_severity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "imagenet_c" not in results


def test_eval_cli_errors_are_one_line(cifar_runs, tmp_path, capsys):
    broken = tmp_path / "c"
    broken.mkdir()
    np.save(broken / "labels.npy", np.zeros(20, np.int64))
    arguments = ["eval", "--checkpoint", str(cifar_runs["mjp"]), "--cifar10-c", str(broken), "--output", str(tmp_path)]
    assert main(arguments) == 2
    err = capsys.readouterr().err
    assert err == (
        f"mjp eval: error: --cifar10-c: {str(broken)!r} holds none of CIFAR-10-C's corruption files "
        "(gaussian_noise.npy, shot_noise.npy, ...): expected --cifar10-c DIR/<corruption>.npy and "
        "DIR/labels.npy\n"
    )


@pytest.mark.parametrize("case", ["empty labels", "empty corruption", "negative dimension"])
def test_eval_cli_unreadable_arrays_are_one_line_and_exit_2(cifar_runs, pictures, tmp_path, capsys, case):
    # an empty .npy was an EOFError, a negative dimension in a 4D header an OverflowError: tracebacks
    root = write_cifar10_c(tmp_path / "c", pictures, corruptions=("fog",))
    _broken(root, case)
    arguments = ["eval", "--checkpoint", str(cifar_runs["mjp"]), "--cifar10-c", str(root), "--output", str(tmp_path)]
    assert main(arguments) == 2
    err = capsys.readouterr().err
    name = "labels.npy" if case == "empty labels" else "fog.npy"
    assert err.startswith(f"mjp eval: error: --cifar10-c: cannot read {str(root / name)!r} as a NumPy array (")
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_require_complete_refuses_a_set_short_of_the_release(cifar_runs, pictures, tmp_path, capsys):
    arguments = ["eval", "--checkpoint", str(cifar_runs["mjp"]), "--output", str(tmp_path), "--no-plots"]
    # 2 of the 15 corruptions: refused before any pass
    assert main([*arguments, "--require-complete", "--cifar10-c", str(cifar_runs["set"])]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"mjp eval: error: --require-complete: --cifar10-c {str(cifar_runs['set'])!r}: 13 of the 15 corruptions "
        "missing (shot_noise, impulse_noise, defocus_blur, ...)\n"
    )
    # all 15, on 4 of the 10,000 test images a pass: known once measured, then refused, no results written
    whole = write_cifar10_c(tmp_path / "c15", pictures, corruptions=BENCHMARK)
    assert main([*arguments, "--require-complete", "--cifar10-c", str(whole)]) == 2
    err = capsys.readouterr().err  # after the passes' lines
    assert err.endswith(
        "\nmjp eval: error: --require-complete: CIFAR-10-C is not its whole release (measured on less of it): no "
        "results written\n"
    )
    assert not (tmp_path / "eval.json").exists()
    # without the flag: measured, and marked partial for its images only
    assert main([*arguments, "--cifar10-c", str(whole)]) == 0
    table = json.loads((tmp_path / "eval.json").read_text())["cifar10_c"]
    assert table["partial"] is True and table["missing_corruptions"] == 0 and table["missing_images"] == 10_000 - 4
    assert table["partial_with_extras"] is True and len(table["missing_extras"]) == 4
