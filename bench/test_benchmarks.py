"""pytest-benchmark timings of the kernels, each group with its baseline.

Not part of the test suite (``pytest.ini`` collects ``tests/`` only). Run from the repository root:

    python -m pytest bench/test_benchmarks.py --benchmark-only
    python -m pytest bench/test_benchmarks.py --benchmark-only --benchmark-json=/tmp/kernels.json

Groups (compare within a group; pytest-benchmark prints one table per group):

- ``sampler-b<batch>-r<ratio>``: the Python loop against ``sample_jigsaw`` on each backend of the device.
- ``jigsaw-apply``: the paper code's pixel pipeline against ``jigsaw_images``.
- ``patch-embed-forward``: timm's ``PatchEmbed`` + position add against ``mjp_patch_embed`` on each backend.

The same code as ``mjp bench``: these functions come from the benchmark modules, which use the ``*_ref``
oracles and the public functions the tests use. The whole-step comparison (``train_step``) is too slow for
pytest-benchmark's repeated rounds and runs only in ``mjp bench``.
"""

from __future__ import annotations

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from bench import bench_jigsaw_apply, bench_patch_embed, bench_sampler  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SYNC = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
GRID = (14, 14)
SAMPLER_CASES = [(256, 0.1), (256, 0.5)]


def _synchronized(function):
    def run():
        result = function()
        SYNC()
        return result

    return run


@pytest.mark.parametrize("batch,ratio", SAMPLER_CASES, ids=[f"b{b}-r{r}" for b, r in SAMPLER_CASES])
@pytest.mark.parametrize("implementation", ["python loop", *bench_sampler.backends_on(DEVICE)])
def test_sampler(benchmark, implementation, batch, ratio):
    benchmark.group = f"sampler-b{batch}-r{ratio}"
    benchmark.extra_info.update(batch=batch, ratio=ratio, grid=list(GRID), device=DEVICE)
    if implementation == "python loop":
        rng = random.Random(0)
        function = lambda: bench_sampler.python_jigsaws(batch, GRID, ratio, rng)
    else:
        function = bench_sampler._sampler(batch, GRID, ratio, implementation, DEVICE)
    mask, _ = benchmark(_synchronized(function))
    assert mask.shape == (batch, GRID[0] * GRID[1])


@pytest.fixture(scope="module")
def apply_problem():
    return bench_jigsaw_apply.Problem(batch=64, image_size=224, patch_size=16, dim=384, ratio=0.1, device=DEVICE)


@pytest.mark.parametrize("implementation", ["paper pixel pipeline", "jigsaw_images"])
def test_jigsaw_apply(benchmark, apply_problem, implementation):
    benchmark.group = "jigsaw-apply"
    benchmark.extra_info.update(shape=list(apply_problem.images.shape), ratio=apply_problem.ratio, device=DEVICE)
    function = apply_problem.paper_pixels if implementation == "paper pixel pipeline" else apply_problem.ours_pixels
    with torch.no_grad():
        out = benchmark(_synchronized(function))
    assert out.shape == apply_problem.images.shape


@pytest.fixture(scope="module")
def embed_problem():
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    return bench_patch_embed.Problem(batch=64, image_size=224, patch_size=16, dim=384, dtype=dtype, device=DEVICE)


EMBED_IMPLEMENTATIONS = ["timm", *(f"mjp[{name}]" for name in bench_patch_embed.backends_on(DEVICE))]


@pytest.mark.parametrize("implementation", EMBED_IMPLEMENTATIONS)
def test_patch_embed_forward(benchmark, embed_problem, implementation):
    benchmark.group = "patch-embed-forward"
    benchmark.extra_info.update(shape=list(embed_problem.images.shape), dtype=str(embed_problem.images.dtype))
    if implementation == "timm":
        function = embed_problem.timm_forward
    else:
        backend = implementation[4:-1]
        function = lambda: embed_problem.mjp_forward(backend)
    with torch.no_grad():
        tokens = benchmark(_synchronized(function))
    assert tokens.shape == (64, 196, 384)
