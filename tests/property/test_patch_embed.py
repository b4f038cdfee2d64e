"""Property tests of ``mjp_patch_embed``: on every backend, the torch backend's result (outputs and gradients) or a
ValueError/TypeError naming an argument, for edge values (B = 0, 1x1 grids, C = 0, D = 1, odd sizes, non-contiguous
images, every dtype), plausible mistakes, and broken jigsaws with ``validate=False`` (mjp_fast/_validate.py)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from mjp_fast import mjp_patch_embed
from mjp_fast.sampler.jigsaw import Jigsaw
from tests.property.common import (
    BACKENDS,
    JIGSAW_KINDS,
    assert_matches_torch,
    assert_refusal_names_an_argument,
    has_repeats,
    in_child_only,
    is_broken,
    jigsaws,
    random_tensor,
    run,
    run_module_isolated,
)

NAMES = ("images", "weight", "bias", "pos_embed", "unk_embed", "jigsaw", "backend")
MISTAKES = (None, "weight rank", "bias shape", "pos_embed shape", "unk_embed dtype", "perm dtype", "mask shape")


@st.composite
def calls(draw):
    batch, channels = draw(st.sampled_from((0, 1, 2))), draw(st.sampled_from((0, 1, 3)))
    patch, rows, cols = (
        draw(st.sampled_from((1, 2, 3))),
        draw(st.sampled_from((1, 2, 3))),
        draw(st.sampled_from((1, 2))),
    )
    dim = draw(st.sampled_from((1, 2, 5)))
    dtype = draw(st.sampled_from((torch.float32, torch.float32, torch.float64, torch.bfloat16)))
    seed = draw(st.integers(0, 1000))
    num_positions = rows * cols
    jigsaw = draw(jigsaws(batch, num_positions, draw(st.sampled_from(JIGSAW_KINDS))))
    inputs = dict(
        images=random_tensor((batch, channels, rows * patch, cols * patch), dtype, seed, draw(st.booleans())),
        weight=random_tensor((dim, channels, patch, patch), dtype, seed + 1),
        bias=random_tensor((dim,), dtype, seed + 2) if draw(st.booleans()) else None,
        pos_embed=random_tensor((num_positions, dim), dtype, seed + 3),
        unk_embed=random_tensor((dim,), dtype, seed + 4) if jigsaw is not None or draw(st.booleans()) else None,
        jigsaw=jigsaw,
        validate=draw(st.booleans()),
    )
    mistake = draw(st.sampled_from(MISTAKES))
    if mistake == "weight rank":
        inputs["weight"] = inputs["weight"][0]
    elif mistake == "bias shape":
        inputs["bias"] = random_tensor((dim + 1,), dtype, seed)
    elif mistake == "pos_embed shape":
        inputs["pos_embed"] = random_tensor((num_positions + 1, dim), dtype, seed)
    elif mistake == "unk_embed dtype" and inputs["unk_embed"] is not None:
        inputs["unk_embed"] = inputs["unk_embed"].to(torch.float16 if dtype != torch.float16 else torch.float32)
    elif mistake == "perm dtype" and jigsaw is not None:
        inputs["jigsaw"] = Jigsaw(jigsaw.mask, jigsaw.perm.float())
    elif mistake == "mask shape" and jigsaw is not None:
        inputs["jigsaw"] = Jigsaw(jigsaw.mask[:, :-1], jigsaw.perm)
    return inputs


@in_child_only
@given(calls())
def test_every_backend_gives_the_torch_result_or_a_named_refusal(inputs):
    reference = run(mjp_patch_embed, inputs, "torch")
    jigsaw = inputs["jigsaw"]
    if reference.error is None and inputs["validate"]:
        assert not is_broken(jigsaw), "validate=True accepted a perm that is not a permutation"
    if reference.error is not None:
        assert_refusal_names_an_argument(reference.error, NAMES)
    loose = ("images",) if has_repeats(jigsaw) else ()
    for backend in BACKENDS[1:]:
        result = run(mjp_patch_embed, inputs, backend)
        if reference.error is not None:
            assert result.error is not None, f"{backend} accepted what torch refused: {reference.error!r}"
            assert_refusal_names_an_argument(result.error, NAMES)
            continue
        assert_matches_torch(result, reference, inputs["images"].dtype, NAMES, loose if backend == "triton" else ())


@in_child_only
@given(calls())
def test_validate_false_never_reads_another_sample(inputs):
    """A broken jigsaw's tokens depend on their own sample only: changing sample 0's pixels leaves the others'."""
    jigsaw = inputs["jigsaw"]
    if jigsaw is None or inputs["images"].shape[0] < 2 or not isinstance(jigsaw, Jigsaw):
        return
    inputs = {**inputs, "validate": False}
    for backend in BACKENDS:
        first = run(mjp_patch_embed, inputs, backend)
        if first.error is not None:
            continue
        changed = inputs["images"].clone()
        changed[0] = 1e4
        second = run(mjp_patch_embed, {**inputs, "images": changed}, backend)
        assert torch.equal(first.output[1:], second.output[1:]), backend


def test_property_tests_in_a_child_process():
    run_module_isolated(__file__)
