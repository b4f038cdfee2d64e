"""Property tests of ``mjp_pos_embed``: on every backend, the torch backend's result (outputs and gradients) or a
ValueError/TypeError naming an argument, for edge values (B = 0, N = 1, D = 0 and 1, non-contiguous tokens, every
dtype, a table of another dtype), plausible mistakes, and broken jigsaws with ``validate=False``."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from mjp_fast import mjp_pos_embed
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

NAMES = ("tokens", "pos_embed", "unk_embed", "jigsaw", "backend")
MISTAKES = (None, "tokens rank", "pos_embed shape", "unk_embed 0-d", "unk_embed shape", "perm dtype", "mask dtype")


@st.composite
def calls(draw):
    batch, num_positions = draw(st.sampled_from((0, 1, 3))), draw(st.sampled_from((1, 2, 5)))
    dim = draw(st.sampled_from((0, 1, 3)))
    dtype = draw(st.sampled_from((torch.float32, torch.float64, torch.float16, torch.bfloat16)))
    table_dtype = draw(st.sampled_from((dtype, torch.float32)))
    seed = draw(st.integers(0, 1000))
    jigsaw = draw(jigsaws(batch, num_positions, draw(st.sampled_from(JIGSAW_KINDS))))
    inputs = dict(
        tokens=random_tensor((batch, num_positions, dim), dtype, seed, draw(st.booleans())),
        pos_embed=random_tensor((num_positions, dim), table_dtype, seed + 1),
        unk_embed=random_tensor((dim,), table_dtype, seed + 2) if jigsaw is not None or draw(st.booleans()) else None,
        jigsaw=jigsaw,
        validate=draw(st.booleans()),
    )
    mistake = draw(st.sampled_from(MISTAKES))
    if mistake == "tokens rank":
        inputs["tokens"] = inputs["tokens"][0]
    elif mistake == "pos_embed shape":
        inputs["pos_embed"] = random_tensor((num_positions, dim + 1), table_dtype, seed)
    elif mistake == "unk_embed 0-d":
        inputs["unk_embed"] = random_tensor((), table_dtype, seed)
    elif mistake == "unk_embed shape":
        inputs["unk_embed"] = random_tensor((dim + 1,), table_dtype, seed)
    elif mistake == "perm dtype" and jigsaw is not None:
        inputs["jigsaw"] = Jigsaw(jigsaw.mask, jigsaw.perm.double())
    elif mistake == "mask dtype" and jigsaw is not None:
        inputs["jigsaw"] = Jigsaw(jigsaw.mask.long(), jigsaw.perm)
    return inputs


@in_child_only
@given(calls())
def test_every_backend_gives_the_torch_result_or_a_named_refusal(inputs):
    reference = run(mjp_pos_embed, inputs, "torch")
    jigsaw = inputs["jigsaw"]
    if reference.error is None and inputs["validate"]:
        assert not is_broken(jigsaw), "validate=True accepted a perm that is not a permutation"
    if reference.error is not None:
        assert_refusal_names_an_argument(reference.error, NAMES)
    loose = ("tokens",) if jigsaw is not None and has_repeats(jigsaw) else ()
    dtype = torch.promote_types(inputs["tokens"].dtype, inputs["pos_embed"].dtype)
    for backend in BACKENDS[1:]:
        result = run(mjp_pos_embed, inputs, backend)
        if reference.error is not None:
            assert result.error is not None, f"{backend} accepted what torch refused: {reference.error!r}"
            assert_refusal_names_an_argument(result.error, NAMES)
            continue
        assert_matches_torch(result, reference, dtype, NAMES, loose if backend == "triton" else ())


@in_child_only
@given(calls())
def test_validate_false_gives_unshown_tokens_zero_gradient(inputs):
    """With any perm, a token that no entry names gets a zero gradient, on every backend (never uninitialised)."""
    jigsaw = inputs["jigsaw"]
    if jigsaw is None or jigsaw.perm.is_floating_point() or jigsaw.mask.dtype != torch.bool:
        return
    inputs = {**inputs, "validate": False}
    num_positions = inputs["tokens"].shape[1] if inputs["tokens"].dim() == 3 else 0
    for backend in BACKENDS:
        result = run(mjp_pos_embed, inputs, backend)
        if result.error is not None or result.grads.get("tokens") is None:
            continue
        for b, row in enumerate(jigsaw.perm):
            for m in range(num_positions):
                if not bool((row == m).any()):
                    assert not bool(result.grads["tokens"][b, m].any()), (backend, b, m)


def test_property_tests_in_a_child_process():
    run_module_isolated(__file__)
