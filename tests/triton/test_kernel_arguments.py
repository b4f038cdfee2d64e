"""Every Triton kernel launch passes int arguments that fit in int32.

torch.compile's Inductor (torch 2.11, the GPU image's) fails to generate the call of a user-defined Triton kernel
with a Python int argument above 2**31 - 1 ("'int' object has no attribute 'xreplace'"), and types a large
negative one as int32. The sampler used to pass its seed and its prob threshold (2**31 at prob 0.5) that way; now
they are read from a tensor. This records the launches of every kernel, in the interpreter, at settings that
used to produce such values.
"""

import inspect
import os

import pytest
import torch

import mjp_fast

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records interpreter launches")

INT32 = (-(2**31), 2**31 - 1)


@pytest.fixture
def launches(monkeypatch):
    from triton.runtime import interpreter

    recorded = []
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        parameters = inspect.signature(self.fn).parameters
        named = dict(zip(self.arg_names, args)) | kwargs
        runtime_ints = {
            name: value
            for name, value in named.items()
            if name in parameters  # launch options (num_warps, num_stages) are not kernel arguments
            and isinstance(value, int)
            and not isinstance(value, bool)
            and "constexpr" not in str(parameters[name].annotation)
        }
        recorded.append((self.fn.__name__, runtime_ints))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    return recorded


def _assert_int32(launches, expected_kernels):
    names = {name for name, _ in launches}
    assert expected_kernels <= names, f"kernels not launched: {expected_kernels - names}"
    for name, ints in launches:
        for argument, value in ints.items():
            assert INT32[0] <= value <= INT32[1], f"{name}({argument}={value}) does not fit in int32"


@pytest.mark.parametrize("prob", [0.5, 1.0])
@pytest.mark.parametrize("seed", [0, 2**31 + 5, 2**64 - 1])
def test_sampler_launches(launches, seed, prob):
    sampler = mjp_fast.JigsawSampler((4, 5), ratio=0.5, prob=prob, seed=seed, min_block=2, backend="triton")
    sampler(3, "cpu")
    mjp_fast.sample_jigsaw(3, (4, 5), 0.5, seed=seed, prob=prob, offset=2**40, min_block=2, backend="triton")
    _assert_int32(launches, {"_sample_jigsaw_kernel"})


def test_embedding_and_dal_launches(launches):
    jigsaw = mjp_fast.sample_jigsaw(2, (2, 3), 0.5, seed=2**64 - 1, prob=0.5, min_block=1, backend="triton")
    images = torch.randn(2, 3, 8, 12, requires_grad=True)
    weight, bias = torch.randn(5, 3, 4, 4, requires_grad=True), torch.randn(5, requires_grad=True)
    pos, unk = torch.randn(6, 5, requires_grad=True), torch.randn(5, requires_grad=True)
    tokens = mjp_fast.mjp_patch_embed(images, weight, bias, pos, unk, jigsaw, backend="triton")
    moved = mjp_fast.mjp_pos_embed(tokens, pos, unk, jigsaw, backend="triton")
    regressor = mjp_fast.DALRegressor(5, "nonlinear")
    dal = mjp_fast.dal_loss(pos, regressor, (2, 3), jigsaw.mask, backend="triton")
    (moved.square().sum() + dal).backward()
    _assert_int32(launches, {"_sample_jigsaw_kernel", "_forward_kernel", "_forward_partial_kernel"})
