"""Property tests of :func:`mjp_fast.sample_jigsaw` under valid edge values and plausible mistakes (issue 25).

On every backend that runs on CPU tensors here, a call gives exactly the ``torch`` backend's jigsaw, or a
``ValueError``/``TypeError`` whose message names the argument. The sampler's kernels check nothing they are not
given checked (the compiled one raises RuntimeError on a bad size): the Python layer must refuse every mistake
before a kernel runs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mjp_fast
from mjp_fast.sampler.dispatch import make_sampler_plan
from mjp_fast.sampler.reference import MAX_GRID_POSITIONS, MAX_GRID_SIDE
from tests.conftest import backends_for

BACKENDS = backends_for("cpu")
OTHERS = [name for name in BACKENDS if name != "torch"]

# ---- valid values, edges included

batch_sizes = st.integers(0, 4)
grids = st.one_of(st.integers(1, 6), st.tuples(st.integers(1, 6), st.integers(1, 6)))
fractions = st.one_of(
    st.sampled_from([0.0, 1.0, 0.5, 1e-300, 1 - 2**-53]), st.floats(0.0, 1.0), st.sampled_from([0, 1])
)
seeds = st.one_of(st.sampled_from([0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
min_blocks = st.one_of(st.integers(1, 40), st.sampled_from([MAX_GRID_POSITIONS]))
min_aspects = st.one_of(st.sampled_from([0.3, 1.0, 1e-6, 1e6]), st.floats(0.01, 100.0))


@st.composite
def valid_settings(draw: st.DrawFn) -> dict:
    batch = draw(batch_sizes)
    # the last valid offset: offset < 2**63 and offset + batch_size <= 2**63 (an empty batch too: 2**63 is refused)
    last = 2**63 - max(batch, 1)
    offset = draw(st.one_of(st.sampled_from([0, 2**31 - 1, 2**32 - 1, last - 1, last]), st.integers(0, last)))
    return dict(
        batch_size=batch,
        grid_size=draw(grids),
        ratio=draw(fractions),
        seed=draw(seeds),
        offset=offset,
        shared=draw(st.booleans()),
        prob=draw(fractions),
        min_block=draw(min_blocks),
        min_aspect=draw(min_aspects),
    )


def _call(settings: dict, backend: str) -> mjp_fast.Jigsaw:
    settings = dict(settings)
    return mjp_fast.sample_jigsaw(
        settings.pop("batch_size"), settings.pop("grid_size"), settings.pop("ratio"), backend=backend, **settings
    )


def _assert_same(jigsaw: mjp_fast.Jigsaw, expected: mjp_fast.Jigsaw) -> None:
    assert jigsaw.mask.dtype == torch.bool and jigsaw.perm.dtype == torch.int64
    assert torch.equal(jigsaw.mask, expected.mask) and torch.equal(jigsaw.perm, expected.perm)


@given(valid_settings())
def test_every_backend_gives_the_torch_backends_jigsaw(settings):
    expected = _call(settings, "torch")
    rows, cols = settings["grid_size"] if isinstance(settings["grid_size"], tuple) else (settings["grid_size"],) * 2
    assert expected.mask.shape == (settings["batch_size"], rows * cols)
    for backend in OTHERS:
        _assert_same(_call(settings, backend), expected)


@given(valid_settings(), st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8]))
def test_a_cpu_tensor_offset_is_the_int_offset(settings, dtype):
    info = torch.iinfo(dtype)
    settings["offset"] = min(settings["offset"], info.max)
    expected = _call(settings, "torch")
    tensor_settings = dict(settings, offset=torch.tensor(settings["offset"], dtype=dtype))
    for backend in BACKENDS:
        _assert_same(_call(tensor_settings, backend), expected)


# ---- mistakes: each is refused by name, on every backend

BAD_VALUES = {
    "batch_size": [-1, 2.0, True, None, "2", torch.tensor(2)],
    "grid_size": [0, -3, (0, 4), (4, 0), (3,), (1, 2, 3), (2.0, 3), "4", 2.5, None, (MAX_GRID_SIDE + 1, 1),
                  (1, 2**30), 2**16],
    "ratio": [float("nan"), float("inf"), -0.1, 1.5, "0.1", None, True],
    "seed": [-1, 2**64, 1.5, None, "0", True],
    "offset": [-1, 2**63, 2**64, 1.5, None, True, torch.tensor(-1), torch.tensor(2**63 - 1), torch.tensor([1, 2]),
               torch.tensor(1.0), torch.tensor(True)],
    "prob": [float("nan"), -1e-9, 1.0000001, "1", None],
    "min_block": [0, -1, MAX_GRID_POSITIONS + 1, 2**31, 1.5, None],
    "min_aspect": [0.0, -1.0, float("nan"), float("inf"), "0.3", None],
    "shared": [1, None, "True"],
    "device": ["nonsense", 3, "cuda:99"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"]),
    "backend": ["bogus", 3, ""],
}  # fmt: skip
MISTAKES = [(name, value) for name, values in BAD_VALUES.items() for value in values]
GOOD = dict(batch_size=2, grid_size=(3, 4), ratio=0.5, seed=0, offset=0, shared=False, prob=1.0, min_block=2,
            min_aspect=0.3)  # fmt: skip


@given(st.sampled_from(MISTAKES), st.sampled_from(BACKENDS))
def test_a_mistake_is_refused_by_name(mistake, backend):
    name, value = mistake
    settings = dict(GOOD, **{name: value})
    if name == "backend":
        backend = value
    if name == "offset" and value is not None and not isinstance(value, (bool, float, str)):
        # 2**63 - 1 with batch 2 passes the int64 range, not offset + batch_size <= 2**63
        settings["batch_size"] = 2
    with pytest.raises((ValueError, TypeError)) as caught:
        _call(settings, backend)
    # (a device the backend cannot run on is refused by the backend's name, naming the device too)
    assert name in str(caught.value), str(caught.value)


@given(valid_settings(), st.sampled_from([None, *BACKENDS]))
def test_meta_device_gives_the_shapes_or_names_the_backend(settings, backend):
    settings = dict(settings, device="meta")
    if backend in (None, "torch"):
        jigsaw = _call(settings, backend)
        rows, cols = settings["grid_size"] if isinstance(settings["grid_size"], tuple) else (settings["grid_size"],) * 2
        assert jigsaw.mask.device.type == "meta" and jigsaw.perm.device.type == "meta"
        assert jigsaw.mask.shape == jigsaw.perm.shape == (settings["batch_size"], rows * cols)
        assert jigsaw.mask.dtype == torch.bool and jigsaw.perm.dtype == torch.int64
    else:
        with pytest.raises(ValueError, match="backend"):
            _call(settings, backend)


# ---- stream positions near 2**63 and 2**64: a GPU tensor offset goes unchecked (reading it would sync), so every
# kernel takes it mod 2**64 and all agree. Tested on the plans, which take the counter as a GPU step does.


@given(
    st.one_of(st.sampled_from([2**63 - 1, 2**63 - 2, -1, -2, -(2**63), 2**32 - 1]), st.integers(-(2**63), 2**63 - 1)),
    st.integers(1, 4),
    st.booleans(),
)
def test_kernels_agree_on_any_int64_stream_position(counter, batch, shared):
    plans = {
        backend: make_sampler_plan(
            (3, 4), 0.5, seed=7, prob=1.0, shared=shared, min_block=2, min_aspect=0.3, device=torch.device("cpu"),
            backend=backend,
        )
        for backend in BACKENDS
    }  # fmt: skip
    position = torch.tensor([counter])
    expected = plans["torch"].sample(batch, position)
    for backend in OTHERS:
        _assert_same(plans[backend].sample(batch, position), expected)
    # the same position as an int (mod 2**64)
    _assert_same(plans["torch"].sample(batch, counter % 2**64), expected)


# ---- the issue's exact cases


def test_issue_25_item_9_a_negative_tensor_offset_is_refused_by_name():
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="offset"):
            mjp_fast.sample_jigsaw(2, 4, 0.5, seed=0, offset=torch.tensor(-1), backend=backend)


def test_issue_25_item_9_rows_near_2_63_agree():
    for backend in BACKENDS:  # a CPU tensor is checked as an int
        with pytest.raises(ValueError, match="offset"):
            mjp_fast.sample_jigsaw(4, 4, 0.5, seed=0, offset=torch.tensor(2**63 - 2), backend=backend)
    last = mjp_fast.sample_jigsaw(2, 4, 0.5, seed=0, offset=2**63 - 2, backend="torch")
    for backend in OTHERS:
        _assert_same(mjp_fast.sample_jigsaw(2, 4, 0.5, seed=0, offset=2**63 - 2, backend=backend), last)


def test_issue_25_item_11_meta_and_cuda_devices():
    jigsaw = mjp_fast.sample_jigsaw(2, 4, 0.5, seed=0, device="meta")
    assert jigsaw.mask.shape == (2, 16) and jigsaw.mask.device.type == "meta"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device"):
            mjp_fast.sample_jigsaw(2, 4, 0.5, seed=0, device="cuda")


def test_issue_25_item_12_offset_2_63_and_a_long_grid():
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="offset"):
            mjp_fast.sample_jigsaw(0, 4, 0.5, seed=0, offset=2**63, backend=backend)
        with pytest.raises(ValueError, match="grid_size"):
            mjp_fast.sample_jigsaw(1, (1, 2**30), 0.5, seed=0, backend=backend)
