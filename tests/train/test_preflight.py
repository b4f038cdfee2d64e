"""What ``mjp train`` checks before its first step (mjp_fast.train.preflight): both models of a comparison, the
folders and the device, every problem at once; the ViT keys of the embedded default fitted to a ResNet."""

import subprocess
import sys
import warnings

import pytest
import torch

from mjp_fast.cli import main
from mjp_fast.train import compare, loop, preflight, train
from mjp_fast.train.config import ConfigError, load_config
from mjp_fast.train.models import create_model, model_spec
from mjp_fast.train.preflight import build_for_checks, check_run
from tests.train.helpers import REPO_ROOT, tiny_overrides

VIT_KEYS_NONE = ["img_size=none", "patch_size=none", "embed_dim=none", "depth=none", "num_heads=none"]


class TrainingStarted(Exception):
    """Raised by the stand-in for train(): the command got as far as training a model."""


@pytest.fixture
def trained(monkeypatch):
    """train() where the CLI and the comparison call it, replaced: it records each run's config and stops the
    command before any training step. The list of recorded configs is the fixture's value."""
    configs = []

    def train(config, *, resume=False):
        configs.append(config)
        raise TrainingStarted(config.output)

    monkeypatch.setattr(loop, "train", train)  # the CLI imports it from loop when it runs
    monkeypatch.setattr(compare, "train", train)
    return configs


@pytest.fixture
def built(monkeypatch):
    """The check builds: (model name, default device) of each, in order."""
    builds = []

    def create(model_name, model_kwargs):
        builds.append((model_name, torch.get_default_device().type))
        return create_model(model_name, model_kwargs)

    monkeypatch.setattr(preflight, "create_model", create)
    return builds


def _error_lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err.strip().splitlines()


def test_resnet18_on_the_embedded_default_gets_no_vit_keys(trained, built, tmp_path, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TrainingStarted):
            main(["train", "--output", str(tmp_path / "run"), "model=resnet18"])
    # both models were built before the baseline's training began, on the meta device
    assert built == [("resnet18", "meta"), ("resnet18", "meta"), ("mjp_resnet18", "meta")]
    (baseline,) = trained
    assert not baseline.mjp and baseline.output == str(tmp_path / "run" / "baseline")
    assert (baseline.img_size, baseline.patch_size, baseline.embed_dim, baseline.depth, baseline.num_heads) == (
        (None,) * 5
    )
    # the recipe's DAL, which the user did not ask for, is off for a model without a position table: no warning
    assert baseline.mjp_dal == "none" and not [w for w in caught if "dal=" in str(w.message)]
    (note,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mjp train: note: ")]
    assert "img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=4 (a ViT's shape, not set here)" in note
    assert "not passed to resnet18 (ResNet)" in note and "224 px" in note
    for use_mjp in (False, True):  # the runs' configs build their real models
        create_model(*model_spec(baseline, 10, mjp=use_mjp))


def test_the_issues_resnet18_command_builds_both_models_before_training(trained, built, tmp_path):
    arguments = ["train", "--output", str(tmp_path / "run"), "model=resnet18", *VIT_KEYS_NONE]
    with pytest.raises(TrainingStarted):
        main([*arguments, "epochs=2", "warmup_epochs=0"])
    assert [name for name, _ in built] == ["resnet18", "resnet18", "mjp_resnet18"]
    assert len(trained) == 1 and trained[0].mjp_dal == "none"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model=resnet18", "img_size=32"], "resnet18 (ResNet) does not take img_size=32: drop it"),
        (
            ["model=resnet18", "compare=false", "depth=2", "num_heads=2"],
            "resnet18 (ResNet) does not take depth=2, num_heads=2: drop them",
        ),
        (["model=swin_tiny_patch4_window7_224", "depth=2"], "(SwinTransformer) does not take depth=2: drop it"),
    ],
)
def test_a_key_the_model_does_not_take_fails_before_training(trained, tmp_path, capsys, overrides, message):
    assert main(["train", "--output", str(tmp_path / "run"), *overrides]) == 2
    assert trained == [] and not (tmp_path / "run").exists()
    (line,) = _error_lines(capsys)
    assert line.startswith("mjp train: error: ") and message in line


