"""torch.compile(fullgraph=True) traces MJPPatchEmbed without graph breaks, the operators pass opcheck, and a
compiled timm model trains DAL with the eager gradients."""

import contextlib
import copy

import pytest
import torch

import mjp_fast
from mjp_fast.sampler.reference import sampler_tables

from .conftest import GPU, backends_for

COMPILED_BACKENDS = [name for name in backends_for("cpu") if name in ("cpu", "triton")]
# (device, backend, compiler) of the DAL-gradient check: on the CPU aot_eager (tracing, functionalization and
# autograd; Inductor on the CPU adds minutes), on a GPU Inductor too, which compiles the Triton kernels themselves.
DAL_COMPILE_CASES = [("cpu", backend, "aot_eager") for backend in COMPILED_BACKENDS] + [
    ("cuda", backend, compiler)
    for backend in (backends_for("cuda") if GPU else [])
    if backend != "torch"
    for compiler in ("aot_eager", "inductor")
]


def _step(module, images):
    tokens = module(images)
    return tokens, module.dal_loss()


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_compiled_module_matches_eager_forward_and_backward(backend):
    torch.manual_seed(0)
    eager = mjp_fast.MJPPatchEmbed(
        16, 4, 3, 16, ratio=0.5, prob=1.0, seed=1, min_block=2, backend=backend, dal="linear"
    )
    compiled_module = copy.deepcopy(eager)
    # CPU graphs: aot_eager checks tracing, functionalization and autograd; Inductor is exercised on a GPU.
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")
    for step in range(2):
        images = torch.randn(2, 3, 16, 16)
        with torch.compiler.set_stance("fail_on_recompile") if step else contextlib.nullcontext():
            tokens, aux = compiled(compiled_module, images)
        expected_tokens, expected_aux = _step(eager, images)
        torch.testing.assert_close(tokens, expected_tokens)
        torch.testing.assert_close(aux, expected_aux)
        (tokens.square().mean() + aux).backward()
        (expected_tokens.square().mean() + expected_aux).backward()
    for (name, got), (_, want) in zip(compiled_module.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=lambda m, name=name: f"{name}: {m}")
    assert compiled_module.samples_seen == eager.samples_seen == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor with the Triton kernels needs a GPU")
def test_inductor_on_gpu():
    module = mjp_fast.MJPPatchEmbed(32, 8, 3, 64, ratio=0.5, prob=1.0, backend="triton").cuda()
    reference = copy.deepcopy(module)
    images = torch.randn(4, 3, 32, 32, device="cuda")
    compiled = torch.compile(module, fullgraph=True)
    torch.testing.assert_close(compiled(images), reference(images))


def _operator_samples(device="cpu"):
    images = torch.randn(2, 3, 8, 12, device=device)
    weight, bias = torch.randn(5, 3, 4, 4, device=device), torch.randn(5, device=device)
    # the whole table of a model with a class token: its row 0 is the class token's (prefix_positions = 1)
    pos, unk, prefix = (torch.randn(*shape, device=device) for shape in ((1, 7, 5), (5,), (1, 1, 5)))
    jigsaw = mjp_fast.sample_jigsaw(2, (2, 3), 0.5, seed=0, min_block=1, device=device)
    for tensor in (images, weight, bias, pos, unk, prefix):
        tensor.requires_grad_(True)
    return images, weight, bias, pos, unk, jigsaw.perm, jigsaw.mask, prefix, 1


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_opcheck_patch_embed(backend):
    # looked up by name: the triton operators are registered only where the triton backend can run
    operator = getattr(torch.ops.mjp_fast, {"cpu": "patch_embed_extension", "triton": "patch_embed_triton"}[backend])
    torch.library.opcheck(operator.default, _operator_samples())


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_opcheck_sampler(backend):
    operator = getattr(
        torch.ops.mjp_fast, {"cpu": "sample_jigsaw_extension", "triton": "sample_jigsaw_triton"}[backend]
    )
    h_thresholds, w_thresholds = sampler_tables(3, 4, 0.3)
    # One schema for both: counter, params (seed bits, prob threshold), tables, sizes, counter scale and shift
    samples = [
        (torch.tensor(5), torch.tensor([123, 2**32]), h_thresholds, w_thresholds, 3, 3, 4, 6, 2, 2, 1, False),
        (torch.tensor([2**32 - 1]), torch.tensor([-7, 2**31]), h_thresholds, w_thresholds, 2, 3, 4, 12, 1, 4, 9, True),
    ]
    for arguments in samples:
        torch.library.opcheck(operator.default, arguments, test_utils=("test_schema", "test_faketensor"))


