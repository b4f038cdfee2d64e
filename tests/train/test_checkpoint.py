"""Checkpoints are written atomically and read back with readable errors; reading one runs nothing in it."""

import collections
import os
import pathlib
import pickle
import random
import shutil
import stat

import numpy as np
import pytest
import torch
from timm.scheduler import create_scheduler_v2

from mjp_fast.cli import main
from mjp_fast.train import checkpoint as checkpoint_io
from mjp_fast.train.config import ConfigError, load_config
from mjp_fast.train.loop import train


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


# --- weights_only: what mjp train writes loads; nothing else does, and nothing in it runs ---------------------------

# A tiny run of the embedded digits default: a 16-wide, 1-block ViT on 64 images, one checkpoint per step.
_TINY_DIGITS = ["epochs=2", "warmup_epochs=1", "embed_dim=16", "depth=1", "max_train_samples=64"]
_TINY_DIGITS += ["max_val_samples=32", "workers=0", "compare=false", "eval_interval=1", "progress=off"]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> pathlib.Path:
    """The output folder of a finished tiny run (its ``last.pt`` and ``best.pt``)."""
    output = tmp_path_factory.mktemp("checkpoints") / "run"
    train(load_config("digits", [*_TINY_DIGITS, f"output={output}", "checkpoint_steps=1"]))
    return output


