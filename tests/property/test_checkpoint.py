"""Property tests of :func:`mjp_fast.train.checkpoint.load_checkpoint` (issue 42): whatever a file holds (a random
dict of plain data with the checkpoint's keys or without them, values of the right or the wrong type; another
torch-saved object; random bytes; a real checkpoint cut short or with bytes changed; a pickle that names a class or a
function, in the zip format or the legacy one), loading it either returns the saved checkpoint (a valid one round-trips
through :func:`save_atomically`, tensors and plain data alike) or raises one ``ConfigError``, one line, naming the
file: never another exception, and nothing in the file runs. A dict is returned exactly when it is a checkpoint as
the module documents it (``model_name``, ``model_kwargs`` and ``state_dict`` present, every known key of its type).
"""

from __future__ import annotations

import math
import pickle
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import event, example, given
from hypothesis import strategies as st

from mjp_fast.train.checkpoint import load_checkpoint, save_atomically
from mjp_fast.train.config import ConfigError

# torch.load warns of a pickle protocol it does not default to (the random files that start with b"\x80\x05").
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
# The documented keys and the types each must hold (mjp_fast/train/checkpoint.py's module docstring and _KEY_TYPES,
# written out here as the contract): None where the docs allow it.
KEY_TYPES = {
    "model_name": (str,),
    "model_kwargs": (dict,),
    "state_dict": (dict,),
    "optimizer": (dict,),
    "scheduler": (dict, type(None)),
    "scaler": (dict, type(None)),
    "epoch": (int,),
    "batch_in_epoch": (int,),
    "step": (int,),
    "finished": (bool,),
    "rng": (dict, type(None)),
    "config": (dict, type(None)),
    "metrics": (list,),
    "running": (dict, type(None)),
    "final": (dict, type(None)),
    "mjp_fast_version": (str,),
}
REQUIRED = ("model_name", "model_kwargs", "state_dict")

tensors = st.builds(
    lambda shape, dtype, seed: (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype),
    st.lists(st.integers(0, 3), max_size=3),
    st.sampled_from((torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool)),
    st.integers(0, 1000),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8)
)  # the docs' plain data: no bytes
plain_data = st.recursive(
    st.one_of(scalars, tensors),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-3, 3)), inner, max_size=3),
    ),
    max_leaves=8,
)
valid_values = {
    "model_name": st.text(max_size=12),
    "model_kwargs": st.dictionaries(st.text(max_size=6), plain_data, max_size=3),
    "state_dict": st.dictionaries(st.text(max_size=8), tensors, max_size=3),
    "optimizer": st.dictionaries(st.text(max_size=6), plain_data, max_size=2),
    "scheduler": st.one_of(st.none(), st.dictionaries(st.text(max_size=6), plain_data, max_size=2)),
    "scaler": st.none(),
    "epoch": st.integers(0, 10**6),
    "batch_in_epoch": st.integers(0, 10**6),
    "step": st.integers(0, 10**9),
    "finished": st.booleans(),
    "rng": st.one_of(st.none(), st.dictionaries(st.text(max_size=6), plain_data, max_size=2)),
    "config": st.one_of(st.none(), st.dictionaries(st.text(max_size=6), plain_data, max_size=3)),
    "metrics": st.lists(st.dictionaries(st.text(max_size=6), scalars, max_size=2), max_size=2),
    "running": st.none(),
    "final": st.none(),
    "mjp_fast_version": st.text(max_size=8),
}


@st.composite
def checkpoints(draw: st.DrawFn) -> object:
    """A checkpoint (the required keys and some others, each of its type) with up to three changes (a key left out,
    a value of any type, another key, another entry in ``state_dict``), or another torch-saved object."""
    if draw(st.integers(0, 9)) == 0:
        return draw(plain_data)  # another torch-saved object (a dict too, now and then)
    keys = sorted({*REQUIRED, *draw(st.lists(st.sampled_from(sorted(KEY_TYPES)), unique=True, max_size=8))})
    checkpoint = {key: draw(valid_values[key]) for key in keys}
    for _ in range(draw(st.integers(0, 3))):
        change = draw(st.sampled_from(("leave out", "any value", "another key", "state_dict entry")))
        if change == "leave out" and checkpoint:
            checkpoint.pop(draw(st.sampled_from(sorted(checkpoint, key=repr))))
        elif change == "any value":
            checkpoint[draw(st.sampled_from(sorted(KEY_TYPES)))] = draw(plain_data)
        elif change == "another key":
            checkpoint[draw(st.one_of(st.text(max_size=6), st.integers()))] = draw(plain_data)
        elif isinstance(checkpoint.get("state_dict"), dict):
            name = draw(
                st.one_of(st.sampled_from(("block._extra_state", "weight")), st.text(max_size=6), st.integers())
            )
            checkpoint["state_dict"][name] = draw(plain_data)
    return checkpoint


def is_checkpoint(value: object) -> bool:
    """The module's contract: a dict with the required keys, every documented key of its type (a bool is no int),
    str keys in ``model_kwargs``, ``state_dict`` and ``config``, and tensors in ``state_dict`` (but under a name
    ending in ``_extra_state``)."""
    if not isinstance(value, dict) or any(key not in value for key in REQUIRED):
        return False
    for key, types in KEY_TYPES.items():
        if key in value:
            if not isinstance(value[key], types) or (isinstance(value[key], bool) and bool not in types):
                return False
    for key in ("model_kwargs", "state_dict", "config"):
        if not all(isinstance(name, str) for name in value.get(key) or {}):
            return False
    return all(
        isinstance(item, torch.Tensor) or name.endswith("_extra_state") for name, item in value["state_dict"].items()
    )


