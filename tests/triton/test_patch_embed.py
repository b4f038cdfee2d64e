"""The Triton patch embedding's GEMM kernels autotune once per bucket of the token count, not once per batch size.

The forward and the image gradient are autotuned; each tuning runs every config, under a host sync. Keyed on the
exact token count ``B * N``, every new batch size (an epoch's last batch, an evaluation batch) tuned again; keyed on
its power-of-two bucket (:func:`~mjp_fast.triton.patch_embed.tuning_bucket`), batch sizes 1 to 9 tune four times.

In the interpreter the kernels have a single config, and Triton's autotuner skips tuning (no key, no cache entry)
when there is one config. So the test gives them two interpreter tiles, as the GPU's list gives them several, and a
benchmark that times each config once; the autotuner's own cache (one entry per tuning) and the benchmark's calls
count the tunings.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402

from mjp_fast.triton import patch_embed as patch_kernels  # noqa: E402
from mjp_fast.triton.common import INTERPRETER_TILE, INTERPRETER_WARPS, interpreting  # noqa: E402
from tests.triton.helpers import patch_embed_reference, random_jigsaw  # noqa: E402

GRID, PATCH, CHANNELS, DIM = (2, 3), 4, 3, 16
NUM_POSITIONS = GRID[0] * GRID[1]
BATCHES = range(1, 10)  # B * N = 6 to 54: the buckets 8, 16, 32 and 64
AUTOTUNED = {"forward": patch_kernels._forward_kernel, "grad_images": patch_kernels._grad_images_kernel}
DEVICE = "cpu" if interpreting() else "cuda"


def _configs(kernel) -> list[triton.Config]:
    """Several configs to tune between: the kernel's own on a GPU; two tiles in the interpreter."""
    if len(kernel.configs) > 1:
        return kernel.configs
    small, tall = INTERPRETER_TILE, 2 * INTERPRETER_TILE
    return [
        triton.Config({"BLOCK_M": rows, "BLOCK_D": small, "BLOCK_K": small}, num_warps=INTERPRETER_WARPS, num_stages=1)
        for rows in (small, tall)
    ]


@pytest.fixture
def bench_calls(monkeypatch) -> dict[str, list[float]]:
    """Each autotuned kernel with several configs, an empty tuning cache and a benchmark that times one run of a
    config (the real one repeats it for about 100 ms); returns the benchmark's timings per kernel."""
    calls: dict[str, list[float]] = {name: [] for name in AUTOTUNED}
    for name, kernel in AUTOTUNED.items():

        def bench(kernel_call, quantiles, name=name):
            start = time.perf_counter()
            kernel_call()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            calls[name].append(time.perf_counter() - start)
            return [calls[name][-1]] * len(quantiles)

        monkeypatch.setattr(kernel, "configs", _configs(kernel))
        monkeypatch.setattr(kernel, "cache", {})
        # do_bench is a cached property of the autotuner: an entry in the instance's dict takes its place
        monkeypatch.setitem(kernel.__dict__, "do_bench", bench)
    return calls


def test_gemm_kernels_tune_once_per_bucket_of_the_token_count(bench_calls):
    # A class token with its row in the table (P = Q = 1), as timm's ViTs have: B * N patch tokens all the same.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(DIM, CHANNELS, PATCH, PATCH, generator=generator)
    bias, unk = torch.randn(DIM, generator=generator), torch.randn(DIM, generator=generator)
    pos = torch.randn(1, 1 + NUM_POSITIONS, DIM, generator=generator)
    prefix = torch.randn(1, 1, DIM, generator=generator)
    for batch in BATCHES:
        images = torch.randn(batch, CHANNELS, GRID[0] * PATCH, GRID[1] * PATCH, generator=generator)
        mask, perm = random_jigsaw(batch, NUM_POSITIONS, "some", generator)
        on_device = [tensor.to(DEVICE) for tensor in (images, weight, bias, pos, unk, perm, mask, prefix)]
        out = patch_kernels.patch_embed_forward_launch(*on_device, 1)
        grad = torch.randn(out.shape, generator=generator)
        needs = [True, False, False, False, False, False]  # the image gradient alone: the other autotuned GEMM
        device_images, device_weight, _, _, _, device_perm, device_mask, _ = on_device
        grad_images = patch_kernels.patch_embed_backward_launch(
            grad.to(DEVICE), device_images, device_weight, device_perm, device_mask, *needs, 1, 1, list(pos.shape),
            list(prefix.shape),
        )[0]  # fmt: skip

        leaf = images.double().requires_grad_()
        tables = [tensor.double() for tensor in (weight, bias, pos, unk)]
        truth = patch_embed_reference(leaf, *tables, perm, mask, prefix.double(), 1)
        (want_images,) = torch.autograd.grad(truth, leaf, grad.double())
        torch.testing.assert_close(out.cpu().double(), truth.detach(), atol=1e-5, rtol=1e-5, msg=f"B={batch}")
        torch.testing.assert_close(grad_images.cpu().double(), want_images, atol=1e-5, rtol=1e-5, msg=f"B={batch}")

    buckets = {triton.next_power_of_2(batch * NUM_POSITIONS) for batch in BATCHES}
    for name, kernel in AUTOTUNED.items():
        # one cache entry per tuning, keyed (bucket, D, K, the tensors' dtypes); each tuning times every config once
        assert len(kernel.cache) == len(buckets), f"{name}: tuned for keys {sorted(kernel.cache)}"
        assert {key[0] for key in kernel.cache} == buckets, name
        assert len(bench_calls[name]) == len(kernel.configs) * len(buckets), name


