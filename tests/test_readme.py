"""The README's commands and snippets, run as users run them (shortened only where a run would take hours)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
README = (REPO_ROOT / "README.md").read_text()
CIFAR10 = REPO_ROOT.parent / "shared" / "data" / "cifar10"


def fenced_blocks(language: str) -> list[str]:
    """The README's fenced code blocks of ``language`` ("" for blocks without one), in order."""
    blocks, current, opened = [], [], None
    for line in README.splitlines():
        if line.startswith("```"):
            if opened is None:
                opened, current = line[3:].strip(), []
            else:
                if opened == language:
                    blocks.append("\n".join(current))
                opened = None
        elif opened is not None:
            current.append(line)
    return blocks


def command_lines(prefix: str) -> list[list[str]]:
    """Every README command line (in any fenced block) that starts with ``prefix``, split like a shell, with its
    trailing comment removed."""
    found = []
    for block in fenced_blocks("") + fenced_blocks("bash"):
        for line in block.splitlines():
            if line.startswith(prefix):
                found.append(shlex.split(line, comments=True))
    return found


def _replace_option(arguments: list[str], option: str, value: str) -> list[str]:
    arguments = list(arguments)
    arguments[arguments.index(option) + 1] = value
    return arguments


def _run_mjp(arguments: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``mjp ...`` from the repository root (where the README's relative paths point), as a separate process."""
    assert arguments[0] == "mjp"
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    environment.pop("TRITON_INTERPRET", None)  # users run without the interpreter
    return subprocess.run(
        [sys.executable, "-m", "mjp_fast.cli", *arguments[1:]],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_readme_cifar_example_trains_with_the_default_augmentations(tmp_path):
    """The README's CIFAR-10 line, as written, with the recipe's default augmentations (RandAugment, mixup, cutmix,
    random erasing, repeated augmentation) and default loader workers; only shortened to one epoch of a subset."""
    if not CIFAR10.is_dir():
        pytest.skip(f"real CIFAR-10 not found at {CIFAR10}")
    (line,) = [arguments for arguments in command_lines("mjp train --data ../shared/data/cifar10")]
    arguments = _replace_option(line, "--output", str(tmp_path / "run"))
    shortened = ["epochs=1", "warmup_epochs=0", "max_train_samples=512", "max_val_samples=256", "progress=off"]
    result = _run_mjp(arguments + shortened, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    # What the README's line leaves at the recipe's defaults stays there.
    assert config["auto_augment"] == "rand-m9-mstd0.5-inc1"
    assert (config["mixup"], config["cutmix"], config["reprob"], config["repeated_aug"]) == (0.8, 1.0, 0.25, True)
    assert config["workers"] is None and config["mjp"] is True
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["epoch"] == 1
    assert (tmp_path / "run" / "last.pt").is_file()


def _snippet_namespace(batch: int, tmp_path: Path) -> dict:
    """What the README's snippets leave to the reader: images, a projection, position tables, a loss, a file."""
    import timm
    import torch

    torch.manual_seed(0)
    proj = torch.nn.Conv2d(3, 384, 16, 16)
    path = tmp_path / "deit_small.pth"
    torch.save(timm.create_model("deit_small_patch16_224").state_dict(), path)
    return {
        "step": 3,
        "images": torch.randn(batch, 3, 224, 224),
        "targets": torch.randint(0, 1000, (batch,)),
        "criterion": torch.nn.CrossEntropyLoss(),
        "dal_weight": 0.01,
        "proj": proj,
        "pos_embed": torch.randn(1, 196, 384) * 0.02,
        "unk_embed": torch.randn(384) * 0.02,
        "patch_tokens": torch.randn(batch, 196, 384),
        "path": str(path),
    }


def test_readme_python_snippets_run_as_written(tmp_path, monkeypatch):
    """Every ```python block, run in order in one namespace (the second uses names the first defines)."""
    import torch

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    blocks = fenced_blocks("python")
    assert len(blocks) == 2 and "sample_jigsaw(64" in blocks[0]
    namespace = _snippet_namespace(64, tmp_path)
    exec(compile(blocks[0], "README.md[python 1]", "exec"), namespace)  # noqa: S102 - the README's own code
    assert namespace["tokens"].shape == (64, 196, 384) and namespace["shuffled_tokens"].shape == (64, 196, 384)
    assert namespace["shuffled"].shape == (64, 3, 224, 224) and namespace["aux"].ndim == 0
    namespace.update({key: value[:2] for key, value in namespace.items() if key in ("images", "targets")})
    exec(compile(blocks[1], "README.md[python 2]", "exec"), namespace)  # noqa: S102
    assert namespace["loss"].ndim == 0 and namespace["shuffled_logits"].shape == (2, 1000)
    model, base_state = namespace["model"], torch.load(namespace["path"])
    assert torch.equal(model.state_dict()["pos_embed"], base_state["pos_embed"])  # the base's weights loaded
    assert [feature.shape[1:] for feature in namespace["features"]] == [(384, 14, 14)] * 3  # timm: last 3 blocks


def test_readme_bundled_recipe_lines_resolve(tmp_path):
    """The README's --config lines name bundled recipes: they resolve (ImageNet itself is not here to train on)."""
    lines = command_lines("mjp train --config")
    assert lines
    for line in lines:
        arguments = _replace_option(_replace_option(line, "--data", str(tmp_path)), "--output", str(tmp_path / "o"))
        result = _run_mjp([*arguments, "--print-config"], timeout=120)
        assert result.returncode == 0, result.stderr
        printed = yaml.safe_load(result.stdout)
        assert printed["model"] == "deit_small_patch16_224" and printed["mjp_ratio"] == 0.03


def test_readme_eval_line_on_a_comparison_run(tmp_path):
    """``mjp eval --checkpoint runs/x/mjp/last.pt --corruptions all --baseline runs/x/baseline/last.pt --json ...``
    on the checkpoints of a short embedded-default comparison."""
    run = tmp_path / "x"
    trained = _run_mjp(["mjp", "train", "--output", str(run), "epochs=1", "warmup_epochs=0", "progress=off"], 600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    (line,) = command_lines("mjp eval --checkpoint")
    arguments = [argument.replace("runs/x", str(run)) for argument in line]
    arguments = _replace_option(arguments, "--json", str(tmp_path / "mjp.json"))
    result = _run_mjp(arguments, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads((tmp_path / "mjp.json").read_text())
    assert {"top1", "consistency", "diff_norm", "pos_mae_1d", "corruptions", "mce"} <= set(measured)
    assert len(measured["corruptions"]["error"]) == 9 and measured["mce"] > 0  # nine corruptions, five severities


def test_readme_attack_line_and_its_quoted_numbers(tmp_path):
    """``mjp attack --ratio 0.5 --json privacy.json`` as written, and the figures the README quotes from it."""
    (line,) = command_lines("mjp attack")
    arguments = _replace_option(line, "--json", str(tmp_path / "privacy.json"))
    result = subprocess.run(
        [sys.executable, "-m", "mjp_fast.cli", *arguments[1:]],
        cwd=tmp_path,  # the grid PNG goes to the working folder
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads((tmp_path / "privacy.json").read_text())
    assert "(a) PSNR 140 dB" in README and "(b) 7.0 dB, LPIPS 0.57" in README and "(b) 140 dB again" in README
    assert round(measured["a"]["psnr"]) == 140 and round(measured["no_unk_b"]["psnr"]) == 140
    assert round(measured["b"]["psnr"], 1) == 7.0 and round(measured["b"]["lpips"], 2) == 0.57
