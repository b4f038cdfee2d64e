"""What the property tests of the token-side operations share: jigsaws drawn valid or broken, the run of one call on
one backend (outputs and gradients, or the exception), the comparison with the ``torch`` backend, and the child
process the kernel calls run in.

The kernel calls may crash a process (that is what they test), so each property module's tests run only in a child
process (:func:`run_module_isolated`, marked by ``MJP_FAST_PROPERTY_CHILD``); in the test process itself one test per
module starts that child and fails with its output if any example failed or the child died of a signal.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st

import mjp_fast
from mjp_fast.sampler.jigsaw import Jigsaw
from tests.harness.isolated import run_pytest_isolated

CHILD = os.environ.get("MJP_FAST_PROPERTY_CHILD") == "1"
in_child_only = pytest.mark.skipif(not CHILD, reason="runs in the child process of run_module_isolated")

BACKENDS = [name for name in ("torch", "cpu", "triton") if name in mjp_fast.available_backends()]
OUT_OF_RANGE = ("N", -1, 10**9, -(10**9))
JIGSAW_KINDS = ("none", "valid", "out_of_range", "repeated")
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float64: dict(atol=1e-9, rtol=1e-9),
    torch.float16: dict(atol=2e-2, rtol=2e-2),
    torch.bfloat16: dict(atol=1e-1, rtol=5e-2),
}


def run_module_isolated(path: str) -> None:
    """Runs the property tests of the module at ``path`` in a child process; fails with the child's output if one
    failed or a signal ended it. In the child itself it skips: the child runs the whole module, this test with it,
    and starting a grandchild from there would recurse without end."""
    if CHILD:
        pytest.skip("the child process runs the property tests themselves")
    done = run_pytest_isolated(path, "-x", env={"MJP_FAST_PROPERTY_CHILD": "1"})
    assert done.returncode == 0, ("a kernel crashed the child: " if done.crashed else "") + done.explain()
    assert re.search(r"\d+ passed", done.stdout), done.explain()


@st.composite
def jigsaws(draw, batch: int, num_positions: int, kind: str) -> Jigsaw | None:
    """A jigsaw for ``[batch, num_positions]``: none, valid, or broken (an out-of-range or a repeated entry)."""
    if kind == "none":
        return None
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=batch * num_positions, max_size=batch * num_positions)))
    mask = mask.reshape(batch, num_positions)
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    perm = torch.arange(num_positions).repeat(batch, 1)
    for b in range(batch):
        masked = mask[b].nonzero().flatten()
        perm[b, masked] = masked[torch.randperm(len(masked), generator=generator)]
    if batch * num_positions and kind == "out_of_range":
        value = draw(st.sampled_from(OUT_OF_RANGE))
        b, n = draw(st.integers(0, batch - 1)), draw(st.integers(0, num_positions - 1))
        perm[b, n] = num_positions if value == "N" else value
    if batch * num_positions and kind == "repeated" and num_positions > 1:
        b = draw(st.integers(0, batch - 1))
        perm[b, 0] = perm[b, 1]
    return Jigsaw(mask, perm)


def is_broken(jigsaw: Jigsaw | None) -> bool:
    """Whether some ``perm[b]`` is not a permutation of the positions."""
    if jigsaw is None or jigsaw.perm.numel() == 0:
        return False
    positions = torch.arange(jigsaw.perm.shape[1])
    return not torch.equal(jigsaw.perm.sort(dim=1).values, positions.expand_as(jigsaw.perm))


def has_repeats(jigsaw: Jigsaw | None) -> bool:
    """Whether some in-range entry of ``perm`` repeats within a sample."""
    if jigsaw is None:
        return False
    for row in jigsaw.perm:
        inside = row[(row >= 0) & (row < jigsaw.perm.shape[1])]
        if len(inside.unique()) != len(inside):
            return True
    return False


@dataclass
class Result:
    """One call on one backend: its output and the gradients of ``inputs`` (None where one got none), or the
    exception it raised."""

    output: torch.Tensor | None = None
    grads: dict[str, torch.Tensor | None] | None = None
    error: BaseException | None = None


def run(call: Callable[..., torch.Tensor], inputs: dict[str, object], backend: str, seed: int = 0) -> Result:
    """``call(**inputs, backend=backend)`` and the backward of a fixed random weighting of its output."""
    leaves = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
            value = value.detach().clone().requires_grad_(True)
        leaves[name] = value
    try:
        output = call(**leaves, backend=backend)
        weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed)).to(output.dtype)
        differentiable = [value for value in leaves.values() if isinstance(value, torch.Tensor) and value.requires_grad]
        if output.requires_grad and differentiable:
            grads = torch.autograd.grad(output, differentiable, weights, allow_unused=True)
        else:
            grads = [None] * len(differentiable)
    except (ValueError, TypeError) as error:
        return Result(error=error)
    names = [name for name, value in leaves.items() if isinstance(value, torch.Tensor) and value.requires_grad]
    return Result(output.detach(), dict(zip(names, grads)))


def assert_refusal_names_an_argument(error: BaseException, names: tuple[str, ...]) -> None:
    """A refusal is a ValueError or TypeError whose message names one of the arguments."""
    assert isinstance(error, (ValueError, TypeError)), repr(error)
    message = str(error)
    assert any(name in message for name in names), f"the message names no argument of {names}: {message!r}"


def assert_matches_torch(
    result: Result, reference: Result, dtype: torch.dtype, names: tuple[str, ...], loose: tuple[str, ...] = ()
) -> None:
    """``result`` is the torch backend's ``reference`` (outputs and gradients, within the dtype's tolerance), or a
    refusal naming an argument. The gradients named in ``loose`` (the images' or tokens', where a perm repeats an
    entry: cuda and triton keep one token's gradient, see mjp_fast/_validate.py) need only be finite where the
    reference is."""
    if result.error is not None:
        assert_refusal_names_an_argument(result.error, names)
        return
    assert reference.error is None, f"torch refused ({reference.error!r}) what this backend accepted"
    tolerance = TOLERANCE[dtype]
    assert result.output.shape == reference.output.shape
    assert result.output.dtype == reference.output.dtype
    torch.testing.assert_close(result.output.double(), reference.output.double(), **tolerance, equal_nan=True)
    for name, expected in reference.grads.items():
        actual = result.grads[name]
        assert (actual is None) == (expected is None), f"{name}: gradient {actual} where torch gives {expected}"
        if expected is None:
            continue
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
        if name in loose:
            assert bool(torch.isfinite(actual).all() | ~torch.isfinite(expected).all()), name
            continue
        torch.testing.assert_close(actual.double(), expected.double(), **tolerance, equal_nan=True, msg=name)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int, contiguous: bool = True) -> torch.Tensor:
    """A random tensor; not contiguous (a transposed copy's transpose) when asked and it has 2 dims or more."""
    generator = torch.Generator().manual_seed(seed)
    if contiguous or len(shape) < 2:
        return torch.randn(shape, generator=generator).to(dtype)
    flipped = (*shape[:-2], shape[-1], shape[-2])
    return torch.randn(flipped, generator=generator).to(dtype).transpose(-1, -2)


def vit_prefix_kwargs(draw) -> dict[str, object]:
    """A timm VisionTransformer's prefix tokens, drawn (within a ``st.composite``): a class token or not, 0-2
    register tokens, the position table with or without rows for them, and the pooling a class token allows."""
    class_token = draw(st.booleans())
    return dict(
        class_token=class_token,
        reg_tokens=draw(st.integers(0, 2)),
        no_embed_class=draw(st.booleans()),
        global_pool="token" if class_token else "avg",
    )
