"""Property tests of the modules over the sampler and the DAL loss under valid edge values and plausible mistakes
(issue 25): :class:`mjp_fast.JigsawSampler`, :class:`mjp_fast.DALRegressor` and :func:`mjp_fast.timm.convert`.

On every backend that runs on CPU tensors here, a call gives the ``torch`` backend's result, or a
``ValueError``/``TypeError`` whose message names the argument.
"""

from __future__ import annotations

import pytest
import timm
import torch
from hypothesis import given
from hypothesis import strategies as st

import mjp_fast
import mjp_fast.timm as mjp_timm
from mjp_fast.sampler.reference import MAX_GRID_POSITIONS, MAX_GRID_SIDE
from tests.conftest import backends_for

BACKENDS = backends_for("cpu")
OTHERS = [name for name in BACKENDS if name != "torch"]
CPU = torch.device("cpu")

# ---- JigsawSampler

fractions = st.one_of(st.sampled_from([0.0, 1.0, 0.5]), st.floats(0.0, 1.0))


@st.composite
def sampler_settings(draw: st.DrawFn) -> dict:
    return dict(
        grid_size=draw(st.one_of(st.integers(1, 5), st.tuples(st.integers(1, 5), st.integers(1, 5)))),
        ratio=draw(fractions),
        prob=draw(fractions),
        seed=draw(st.one_of(st.sampled_from([0, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))),
        min_block=draw(st.one_of(st.integers(1, 30), st.just(MAX_GRID_POSITIONS))),
        min_aspect=draw(st.one_of(st.just(0.3), st.floats(0.05, 20.0))),
        shared=draw(st.booleans()),
    )


@given(sampler_settings(), st.lists(st.integers(0, 4), min_size=1, max_size=3), st.booleans(), st.data())
def test_jigsaw_sampler_gives_the_torch_backends_stream(settings, batches, evaluating, data):
    other_grid = data.draw(st.one_of(st.none(), st.tuples(st.integers(1, 4), st.integers(1, 4))))
    samplers = {backend: mjp_fast.JigsawSampler(**settings, backend=backend) for backend in BACKENDS}
    for batch in batches:
        results = {}
        for backend, sampler in samplers.items():
            if evaluating:
                sampler.eval()
                with sampler.jigsaw_eval(ratio=settings["ratio"], seed=settings["seed"], start=3):
                    results[backend] = sampler(batch, CPU, other_grid)
            else:
                results[backend] = sampler(batch, "cpu", other_grid)
        expected = results["torch"]
        for backend in OTHERS:
            if expected is None:
                assert results[backend] is None
            else:
                assert torch.equal(results[backend].mask, expected.mask)
                assert torch.equal(results[backend].perm, expected.perm)
    assert len({int(sampler.sample_counter) for sampler in samplers.values()}) == 1


SAMPLER_MISTAKES = {
    "grid_size": [0, (0, 4), (3,), "4", 2.5, (MAX_GRID_SIDE + 1, 1), (1, 2**30)],
    "ratio": [float("nan"), -0.1, 1.5, "0.1", None],
    "prob": [float("inf"), -1.0, "1", None],
    "seed": [-1, 2**64, 1.5, None],
    "min_block": [0, 2**31, MAX_GRID_POSITIONS + 1, 1.5],
    "min_aspect": [0.0, float("nan"), -2.0, None],
    "shared": [1, None],
}
MISTAKES = [(name, value) for name, values in SAMPLER_MISTAKES.items() for value in values]
GOOD = dict(grid_size=(3, 4), ratio=0.5, prob=1.0, seed=0, min_block=2, min_aspect=0.3, shared=False)


@given(st.sampled_from(MISTAKES))
def test_jigsaw_sampler_refuses_a_mistake_by_name(mistake):
    name, value = mistake
    with pytest.raises((ValueError, TypeError)) as caught:
        mjp_fast.JigsawSampler(**dict(GOOD, **{name: value}))
    assert name in str(caught.value), str(caught.value)


@given(st.sampled_from([m for m in MISTAKES if m[0] != "grid_size"]), st.sampled_from(BACKENDS))
def test_a_setting_changed_to_a_mistake_is_refused(mistake, backend):
    name, value = mistake
    sampler = mjp_fast.JigsawSampler(**GOOD, backend=backend)
    sampler(2, CPU)
    with pytest.raises((ValueError, TypeError)) as caught:
        setattr(sampler, name, value)  # refused where it is made
        sampler(2, CPU)
    assert name in str(caught.value), str(caught.value)


FORWARD_MISTAKES = [
    ("batch", dict(batch=-1)),
    ("batch", dict(batch=2.0)),
    ("batch", dict(batch=True)),
    ("batch", dict(batch=None)),
    ("grid_size", dict(grid_size=(0, 4))),
    ("grid_size", dict(grid_size=(4,))),
    ("grid_size", dict(grid_size=(MAX_GRID_SIDE + 1, 2))),
    ("device", dict(device="nonsense")),
    ("device", dict(device=3)),
    *([] if torch.cuda.is_available() else [("device", dict(device="cuda")), ("device", dict(device="cuda:1"))]),
]


@given(st.sampled_from(FORWARD_MISTAKES), st.sampled_from(BACKENDS), st.booleans())
def test_jigsaw_sampler_forward_refuses_a_mistake_by_name(mistake, backend, evaluating):
    name, change = mistake
    sampler = mjp_fast.JigsawSampler(**GOOD, backend=backend)
    arguments = dict(dict(batch=2, device=CPU, grid_size=None), **change)
    if evaluating:
        sampler.eval()
    with sampler.jigsaw_eval() if evaluating else _nothing():
        with pytest.raises((ValueError, TypeError)) as caught:
            sampler(arguments["batch"], arguments["device"], arguments["grid_size"])
    assert name in str(caught.value), str(caught.value)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *_):
        return False


