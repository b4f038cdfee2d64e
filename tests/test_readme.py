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
SHARED = REPO_ROOT.parent / "shared"
CIFAR10 = SHARED / "data" / "cifar10"


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


@pytest.mark.slow
def test_readme_cifar_example_trains_with_the_default_augmentations(tmp_path):
    """The README's CIFAR-10 line, as written, with the recipe's default augmentations (RandAugment, mixup, cutmix,
    random erasing, repeated augmentation) and default loader workers; only shortened to one epoch of a subset."""
    if not CIFAR10.is_dir():
        pytest.skip(f"real CIFAR-10 not found at {CIFAR10}")
    (line,) = [line for line in command_lines("mjp train --data ../shared/data/cifar10") if "epochs=100" in line]
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


SIZE_KEYS = ("epochs", "warmup_epochs", "max_train_samples", "max_val_samples")


def _overrides(line: list[str]) -> dict[str, str]:
    return dict(argument.split("=", 1) for argument in line if "=" in argument and not argument.startswith("-"))


def test_readme_cifar_cpu_line_is_the_recipe_on_a_subset(tmp_path):
    """The README's CPU-sized CIFAR-10 line is the 100-epoch line with only its size changed, and it resolves."""
    lines = command_lines("mjp train --data ../shared/data/cifar10")
    (full,) = [line for line in lines if "epochs=100" in line]
    (small,) = [line for line in lines if "max_train_samples=2000" in line]
    unsized = {key: value for key, value in _overrides(full).items() if key not in SIZE_KEYS}
    assert {key: value for key, value in _overrides(small).items() if key not in SIZE_KEYS} == unsized
    arguments = _replace_option(_replace_option(small, "--data", str(tmp_path)), "--output", str(tmp_path / "o"))
    result = _run_mjp([*arguments, "--print-config"], timeout=120)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert {key: str(printed[key]) for key in SIZE_KEYS} == {key: _overrides(small)[key] for key in SIZE_KEYS}


OUTPUT_OPTIONS = ("--output", "--json", "--png", "--markdown", "--report")
# The one deliberate write into the checkout: the command that replaces the committed report (its line says so).
DELIBERATE = {("--report", "docs/reproduction.md")}


def test_readme_commands_write_under_runs():
    """Every output path in the README's commands is under runs/ (git ignores it) or outside the checkout, so that
    running them from the repository leaves no untracked file in it."""
    assert "/runs/" in (REPO_ROOT / ".gitignore").read_text().splitlines()
    lines = command_lines("mjp ") + command_lines("torchrun ")
    checked = 0
    for line in lines:
        for option in OUTPUT_OPTIONS:
            if option in line:
                path = line[line.index(option) + 1]
                assert path.startswith(("runs/", "/")) or (option, path) in DELIBERATE, " ".join(line)
                checked += 1
    assert checked >= 5


# Runs one README block as a program (its own file, as a user would paste it into one), in a fresh interpreter, then
# prints what it left: the shape of each tensor, the shapes of a list of tensors, ints and floats. The only thing it
# adds is a spy on torch.save, to check that a model built with pretrained=True holds the weights the block saved.
BLOCK_RUNNER = """
import json, runpy, sys

import torch

saved = []
save = torch.save


def recording_save(obj, *args, **kwargs):
    saved.append(obj)
    return save(obj, *args, **kwargs)


torch.save = recording_save
namespace = runpy.run_path(sys.argv[1], run_name="__main__")


def describe(value):
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "nonzero": int(value.count_nonzero())}
    if isinstance(value, list) and value and all(isinstance(item, torch.Tensor) for item in value):
        return [list(item.shape) for item in value]
    if isinstance(value, (bool, int, float)):
        return value
    return None


report = {name: describe(value) for name, value in namespace.items() if not name.startswith("__")}
model = namespace.get("model")
if saved and isinstance(model, torch.nn.Module):
    state = model.state_dict()
    keys = ("pos_embed", "cls_token", "blocks.0.mlp.fc1.weight")
    report["model_holds_the_saved_weights"] = all(torch.equal(state[key], saved[-1][key]) for key in keys)
print("REPORT " + json.dumps({name: value for name, value in report.items() if value is not None}))
"""


