import pytest
import torch

import mjp_fast
from mjp_fast import backend


def test_torch_is_always_available_and_listed_last():
    names = mjp_fast.available_backends()
    assert names[-1] == "torch"
    assert set(names) <= set(backend.KNOWN_BACKENDS)


def test_automatic_choice_prefers_the_compiled_path_on_cpu(monkeypatch):
    monkeypatch.delenv(backend.ENV_VARIABLE, raising=False)
    chosen = backend.resolve_backend(None, torch.device("cpu"))
    assert chosen == ("cpu" if backend.extension() is not None else "torch")


def test_explicit_argument_beats_the_environment(monkeypatch):
    monkeypatch.setenv(backend.ENV_VARIABLE, "definitely-not-a-backend")
    assert backend.resolve_backend("torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match=backend.ENV_VARIABLE):
        backend.resolve_backend(None, torch.device("cpu"))


def test_backend_on_the_wrong_device_is_refused():
    if backend.extension() is not None:
        with pytest.raises(ValueError, match="cannot run on"):
            backend.resolve_backend("cpu", torch.device("cuda"))
    with pytest.raises(TypeError, match="backend"):
        backend.resolve_backend(3, torch.device("cpu"))


def test_the_extension_state_is_reported():
    assert (backend.extension() is None) == (backend.extension_error() is not None)
