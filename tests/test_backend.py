import os
import subprocess
import sys

import pytest
import torch

import mjp_fast
from mjp_fast import backend
from tests.harness.isolated import run_isolated


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


@pytest.mark.parametrize(
    "available, chosen",
    [
        (("cuda", "triton", "cpu", "torch"), "cuda"),  # the faster at every point the H200 measured (2026-11-28)
        (("triton", "cpu", "torch"), "triton"),  # an extension built without nvcc
        (("cpu", "torch"), "torch"),
    ],
)
def test_automatic_choice_on_a_gpu_takes_the_fastest_measured_backend(monkeypatch, available, chosen):
    monkeypatch.delenv(backend.ENV_VARIABLE, raising=False)
    monkeypatch.setattr(backend, "_AVAILABLE", available)
    assert backend.resolve_backend(None, torch.device("cuda")) == chosen


def test_the_backends_are_listed_fastest_first_on_a_gpu(monkeypatch):
    monkeypatch.setattr(backend, "_has_cuda_kernels", lambda: True)
    monkeypatch.setattr(backend, "triton_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    names = backend._detect_backends()
    assert names[:2] == ("cuda", "triton") and names[-1] == "torch"


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


def test_where_triton_cannot_run_its_kernels_are_not_imported():
    """No GPU and no interpreter: the triton backend cannot run, so the operations neither import its kernels nor
    register their operators, and an explicit backend="triton" says why."""
    script = """
import sys, torch, mjp_fast
assert not torch.cuda.is_available()
loaded = sorted(name for name in sys.modules if name.startswith(("mjp_fast.triton", "mjp_fast.sampler.triton")))
assert not loaded, loaded
assert "triton" not in mjp_fast.available_backends(), mjp_fast.available_backends()
try:
    mjp_fast.sample_jigsaw(2, 4, 0.5, seed=0, backend="triton")
except ValueError as error:
    assert "TRITON_INTERPRET" in str(error), error
else:
    raise AssertionError("backend='triton' ran without a GPU or the interpreter")
tokens = mjp_fast.mjp_pos_embed(torch.randn(2, 16, 8), torch.randn(16, 8), torch.zeros(8),
                                mjp_fast.sample_jigsaw(2, 4, 0.5, seed=0))
assert tokens.shape == (2, 16, 8)
print("ok")
"""
    done = run_isolated(script, timeout=300, env={"TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.explain()
    assert done.stdout.startswith("ok")


def _tiny_vit(**kwargs):
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=3, **kwargs
    )


def _record_backends(monkeypatch) -> list[str]:
    """The backends that the MJP step's operations run on, as they are called (the sampler's plan, the fused
    embedding, the position step, the DAL loss)."""
    import mjp_fast.core
    import mjp_fast.sampler.module
    import mjp_fast.timm.fused
    import mjp_fast.timm.state

    seen = []
    wrap = {
        mjp_fast.timm.fused: ("patch_embed_step", 6),
        mjp_fast.timm.state: ("mjp_position_step", 4),
        mjp_fast.core: ("dal_loss_unchecked", 4),
        mjp_fast.sampler.module: ("make_sampler_plan", None),
    }
    for module, (name, index) in wrap.items():
        original = getattr(module, name)

        def recorded(*args, _original=original, _index=index, **kwargs):
            seen.append(kwargs["backend"] if _index is None else args[_index])
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)
    return seen


@pytest.mark.parametrize("fused", [True, False])
def test_a_model_keeps_one_backend_when_the_environment_changes_mid_run(fused, monkeypatch):
    # One resolved backend per model, held by its sampler: MJP_FAST_BACKEND is read at the first step, and a change
    # of it mid-run moves no part of the model (neither the sampler, the embedding nor the DAL loss).
    monkeypatch.delenv(backend.ENV_VARIABLE, raising=False)
    torch.manual_seed(0)
    # pca: the DAL loss runs as its own operation (not fused into the cpu position step), so it is seen here
    model = mjp_fast.convert(_tiny_vit(), ratio=0.5, prob=1.0, dal="pca", fused_patch_embed=fused)
    images = torch.randn(2, 3, 32, 32)
    seen = _record_backends(monkeypatch)
    model(images)
    first = backend.resolve_backend(None, images.device)
    assert set(seen) == {first} and len(seen) == 3  # the sampler, the embedding or position step, DAL
    monkeypatch.setenv(backend.ENV_VARIABLE, "torch" if first != "torch" else "cpu")
    seen.clear()
    model(images)
    model.mjp.sampler.prob = 0.75  # a new sampler plan: it too keeps the model's backend
    model(images)
    assert set(seen) == {first} and model.mjp.backend_for(images.device) == first
    model.eval()
    model(images)  # the plain fused embedding of an eval step, too
    assert set(seen) == {first}
    # Set on the model, a backend moves every part at once.
    model.train()
    model.mjp.backend = "torch"
    seen.clear()
    model(images)
    assert set(seen) == {"torch"} and model.mjp.sampler.backend == "torch"


def test_fast_patch_embed_sets_the_one_backend_of_an_mjp_model():
    model = mjp_fast.convert(_tiny_vit(), ratio=0.5, prob=1.0, dal=None)
    assert mjp_fast.fast_patch_embed(model, backend="torch") is model
    assert model.mjp.backend == model.mjp.sampler.backend == "torch"
    assert model.patch_embed.fused_backend is None  # the model's backend has one holder: model.mjp
    mjp_fast.fast_patch_embed(model)  # None keeps it
    assert model.mjp.backend == "torch"


def test_a_plain_fused_model_resolves_its_backend_once(monkeypatch):
    monkeypatch.delenv(backend.ENV_VARIABLE, raising=False)
    model = mjp_fast.fast_patch_embed(_tiny_vit()).eval()
    images = torch.randn(2, 3, 32, 32)
    expected = model(images)
    monkeypatch.setenv(backend.ENV_VARIABLE, "not-a-backend")  # read again, it would raise
    torch.testing.assert_close(model(images), expected, rtol=0, atol=0)


def test_mjp_patch_embed_keeps_one_backend_when_the_environment_changes(monkeypatch):
    monkeypatch.delenv(backend.ENV_VARIABLE, raising=False)
    module = mjp_fast.MJPPatchEmbed(32, 8, 3, 16, ratio=0.5, prob=1.0, dal="nonlinear")
    images = torch.randn(2, 3, 32, 32)
    module(images)
    first = module.backend_for(images.device)
    monkeypatch.setenv(backend.ENV_VARIABLE, "not-a-backend")  # read again, it would raise
    module(images)
    module.sampler.ratio = 0.25  # a new plan
    module(images)
    module.dal_loss()
    assert module.backend_for(images.device) == first