def _run_block(block: str, tmp_path: Path) -> dict:
    """Runs ``block`` as its own program in a fresh interpreter, in an empty working folder with its own empty
    temporary folder; checks that it leaves both empty; returns what it left (see ``BLOCK_RUNNER``)."""
    program, working, temporary = tmp_path / "block.py", tmp_path / "working", tmp_path / "temporary"
    working.mkdir()
    temporary.mkdir()
    program.write_text(block + "\n")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(temporary)}
    for name in ("TRITON_INTERPRET", "MJP_FAST_BACKEND"):  # users run without them
        environment.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_RUNNER, str(program)],
        cwd=working,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert list(working.iterdir()) == [] and list(temporary.iterdir()) == []  # nothing left behind
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    return json.loads(line.removeprefix("REPORT "))


def _check_use_block(left: dict) -> None:
    """The "Use" block: every output has the shape its comment gives, and the DAL losses are scalars."""
    batch, grid, dim = left["batch"], left["grid"], left["dim"]
    assert left["tokens"]["shape"] == left["shuffled_tokens"]["shape"] == [batch, grid * grid, dim]
    assert left["patch_tokens"]["shape"] == [batch, grid * grid, dim]
    assert left["shuffled"]["shape"] == left["images"]["shape"] == [batch, 3, left["img_size"], left["img_size"]]
    assert left["loss"]["shape"] == left["aux"]["shape"] == []


def _check_timm_block(left: dict) -> None:
    """The "With timm" block: a loss, logits of the jigsawed images, the base's weights loaded, three feature maps."""
    images = left["images"]["shape"]
    assert left["loss"]["shape"] == [] and left["shuffled_logits"]["shape"] == [images[0], 1000]
    assert left["model_holds_the_saved_weights"] is True
    grid = images[-1] // 16
    assert left["features"] == [[images[0], 192, grid, grid]] * 3  # DeiT-Tiny's width; timm: the last three blocks


BLOCK_CHECKS = {"mjp_fast.sample_jigsaw(": _check_use_block, '"mjp_deit_tiny_patch16_224"': _check_timm_block}


@pytest.mark.parametrize("index", range(len(fenced_blocks("python"))))
def test_readme_python_block_runs_as_pasted(index, tmp_path):
    """Each ```python block on its own, exactly as README.md has it, in a new interpreter with nothing defined
    around it, offline (HF_HUB_OFFLINE=1), from an empty working folder that it must leave empty."""
    block = fenced_blocks("python")[index]
    left = _run_block(block, tmp_path)
    checks = [check for marker, check in BLOCK_CHECKS.items() if marker in block]
    for check in checks:
        check(left)


def test_readme_python_blocks_are_the_checked_ones():
    """Both blocks that BLOCK_CHECKS knows are still in README.md, one each (else their checks would not run)."""
    blocks = fenced_blocks("python")
    for marker in BLOCK_CHECKS:
        assert sum(marker in block for block in blocks) == 1, marker


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


