"""The GPU training path, on a GPU: the timm models' kernels on CUDA tensors, torch.compile with Inductor, a whole
step captured in a CUDA graph, and no host synchronization in a step.

Skipped where no GPU is visible; `bash bench/device_check.sh` runs them on the lent machine.
"""

import copy
import math

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


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
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


# The extension's position step on CUDA (pos_embed_cuda.cu) against its CPU kernels: the same sums in the same order
# and type, so equal exactly. (batch, N, D, P, Q): a single position, odd sizes, a class token with its table row,
# register tokens without, a ViT grid, an empty batch.
POSITION_SHAPES = [(1, 1, 1, 0, 0), (3, 7, 5, 1, 1), (4, 12, 40, 3, 0), (2, 196, 24, 1, 1), (0, 6, 8, 1, 1)]
POSITION_DTYPES = [  # (tokens, table = output): autocast's bfloat16 tokens on a float32 table, and one dtype each
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float64, torch.float64),
]


def _position_arguments(batch, positions, dim, prefix_count, prefix_positions, token_dtype, dtype, perm_kind):
    generator = torch.Generator().manual_seed(positions * 31 + dim)
    tokens = torch.randn(batch, positions, dim, generator=generator).to(token_dtype)
    table = torch.randn(1, prefix_positions + positions, dim, generator=generator).to(dtype)
    unk = torch.randn(dim, generator=generator).to(dtype)
    prefix = torch.randn(1, prefix_count, dim, generator=generator).to(dtype) if prefix_count else None
    mask = torch.rand(batch, positions, generator=generator) < 0.4
    perm = torch.argsort(torch.rand(batch, positions, generator=generator), dim=1)  # a permutation per sample
    # validate=False's jigsaws: a token shown twice, one never, one entry out of range
    if perm_kind == "invalid" and batch and positions > 1:
        perm[:, 0] = perm[:, 1]
        perm[0, -1] = positions + 3
    grad = torch.randn(batch, prefix_count + positions, dim, generator=generator).to(dtype)
    return tokens, perm, mask, table, unk, prefix, grad


