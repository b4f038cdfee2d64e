"""The argument checks shared by the public operations (mjp_fast/_validate.py), issue 42 items 7 and 8: ``validate``
is a bool on every operation that takes it, and on meta tensors ``validate=True`` skips the checks that read values
(there are none to read) but keeps those of shapes and dtypes, and the operations give meta outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mjp_fast
from mjp_fast._validate import canonical_device, check_bool, check_int_like, check_same_dtype, holds_values
from mjp_fast.ops.rope_identity import rope_identity
from mjp_fast.sampler.jigsaw import Jigsaw


def _jigsaw(batch: int, num_positions: int, device: str = "cpu") -> Jigsaw:
    """A valid jigsaw: positions 0 and 1 swapped in every sample."""
    perm = torch.arange(num_positions, device=device).repeat(batch, 1)
    perm[:, [0, 1]] = perm[:, [1, 0]]
    mask = torch.zeros(batch, num_positions, dtype=torch.bool, device=device)
    mask[:, :2] = True
    return Jigsaw(mask, perm)


def _call(op: str, validate: object, device: str = "cpu", *, jigsaw: bool = True) -> torch.Tensor:
    """One call of ``op`` on a batch of 2 of a 2x4 grid (patch 2, D = 8) on ``device``."""
    batch, positions, dim = 2, 8, 8
    torch.manual_seed(0)
    chosen = _jigsaw(batch, positions, device) if jigsaw else None
    unk = torch.randn(dim, device=device)
    images = torch.randn(batch, 3, 4, 8, device=device)
    if op == "mjp_pos_embed":
        tokens = torch.randn(batch, positions, dim, device=device)
        return mjp_fast.mjp_pos_embed(
            tokens, torch.randn(positions, dim, device=device), unk, chosen, validate=validate
        )
    if op == "mjp_patch_embed":
        weight, bias = torch.randn(dim, 3, 2, 2, device=device), torch.randn(dim, device=device)
        pos = torch.randn(positions, dim, device=device)
        return mjp_fast.mjp_patch_embed(images, weight, bias, pos, unk, chosen, validate=validate)
    if op == "jigsaw_images":
        return mjp_fast.jigsaw_images(images, chosen, 2, validate=validate)
    mask = _jigsaw(batch, positions, device).mask
    return rope_identity(torch.randn(positions, 6, device=device), mask, validate=validate)


OPS = ["mjp_pos_embed", "mjp_patch_embed", "jigsaw_images", "rope_identity"]


# --- item 7: validate is a bool --------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("value", [None, "yes", "", 1, 0, np.bool_(True), torch.tensor(True)], ids=repr)
def test_validate_must_be_a_bool(op, value):
    """None skipped every check of rope_identity and "yes" ran them: any value but True or False is refused."""
    with pytest.raises(TypeError, match=r"^validate must be a bool \(True or False\), got "):
        _call(op, value)


@pytest.mark.parametrize("op", ["mjp_pos_embed", "mjp_patch_embed"])
def test_validate_must_be_a_bool_without_a_jigsaw_too(op):
    with pytest.raises(TypeError, match="validate must be a bool"):
        _call(op, None, jigsaw=False)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("validate", [True, False])
def test_true_and_false_are_accepted_and_agree(op, validate):
    torch.testing.assert_close(_call(op, validate), _call(op, True), rtol=0, atol=0)


def test_check_bool():
    assert check_bool("flag", True) is True and check_bool("flag", False) is False
    with pytest.raises(TypeError, match="flag must be a bool .* got NoneType None"):
        check_bool("flag", None)


# --- item 8: meta tensors ---------------------------------------------------------------------------------------

META_SHAPES = {"mjp_pos_embed": (2, 8, 8), "mjp_patch_embed": (2, 8, 8), "jigsaw_images": (2, 3, 4, 8)}


@pytest.mark.parametrize("op", META_SHAPES)
@pytest.mark.parametrize("validate", [True, False])
def test_meta_tensors_give_meta_outputs(op, validate):
    """validate=True read the perm (Tensor.item() cannot be called on meta tensors)."""
    out = _call(op, validate, "meta")
    assert out.device.type == "meta" and tuple(out.shape) == META_SHAPES[op] and out.dtype == torch.float32


def test_meta_tensors_keep_their_shape_and_dtype_checks():
    images = torch.empty(2, 3, 4, 8, device="meta")
    jigsaw = _jigsaw(2, 8, "meta")
    with pytest.raises(ValueError, match=r"jigsaw.perm must have shape \[batch, N\] = \[2, 8\]"):
        mjp_fast.jigsaw_images(images, Jigsaw(jigsaw.mask, jigsaw.perm[:, :4]), 2)
    with pytest.raises(TypeError, match="jigsaw.mask must be a bool tensor"):
        mjp_fast.jigsaw_images(images, Jigsaw(jigsaw.perm, jigsaw.perm), 2)
    tokens = torch.empty(2, 8, 8, device="meta")
    with pytest.raises(TypeError, match="tokens must be float32"):
        mjp_fast.mjp_pos_embed(tokens.long(), torch.empty(8, 8, device="meta"), None, None)
    with pytest.raises(ValueError, match="pos_embed must be"):
        mjp_fast.mjp_pos_embed(tokens, torch.empty(7, 8, device="meta"), torch.empty(8, device="meta"), jigsaw)
    with pytest.raises(ValueError, match="weight expects"):
        weight = torch.empty(8, 1, 2, 2, device="meta")
        mjp_fast.mjp_patch_embed(images, weight, None, torch.empty(8, 8, device="meta"), None, jigsaw)


def test_meta_tensors_backward():
    tokens = torch.empty(2, 8, 8, device="meta", requires_grad=True)
    unk = torch.empty(8, device="meta", requires_grad=True)
    out = mjp_fast.mjp_pos_embed(tokens, torch.empty(8, 8, device="meta"), unk, _jigsaw(2, 8, "meta"))
    out.sum().backward()
    assert tokens.grad.shape == tokens.shape and unk.grad.device.type == "meta"


def test_a_backend_that_cannot_run_on_meta_is_refused_by_name():
    backend = next((name for name in ("cpu", "triton") if name in mjp_fast.available_backends()), None)
    if backend is None:
        pytest.skip("only the torch backend is available here")
    tokens = torch.empty(2, 8, 8, device="meta")
    with pytest.raises(ValueError, match=f"backend='{backend}' cannot run on tensors on device meta$"):
        mjp_fast.mjp_pos_embed(tokens, torch.empty(8, 8, device="meta"), None, None, backend=backend)


def test_holds_values():
    assert holds_values(torch.zeros(1)) and not holds_values(torch.empty(1, device="meta"))


# --- helpers: integers and devices (items 6 and 9) --------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [0, 7, 10**400, np.int64(7), np.uint8(7), torch.tensor(7), torch.tensor(7, dtype=torch.int32)],
    ids=["0", "7", "10**400", "int64", "uint8", "tensor", "int32_tensor"],
)
def test_check_int_like_accepts_integer_scalars(value):
    got = check_int_like("step", value, minimum=0)
    assert type(got) is int and got == int(value)


@pytest.mark.parametrize(
    "value, words",
    [
        (True, "bool True"),
        (np.bool_(True), "bool"),
        (torch.tensor(True), "torch.bool tensor"),
        (1.0, "float 1.0"),
        ("x", "str 'x'"),
        (None, "NoneType None"),
        (torch.tensor(1.0), "torch.float32 tensor"),
        (torch.tensor([1]), r"tensor of shape \[1\]"),
    ],
    ids=repr,
)
def test_check_int_like_refuses_other_values_by_name(value, words):
    with pytest.raises(TypeError, match=f"^step must be an int, got .*{words}"):
        check_int_like("step", value)


def test_check_int_like_minimum():
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        check_int_like("step", np.int32(-1), minimum=0)


def test_canonical_device(monkeypatch):
    assert canonical_device(torch.device("cpu:0")) == torch.device("cpu") == canonical_device(torch.device("cpu"))
    assert canonical_device(torch.device("meta:0")) == torch.device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert canonical_device(torch.device("cuda")) == torch.device("cuda:1")
    assert canonical_device(torch.device("cuda:0")) == torch.device("cuda:0")


def test_check_same_dtype_names_the_tensor_and_the_reference():
    images, weight = torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.float16)
    check_same_dtype("images", images=images, weight=None, bias=torch.zeros(2))  # None skipped, same dtype passes
    words = r"^weight has dtype torch.float16 but images have torch.float32; use one dtype$"
    with pytest.raises(TypeError, match=words):
        check_same_dtype("images", images=images, weight=weight)
