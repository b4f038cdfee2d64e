import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_for_gpu.py")


def test_every_triton_kernel_compiles_for_hopper():
    # The interpreter (TRITON_INTERPRET=1, how the other tests run the kernels) checks what they compute, not
    # that they compile: the script compiles each one to a cubin for sm_90 in a process without it.
    pytest.importorskip("triton")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "90"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=SCRIPT.parents[2],
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert result.stdout.count("ok   sm_90") >= 18 and "\n0 failed" in result.stdout
    # with a perm, the weight gradient's tiles are pipelined as deep as without one (GRAD_WEIGHT_PERM_STAGES)
    assert "ok   sm_90 pipelining of the weight gradient" in result.stdout
    # and as deep with the inverse permutation (the training step's: a sampler's jigsaw), for autocast's two variants
    assert len(re.findall(r"ok   sm_90 pipelining of the weight gradient [^\n]* with the inverse", result.stdout)) == 2
    assert "FAIL" not in result.stdout
    # the DAL loss: forward (partial and finish) and backward, nonlinear and linear, float32, bfloat16 and mixed,
    # with the sizes of 1 that a launch makes constexpr, a class token's row skipped (skip_rows = 1), and the float
    # scale typed fp64 as inductor launches the kernels under torch.compile
    assert result.stdout.count("ok   sm_90 dal_loss") == 25
    assert len(re.findall(r"ok   sm_90 dal_loss (backward|forward_finish)[^\n]* scale=fp64", result.stdout)) == 6
    # prefix rows: P = Q = 1 (constexpr, as a ViT's class token launches them), P = 0, P = 5 (int32 arguments)
    for kernel in ("patch_embed forward", "patch_embed grad_images", "patch_embed grad_weight", "pos_embed forward"):
        for prefix in ("P=1", "P=0", "P=5"):
            assert re.search(rf"ok   sm_90 {kernel} bf16[^\n]* {prefix}: cubin", result.stdout), (kernel, prefix)
    for prefix in ("P=1", "P=0", "P=5"):
        for witness in (True, False):  # the eager backward reads the forward's witness; the compiled one does not
            assert f"ok   sm_90 grad_position partials bf16 mask=True scatter=True witness={witness} {prefix}:" in (
                result.stdout
            )
            assert f"ok   sm_90 pos_embed forward bf16 witness={witness} {prefix}:" in result.stdout
        assert f"ok   sm_90 grad_position reduce fp32 bias=True {prefix}:" in result.stdout
        # the weight gradient through the inverse permutation, and the partials kernel that writes the inverse
        assert re.search(rf"ok   sm_90 patch_embed grad_weight inverse bf16 {prefix}: cubin", result.stdout), prefix
        for partials in (
            f"grad_position partials fp32 mask=True scatter=False witness=False inverse {prefix}",
            f"grad_position partials fp32 mask=True scatter=False witness=False {prefix}",
            f"grad_position partials fp32 mask=False scatter=False witness=False {prefix}",
        ):  # the patch embedding's backward: a sampler's jigsaw, any jigsaw, none
            assert f"ok   sm_90 {partials}:" in result.stdout
            # its gradient tiles copied to shared memory steps ahead (NUM_STAGES): not a load waited on between adds
            pipelined = rf"ok   sm_90 pipelining of the {partials.removeprefix('grad_position ')}: [23] stages"
            assert re.search(pipelined, result.stdout), partials
    # every setting that the kernels benchmark times on a GPU (bench/bench_kernels.py) compiles there
    if str(SCRIPT.parents[2]) not in sys.path:  # `bench` is a folder of the checkout, not an installed package
        sys.path.insert(0, str(SCRIPT.parents[2]))
    from bench.bench_kernels import DEFAULT, SETTINGS

    for name in SETTINGS:
        if name != DEFAULT:
            assert f"ok   sm_90 setting {name}: " in result.stdout, name
    # the gathered (NaFlex) patch embedding: forward, the patches', weight's and per-sample position gradients
    assert result.stdout.count("ok   sm_90 gathered_patch_embed") == 32
    # _dot with mixed operand dtypes (bfloat16 x float32) compiles its float32 branch alone
    assert result.stdout.count("(upcast): cubin") == 3
