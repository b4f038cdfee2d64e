"""Test set-up. Environment variables that must precede any import of the package go here."""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Where no GPU is visible, the Triton kernels run in the interpreter on CPU tensors; it must be set before they are
# defined (before mjp_fast is imported). Where a GPU is visible the real kernels run on CUDA tensors, unless the
# caller set TRITON_INTERPRET itself.
GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("MJP_FAST_BACKEND", None)  # tests choose backends explicitly

import pytest  # noqa: E402

import mjp_fast  # noqa: E402
from mjp_fast import backend as backend_module  # noqa: E402
from tests.train.helpers import make_cifar_tree  # noqa: E402

try:
    import hypothesis  # noqa: E402, F401
except ImportError:
    # The property tests need hypothesis (the test extras). The lent GPU machine's image lacks it and cannot install
    # it: there tests/property is left out of the collection, and every other test still runs.
    collect_ignore_glob = ["property/*"]
else:
    from tests.property.settings import register_profiles

    register_profiles()


def backends_for(device: str) -> list[str]:
    """The available backends that can run on tensors on ``device``, as the package itself decides it: ``triton``
    on CPU tensors only in the interpreter, on CUDA tensors only with the real kernels."""
    return [
        name
        for name in mjp_fast.available_backends()
        if backend_module.runs_on(name, torch.device(device))
        and not (name == "triton" and device == "cuda" and backend_module.triton_interpreting())
    ]


DEVICES = ["cpu"] + (["cuda"] if GPU else [])
BACKEND_DEVICE_PAIRS = [(backend, device) for device in DEVICES for backend in backends_for(device)]


@pytest.fixture(params=BACKEND_DEVICE_PAIRS, ids=[f"{b}-{d}" for b, d in BACKEND_DEVICE_PAIRS])
def backend_device(request):
    return request.param


@pytest.fixture(scope="session")
def cifar_tree(tmp_path_factory):
    """A small ImageFolder tree of links to real CIFAR-10 (tests.train.helpers.make_cifar_tree), made once for the
    training, evaluation and reproduce tests."""
    return make_cifar_tree(tmp_path_factory.mktemp("cifar"))


def pytest_collection_modifyitems(config, items):
    """The tests marked slow run first. pytest-xdist deals the tests out in this order, and most slow tests sit in
    late folders (timm/, train/): dealt last, one of them could keep a worker busy for up to a minute after the
    other worker had finished."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order
