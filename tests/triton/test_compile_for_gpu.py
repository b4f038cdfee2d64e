import os
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
    # the DAL loss: forward (partial and finish) and backward, nonlinear and linear, float32, bfloat16 and mixed,
    # and with the sizes of 1 that a launch makes constexpr
    assert result.stdout.count("ok   sm_90 dal_loss") == 17