@pytest.mark.skipif("cuda" not in mjp_fast.available_backends(), reason="needs the extension's CUDA kernels")
@pytest.mark.parametrize("perm_kind", ["permutation", "invalid"])
@pytest.mark.parametrize("dtypes", POSITION_DTYPES, ids=lambda pair: "-".join(str(d)[6:] for d in pair))
@pytest.mark.parametrize("shape", POSITION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_cuda_position_step_equals_the_cpu_kernels(shape, dtypes, perm_kind):
    batch, positions, dim, prefix_count, prefix_positions = shape
    tokens, perm, mask, table, unk, prefix, grad = _position_arguments(*shape, *dtypes, perm_kind)
    forward, backward = torch.ops.mjp_fast.pos_embed_extension, torch.ops.mjp_fast.pos_embed_extension_backward
    prefix_shape = list(prefix.shape) if prefix is not None else [0]
    dtype_args = (dtypes[0], table.dtype, unk.dtype, table.dtype)

    def run(device):
        on = [None if t is None else t.to(device) for t in (tokens, perm, mask, table, unk, prefix, grad)]
        out = forward(*on[:6], prefix_positions)
        grads = backward(
            on[6], on[1], on[2], prefix_count, prefix_positions, list(table.shape), prefix_shape, *dtype_args
        )
        return [out, *grads]

    for name, got, want in zip(("out", "tokens", "table", "unk", "prefix"), run("cuda"), run("cpu")):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif("cuda" not in mjp_fast.available_backends(), reason="needs the extension's CUDA kernels")
def test_the_cuda_position_step_passes_opcheck():
    """Schema, fake (Meta) kernels and autograd registration hold for CUDA tensors too, mixed dtypes included."""
    shape = (3, 12, 8, 1, 1)
    tokens, perm, mask, table, unk, prefix, grad = (
        None if t is None else t.cuda()
        for t in _position_arguments(*shape, torch.bfloat16, torch.float32, "permutation")
    )
    torch.library.opcheck(torch.ops.mjp_fast.pos_embed_extension.default, (tokens, perm, mask, table, unk, prefix, 1))
    dtypes = (torch.bfloat16, torch.float32, torch.float16, torch.bfloat16)  # tokens, table, unk, prefix
    arguments = (grad, perm, mask, 1, 1, list(table.shape), list(prefix.shape), *dtypes)
    torch.library.opcheck(torch.ops.mjp_fast.pos_embed_extension_backward.default, arguments)


@pytest.mark.skipif("cuda" not in mjp_fast.available_backends(), reason="needs the extension's CUDA kernels")
def test_the_cuda_position_step_trains_through_its_cpp_autograd():
    """mjp_pos_embed on the cuda backend: the C++ autograd node over the CUDA kernels passes a float64 gradcheck
    (its gradients against the oracle's: test_pos_embed_on_cuda_matches_the_oracle)."""
    jigsaw = mjp_fast.sample_jigsaw(3, (2, 3), 0.5, seed=2, min_block=1, device="cuda")
    tokens, pos, unk = (
        torch.randn(*shape, device="cuda", dtype=torch.float64, requires_grad=True)
        for shape in ((3, 6, 4), (6, 4), (4,))
    )
    assert torch.autograd.gradcheck(
        lambda t, p, u: mjp_fast.mjp_pos_embed(t, p, u, jigsaw, backend="cuda"), (tokens, pos, unk)
    )


# The cuda sampler (sampler_cuda.cu) against the cpu backend's: one warp per sample up to 1024 positions
# (sampler_lanes.h), one thread per sample beyond. (batch, grid, settings): DeiT's batch and grid, grids around the
# lanes path's words and limit, thin grids, the one-thread path, the stream and prob settings.
SAMPLER_CASES = [
    (256, 14, dict(ratio=0.5, min_block=16)),
    (64, 14, dict(ratio=0.1, prob=0.5, offset=2**32 - 7)),
    (16, (7, 13), dict(ratio=0.97, min_block=1)),
    (8, 24, dict(ratio=0.3, seed=2**64 - 1)),
    (4, 32, dict(ratio=0.75, min_block=50)),
    # 1024 positions in narrow grids. BEiT's blocks must be strictly narrower and shorter than the grid, so a grid
    # one patch wide never masks (the H200 ran (1, 1024) and (1024, 1) at ratio 0.5, 2026-11-28: nothing sampled,
    # the check below failed): it stays as a case under ratio 0.3; four patches wide masks a few blocks
    (3, (1, 1024), dict(ratio=0.2, min_block=8)),
    (3, (4, 256), dict(ratio=0.5, min_block=4)),
    (3, (256, 4), dict(ratio=0.5, min_block=4)),
    (5, 33, dict(ratio=0.5, min_block=16)),  # 1089 positions: the one-thread path
    (6, (5, 9), dict(ratio=0.4, shared=True)),
    (7, 14, dict(ratio=1.0, min_block=1)),
]


@pytest.mark.skipif("cuda" not in mjp_fast.available_backends(), reason="needs the extension's CUDA kernels")
@pytest.mark.parametrize("batch, grid, settings", SAMPLER_CASES, ids=lambda case: str(case).replace(" ", ""))
def test_the_cuda_sampler_equals_the_cpu_kernels(batch, grid, settings):
    settings = dict(seed=5) | settings
    got = mjp_fast.sample_jigsaw(batch, grid, **settings, device="cuda", backend="cuda")
    want = mjp_fast.sample_jigsaw(batch, grid, **settings, backend="cpu")
    assert torch.equal(got.mask.cpu(), want.mask) and torch.equal(got.perm.cpu(), want.perm)
    if settings["ratio"] >= 0.3 and settings.get("prob", 1.0) == 1.0:
        assert want.mask.any(), "a case that samples nothing checks little"


# The cuda patch embedding's patch copies (gather and scatter) at each chunk width: 16, 8, 4 bytes and one bf16
# element, an image whose base is not 16-byte aligned, and one with padded rows (strides wider than the image).
def _patch_images(kind, channels, size, dtype):
    """Images [2, C, size, size] in ``dtype``, made in it: a conversion would give a contiguous copy."""
    if kind == "offset":  # storage offset of one element: one-element chunks
        flat = torch.randn(2 * channels * size * size + 1, device="cuda", dtype=dtype)
        return flat[1:].view(2, channels, size, size)
    if kind == "padded":
        return torch.randn(2, channels, size, size + 8, device="cuda", dtype=dtype)[..., :size]
    return torch.randn(2, channels, size, size, device="cuda", dtype=dtype)


@pytest.mark.skipif("cuda" not in mjp_fast.available_backends(), reason="needs the extension's CUDA kernels")
@pytest.mark.parametrize(
    "patch, kind", [(16, "plain"), (4, "plain"), (2, "plain"), (3, "plain"), (16, "offset"), (8, "padded")]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_cuda_patch_copies_move_every_pixel(patch, kind, dtype):
    channels, dim, rows = 3, 24, 5
    images = _patch_images(kind, channels, patch * rows, dtype).requires_grad_(True)
    assert images.storage_offset() == (kind == "offset") and images.is_contiguous() == (kind != "padded")
    weight, pos = torch.randn(dim, channels, patch, patch, device="cuda"), torch.randn(rows * rows, dim, device="cuda")
    weight, pos, unk = weight.to(dtype), pos.to(dtype), torch.randn(dim, device="cuda", dtype=dtype)
    jigsaw = mjp_fast.sample_jigsaw(2, rows, 0.6, seed=3, min_block=1, device="cuda")
    grad = torch.randn(2, rows * rows, dim, device="cuda", dtype=dtype)

    def run(backend):
        out = mjp_fast.mjp_patch_embed(images, weight, None, pos, unk, jigsaw, backend=backend)
        return out, torch.autograd.grad(out, images, grad)[0]

    out, grad_images = run("cuda")
    # The torch backend's images gradient is a convolution's, which cuDNN runs in TF32 for float32 by default
    # (torch.backends.cudnn.allow_tf32): 8.8e-3 off on the H200 (2026-11-28), where the same test with TF32 off
    # passed at 1e-4. The reference is computed in full float32.
    allow_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        want, want_grad = run("torch")
    finally:
        torch.backends.cudnn.allow_tf32 = allow_tf32
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(out, want, **tolerance)
    torch.testing.assert_close(grad_images, want_grad, **tolerance)


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


# The GPU backends: the torch backend (the oracle) samples its jigsaws with host loops, a sync by design (H100,
# 2026-11-27: this test's torch cases failed there, as they must).
GPU_BACKENDS = [name for name in CUDA_BACKENDS if name != "torch"]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("fused", [False, True])
def test_a_whole_training_step_has_no_host_sync(backend, fused):
    model = mjp_timm.convert(_vit(), ratio=0.1, prob=0.5, backend=backend, fused_patch_embed=fused).train()
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


@pytest.mark.skipif("triton" not in CUDA_BACKENDS, reason="needs the triton backend")
def test_triton_scratch_buffers_are_per_stream_and_none_is_kept_from_a_graph_capture():
    # A scratch buffer is reused in stream order, so each stream has its own; one made while a CUDA graph is
    # captured comes from the graph's private pool, so it is never kept. (The whole triton step under capture:
    # test_a_whole_training_step_replays_in_a_cuda_graph.)
    from mjp_fast.triton import common

    common.clear_scratch()
    device = torch.device("cuda")
    first = common.scratch("partials", (64,), device, False)
    assert common.scratch("partials", (64,), device, False) is first
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = common.scratch("partials", (64,), device, False)
        assert on_side is not first and common.scratch("partials", (64,), device, False) is on_side
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = common.scratch("partials", (64,), device, False)
        assert common.scratch("partials", (64,), device, False) is not captured
        captured.fill_(1.0)
    graph.replay()
    assert all(buffer is not captured for buffer in common._scratch.buffers.values())
    assert len(common._scratch.buffers) == 2
    common.clear_scratch()


@pytest.mark.slow
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_reduce_overhead_compiles_an_mjp_model_into_cuda_graphs(backend):
    """torch.compile(mode="reduce-overhead") (``mjp train compile_mode=reduce-overhead``, the benchmarks'
    ``--compile-mode``): the training steps replay CUDA graphs and track the eager twin's losses; the sampler's
    counter advances inside the graphs as in eager steps."""
    model = mjp_timm.convert(_vit(), ratio=0.3, prob=1.0, min_block=2, backend=backend).train()
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, mode="reduce-overhead")
    images, targets = torch.randn(8, 3, 32, 32, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (model, twin)]
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(compiled(images).float(), targets)
        loss.backward()
        optimizers[0].step()
        optimizers[0].zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            expected = torch.nn.functional.cross_entropy(twin(images).float(), targets)
        expected.backward()
        optimizers[1].step()
        optimizers[1].zero_grad(set_to_none=True)
        torch.testing.assert_close(loss.detach(), expected.detach(), atol=2e-2, rtol=2e-2)
    assert model.mjp.sampler.samples_seen == twin.mjp.sampler.samples_seen


@pytest.mark.slow  # compiles the training and evaluation graphs: first in the queue, with a longer limit
@pytest.mark.timeout(170)
def test_mjp_train_runs_its_loop_with_cuda_graphs(tmp_path):
    """``mjp train compile=true compile_mode=reduce-overhead``: the real loop (its loss tally, DAL read-backs, the
    evaluation and the checkpoint) around a model whose steps replay CUDA graphs."""
    from mjp_fast.train import load_config, train

    settings = ["device=cuda", "epochs=1", "warmup_epochs=0", "compare=false", "mjp=true", "max_train_samples=256",
                "max_val_samples=64", "log_interval=4", "progress=off", "compile=true", "compile_mode=reduce-overhead",
                f"output={tmp_path / 'run'}"]  # fmt: skip
    result = train(load_config("digits", settings))
    assert (tmp_path / "run" / "last.pt").is_file() and result.config.compile_mode == "reduce-overhead"
    (record,) = result.history
    assert math.isfinite(record["train_loss"]) and math.isfinite(record["dal_loss"]) and record["step"] == 8
