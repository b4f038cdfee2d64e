"""Checkpoints are written atomically and read back with readable errors."""

import os
import random

import numpy as np
import pytest
import torch

from mjp_fast.train import checkpoint as checkpoint_io
from mjp_fast.train.config import ConfigError


def test_save_replaces_the_file_atomically(tmp_path):
    path = tmp_path / "last.pt"
    checkpoint_io.save_atomically({"value": 1}, path)
    checkpoint_io.save_atomically({"value": 2}, path)
    assert torch.load(path)["value"] == 2
    assert os.listdir(tmp_path) == ["last.pt"]  # no temporary file left


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    checkpoint_io.save_atomically({"value": 1}, path)

    def broken_save(payload, file):
        file.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint_io.save_atomically({"value": 2}, path)
    monkeypatch.undo()
    assert torch.load(path)["value"] == 1
    assert os.listdir(tmp_path) == ["last.pt"]


def test_rng_states_round_trip():
    states = checkpoint_io.rng_states()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint_io.restore_rng_states(states)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        checkpoint_io.load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "garbage.pt").write_text("garbage")
    with pytest.raises(ConfigError, match="cannot read checkpoint"):
        checkpoint_io.load_checkpoint(tmp_path / "garbage.pt")
    torch.save({"model_name": "x"}, tmp_path / "partial.pt")
    with pytest.raises(ConfigError, match="is not an mjp checkpoint"):
        checkpoint_io.load_checkpoint(tmp_path / "partial.pt")
