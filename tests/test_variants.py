"""The paper's ablation rows as plain ``mjp train`` configs (issue 13), each trained for one epoch on the embedded
digits preset, checkpointed, rebuilt and evaluated with ``mjp eval``.

B: ``mjp=false pos_embed=none``; D: ``mjp_ratio=0 mjp_dal=nonlinear`` (DAL, no jigsaw); E: ``mjp_unk=false`` (the
naive shuffle); ``dal_reduction=sum`` against the default mean.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mjp_fast import dal_loss
from mjp_fast.cli import main
from mjp_fast.train.checkpoint import load_checkpoint, load_model
from mjp_fast.train.config import load_config
from mjp_fast.train.models import model_spec

# One epoch of the digits preset, small: a 1-block, 16-wide ViT on a 4x4 grid; 32 training images (one step of
# batch 32), 16 validation images. The jigsaw is on from the first step, for every sample.
SHORT = [
    "compare=false", "epochs=1", "warmup_epochs=0", "embed_dim=16", "depth=1", "max_train_samples=32",
    "max_val_samples=16", "progress=off", "mjp_prob=1.0",
]  # fmt: skip


def _train(output: Path, *overrides: str) -> dict:
    """Runs ``mjp train`` on the digits preset; returns its one epoch's record."""
    assert main(["train", "--output", str(output), *SHORT, *overrides]) == 0
    (record,) = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return record


def _evaluate(checkpoint: Path, output: Path) -> dict:
    """Runs ``mjp eval`` on the checkpoint's own data, the 16 validation images its run evaluated; returns its
    JSON."""
    arguments = ["eval", "--checkpoint", str(checkpoint), "--output", str(output), "--no-plots", "--progress", "off"]
    arguments += ["--max-images", "16"]
    assert main(arguments) == 0
    return json.loads((output / "eval.json").read_text())


def _same_as_the_training_run(results: dict, record: dict) -> None:
    """``mjp eval`` on a run's own validation images repeats the loop's evaluation after its last epoch: the same 16
    images, the same jigsaws (``eval_ratio``, ``eval_seed``: the defaults of both) and the same 5-fold regression."""
    assert results["images"] == 16 and results["eval_ratio"] == 0.5
    for key in ("top1", "top5", "consistency", "diff_norm", "pos_mae_1d", "pos_mae_2d"):
        assert results[key] == pytest.approx(record[key], rel=1e-4, abs=1e-6), key
    assert 0.0 <= results["top1"] <= 100.0 and results["top1"] * 16 / 100 == round(results["top1"] * 16 / 100)
    assert 0.0 <= results["consistency"] <= 100.0


def _rebuilt_matches_its_config(output: Path) -> tuple[torch.nn.Module, dict]:
    """The checkpoint's model, rebuilt (strict load), and the model its saved config names: the same spec."""
    model, checkpoint = load_model(output / "last.pt")
    config = load_config(output / "config.yaml")
    name, kwargs = model_spec(config, checkpoint["model_kwargs"]["num_classes"])
    assert (name, kwargs) == (checkpoint["model_name"], checkpoint["model_kwargs"])
    return model, checkpoint


def test_b_no_position_embeddings_trains_and_is_jigsaw_invariant(tmp_path, capsys):
    record = _train(tmp_path / "b", "mjp=false", "pos_embed=none")
    assert 0.0 <= record["top1"] <= 100.0 and record["pos_mae_1d"] is None  # no position embeddings to regress
    model, checkpoint = _rebuilt_matches_its_config(tmp_path / "b")
    assert checkpoint["model_name"] == "deit_tiny_patch16_224" and checkpoint["model_kwargs"]["pos_embed"] == "none"
    assert model.pos_embed is None and "pos_embed" not in checkpoint["state_dict"]
    results = _evaluate(tmp_path / "b" / "last.pt", tmp_path / "b-eval")
    # Without position embeddings a ViT cannot tell where a patch is: the jigsawed image gives the same prediction
    # (the paper's 100.0) and the same features, up to float rounding.
    assert results["consistency"] == 100.0 and results["diff_norm"] < 1e-4
    assert results["pos_mae_1d"] is None


