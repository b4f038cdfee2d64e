"""The ``train_loop`` case (``bench/bench_train_loop.py``): the two command lines carry one recipe, both tools see
the same files, timm's log and mjp's records are read as documented, and the mjp rows run without timm's script."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `bench` is a folder of the checkout, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from bench import bench_train_loop as case  # noqa: E402

# The log lines of a real run of timm 1.0.28's train.py (timm 1.0.31 installed) on this machine: 20 updates of 64
# CIFAR-10 images with the cpu-preset model, --log-interval 5, 4 validation batches of 32 (a loaded machine: the
# rates are low). Between them, the lines that the parser must skip.
TIMM_LOG = """\
Training with a single process on 1 device (cpu).
Model deit_tiny_patch16_224 created, param count:164234
Scheduled epochs: 1 (epochs + cooldown_epochs). Warmup within epochs when warmup_prefix=False. LR stepped per update.
Train: 0 [   0/20 (  5%)]  Loss: 2.29 (2.29)  Time: 7.762s,    8.25/s  (7.762s,    8.25/s)  LR: 2.000e-03  Data: 0.776 (0.776)
Train: 0 [   5/20 ( 30%)]  Loss: 2.28 (2.27)  Time: 6.280s,   10.19/s  (5.639s,   11.35/s)  LR: 1.707e-03  Data: 0.044 (0.151)
Train: 0 [  10/20 ( 55%)]  Loss: 2.18 (2.24)  Time: 4.309s,   14.85/s  (5.340s,   11.98/s)  LR: 1.000e-03  Data: 0.002 (0.087)
Train: 0 [  15/20 ( 80%)]  Loss: 2.25 (2.23)  Time: 6.510s,    9.83/s  (5.521s,   11.59/s)  LR: 2.929e-04  Data: 0.021 (0.072)
Train: 0 [  19/20 (100%)]  Loss: 2.13 (2.21)  Time: 4.980s,   12.85/s  (5.521s,   11.59/s)  LR: 1.231e-05  Data: 0.008 (0.060)
Test: [   0/3]  Time: 2.198 (2.198)  Loss:   2.239 ( 2.239)  Acc@1:  25.000 ( 25.000)  Acc@5:  65.625 ( 65.625)
Test: [   3/3]  Time: 1.472 (1.694)  Loss:   2.248 ( 2.146)  Acc@1:   0.000 ( 19.000)  Acc@5:  75.000 ( 71.000)
Current checkpoints:
*** Best metric: 19.0 (epoch 0)"""  # noqa: E501


def test_timm_log_gives_the_last_batch_mean_rate_and_the_validation_time():
    measured = case.parse_timm_log(TIMM_LOG)
    assert measured["train_images_per_s"] == 11.59  # the mean rate at the last batch, not that batch's own
    assert measured["train_step_s"] == 5.521
    assert measured["updates"] == 20
    assert measured["eval_batches"] == 4
    assert measured["eval_s"] == pytest.approx(4 * 1.694)
    assert measured["eval_s_from_lines"] is None  # plain text: no arrival times

    timed = [(float(index), line) for index, line in enumerate(TIMM_LOG.splitlines())]
    assert case.parse_timm_log(timed)["eval_s_from_lines"] == 2.0  # last Test line (9) - last Train line (7)


def test_timm_log_without_the_last_batch_is_refused():
    cut = "\n".join(line for line in TIMM_LOG.splitlines() if "19/20" not in line)
    with pytest.raises(ValueError, match="last batch"):
        case.parse_timm_log(cut)


def test_mjp_run_reads_metrics_and_times_the_evaluation_from_its_lines(tmp_path):
    record = {"epoch": 1, "step": 40, "train_images_per_second": 400.0, "epoch_seconds": 3.2}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    lines = [
        (5.0, "mjp train: deit_tiny_patch16_224 with ..."),
        # a log line within the epoch (output not on a terminal) is not the epoch's record
        (6.1, "epoch   1/1  batch  21/40  loss 2.4102 (mean 2.4800)  lr 1.00e-03  400 img/s  ETA 0:00:01"),
        (9.7, "epoch   1/1  loss 2.3  400 img/s  3.2 s"),
    ]
    measured = case.parse_mjp_run(tmp_path, lines)
    assert measured["train_images_per_s"] == 400.0
    assert measured["train_step_s"] == pytest.approx(3.2 / 40)
    assert measured["updates"] == 40
    assert measured["eval_s"] == pytest.approx(9.7 - 5.0 - 3.2)
    assert measured["eval_source"] == "output line times"

    (tmp_path / "metrics.jsonl").write_text(json.dumps({**record, "eval_seconds": 1.25}) + "\n")
    recorded = case.parse_mjp_run(tmp_path, lines)
    assert recorded["eval_s"] == 1.25 and recorded["eval_source"] == "metrics.jsonl eval_seconds"


def _fake_image_folder(root: Path, split_sizes: dict[str, int], classes=("cat", "dog", "emu")) -> None:
    for split, size in split_sizes.items():
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            for index in range(size):
                Image.new("RGB", (4, 4), (index, 0, 0)).save(folder / f"{index:03d}.png")
            (folder / "notes.txt").write_text("not an image")


def test_image_folder_subset_links_a_balanced_fixed_subset(tmp_path):
    _fake_image_folder(tmp_path / "source", {"train": 7, "test": 5})
    info = case.image_folder_subset(tmp_path / "source", tmp_path / "a", train_images=8, val_images=4)
    again = case.image_folder_subset(tmp_path / "source", tmp_path / "b", train_images=8, val_images=4)
    assert info == again
    assert info["val_split"] == "test" and info["classes"] == ["cat", "dog", "emu"]
    assert info["images"] == {"train": 8, "test": 4}
    counts = {name: len(list((tmp_path / "a" / "train" / name).iterdir())) for name in info["classes"]}
    assert counts == {"cat": 3, "dog": 3, "emu": 2}  # as even as 8 goes over 3 classes
    for link in (tmp_path / "a").rglob("*.png"):
        assert link.is_symlink()
        assert link.resolve() == (tmp_path / "source" / link.relative_to(tmp_path / "a")).resolve()
        assert (tmp_path / "b" / link.relative_to(tmp_path / "a")).exists()  # the same files, whatever the folder
    with pytest.raises(ValueError, match="class 'cat' has 7 images, 9 wanted"):
        case.image_folder_subset(tmp_path / "source", tmp_path / "c", train_images=27, val_images=3)


def test_digits_folder_holds_the_images_that_mjp_trains_on(tmp_path):
    from mjp_fast.train.data import DigitsDataset, fixed_subset

    info = case.digits_folder(tmp_path, train_images=64, val_images=None)
    assert info["images"] == {"train": 64, "val": 360}
    assert sorted(path.name for path in (tmp_path / "train").iterdir()) == [str(digit) for digit in range(10)]
    subset = fixed_subset(DigitsDataset("train"), 64)
    written = {path.name: path for path in (tmp_path / "train").rglob("*.png")}
    for position in (0, 17, 63):
        image, target = subset[position]
        path = written[f"{position:05d}.png"]
        assert path.parent.name == str(target)
        with Image.open(path) as stored:
            assert np.array_equal(np.asarray(stored.convert("RGB")), np.asarray(image))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_both_command_lines_carry_one_recipe(tmp_path, device):
    from mjp_fast.cli import build_parser
    from mjp_fast.train.cli import config_from_args

    chosen = case.setups(
        ["embedded", "cifar10"], device=device, steps=None, val_images=1000, workers=1, threads=2, cifar10=tmp_path
    )
    assert [setup.steps for setup in chosen] == [40, 100]
    for setup in chosen:
        config = setup.config
        assert config.epochs == 1 and config.warmup_epochs == 0 and config.workers == 1 and config.threads == 2
        assert config.smoothing == 0.1 and config.clip_grad == 5.0 and config.opt == "adamw"
        assert config.sched == "cosine" and config.mixup == 0 and config.auto_augment is None
        for mjp in (False, True):
            command = case.mjp_command(config, mjp=mjp, data_dir=tmp_path, output=tmp_path / "out")
            assert command[1:4] == ["-m", "mjp_fast.cli", "train"]
            args = build_parser().parse_args(command[3:])
            parsed = config_from_args(args)
            expected = config.replace(mjp=mjp, data=str(tmp_path), output=str(tmp_path / "out"))
            if config.dataset == "digits":
                expected = expected.replace(data=None)
                parsed = parsed.replace(data=None)
            assert parsed == expected  # every key as the bench means it, whatever mjp's defaults
        timm = case.timm_command(
            Path("train.py"),
            config,
            data_dir=tmp_path,
            val_split="test",
            class_map=tmp_path / "classes.txt",
            output=tmp_path / "out",
            experiment="run",
        )
        text = " ".join(timm)
        assert f"--model {config.model} " in text
        assert f"--model-kwargs img_size={config.img_size} patch_size={config.patch_size} " in text
        assert f"-b {config.batch_size} " in text and "-j 1 " in text and f"--lr {config.lr} " in text
        assert "--sched-on-updates" in timm and "--clip-grad 5.0 --clip-mode norm" in text
        assert ("--no-prefetcher" in timm) == (device == "cpu")  # on a GPU, timm's prefetcher stays on
        assert ("--pin-mem" in timm) == (device == "cuda")
        assert ("--amp" in timm) == (device == "cuda")


def test_recipes_that_timm_cannot_be_told_are_refused():
    from mjp_fast.train.config import load_config

    with pytest.raises(ValueError, match="reprob"):
        case.check_translatable(load_config("digits", ["reprob=0.25", "cache_images=false"]))


@pytest.mark.skipif(not os.environ.get(case.TIMM_TRAIN_PY_ENV), reason="TIMM_TRAIN_PY is not set")
def test_timm_train_py_parses_the_command_as_meant(tmp_path, monkeypatch):
    """timm's own parser reads the command line the bench writes (needs the real train.py: $TIMM_TRAIN_PY)."""
    spec = importlib.util.spec_from_file_location("timm_train_script", os.environ[case.TIMM_TRAIN_PY_ENV])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # defines the parsers; main() runs only as __main__
    (setup,) = case.setups(["cifar10"], device="cpu", steps=2, val_images=10, workers=1, threads=2, cifar10=tmp_path)
    command = case.timm_command(
        Path("train.py"),
        setup.config,
        data_dir=tmp_path,
        val_split="test",
        class_map=tmp_path / "classes.txt",
        output=tmp_path,
        experiment="run",
    )
    monkeypatch.setattr(sys, "argv", command[1:])
    args, _ = script._parse_args()
    assert isinstance(args, argparse.Namespace)
    assert args.model_kwargs == {"img_size": 28, "patch_size": 2, "embed_dim": 64, "depth": 3, "num_heads": 2}
    assert (args.lr, args.weight_decay, args.clip_grad, args.smoothing) == (0.002, 0.05, 5.0, 0.1)
    assert (args.batch_size, args.workers, args.no_prefetcher, args.device) == (128, 1, True, "cpu")
    assert (args.aa, args.reprob, args.mixup, args.cutmix, args.train_interpolation) == (None, 0, 0, 0, "bicubic")
    assert args.sched_on_updates and args.epochs == 1 and args.warmup_epochs == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_runs_mjp_and_says_where_timm_train_py_comes_from(monkeypatch):
    monkeypatch.delenv(case.TIMM_TRAIN_PY_ENV, raising=False)
    section = case.collect(smoke=True, device="cpu", datasets="embedded")
    tools = [row["implementation"] for row in section["results"]]
    assert tools == [case.MJP_FALSE, case.MJP_TRUE]
    for row in section["results"]:
        assert row["steps"] == case.SMOKE_STEPS and row["batch"] == 32 and row["train_images"] == 64
        assert row["images_per_s"] > 0 and 0 < row["p20_s"] <= row["median_s"] <= row["p80_s"]
        assert row["eval_s"] is not None and row["eval_s"] > 0 and row["wall_s"] > row["eval_s"]
    assert section["results"][1]["ratio_vs_mjp_false"] == pytest.approx(
        section["results"][1]["images_per_s"] / section["results"][0]["images_per_s"]
    )
    assert section["not_run"] == {f"embedded: {case.TIMM}": case.WHERE_TIMM_TRAIN_PY}
    assert {aim["verdict"] for aim in section["aims"]} == {"NOT JUDGED"}
    printed = case.report(section, {"device": "cpu", "cpu": "test CPU", "torch_threads": 2, "gpu": None})
    assert "NOT RUN: embedded: timm train.py: timm's train.py is not in timm's wheel or sdist" in printed
    assert "| embedded | mjp train mjp=true" in printed