@given(st.integers(0, 3), st.sampled_from([None, "torch"]))
def test_jigsaw_sampler_on_the_meta_device_gives_shapes(batch, backend):
    sampler = mjp_fast.JigsawSampler(**GOOD, backend=backend)
    jigsaw = sampler(batch, "meta")
    assert jigsaw.mask.device.type == "meta" and jigsaw.mask.shape == jigsaw.perm.shape == (batch, 12)


def test_issue_25_item_14_cases():
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="min_block"):
            mjp_fast.JigsawSampler(4, 0.5, 1.0, min_block=2**31, backend=backend)
        sampler = mjp_fast.JigsawSampler(4, 0.5, 1.0, backend=backend)
        with pytest.raises(ValueError, match="batch"):
            sampler(-1, CPU)
        with pytest.raises(ValueError, match="grid_size"):
            sampler(2, CPU, (0, 4))


# ---- DALRegressor

REGRESSOR_MISTAKES = [
    ("dim", dict(dim=0)),
    ("dim", dict(dim=-1)),
    ("dim", dict(dim=2.0)),
    ("dim", dict(dim=True)),
    ("dim", dict(dim=None)),
    ("kind", dict(kind="bogus")),
    ("kind", dict(kind=None)),
    ("kind", dict(kind=["linear"])),
    ("hidden_dim", dict(hidden_dim=0)),
    ("hidden_dim", dict(hidden_dim=1.5)),
    ("hidden_dim", dict(kind="linear", hidden_dim=4)),
    ("hidden_dim", dict(kind="pca", hidden_dim=4)),
]


@given(st.sampled_from(REGRESSOR_MISTAKES))
def test_dal_regressor_refuses_a_mistake_by_name(mistake):
    name, change = mistake
    with pytest.raises((ValueError, TypeError)) as caught:
        mjp_fast.DALRegressor(**dict(dict(dim=4), **change))
    assert name in str(caught.value), str(caught.value)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@given(
    st.sampled_from(["nonlinear", "linear", "pca"]),
    st.sampled_from(DTYPES),
    st.sampled_from(DTYPES),
    st.integers(1, 5),
    st.integers(1, 6),
)
def test_dal_regressor_maps_a_table_of_any_float_dtype(kind, table_dtype, regressor_dtype, dim, positions):
    torch.manual_seed(dim * 7 + positions)
    regressor = mjp_fast.DALRegressor(dim, kind).to(regressor_dtype)
    table = torch.randn(positions, dim).to(table_dtype).requires_grad_(True)
    out = regressor(table)
    assert out.shape == (positions, 2)
    # the same as the regressor and table in their promoted dtype (at least float32)
    dtype = torch.promote_types(torch.promote_types(table_dtype, regressor_dtype), torch.float32)
    if table_dtype == regressor_dtype and kind != "pca":
        dtype = table_dtype  # the regressor as itself
    reference = mjp_fast.DALRegressor(dim, kind).to(dtype)
    reference.load_state_dict({k: v.to(dtype) for k, v in regressor.state_dict().items()})
    expected = reference(table.detach().to(dtype))
    torch.testing.assert_close(out.to(dtype), expected.to(out.dtype).to(dtype), equal_nan=True)
    out.float().sum().backward()
    assert table.grad is not None and table.grad.dtype == table_dtype


