"""``mjp train`` on the command line: help, the compare table, resume, and one-line errors with exit codes."""

import pytest

from mjp_fast.cli import main
from mjp_fast.train.config import FIELDS
from tests.train.helpers import tiny_overrides


def test_help_explains_every_option_and_key(capsys):
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for option in ("--config", "--data", "--output", "--resume", "--resume-from", "--print-config", "KEY=VALUE"):
        assert option in text
    for name in FIELDS:
        assert f"  {name}=" in text, name


def test_print_config_shows_the_digits_default(capsys):
    assert main(["train", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "dataset: digits" in text and "compare: true" in text


def test_compare_on_digits_prints_both_runs_side_by_side(tmp_path, capsys):
    overrides = ["epochs=2", "warmup_epochs=1", "embed_dim=16", "depth=1", "eval_interval=1", "progress=off"]
    overrides += ["max_train_samples=256", "max_val_samples=64"]
    assert main(["train", "--output", str(tmp_path / "demo"), *overrides]) == 0
    out = capsys.readouterr().out
    assert "| | baseline | mjp |" in out and "| consistency (%, higher is better) |" in out
    assert "| diff-norm (lower is better) |" in out and "| position MAE 1D (cells, lower: more position kept) |" in out
    # the header names what trains: the preset's width, depth and patch, not only the timm name
    assert "deit_tiny_patch16_224 with embed_dim=16, depth=1, num_heads=4, patch 4 (4x4 grid), 16 px" in out
    assert "2 epochs x 8 steps" in out and "2 epochs each" in out
    assert (tmp_path / "demo" / "summary.json").is_file()
    assert (tmp_path / "demo" / "baseline" / "last.pt").is_file() and (tmp_path / "demo" / "mjp" / "last.pt").is_file()
    # resuming a finished comparison does no training and prints the table again
    assert main(["train", "--output", str(tmp_path / "demo"), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "finished already" in out and "| | baseline | mjp |" in out


def test_resume_extends_a_run(cifar_tree, tmp_path, capsys):
    output = tmp_path / "run"
    arguments = ["train", "--data", str(cifar_tree), "--output", str(output)]
    assert main([*arguments, *tiny_overrides(epochs=1, warmup_epochs=0)]) == 0
    assert main(["train", "--output", str(output), "--resume", "epochs=2"]) == 0
    out = capsys.readouterr().out
    assert "resuming" in out and "the schedule changed" in out
    assert len((output / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--data", "no/such/folder"], "data folder 'no/such/folder' does not exist"),
        (["--config", "missing.yaml"], "config file 'missing.yaml' does not exist"),
        (["epochs=many"], "epochs must be an integer, got 'many'"),
        (["learning_rate=1"], "unknown config key 'learning_rate'"),
        (["mjp_ratio=2"], "mjp_ratio must be in [0, 1]"),
        (["model=no_such_model"], "model 'no_such_model' is not a timm model"),
        (["model=deit_tiny_patch16_22"], "did you mean deit_tiny_patch16_224"),
        (["--resume"], "--resume needs --output DIR"),
        (["--resume-from", "nothing.pt"], "checkpoint 'nothing.pt' does not exist"),
        (["amp=fp16"], "amp=fp16 needs a CUDA device"),
        (["batch_size=5000", "epochs=1", "warmup_epochs=0"], "fewer than batch_size 5000"),
    ],
)
def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys, arguments, message):
    if torch_cuda() and "amp=fp16" in arguments:
        pytest.skip("fp16 works with a GPU")
    status = (
        main(["train", "--output", str(tmp_path / "run"), *arguments])
        if "--resume" not in arguments
        else (main(["train", *arguments]))
    )
    captured = capsys.readouterr()
    assert status == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mjp train: error: "), captured.err
    assert message in lines[0]
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize("model", ["nosuchmodel", "mjp_deit_tiny_patch16"])
def test_an_unknown_model_fails_before_anything_is_written(tmp_path, capsys, monkeypatch, model):
    monkeypatch.chdir(tmp_path)  # the default output folder, runs/..., would land here
    assert main(["train", f"model={model}"]) == 2
    assert main(["train", "--output", "run", f"model={model}", "compare=false"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and list(tmp_path.iterdir()) == []
    lines = captured.err.strip().splitlines()
    assert len(lines) == 2 and lines[0] == lines[1] and lines[0].startswith("mjp train: error: model ")
    if model.startswith("mjp_"):  # an MJP name is checked by its timm base
        assert "did you mean deit_tiny_patch16_224" in lines[0]


def test_one_epoch_is_one_epoch(tmp_path, capsys):
    arguments = ["train", "--output", str(tmp_path / "run"), "compare=false", "epochs=1", "warmup_epochs=0"]
    arguments += ["embed_dim=16", "depth=1", "max_train_samples=32", "max_val_samples=16", "progress=off"]
    assert main(arguments) == 0
    assert "; 1 epoch x 1 step, " in capsys.readouterr().out
    assert main(["train", "--output", str(tmp_path / "run"), "--resume"]) == 0
    assert "finished already (1 epoch)" in capsys.readouterr().out


def test_a_folder_with_a_run_is_not_overwritten(cifar_tree, tmp_path, capsys):
    arguments = ["train", "--data", str(cifar_tree), "--output", str(tmp_path / "run")]
    overrides = tiny_overrides(epochs=1, warmup_epochs=0, max_train_samples=16)
    assert main([*arguments, *overrides]) == 0
    assert main([*arguments, *overrides]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_bad_data_layout(tmp_path, capsys):
    (tmp_path / "data" / "train").mkdir(parents=True)
    assert main(["train", "--data", str(tmp_path / "data"), "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "has no" in err and "/data/test folder" in err and "expected <data>/<split>/<class>/<image>" in err
    (tmp_path / "data" / "val").mkdir()
    assert main(["train", "--data", str(tmp_path / "data"), "--output", str(tmp_path / "run")]) == 2
    assert "has no class folders" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written before the data is found usable


def test_nan_exits_with_code_3(cifar_tree, tmp_path, monkeypatch, capsys):
    import torch

    from mjp_fast.train import build

    class InfiniteLoss(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

        def forward(self, logits, targets):
            return logits.sum() * float("inf")

    monkeypatch.setattr(build, "SoftTargetCrossEntropy", InfiniteLoss)
    arguments = ["train", "--data", str(cifar_tree), "--output", str(tmp_path / "run"), *tiny_overrides()]
    assert main(arguments) == 3
    err = capsys.readouterr().err
    assert err.startswith("mjp train: error: the loss became ") and len(err.strip().splitlines()) == 1


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