def test_the_weight_gradient_pipelines_deeper_with_a_perm_where_shared_memory_allows(monkeypatch):
    # The rule of the launch's num_stages (its effect on the pipeline: tests/triton/compile_for_gpu.py, in
    # test_compile_for_gpu.py): five stages with a perm on a GPU whose block may use 160 KiB or more (A100, H100),
    # the default three otherwise, and on a smaller GPU (an RTX 4090's 99 KiB), where five might not fit.
    cuda = torch.device("cuda")
    for optin, with_perm in ((232448, patch_kernels.GRAD_WEIGHT_PERM_STAGES), (166912, 5), (101376, 3), (0, 3)):
        monkeypatch.setattr(patch_kernels, "shared_memory_optin", lambda device, optin=optin: optin)
        assert patch_kernels.grad_weight_stages(True, cuda) == with_perm
        assert patch_kernels.grad_weight_stages(False, cuda) == patch_kernels.GRAD_WEIGHT_STAGES == 3
    assert patch_kernels.GRAD_WEIGHT_PERM_STAGES == 5
    # a CPU tensor (the interpreter): no shared memory to ask about
    monkeypatch.undo()
    assert patch_kernels.grad_weight_stages(True, torch.device("cpu")) == patch_kernels.GRAD_WEIGHT_STAGES


def test_autocast_gradients_are_rounded_for_the_tensor_cores(monkeypatch):
    """_dot's (UPCAST, ROUND) per launch. The backward's float32 gradient (the output is float32 under autocast: the
    table's) against bfloat16 or float16 images and weight: rounded to their dtype and multiplied on the tensor
    cores, as timm's convolution gets its gradient, not multiplied in float32 ("ieee"), which made DeiT-S's weight
    gradient take 10-14 ms on an H100. Autocast's compute dtype: float32 images, weight and gradient rounded to it
    as they are loaded. The interpreter rounds as a GPU does but multiplies bfloat16 in float32 (it multiplies
    bfloat16 wrongly); mixed operands without a compute dtype multiply in float32."""
    from mjp_fast.triton import patch_embed as pe

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    monkeypatch.setattr(pe, "interpreting", lambda: False)  # as on a GPU
    assert pe._mixing(f32, bf16, gradient=True) == (pe.SAME_DTYPE, pe.TO_BFLOAT16)
    assert pe._mixing(f32, f16, gradient=True) == (pe.SAME_DTYPE, pe.TO_FLOAT16)
    assert pe._mixing(f32, bf16) == (pe.UPCAST_BOTH, pe.KEEP)  # the forward's images x weight
    assert pe._mixing(bf16, f32, gradient=True) == (pe.UPCAST_BOTH, pe.KEEP)  # a float32 weight or images
    assert pe._mixing(f32, f32, gradient=True) == (pe.SAME_DTYPE, pe.KEEP)
    assert pe._mixing(f32, f32, compute=bf16) == (pe.SAME_DTYPE, pe.TO_BFLOAT16)  # autocast's float32 inputs
    assert pe._mixing(f32, f32, gradient=True, compute=f16) == (pe.SAME_DTYPE, pe.TO_FLOAT16)
    assert pe._mixing(f32, f32, compute=f32) == (pe.SAME_DTYPE, pe.KEEP)
    monkeypatch.setattr(pe, "interpreting", lambda: True)
    assert pe._mixing(f32, bf16, gradient=True) == (pe.UPCAST_BOTH, pe.BFLOAT16_IN_FLOAT32)
    assert pe._mixing(f32, f32, compute=bf16) == (pe.UPCAST_BOTH, pe.BFLOAT16_IN_FLOAT32)
    assert pe._mixing(f32, f32, compute=f16) == (pe.SAME_DTYPE, pe.TO_FLOAT16)


@pytest.mark.parametrize(
    "images_dtype, weight_dtype",
    [
        (torch.float64, torch.float64),
        (torch.float64, torch.float32),
        (torch.float32, torch.float64),
        (torch.uint8,) * 2,
    ],
    ids=str,
)
def test_the_launchers_refuse_dtypes_the_gemms_cannot_multiply(images_dtype, weight_dtype):
    # Two float64 tiles make tl.dot return float64, which the float32 accumulator does not hold: the interpreter left
    # the high half of each float64 output as torch.empty found it (issue 42). uint8 images would be summed as floats
    # and truncated to uint8 tokens. The timm models' step sends float64 to the torch backend before the kernels.
    images = torch.randn(1, CHANNELS, GRID[0] * PATCH, GRID[1] * PATCH, device=DEVICE).to(images_dtype)
    weight = torch.randn(DIM, CHANNELS, PATCH, PATCH, device=DEVICE).to(weight_dtype)
    pos = torch.zeros(NUM_POSITIONS, DIM, device=DEVICE)
    refused = torch.float64 if torch.float64 in (images_dtype, weight_dtype) else torch.uint8
    words = str(refused).removeprefix("torch.")
    with pytest.raises(TypeError, match=words):
        patch_kernels.patch_embed_forward_launch(images, weight, None, pos, None, None, None)
    grad = torch.zeros(1, NUM_POSITIONS, DIM, device=DEVICE)
    needs = (True, True, False, False, False, False)
    with pytest.raises(TypeError, match=words):
        patch_kernels.patch_embed_backward_launch(
            grad, images, weight, None, None, *needs, 0, 0, [NUM_POSITIONS, DIM], [0]
        )
