"""Test set-up. Environment variables that must precede any import of the package go here."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels must see this before they are defined, so the interpreter runs them on the CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("MJP_FAST_BACKEND", None)  # tests choose backends explicitly

import pytest  # noqa: E402
import torch  # noqa: E402

import mjp_fast  # noqa: E402


def backends_for(device: str) -> list[str]:
    """The available backends that run on ``device``."""
    names = mjp_fast.available_backends()
    if device == "cpu":
        # triton on CPU tensors: the real kernels in the interpreter (TRITON_INTERPRET=1 above)
        return [name for name in names if name in ("torch", "cpu", "triton")]
    return [name for name in names if name in ("torch", "cuda", "triton")]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BACKEND_DEVICE_PAIRS = [(backend, device) for device in DEVICES for backend in backends_for(device)]


@pytest.fixture(params=BACKEND_DEVICE_PAIRS, ids=[f"{b}-{d}" for b, d in BACKEND_DEVICE_PAIRS])
def backend_device(request):
    return request.param