def test_b_with_the_jigsaw_is_the_pixel_space_model(tmp_path, capsys):
    record = _train(tmp_path / "b-mjp", "pos_embed=none", "mjp_dal=none")
    assert record["dal_loss"] is None
    model, checkpoint = _rebuilt_matches_its_config(tmp_path / "b-mjp")
    assert checkpoint["model_name"] == "mjp_deit_tiny_patch16_224"
    assert model.pos_embed is None and model.mjp.unk_embed is None and model.mjp.dal_regressor is None
    assert int(model.mjp.sampler.sample_counter) == 32  # every sample was jigsawed (in pixel space)
    assert _evaluate(tmp_path / "b-mjp" / "last.pt", tmp_path / "b-mjp-eval")["consistency"] == 100.0


def test_d_dal_without_a_jigsaw(tmp_path, capsys):
    record = _train(tmp_path / "d", "mjp_ratio=0", "mjp_dal=nonlinear")
    assert record["dal_loss"] > 0 and record["pos_mae_1d"] > 0
    model, checkpoint = _rebuilt_matches_its_config(tmp_path / "d")
    assert checkpoint["model_kwargs"]["mjp_ratio"] == 0.0
    assert int(model.mjp.sampler.sample_counter) == 0  # ratio 0 draws no jigsaw
    # In training mode the model is the plain one, and the DAL loss regresses every position.
    model.train()
    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        logits = model(images)
    assert model.mjp.last_jigsaw is None
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits, model(images))
    every_position = dal_loss(model.pos_embed[0, 1:], model.mjp.dal_regressor, (4, 4), None, backend="torch")
    torch.testing.assert_close(model.mjp_aux_loss(), every_position)
    results = _evaluate(tmp_path / "d" / "last.pt", tmp_path / "d-eval")
    _same_as_the_training_run(results, record)
    # trained without a jigsaw, measured with one (and its unknown embedding): the features move
    assert results["jigsaw"] == "unk" and results["diff_norm"] > 0 and results["pos_mae_1d"] > 0


def test_e_the_naive_shuffle_has_no_unknown_embedding(tmp_path, capsys):
    record = _train(tmp_path / "e", "mjp_unk=false")
    assert record["dal_loss"] > 0
    model, checkpoint = _rebuilt_matches_its_config(tmp_path / "e")
    assert checkpoint["model_kwargs"]["mjp_unk"] is False
    assert model.mjp.unk_embed is None and not any("unk" in key for key in checkpoint["state_dict"])
    assert int(model.mjp.sampler.sample_counter) == 32
    # `mjp eval` measures it as the plain model sees a jigsawed image: what this model trained on
    results = _evaluate(tmp_path / "e" / "last.pt", tmp_path / "e-eval")
    assert results["jigsaw"] == "pixel"
    _same_as_the_training_run(results, record)
    assert results["diff_norm"] > 0 and results["pos_mae_1d"] > 0


def test_dal_reduction_sum_doubles_the_dal_loss(tmp_path, capsys):
    # One step each, from the same seed: the recorded DAL loss is the first step's, before any update.
    mean = _train(tmp_path / "mean", "dal_reduction=mean")
    total = _train(tmp_path / "sum", "dal_reduction=sum")
    assert total["dal_loss"] == pytest.approx(2 * mean["dal_loss"], rel=1e-5)
    model, checkpoint = _rebuilt_matches_its_config(tmp_path / "sum")
    assert checkpoint["model_kwargs"]["mjp_dal_reduction"] == "sum" and model.mjp.dal_scale == 1.0
    assert load_checkpoint(tmp_path / "mean" / "last.pt")["model_kwargs"]["mjp_dal_reduction"] == "mean"