def test_dal_regressor_refuses_a_table_of_another_width():
    for kind in ("nonlinear", "linear", "pca"):
        with pytest.raises(ValueError, match="pos_embed"):
            mjp_fast.DALRegressor(4, kind)(torch.randn(6, 5))


# ---- timm convert

TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=5)
CONVERT_MISTAKES = [
    ("patch_size", dict(patch_size=0)),
    ("patch_size", dict(patch_size=-4)),
    ("patch_size", dict(patch_size=2.5)),
    ("patch_size", dict(patch_size=True)),
    ("patch_size", dict(patch_size="16")),
    ("ratio", dict(ratio=float("nan"))),
    ("ratio", dict(ratio=2.0)),
    ("prob", dict(prob=-0.5)),
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=2**64)),
    ("min_block", dict(min_block=0)),
    ("min_block", dict(min_block=2**31)),
    ("min_aspect", dict(min_aspect=0.0)),
    ("shared", dict(shared=1)),
    ("backend", dict(backend="bogus")),
    ("dal", dict(dal="bogus")),
    ("dal_reduction", dict(dal_reduction="avg")),
    ("dal_weight", dict(dal_weight=float("nan"))),
    ("model", dict(model=torch.nn.Linear(2, 2))),
    ("model", dict(model=3)),
]


@pytest.fixture(scope="module")
def tiny_resnet_state():
    torch.manual_seed(0)
    return timm.create_model("resnet10t", pretrained=False, num_classes=3).state_dict()


def _tiny_resnet(state):
    model = timm.create_model("resnet10t", pretrained=False, num_classes=3)
    model.load_state_dict(state)
    return model


@given(st.sampled_from(CONVERT_MISTAKES), st.sampled_from(["resnet", "vit"]))
def test_convert_refuses_a_mistake_by_name(tiny_resnet_state, mistake, family):
    name, change = mistake
    if family == "resnet":
        model = _tiny_resnet(tiny_resnet_state)
        arguments = dict(model=model, dal=None)
    else:
        model = timm.create_model("vit_tiny_patch16_224", **TINY_VIT)
        arguments = dict(model=model)
    if family == "vit" and name == "patch_size" and isinstance(change["patch_size"], int):
        pass  # checked for every family, though a ViT uses its own
    arguments.update(change)
    with pytest.raises((ValueError, TypeError)) as caught:
        mjp_timm.convert(**arguments)
    assert name in str(caught.value), str(caught.value)


@given(st.sampled_from([1, 4, 8, 16, 32, 300]), st.sampled_from(BACKENDS), st.booleans())
def test_converted_resnet_gives_the_torch_backends_output(tiny_resnet_state, patch_size, backend, shared):
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(patch_size))
    outputs = {}
    for name in ("torch", backend):
        model = mjp_timm.convert(
            _tiny_resnet(tiny_resnet_state), ratio=0.5, prob=1.0, dal=None, patch_size=patch_size, shared=shared,
            backend=name,
        ).train()  # fmt: skip
        try:
            outputs[name] = model(images)
        except (ValueError, TypeError) as error:  # a patch larger than the images: refused by name
            assert patch_size > 32 and ("patch" in str(error) or "grid" in str(error)), str(error)
            return
    torch.testing.assert_close(outputs[backend], outputs["torch"], rtol=1e-4, atol=1e-5)


def test_issue_25_item_16_patch_size_zero():
    with pytest.raises(ValueError, match="patch_size"):
        mjp_timm.convert(timm.create_model("resnet10t", pretrained=False), dal=None, patch_size=0)