def test_a_model_only_mjp_cannot_build_fails_before_the_baseline_trains(trained, tmp_path, capsys):
    # An 8-pixel patch on 4-pixel images: timm builds the baseline (an empty grid, which would fail at its first
    # step), MJP refuses the grid when it is built: before, that was after the baseline's run.
    assert main(["train", "--output", str(tmp_path / "run"), "img_size=4", "patch_size=8"]) == 2
    assert trained == [] and not (tmp_path / "run").exists()
    (line,) = _error_lines(capsys)
    assert line.startswith("mjp train: error: cannot build model mjp_deit_tiny_patch16_224 with ")
    assert "num_classes" not in line  # the check's stand-in head is not named
    assert "grid_size[0] must be >= 1" in line


def test_a_missing_data_folder_is_reported_not_the_warmup(trained, tmp_path, capsys):
    missing = str(tmp_path / "cifar100")
    assert main(["train", "--data", missing, "--output", str(tmp_path / "run"), "epochs=1"]) == 2
    assert _error_lines(capsys) == [f"mjp train: error: data folder {missing!r} does not exist"]
    assert trained == []


def test_every_problem_is_reported_at_once_the_folder_first(tmp_path, capsys):
    missing = str(tmp_path / "cifar100")
    arguments = ["train", "--data", missing, "mjp_ratio=2", "epochs=1", "warmup_epochs=5"]
    assert main(arguments) == 2
    assert _error_lines(capsys) == [
        "mjp train: error: 3 problems:",
        f"  data folder {missing!r} does not exist",
        "  mjp_ratio must be in [0, 1], got 2.0",
        "  warmup_epochs (5) must be <= epochs (1)",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 works with a GPU")
def test_the_device_joins_the_folder_problems(trained, tmp_path, capsys):
    missing = str(tmp_path / "cifar100")
    assert main(["train", "--data", missing, "amp=fp16", "compare=false"]) == 2
    lines = _error_lines(capsys)
    assert lines[:2] == ["mjp train: error: 2 problems:", f"  data folder {missing!r} does not exist"]
    assert len(lines) == 3 and "amp=fp16 needs a CUDA device" in lines[2]


@pytest.mark.parametrize("compare", ["true", "false"])
def test_a_short_run_fits_the_warmup_and_says_so_once(trained, tmp_path, capsys, compare):
    with pytest.raises(TrainingStarted):
        main(["train", "--output", str(tmp_path / "run"), "epochs=1", f"compare={compare}"])
    assert trained[0].warmup_epochs == 0 and trained[0].epochs == 1
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mjp train: note: ")]
    assert len(notes) == 1 and "warmup_epochs=3 (not set here) does not fit in epochs=1" in notes[0]


def test_a_comparison_whose_mjp_folder_holds_a_run_fails_before_the_baseline(trained, tmp_path, capsys):
    (tmp_path / "run" / "mjp").mkdir(parents=True)
    (tmp_path / "run" / "mjp" / "last.pt").write_bytes(b"")
    assert main(["train", "--output", str(tmp_path / "run")]) == 2
    (line,) = _error_lines(capsys)
    assert f"output folder {str(tmp_path / 'run' / 'mjp')!r} already holds a run" in line
    assert trained == [] and not (tmp_path / "run" / "baseline").exists()


def test_print_config_shows_the_fitted_config_without_checking_folders(tmp_path, capsys):
    assert main(["train", "--print-config", "--data", str(tmp_path / "elsewhere"), "model=resnet18"]) == 0
    out = capsys.readouterr().out
    assert "img_size: null" in out and "mjp_dal: none" in out


def test_a_user_img_size_equal_to_the_models_own_is_dropped_silently():
    # a saved config.yaml of a ResNet run holds its resolved img_size (224): rerunning it must build
    config = check_run(load_config(None, ["model=resnet18", "img_size=224", "mjp=false"]), environment=False)
    assert config.img_size is None and config.notes == ()


# Issue 42 item 11: a DAL the user asked for, of a model that cannot do it, warned and trained on without it.
NO_TABLE_MODELS = {
    "resnet18": "resnet18 (ResNet)",
    "vit_small_patch16_rope_224": "vit_small_patch16_rope_224 (Eva)",  # a RoPE ViT: no absolute table either
}


@pytest.mark.parametrize("model", NO_TABLE_MODELS)
@pytest.mark.parametrize("dal", ["linear", "nonlinear"])
def test_a_dal_the_user_asked_of_a_model_without_a_table_is_an_error(model, dal):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error replaces the warning: none is left
        with pytest.raises(ConfigError) as caught:
            check_run(load_config("digits", [f"model={model}", f"mjp_dal={dal}"]), environment=False)
    assert caught.value.problems == [
        f"mjp_dal={dal}: {NO_TABLE_MODELS[model]} has no absolute position table for DAL to regress; set mjp_dal=none "
        "(or choose a ViT with a learned position table)"
    ]


def test_the_python_api_refuses_an_impossible_dal_before_training(monkeypatch, tmp_path):
    def train_started(config, context, resume):
        raise TrainingStarted(config.output)

    monkeypatch.setattr(loop, "_train", train_started)
    output = tmp_path / "run"
    config = load_config("digits", ["model=resnet18", "mjp_dal=nonlinear", "compare=false", f"output={output}"])
    with pytest.raises(ConfigError, match="^mjp_dal=nonlinear: resnet18 .* set mjp_dal=none"):
        train(config)
    with pytest.raises(ConfigError, match="^mjp_dal=nonlinear: resnet18"):
        compare.train_compare(config.replace(compare=True))
    assert not output.exists()
    # the recipe's DAL, not asked for, is still turned off silently; mjp_dal=none and a baseline are fine too
    for overrides in (["model=resnet18"], ["model=resnet18", "mjp_dal=none"], ["model=resnet18", "mjp=false"]):
        with pytest.raises(TrainingStarted):
            train(load_config("digits", [*overrides, "compare=false", f"output={output}"]))


def test_the_cli_refuses_an_impossible_dal_in_one_line(trained, tmp_path, capsys):
    for compare_runs in ("true", "false"):
        arguments = ["train", "--output", str(tmp_path / "run"), "model=resnet18", "mjp_dal=nonlinear"]
        assert main([*arguments, f"compare={compare_runs}"]) == 2
        (line,) = _error_lines(capsys)
        assert line.startswith("mjp train: error: mjp_dal=nonlinear: resnet18 (ResNet) has no absolute position table")
    assert trained == [] and not (tmp_path / "run").exists()


def test_python_dash_m_mjp_train_stops_before_training(cifar_tree, tmp_path):
    """The issue's command in a process of its own: before, it warned and trained a ResNet without DAL (exit 0)."""
    output = tmp_path / "run"
    overrides = tiny_overrides(
        model="resnet18", img_size=None, patch_size=None, embed_dim=None, depth=None, num_heads=None, epochs=1
    )
    command = [sys.executable, "-m", "mjp_fast.cli", "train", "--data", str(cifar_tree), "--output", str(output)]
    result = subprocess.run(
        [*command, *overrides, "warmup_epochs=0", "compare=false", "mjp_dal=nonlinear"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "mjp train: error: mjp_dal=nonlinear: resnet18 (ResNet) has no absolute position table for DAL to regress; "
        "set mjp_dal=none (or choose a ViT with a learned position table)"
    ]
    assert not output.exists()


def test_a_vit_keeps_the_presets_shape_and_dal():
    config = check_run(load_config("digits"), environment=False)
    assert (config.img_size, config.patch_size, config.embed_dim, config.depth, config.num_heads) == (16, 4, 64, 2, 4)
    assert config.mjp_dal == "nonlinear" and config.notes == ()


def test_build_for_checks_falls_back_to_the_cpu_where_meta_fails(monkeypatch):
    def refuses_meta(model_name, model_kwargs):
        if torch.get_default_device().type == "meta":  # as a constructor that calls .item() would
            raise ConfigError("Tensor.item() cannot be called on meta tensors")
        return create_model(model_name, model_kwargs)

    monkeypatch.setattr(preflight, "create_model", refuses_meta)
    model = build_for_checks("resnet18", {"num_classes": 3})
    assert {parameter.device.type for parameter in model.parameters()} == {"cpu"}
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="dim should be divisible by num_heads"):  # both fail: the model's error
        build_for_checks("deit_tiny_patch16_224", {"embed_dim": 30, "num_heads": 4})
