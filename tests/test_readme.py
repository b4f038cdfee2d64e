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
