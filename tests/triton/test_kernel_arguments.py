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


def test_prefix_row_launches(launches):
    # The kernels' own launchers with prefix rows (a class token and its table row) and a full DAL table.
    from mjp_fast.triton import dal_loss, patch_embed, pos_embed

    mask = torch.tensor([[True, False, True, False, False, True]] * 2)
    perm = torch.tensor([[2, 1, 5, 3, 4, 0]] * 2)
    images, weight, bias = torch.randn(2, 3, 8, 12), torch.randn(5, 3, 4, 4), torch.randn(5)
    pos, unk, prefix = torch.randn(1, 7, 5), torch.randn(5), torch.randn(1, 1, 5)
    tokens = patch_embed.patch_embed_forward_launch(images, weight, bias, pos, unk, perm, mask, prefix, 1)
    patch_embed.patch_embed_backward_launch(
        torch.randn_like(tokens), images, weight, perm, mask, *[True] * 6, 1, 1, [1, 7, 5], [1, 1, 5]
    )
    moved = pos_embed.pos_embed_forward_launch(tokens[:, 1:].contiguous(), perm, mask, pos, unk, prefix, 1)
    pos_embed.pos_embed_backward_launch(moved, perm, mask, 1, 1, [1, 7, 5], [1, 1, 5], *[torch.float32] * 4)
    w1, w2, coords = torch.randn(8, 5), torch.randn(2, 8), torch.randn(6, 2)
    loss, saved = dal_loss.dal_forward_launch(pos, 1, w1, None, w2, None, coords, mask, 1.0)
    dal_loss.dal_backward_launch(torch.ones(()), pos, 1, w1, w2, coords, saved, 1.0, False, False)
    _assert_int32(
        launches,
        {
            "_forward_kernel",
            "_grad_weight_kernel",
            "_grad_images_kernel",
            "_position_partials_kernel",
            "_position_reduce_kernel",
            "_forward_partial_kernel",
            "_backward_kernel",
        },
    )
