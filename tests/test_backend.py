import os
import subprocess
import sys

import pytest
import torch

import mjp_fast
from mjp_fast import backend


def test_torch_is_always_available():
    names = mjp_fast.available_backends()
    assert "torch" in names and set(names) <= set(backend.KNOWN_BACKENDS)
    if not torch.cuda.is_available():
        assert "cuda" not in names
        # the Triton interpreter is listed after torch: available for tests, never the fast choice
        assert "triton" not in names or names.index("triton") > names.index("torch")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    if "triton" not in mjp_fast.available_backends() or torch.cuda.is_available():
        pytest.skip("needs triton and no GPU")
    assert backend.resolve_backend("triton", torch.device("cpu")) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        backend.resolve_backend("triton", torch.device("cpu"))


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


def test_a_missing_extension_is_said_once_and_its_reason_kept(monkeypatch):
    # As on a machine where the build failed: the import of mjp_fast._C fails (None in sys.modules makes it raise).
    monkeypatch.setitem(sys.modules, "mjp_fast._C", None)
    monkeypatch.delattr(mjp_fast, "_C", raising=False)
    monkeypatch.setattr(backend, "_extension", None)
    monkeypatch.setattr(backend, "_extension_error", None)
    monkeypatch.setattr(backend, "_extension_loaded", False)
    with pytest.warns(RuntimeWarning, match="'torch' backend runs instead") as record:
        assert backend.extension() is None
        assert backend.extension() is None
    assert len(record) == 1
    assert "mjp_fast._C" in backend.extension_error()


def test_the_package_works_without_triton():
    # CPU-only torch wheels ship no triton: the package must import and run its other backends without it.
    script = """
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoTriton())
import torch, timm, mjp_fast, mjp_fast.timm
from mjp_fast import backend

assert "triton" not in mjp_fast.available_backends(), mjp_fast.available_backends()
assert not backend.triton_importable()
expected = mjp_fast.sample_jigsaw(3, 6, 0.5, seed=1, min_block=2, backend="torch")
for name in mjp_fast.available_backends():
    got = mjp_fast.sample_jigsaw(3, 6, 0.5, seed=1, min_block=2, backend=name)
    assert torch.equal(got.mask, expected.mask) and torch.equal(got.perm, expected.perm), name
model = timm.create_model(
    "mjp_deit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mjp_prob=1.0
)
(model(torch.randn(2, 3, 32, 32)).sum() + model.mjp_aux_loss()).backward()
assert model.pos_embed.grad is not None
print("ok", mjp_fast.available_backends())
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")
