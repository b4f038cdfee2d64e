"""``mjp eval`` on checkpoints of tiny runs on real CIFAR-10 images: the JSON, the tables, plots, corruptions."""

import json

import pytest

from mjp_fast.cli import main
from mjp_fast.evaluate.run import REQUIRED_KEYS, evaluate_checkpoint
from mjp_fast.train.config import load_config
from mjp_fast.train.loop import train
from tests.train.helpers import tiny_overrides


@pytest.fixture(scope="module")
def checkpoints(cifar_tree, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    paths = {}
    for name, mjp in (("baseline", False), ("mjp", True)):
        overrides = tiny_overrides(data=str(cifar_tree), output=str(root / name), mjp=mjp, epochs=1, warmup_epochs=0)
        paths[name] = train(load_config(None, overrides)).checkpoint
    return paths


def test_eval_writes_json_tables_and_plots(checkpoints, tmp_path, capsys):
    json_path = tmp_path / "out.json"
    arguments = ["eval", "--checkpoint", str(checkpoints["mjp"]), "--json", str(json_path), "--output", str(tmp_path)]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    assert "| top-1 (%) |" in printed and "| position MAE 2D (cells) |" in printed
    assert "| precision of the clean pass | float32 |" in printed  # on the CPU, --amp auto: no autocast
    results = json.loads(json_path.read_text())
    for key in REQUIRED_KEYS:
        assert isinstance(results[key], float), key
    assert results["jigsaw"] == "unk" and results["images"] == 24 and results["mjp"] is True
    assert set(results["position_regression"]) >= {"mae_1d", "mae_1d_std", "mae_2d", "mae_2d_std"}
    names = sorted(path.name for path in tmp_path.glob("*.png"))
    assert {"attention.png", "position_pca_2d.png", "position_pca_3d.png", "position_similarity.png"} <= set(names)
    for path in tmp_path.glob("*.png"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_baseline_consistency_uses_the_pixel_jigsaw(checkpoints, cifar_tree):
    results = evaluate_checkpoint(checkpoints["baseline"], data=str(cifar_tree), plots=None)
    assert results["jigsaw"] == "pixel" and results["mjp"] is False
    assert 0 <= results["consistency"] <= 100 and results["diff_norm"] >= 0
    # the same checkpoint, no jigsaw: no consistency
    none = evaluate_checkpoint(checkpoints["baseline"], jigsaw="none")
    assert none["consistency"] is None and none["top1"] == results["top1"]


def test_corruptions_and_mce_against_a_baseline(checkpoints):
    results = evaluate_checkpoint(
        checkpoints["mjp"],
        corruptions=["gaussian_noise", "contrast"],
        severities=[1, 5],
        baseline=checkpoints["baseline"],
    )
    corruption = results["corruptions"]
    assert set(corruption["error"]) == {"gaussian_noise", "contrast"}
    assert all(len(errors) == 2 for errors in corruption["error"].values())
    for name in ("gaussian_noise", "contrast"):
        expected = 100 * sum(corruption["error"][name]) / sum(corruption["baseline_error"][name])
        assert corruption["ce"][name] == pytest.approx(expected)
    assert results["mce"] == pytest.approx(sum(corruption["ce"].values()) / 2)
    # the corrupted images are the same from run to run
    again = evaluate_checkpoint(checkpoints["mjp"], corruptions=["gaussian_noise"], severities=[1, 5])
    assert again["corruptions"]["error"]["gaussian_noise"] == corruption["error"]["gaussian_noise"]


def test_without_a_terminal_each_pass_over_the_data_is_one_line(checkpoints, tmp_path, capsys):
    # A corruption sweep is dozens of passes over the data: in a log file (no terminal, so no bar) a user saw
    # nothing for minutes. Now each pass prints a numbered line; --progress off prints none.
    arguments = ["eval", "--checkpoint", str(checkpoints["mjp"]), "--output", str(tmp_path), "--no-plots"]
    sweep = ["--corruptions", "contrast", "--severities", "1", "3", "--baseline", str(checkpoints["baseline"])]
    assert main([*arguments, *sweep]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eval [")]
    results = json.loads((tmp_path / "eval.json").read_text())
    assert len(lines) == 5, lines  # clean, then 2 severities for each model
    assert lines[0] == f"eval [1/5] clean: top-1 {results['top1']:.2f}% on 24 images" + lines[0][lines[0].index(" (") :]
    errors = results["corruptions"]["error"]["contrast"]
    assert lines[2].startswith(f"eval [3/5] contrast severity 3: top-1 {100 - errors[1]:.2f}% on 24 images (")
    assert lines[4].startswith("eval [5/5] baseline contrast severity 3: top-1 ")
    assert main([*arguments, "--progress", "off"]) == 0
    assert "eval [" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--checkpoint", "missing.pt"], "checkpoint 'missing.pt' does not exist"),
        (["--ratio", "2"], "a ratio must be in [0, 1]"),
        (["--corruptions", "fog"], "unknown corruption 'fog'"),
        (["--data", "no/such/data"], "data folder 'no/such/data' does not exist"),
        (["--jigsaw", "unk", "--baseline-run"], "unrecognized arguments"),
    ],
)
def test_eval_errors(checkpoints, tmp_path, capsys, arguments, message):
    if "--checkpoint" not in arguments:
        arguments = ["--checkpoint", str(checkpoints["mjp"]), *arguments]
    assert main(["eval", "--output", str(tmp_path), *arguments]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _eval_error(capsys, *arguments: str) -> str:
    """Runs ``mjp eval`` expecting exit code 2; returns its one-line error."""
    assert main(["eval", *arguments]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mjp eval: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_eval_refuses_a_file_that_is_not_a_checkpoint(tmp_path, capsys):
    import torch

    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a checkpoint")
    assert "is not a file written by mjp train (torch.load failed: " in _eval_error(capsys, "--checkpoint", str(broken))
    text = tmp_path / "notes.txt"
    text.write_text("hello world\nsecond line of text here\n")
    assert f"checkpoint {str(text)!r} is not a file written by mjp train (torch.load failed: " in _eval_error(
        capsys, "--checkpoint", str(text)
    )
    torch.save({"weights": 1}, tmp_path / "other.pt")
    err = _eval_error(capsys, "--checkpoint", str(tmp_path / "other.pt"))
    assert err.endswith(
        "is a torch file but not a checkpoint written by mjp train: it lacks the keys model_name, model_kwargs, "
        "state_dict (its keys: weights)"
    )


def test_eval_refuses_a_truncated_checkpoint(checkpoints, tmp_path, capsys):
    cut = tmp_path / "cut.pt"
    cut.write_bytes(checkpoints["mjp"].read_bytes()[:1000])
    assert f"checkpoint {str(cut)!r} is truncated or damaged, or not a checkpoint written by mjp train" in (
        _eval_error(capsys, "--checkpoint", str(cut))
    )


def test_eval_given_a_directory_suggests_its_checkpoints(checkpoints, tmp_path, capsys):
    run = checkpoints["mjp"].parent
    err = _eval_error(capsys, "--checkpoint", str(run), "--output", str(tmp_path))
    assert (
        f"checkpoint {str(run)!r} is a directory, not a checkpoint file; did you mean {str(run / 'last.pt')!r}" in err
    )
    assert "does not exist" not in err
    # the folder of a compare run (or any folder above the runs): its mjp/ and baseline/ checkpoints
    assert f"did you mean {str(run.parent / 'mjp' / 'last.pt')!r} or {str(run.parent / 'baseline' / 'last.pt')!r}?" in (
        _eval_error(capsys, "--checkpoint", str(run.parent), "--output", str(tmp_path))
    )
    err = _eval_error(capsys, "--checkpoint", str(tmp_path))
    assert "is a directory, not a checkpoint file; mjp train writes last.pt and best.pt into its output folder" in err


def test_eval_checks_the_baseline_before_evaluating(checkpoints, tmp_path, capsys, monkeypatch):
    from mjp_fast.evaluate import run as evaluate_run

    def no_evaluation(*args, **kwargs):
        raise AssertionError("the model was evaluated before the baseline was loaded")

    monkeypatch.setattr(evaluate_run, "_Evaluator", no_evaluation)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    arguments = ["--checkpoint", str(checkpoints["mjp"]), "--corruptions", "contrast", "--output", str(tmp_path)]
    err = _eval_error(capsys, *arguments, "--baseline", str(tmp_path / "notes.txt"))
    assert f"baseline checkpoint {str(tmp_path / 'notes.txt')!r} is not a file written by mjp train" in err
    run = checkpoints["baseline"].parent
    err = _eval_error(capsys, *arguments, "--baseline", str(run))
    assert f"baseline checkpoint {str(run)!r} is a directory, not a checkpoint file; did you mean" in err


def test_eval_refuses_a_baseline_with_another_class_count(checkpoints, tmp_path, capsys, cifar_tree):
    # CE and mCE (the proxy's, ImageNet-C's, CIFAR-10-C's) compare the two models on the same classes: a baseline
    # trained on other classes is refused before any pass, for every comparison, not only the natural sets'
    for split in ("train", "test"):
        (tmp_path / "two" / split).mkdir(parents=True)
        for name in ("airplane", "cat"):
            (tmp_path / "two" / split / name).symlink_to((cifar_tree / split / name).resolve())
    overrides = tiny_overrides(data=str(tmp_path / "two"), output=str(tmp_path / "run"), epochs=1, warmup_epochs=0)
    two = train(load_config(None, [*overrides, "mjp=false"])).checkpoint
    capsys.readouterr()  # the training's own output
    arguments = ["--checkpoint", str(checkpoints["mjp"]), "--corruptions", "contrast", "--severities", "1"]
    err = _eval_error(capsys, *arguments, "--no-plots", "--output", str(tmp_path / "eval"), "--baseline", str(two))
    assert "--baseline: the baseline has 2 classes, the model 3: the comparisons score both on the same classes" in err


def test_eval_refuses_data_with_another_class_count(checkpoints, tmp_path, capsys, cifar_tree):
    for split in ("val",):
        for name in ("a", "b"):
            (tmp_path / "data" / split / name).mkdir(parents=True)
            source = next((cifar_tree / "test" / "cat").iterdir())
            (tmp_path / "data" / split / name / "x.jpg").symlink_to(source.resolve())
    assert main(["eval", "--checkpoint", str(checkpoints["mjp"]), "--data", str(tmp_path / "data")]) == 2
    assert "the model has 3 classes but the data has 2" in capsys.readouterr().err


def test_eval_help_explains_every_option(capsys):
    assert main(["eval", "--help"]) == 0
    text = capsys.readouterr().out
    for option in ("--checkpoint", "--data", "--json", "--ratio", "--corruptions", "--baseline", "--severities"):
        assert option in text
    for metric in ("consistency", "diff-norm", "position MAE", "mCE"):
        assert metric in text