def _dal_gradients(net, model, images):
    """One training step's gradients of the DAL regressor and the tables (the loop adds ``mjp_aux_loss()`` itself,
    so both the attached loss and the explicit one take part), and the DAL loss the forward attached."""
    out = net(images)
    (out.float().square().mean() + 0.01 * model.mjp_aux_loss()).backward()
    names = ("pos_embed", "mjp.unk_embed")
    gradients = {
        name: parameter.grad.clone()
        for name, parameter in model.named_parameters()
        if name.startswith("mjp.dal_regressor.") or name in names
    }
    return gradients, model.mjp.last_dal_loss


@pytest.mark.parametrize(
    ("device", "backend", "compiler"), DAL_COMPILE_CASES, ids=["-".join(c) for c in DAL_COMPILE_CASES]
)
def test_a_compiled_model_trains_dal_with_the_eager_gradients(device, backend, compiler):
    import timm

    import mjp_fast.timm as mjp_timm

    torch.manual_seed(0)
    settings = dict(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2, num_classes=10)
    vit = timm.create_model("vit_tiny_patch16_224", **settings).to(device)
    model = mjp_timm.convert(vit, ratio=0.5, prob=1.0, min_block=2, backend=backend).train()
    eager = copy.deepcopy(model)
    images = torch.randn(4, 3, 32, 32, device=device)
    got, got_loss = _dal_gradients(torch.compile(model, backend=compiler), model, images)
    want, want_loss = _dal_gradients(eager, eager, images)
    # DAL's gradients are small (0.01 of a loss near 1): each is held to its own scale, and the report says how
    # the compiled one relates to the eager one (a ratio of 2: the loss counted twice; 0: its gradient lost).
    report = [f"DAL loss: compiled {got_loss}, eager {want_loss}"]
    mismatched = []
    for name, expected in want.items():
        actual, scale = got[name], expected.abs().max().item()
        close = torch.allclose(actual, expected, rtol=1e-3, atol=1e-3 * scale + 1e-8)
        ratio = actual.flatten() @ expected.flatten() / (expected.flatten() @ expected.flatten()).clamp_min(1e-30)
        report.append(
            f"{name}: {'ok' if close else 'MISMATCH'}, compiled/eager {ratio.item():.4g}, max |eager| {scale:.3g}, "
            f"max |difference| {(actual - expected).abs().max().item():.3g}"
        )
        mismatched += [] if close else [name]
    assert got_loss is not None and torch.allclose(got_loss, want_loss, rtol=1e-4), "\n".join(report)
    assert not mismatched, "\n".join(report)


@pytest.mark.parametrize("fused", [False, True])
def test_forwards_record_the_jigsaw_without_the_property_setter(fused, monkeypatch):
    # torch 2.11's dynamo (the lent GPU machines') replays a property set on a module after the compiled graph: a
    # forward that set last_jigsaw through its setter had its new DAL loss forgotten after it was kept, and
    # mjp_aux_loss() computed a second one (DAL counted twice; reproduced on the CPU with torch 2.11, aot_eager and
    # Inductor alike). The forwards call record_jigsaw; the setter is for code outside them.
    import timm

    import mjp_fast.timm as mjp_timm
    from mjp_fast.core import MJPCore

    settings = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=4)
    model = mjp_timm.convert(timm.create_model("vit_tiny_patch16_224", **settings), ratio=0.5, prob=1.0, min_block=2,
                             fused_patch_embed=fused).train()  # fmt: skip
    patch_embed = mjp_fast.MJPPatchEmbed(16, 4, 3, 16, ratio=0.5, prob=1.0, dal="linear").train()
    calls = []
    original = MJPCore.last_jigsaw
    monkeypatch.setattr(
        MJPCore,
        "last_jigsaw",
        property(original.fget, lambda self, jigsaw: calls.append(jigsaw) or original.fset(self, jigsaw)),
    )
    model(torch.randn(2, 3, 32, 32))
    patch_embed(torch.randn(2, 3, 16, 16))
    assert model.mjp.last_jigsaw is not None and model.mjp.last_dal_loss is not None
    assert calls == []
    model.mjp.last_jigsaw = None  # code outside a forward still may, and it forgets the kept loss
    assert calls == [None] and model.mjp.last_dal_loss is None
