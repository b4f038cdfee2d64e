"""Checkpoints are written atomically and read back with readable errors."""

import os
import random
import stat

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


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize("umask, expected", [(0o022, 0o644), (0o077, 0o600)])
def test_a_checkpoint_gets_the_mode_of_a_plain_write(tmp_path, umask, expected):
    previous = os.umask(umask)
    try:
        checkpoint_io.save_atomically({"value": 1}, tmp_path / "last.pt")
        (tmp_path / "plain.txt").write_text("plain")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "last.pt").stat().st_mode) == expected
    assert stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == expected


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_rewriting_a_checkpoint_keeps_its_mode(tmp_path):
    path = tmp_path / "last.pt"
    checkpoint_io.save_atomically({"value": 1}, path)
    path.chmod(0o640)  # as a plain open(path, "w") would, the next save keeps what the user chose
    checkpoint_io.save_atomically({"value": 2}, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert torch.load(path)["value"] == 2


def _checkpoint(**extra) -> dict:
    return {"model_name": "vit_tiny_patch16_224", "model_kwargs": {}, "state_dict": {}, **extra}


def test_load_refuses_a_missing_path_and_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint '.*missing.pt' does not exist"):
        checkpoint_io.load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(ConfigError, match=r"is a directory, not a checkpoint file; mjp train writes last.pt and best"):
        checkpoint_io.load_checkpoint(tmp_path)


def test_load_suggests_the_checkpoints_in_a_directory(tmp_path):
    run = tmp_path / "run"
    checkpoint_io.save_atomically(_checkpoint(), run / "last.pt")
    with pytest.raises(ConfigError) as raised:
        checkpoint_io.load_checkpoint(run)
    assert str(raised.value) == f"checkpoint {str(run)!r} is a directory, not a checkpoint file; did you mean " + (
        f"{str(run / 'last.pt')!r}?"
    )
    checkpoint_io.save_atomically(_checkpoint(), run / "best.pt")
    with pytest.raises(ConfigError, match=r"did you mean '.*run/last.pt' or '.*run/best.pt'\?"):
        checkpoint_io.load_checkpoint(run)
    # a compare run: one folder per model
    compare = tmp_path / "compare"
    for name in ("mjp", "baseline"):
        checkpoint_io.save_atomically(_checkpoint(), compare / name / "last.pt")
    with pytest.raises(ConfigError, match=r"did you mean '.*compare/mjp/last.pt' or '.*compare/baseline/last.pt'\?"):
        checkpoint_io.load_checkpoint(compare, what="baseline checkpoint")
    with pytest.raises(ConfigError, match="^baseline checkpoint "):
        checkpoint_io.load_checkpoint(compare, what="baseline checkpoint")


def test_load_refuses_files_that_are_not_checkpoints(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello world\nsecond line of text here\n")
    with pytest.raises(ConfigError) as raised:
        checkpoint_io.load_checkpoint(text)
    message = str(raised.value)
    assert message.startswith(f"checkpoint {str(text)!r} is not a file written by mjp train (torch.load failed: ")
    assert "\n" not in message

    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="is an empty file, not a checkpoint written by mjp train"):
        checkpoint_io.load_checkpoint(tmp_path / "empty.pt")

    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ConfigError, match="holds a torch-saved list, not a checkpoint written by mjp train"):
        checkpoint_io.load_checkpoint(tmp_path / "list.pt")


def test_load_refuses_a_truncated_checkpoint(tmp_path):
    whole = tmp_path / "last.pt"
    checkpoint_io.save_atomically(_checkpoint(state_dict={"weight": torch.zeros(4096)}), whole)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ConfigError) as raised:
        checkpoint_io.load_checkpoint(cut)
    message = str(raised.value)
    assert message.startswith(f"checkpoint {str(cut)!r} is truncated or damaged, or not a checkpoint written by mjp")
    assert "(torch.load failed: " in message and "\n" not in message
    assert "If you are seeing this error" not in message  # torch's paragraph of advice is cut off


def test_load_names_the_missing_keys(tmp_path):
    torch.save({"model_name": "x", "weights": 1}, tmp_path / "partial.pt")
    with pytest.raises(ConfigError) as raised:
        checkpoint_io.load_checkpoint(tmp_path / "partial.pt")
    assert str(raised.value).endswith(
        "is a torch file but not a checkpoint written by mjp train: it lacks the keys model_kwargs, state_dict "
        "(its keys: model_name, weights)"
    )
    torch.save(_checkpoint(), tmp_path / "whole.pt")
    assert checkpoint_io.load_checkpoint(tmp_path / "whole.pt")["model_name"] == "vit_tiny_patch16_224"
