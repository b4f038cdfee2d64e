"""The GPU training path, on a GPU: the timm models' kernels on CUDA tensors, torch.compile with Inductor, a whole
step captured in a CUDA graph, and no host synchronization in a step.

Skipped where no GPU is visible; `bash bench/device_check.sh` runs them on the lent machine.
"""

import copy

import pytest
import torch

import mjp_fast
import mjp_fast.timm as mjp_timm
from mjp_fast.ops.pos_embed import mjp_pos_embed_ref

from .conftest import backends_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

CUDA_BACKENDS = backends_for("cuda") if torch.cuda.is_available() else []


def _vit(**kwargs):
    import timm

    torch.manual_seed(0)
    settings = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10)
    return timm.create_model("vit_tiny_patch16_224", **(settings | kwargs)).cuda()


# mjp_pos_embed refuses backend="cuda" by name (no CUDA kernels of the extension for it; tests/ops/test_pos_embed.py).
@pytest.mark.parametrize("backend", [name for name in CUDA_BACKENDS if name != "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pos_embed_on_cuda_matches_the_oracle(backend, dtype):
    tokens = torch.randn(5, 12, 40, device="cuda", dtype=dtype, requires_grad=True)
    pos = torch.randn(12, 40, device="cuda", dtype=dtype, requires_grad=True)
    unk = torch.randn(40, device="cuda", dtype=dtype, requires_grad=True)
    jigsaw = mjp_fast.sample_jigsaw(5, (3, 4), 0.5, seed=1, min_block=1, device="cuda")
    grad = torch.randn(5, 12, 40, device="cuda", dtype=dtype)
    out = mjp_fast.mjp_pos_embed(tokens, pos, unk, jigsaw, backend=backend)
    grads = torch.autograd.grad(out, (tokens, pos, unk), grad)
    expected = mjp_pos_embed_ref(tokens, pos, unk, jigsaw)
    expected_grads = torch.autograd.grad(expected, (tokens, pos, unk), grad)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected, **tolerance)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("variant", [{}, {"reg_tokens": 2}, {"no_embed_class": True}], ids=["cls", "reg", "no_embed"])
def test_timm_models_on_cuda_match_the_torch_backend(backend, fused, variant):
    plain = _vit(**variant)
    settings = dict(ratio=0.5, prob=1.0, min_block=2, dal="nonlinear")
    model = mjp_timm.convert(copy.deepcopy(plain), backend=backend, fused_patch_embed=fused, **settings).train()
    reference = mjp_timm.convert(copy.deepcopy(plain), backend="torch", fused_patch_embed=False, **settings).train()
    reference.mjp.load_state_dict(model.mjp.state_dict())
    images = torch.randn(4, 3, 32, 32, device="cuda")
    for net in (model, reference):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(images).float().square().mean() + 0.01 * net.mjp_aux_loss()
        loss.backward()
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=3e-2, rtol=3e-2, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
@pytest.mark.parametrize("fused", [False, True])
def test_inductor_compiles_mjp_models(mode, fused):
    model = mjp_timm.convert(_vit(), ratio=0.5, prob=1.0, min_block=2, fused_patch_embed=fused).train()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, mode=mode)
    images = torch.randn(4, 3, 32, 32, device="cuda")
    for net in (compiled, eager):
        loss = net(images).square().mean() + 0.01 * (model if net is compiled else eager).mjp_aux_loss()
        loss.backward()
    for (name, got), (_, want) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-3, rtol=1e-3, msg=lambda m, name=name: f"{name}: {m}")


def test_inductor_compiles_the_patch_embedding_module():
    module = mjp_fast.MJPPatchEmbed(32, 8, 3, 64, ratio=0.5, prob=1.0, dal="nonlinear").cuda()
    reference = copy.deepcopy(module)
    compiled = torch.compile(module, fullgraph=True)
    images = torch.randn(4, 3, 32, 32, device="cuda")
    torch.testing.assert_close(compiled(images), reference(images))


def _step(model, optimizer, images, targets):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(images).float(), targets) + 0.01 * model.mjp_aux_loss()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # graphs replay into the same gradient buffers
    return loss.detach()


def test_a_whole_training_step_has_no_host_sync():
    model = mjp_timm.convert(_vit(), ratio=0.1, prob=0.5).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    images, targets = torch.randn(8, 3, 32, 32, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    _step(model, optimizer, images, targets)  # first step: lazy initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _step(model, optimizer, images, targets)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_whole_training_step_replays_in_a_cuda_graph():
    model = mjp_timm.convert(_vit(), ratio=0.3, prob=1.0, min_block=2).train()
    twin = copy.deepcopy(model)
    images, targets = torch.randn(8, 3, 32, 32, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True) for m in (model, twin)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
        for _ in range(3):
            _step(model, optimizers[0], images, targets)
            _step(twin, optimizers[1], images, targets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_loss = _step(model, optimizers[0], images, targets)
    for _ in range(3):
        graph.replay()
        eager_loss = _step(twin, optimizers[1], images, targets)
        # The sampler's counter advances on the device in both: the replays draw the eager steps' jigsaws.
        torch.testing.assert_close(captured_loss, eager_loss, atol=1e-4, rtol=1e-4)
    assert model.mjp.sampler.samples_seen == twin.mjp.sampler.samples_seen
    for (name, got), (_, want) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