@pytest.mark.slow
def test_readme_eval_line_on_a_comparison_run(tmp_path):
    """``mjp eval --checkpoint runs/x/mjp/last.pt --corruptions all --baseline runs/x/baseline/last.pt`` on the
    checkpoints of a short embedded-default comparison: its JSON goes to the run's folder, as the README says."""
    run = tmp_path / "x"
    trained = _run_mjp(["mjp", "train", "--output", str(run), "epochs=1", "warmup_epochs=0", "progress=off"], 600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    (line,) = [line for line in command_lines("mjp eval --checkpoint") if "--corruptions" in line]
    arguments = [argument.replace("runs/x", str(run)) for argument in line]
    result = _run_mjp(arguments, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`runs/x/mjp/eval/eval.json`" in README
    measured = json.loads((run / "mjp" / "eval" / "eval.json").read_text())
    assert {"top1", "consistency", "diff_norm", "pos_mae_1d", "corruptions", "mce"} <= set(measured)
    assert len(measured["corruptions"]["error"]) == 9 and measured["mce"] > 0  # nine corruptions, five severities


def test_readme_robustness_lines_parse_and_every_set_is_documented():
    """The README's ``mjp eval`` lines with the robustness sets parse as ``mjp eval`` arguments (the sets
    themselves cannot be downloaded here: tests/evaluate builds them in their layouts), and the README and
    ``mjp eval --help`` say where each set comes from."""
    from mjp_fast.cli import build_parser

    options = ("--imagenet-c", "--imagenet-a", "--imagenet-r", "--imagenet-o", "--cifar10-c")
    lines = [line for line in command_lines("mjp eval --checkpoint") if any(option in line for option in options)]
    assert {option for line in lines for option in options if option in line} == set(options)
    for line in lines:
        parsed = build_parser().parse_args(line[1:])
        assert parsed.checkpoint == line[line.index("--checkpoint") + 1]
    help_text = subprocess.run(
        [sys.executable, "-m", "mjp_fast.cli", "eval", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    for option in options:
        assert f"| `{option} DIR` |" in README and option in help_text
    assert "Zenodo record 2235448" in README and "Zenodo record 2535967" in README
    assert "Hendrycks & Dietterich (ICLR 2019" in help_text and "Zenodo record 2535967" in help_text


def test_readme_attack_line_and_its_quoted_numbers(tmp_path):
    """``mjp attack --ratio 0.5 --output runs/attack`` as written (from a working folder of its own), the files the
    README says it writes there, and the figures the README quotes from it."""
    (line,) = [line for line in command_lines("mjp attack") if "--compare" not in line]
    result = subprocess.run(
        [sys.executable, "-m", "mjp_fast.cli", *line[1:]],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = tmp_path / line[line.index("--output") + 1]
    assert "`attack.json`, `attack.md` and `attack.png`" in README
    assert sorted(path.name for path in output.iterdir()) == ["attack.json", "attack.md", "attack.png"]
    assert [path.name for path in tmp_path.iterdir()] == ["runs"]
    measured = json.loads((output / "attack.json").read_text())
    assert "(a) PSNR 140 dB" in README and "(b) 7.0 dB, LPIPS 0.57" in README and "(b) 140 dB again" in README
    assert round(measured["a"]["psnr"]) == 140 and round(measured["no_unk_b"]["psnr"]) == 140
    assert round(measured["b"]["psnr"], 1) == 7.0 and round(measured["b"]["lpips"], 2) == 0.57


def test_readme_compare_line_and_its_quoted_numbers(tmp_path):
    """``mjp attack --compare --prior-images ../shared/data/imagenet-samples --output runs/compare`` as written (from
    a working folder beside ``shared``, so that the README's relative path is the data's): the files it writes and
    the photo figures the README quotes (the attacker who knows MJP, against APRIL and the blind guess)."""
    (line,) = [line for line in command_lines("mjp attack") if "--compare" in line]
    prior = line[line.index("--prior-images") + 1]
    assert prior == "../shared/data/imagenet-samples"
    if not (SHARED / "data" / "imagenet-samples").is_dir():
        pytest.skip(f"the ImageNet sample images not found at {SHARED / 'data' / 'imagenet-samples'}")
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "shared").symlink_to(SHARED)
    result = subprocess.run(
        [sys.executable, "-m", "mjp_fast.cli", *line[1:]],
        cwd=work,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = work / line[line.index("--output") + 1]
    assert "`compare.md`, `compare.json` and `compare.png`" in README
    assert {"compare.json", "compare.md", "compare.png"} <= {path.name for path in output.iterdir()}
    measured = json.loads((output / "compare.json").read_text())["comparison"]

    def mean_psnr(ratio: str, attacker: str) -> float:
        values = measured["ratios"][ratio]["modes"]["per_sample"]["unk"][attacker]["psnr"]
        return sum(values) / len(values)

    blind = measured["blind"]["psnr"]
    blind = sum(blind) / len(blind) if isinstance(blind, list) else blind
    assert "27.7 dB at ratio 0.1 and still 15.7 dB at 0.75 (blind: 11.8)" in README
    assert round(mean_psnr("0.1", "adaptive"), 1) == 27.7 and round(mean_psnr("0.75", "adaptive"), 1) == 15.7
    assert round(blind, 1) == 11.8
    for ratio in ("0.1", "0.27", "0.5", "0.75"):  # the attacker who knows MJP beats APRIL at every ratio
        assert mean_psnr(ratio, "adaptive") > mean_psnr(ratio, "april") + 5