def test_checkpoints_of_a_real_run_hold_tensors_and_plain_data_only(digits_run, tmp_path):
    output = tmp_path / "run"
    shutil.copytree(digits_run, output)  # resumed below: the other tests keep the finished run
    for name in ("last.pt", "best.pt"):
        # no global outside torch's own weights-only allow-list: not even the NumPy ones kept for older files
        assert torch.serialization.get_unsafe_globals_in_checkpoint(output / name) == [], name
        checkpoint = checkpoint_io.load_checkpoint(output / name)
        assert checkpoint["optimizer"]["state"] and checkpoint["scheduler"] is not None and checkpoint["metrics"]
        assert checkpoint["config"]["output"] == str(digits_run) and checkpoint["rng"]["numpy"][0] == "MT19937"
    assert checkpoint_io.load_checkpoint(output / "last.pt")["finished"]
    model, _ = checkpoint_io.load_model(output / "last.pt")
    assert not model.training
    # a run resumed from it (optimizer, schedule, generator states and all) goes on to a third epoch
    longer = load_config("digits", [*_TINY_DIGITS, f"output={output}", "checkpoint_steps=1", "epochs=3"])
    assert [record["epoch"] for record in train(longer, resume=True).history] == [1, 2, 3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mjp train's fp16 gradient scaler is CUDA's")
def test_an_fp16_run_on_cuda_saves_its_scaler_and_generators_as_plain_data(tmp_path):
    output = tmp_path / "fp16"
    train(load_config("digits", [*_TINY_DIGITS, f"output={output}", "device=cuda", "amp=fp16"]))
    assert torch.serialization.get_unsafe_globals_in_checkpoint(output / "last.pt") == []
    checkpoint = checkpoint_io.load_checkpoint(output / "last.pt")
    assert checkpoint["scaler"]["scale"] > 0 and checkpoint["rng"]["cuda"]


def test_every_part_of_a_payload_loads_back(tmp_path):
    """The parts the trainer saves, the fp16 scaler's included (a CPU scaler: the trainer's is CUDA's, the same
    state), and the values that plain_data turns into plain data."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    scheduler, _ = create_scheduler_v2(optimizer, sched="cosine", num_epochs=3, warmup_epochs=1)
    payload = _checkpoint(
        state_dict=model.state_dict(),
        optimizer=optimizer.state_dict(),
        scheduler=scheduler.state_dict(),
        scaler=scaler.state_dict(),
        rng=checkpoint_io.rng_states(),
        config=load_config("digits").to_dict(),
        metrics=[{"epoch": 1, "top1": np.float64(12.5), "images": np.int64(3)}],
        running={"loss": np.float32(0.5)},
        final={"where": pathlib.Path("/runs/x"), "counts": np.arange(3)},
    )
    checkpoint_io.save_atomically(payload, tmp_path / "last.pt")
    loaded = checkpoint_io.load_checkpoint(tmp_path / "last.pt")
    assert loaded["scaler"] == scaler.state_dict() and loaded["scaler"]["scale"] > 0
    assert loaded["optimizer"]["param_groups"] == optimizer.state_dict()["param_groups"]
    assert loaded["scheduler"] == scheduler.state_dict() and loaded["config"] == payload["config"]
    assert loaded["metrics"] == [{"epoch": 1, "top1": 12.5, "images": 3}]
    assert type(loaded["metrics"][0]["top1"]) is float
    assert loaded["final"] == {"where": "/runs/x", "counts": [0, 1, 2]}
    torch.testing.assert_close(loaded["state_dict"], model.state_dict())
    assert loaded["state_dict"]._metadata == model.state_dict()._metadata  # the module versions load_state_dict reads


def test_plain_data_keeps_what_needs_no_change():
    state = torch.nn.Linear(2, 2).state_dict()
    assert checkpoint_io.plain_data(state) is state
    nested = {"a": [1, (2.0, "x")], "b": None, "size": torch.Size([2, 3])}
    assert checkpoint_io.plain_data(nested) is nested
    ordered = collections.OrderedDict(value=np.float32(1.5))
    converted = checkpoint_io.plain_data(ordered)
    assert type(converted) is collections.OrderedDict and converted == {"value": 1.5}
    assert type(converted["value"]) is float and type(ordered["value"]) is np.float32  # a copy: the input is kept


def test_the_numpy_generator_state_is_saved_as_a_tensor_and_older_arrays_still_restore(tmp_path):
    name, key, *_ = checkpoint_io.rng_states()["numpy"]
    assert name == "MT19937" and key.dtype == torch.int64 and key.shape == (624,)
    # a checkpoint written before: NumPy's state as np.random.get_state() gives it, a uint32 array
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    older = _checkpoint(rng=states)
    torch.save(older, tmp_path / "older.pt")
    assert "numpy.ndarray" in torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "older.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint_io.restore_rng_states(checkpoint_io.load_checkpoint(tmp_path / "older.pt")["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    # written under NumPy 1, whose reconstructor lived in numpy.core: torch's legacy format, whose pickle names its
    # globals as newline-ended text, so that the module's name can be changed in place
    torch.save(older, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    numpy1 = (tmp_path / "legacy.pt").read_bytes().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    assert b"numpy.core.multiarray\n_reconstruct" in numpy1
    (tmp_path / "numpy1.pt").write_bytes(numpy1)
    key = checkpoint_io.load_checkpoint(tmp_path / "numpy1.pt")["rng"]["numpy"][1]
    assert key.dtype == np.uint32 and np.array_equal(key, states["numpy"][1])


class _Planted:
    """Pickles as a call of ``Path.touch`` on ``marker``: unpickling it in full creates the file."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def _planted_files(tmp_path: pathlib.Path) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """A marker path and two files that would create it when unpickled: a torch.save zip archive with the right
    keys, and a bare pickle (torch's legacy format)."""
    marker = tmp_path / "planted-code-ran"
    archive = tmp_path / "planted.pt"
    torch.save(_checkpoint(model_name=_Planted(marker)), archive)
    legacy = tmp_path / "planted.pkl"
    legacy.write_bytes(pickle.dumps(_checkpoint(state_dict={"weight": _Planted(marker)}), protocol=2))
    return marker, [archive, legacy]


def test_a_planted_file_is_refused_and_nothing_in_it_runs(tmp_path):
    marker, files = _planted_files(tmp_path)
    for path in files:
        with pytest.raises(ConfigError) as raised:
            checkpoint_io.load_checkpoint(path)
        message = str(raised.value)
        assert message.startswith(f"checkpoint {str(path)!r} is refused: its pickle names ")
        assert "loading it could run code" in message and "\n" not in message and "\x1b" not in message
        assert not marker.exists()
    with pytest.raises(ConfigError, match="^baseline checkpoint .* is refused"):
        checkpoint_io.load_model(files[0], what="baseline checkpoint")
    assert not marker.exists()
    # the files are live: unpickled in full (as before weights_only=True), the first one runs its code
    torch.load(files[0], weights_only=False)
    assert marker.exists()


def test_a_pickled_object_of_any_class_is_refused(tmp_path):
    torch.save(_checkpoint(config=load_config("digits")), tmp_path / "dataclass.pt")
    with pytest.raises(ConfigError) as raised:
        checkpoint_io.load_checkpoint(tmp_path / "dataclass.pt")
    message = str(raised.value)
    assert "its pickle names mjp_fast.train.config.TrainConfig, which is not a tensor or plain data" in message


def test_mjp_eval_refuses_a_planted_checkpoint_in_one_line(tmp_path, capsys):
    marker, (archive, legacy) = _planted_files(tmp_path)
    for planted in (archive, legacy):
        assert main(["eval", "--checkpoint", str(planted), "--output", str(tmp_path / "eval")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mjp eval: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert f"checkpoint {str(planted)!r} is refused: its pickle names " in err
        assert not marker.exists()


def test_mjp_eval_refuses_a_planted_baseline_in_one_line(digits_run, tmp_path, capsys):
    marker, (archive, _) = _planted_files(tmp_path)
    arguments = ["eval", "--checkpoint", str(digits_run / "last.pt"), "--baseline", str(archive)]
    assert main([*arguments, "--corruptions", "contrast", "--output", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mjp eval: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"baseline checkpoint {str(archive)!r} is refused: its pickle names " in err
    assert not marker.exists()


# --- the values under the keys --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({"model_kwargs": "vit"}, "its 'model_kwargs' is a str ('vit'), expected a dict of timm.create_model keywords"),
        ({"config": "deit_s"}, "its 'config' is a str ('deit_s'), expected a dict of config values or None"),
        ({"state_dict": None}, "its 'state_dict' is None, expected a dict of tensors (the model's weights)"),
        ({"model_name": 3}, "its 'model_name' is an int, expected a str (a timm model name)"),
        ({"epoch": "1"}, "its 'epoch' is a str ('1'), expected an int"),
        ({"step": True}, "its 'step' is a bool, expected an int"),
        ({"metrics": {}}, "its 'metrics' is a dict, expected a list of epoch records"),
        ({"model_kwargs": {1: 2}}, "its 'model_kwargs' has the key 1 (int), expected str keys"),
        ({"state_dict": {"weight": [1.0]}}, "its 'state_dict' holds a list under 'weight', expected tensors"),
    ],
)
def test_load_names_a_key_whose_value_has_the_wrong_type(tmp_path, changes, problem):
    path = tmp_path / "odd.pt"
    torch.save(_checkpoint(**changes), path)
    with pytest.raises(ConfigError) as raised:
        checkpoint_io.load_checkpoint(path)
    assert str(raised.value) == (
        f"checkpoint {str(path)!r} is a torch file but not a checkpoint written by mjp train: {problem}"
    )


@pytest.mark.parametrize("changes", [{"model_kwargs": "vit"}, {"config": "deit_s"}, {"state_dict": None}])
def test_mjp_eval_names_a_key_whose_value_has_the_wrong_type(tmp_path, capsys, changes):
    path = tmp_path / "odd.pt"
    torch.save(_checkpoint(**changes), path)
    assert main(["eval", "--checkpoint", str(path), "--output", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mjp eval: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"its {next(iter(changes))!r} is " in err and str(path) in err