def same(loaded: object, saved: object) -> bool:
    """Whether ``loaded`` is ``saved`` read back: the same types and values (tensors bit for bit, NaN as NaN)."""
    if isinstance(saved, torch.Tensor):
        return isinstance(loaded, torch.Tensor) and loaded.dtype == saved.dtype and torch.equal(loaded, saved)
    if type(loaded) is not type(saved):
        return False
    if isinstance(saved, dict):
        return list(loaded) == list(saved) and all(same(loaded[key], saved[key]) for key in saved)
    if isinstance(saved, (list, tuple)):
        return len(loaded) == len(saved) and all(same(a, b) for a, b in zip(loaded, saved))
    if isinstance(saved, float) and math.isnan(saved):
        return math.isnan(loaded)
    return loaded == saved


def assert_refused(path: Path, one_line: bool = True) -> None:
    """Loading ``path`` raises one ConfigError naming the file, one line (never another exception)."""
    try:
        load_checkpoint(path)
    except Exception as error:  # noqa: BLE001 - the property: which exceptions come out
        assert type(error) is ConfigError, f"{type(error).__name__}: {error}"
        assert str(path) in str(error), str(error)
        assert not one_line or "\n" not in str(error), str(error)
    else:
        raise AssertionError(f"{path.name} loaded")


def saved(checkpoint: object, folder: str, legacy: bool) -> Path:
    path = Path(folder) / "last.pt"
    if legacy:  # torch's format before its zip archives
        torch.save(checkpoint, path, _use_new_zipfile_serialization=False)
    else:
        save_atomically(checkpoint, path)
    return path


@given(checkpoints(), st.booleans())
def test_a_dict_round_trips_exactly_when_it_is_a_checkpoint_else_one_config_error(checkpoint, legacy):
    with tempfile.TemporaryDirectory() as folder:
        path = saved(checkpoint, folder, legacy)
        if is_checkpoint(checkpoint):
            event("a checkpoint: round-trips")  # --hypothesis-show-statistics: how often each outcome came
            assert same(load_checkpoint(path), checkpoint)
        else:
            event("not a checkpoint: refused")
            assert_refused(path, one_line=False)  # see the next test


@given(checkpoints(), st.booleans())
@example({"\n": None}, False)
@example({"a\nb": 1, "model_name": "x"}, True)
def test_the_refusal_of_a_dict_is_one_line(checkpoint, legacy):
    with tempfile.TemporaryDirectory() as folder:
        path = saved(checkpoint, folder, legacy)
        if not is_checkpoint(checkpoint):
            assert_refused(path)


@st.composite
def damaged_files(draw: st.DrawFn) -> tuple[str, object]:
    kind = draw(st.sampled_from(("bytes", "magic bytes", "truncated", "changed bytes")))
    if kind == "bytes":
        return kind, draw(st.binary(max_size=400))
    if kind == "magic bytes":  # a zip archive's start or a pickle's protocol byte, then anything
        return kind, draw(st.sampled_from((b"PK\x03\x04", b"\x80\x02", b"\x80\x05"))) + draw(st.binary(max_size=400))
    if kind == "truncated":
        return kind, draw(st.floats(0.0, 1.0, exclude_max=True))
    return kind, draw(st.lists(st.tuples(st.floats(0.0, 1.0, exclude_max=True), st.integers(0, 255)), min_size=1))


VALID = {
    "model_name": "vit_tiny_patch16_224",
    "model_kwargs": {"img_size": 32, "num_classes": 10},
    "state_dict": {"pos_embed": torch.randn(1, 5, 8), "head.weight": torch.randn(10, 8), "counter": torch.tensor(3)},
    "epoch": 2,
    "finished": False,
    "metrics": [{"top1": 12.5}],
}


@given(damaged_files(), st.booleans())
def test_random_bytes_and_damaged_checkpoints_are_one_config_error_or_a_checkpoint(damaged, legacy):
    kind, what = damaged
    with tempfile.TemporaryDirectory() as folder:
        if kind in ("bytes", "magic bytes"):
            path = Path(folder) / "last.pt"
            path.write_bytes(what)
            assert_refused(path)
            return
        path = saved(VALID, folder, legacy)
        data = bytearray(path.read_bytes())
        if kind == "truncated":
            path.write_bytes(bytes(data[: int(len(data) * what)]))
            assert_refused(path)
            return
        for fraction, value in what:
            data[int(len(data) * fraction)] = value
        path.write_bytes(bytes(data))
        try:
            loaded = load_checkpoint(path)
        except Exception:  # noqa: BLE001
            event("changed bytes: refused")
            assert_refused(path)
            return
        event("changed bytes: loaded")
        assert is_checkpoint(loaded)  # a change in the tensors' bytes, or none that mattered


MARKS: list[str] = []


def _mark(text: str) -> None:
    MARKS.append(text)


class _Planted:
    """An object whose unpickling would run code (``_mark``): records that it ran."""

    def __reduce__(self):
        return (_mark, ("ran",))


@given(
    st.sampled_from(("object", "function", "class")),
    st.sampled_from(("zip", "legacy", "bare pickle")),
    st.sampled_from((*REQUIRED, "metrics", "other")),
)
def test_a_pickle_that_names_a_class_or_function_is_refused_and_nothing_runs(planted, container, key):
    payload = {"object": _Planted(), "function": print, "class": Path}[planted]
    checkpoint = {"model_name": "x", "model_kwargs": {}, "state_dict": {}}
    checkpoint[key] = [payload] if key == "metrics" else payload
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "last.pt"
        if container == "bare pickle":
            path.write_bytes(pickle.dumps(checkpoint, protocol=2))
        else:
            torch.save(checkpoint, path, _use_new_zipfile_serialization=container == "zip")
        MARKS.clear()
        assert_refused(path)
        assert MARKS == []
