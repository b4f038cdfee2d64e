"""torch.compile(fullgraph=True) traces MJPPatchEmbed without graph breaks, and the operators pass opcheck."""

import contextlib
import copy

import pytest
import torch

import mjp_fast
from mjp_fast.sampler.reference import sampler_tables

from .conftest import backends_for

COMPILED_BACKENDS = [name for name in backends_for("cpu") if name in ("cpu", "triton")]


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
    operator = {"cpu": torch.ops.mjp_fast.patch_embed_extension, "triton": torch.ops.mjp_fast.patch_embed_triton}
    torch.library.opcheck(operator[backend].default, _operator_samples())


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_opcheck_sampler(backend):
    operator = {"cpu": torch.ops.mjp_fast.sample_jigsaw_extension, "triton": torch.ops.mjp_fast.sample_jigsaw_triton}
    h_thresholds, w_thresholds = sampler_tables(3, 4, 0.3)
    # One schema for both: counter, params (seed bits, prob threshold), tables, sizes, counter scale and shift
    samples = [
        (torch.tensor(5), torch.tensor([123, 2**32]), h_thresholds, w_thresholds, 3, 3, 4, 6, 2, 2, 1, False),
        (torch.tensor([2**32 - 1]), torch.tensor([-7, 2**31]), h_thresholds, w_thresholds, 2, 3, 4, 12, 1, 4, 9, True),
    ]
    for arguments in samples:
        torch.library.opcheck(operator[backend].default, arguments, test_utils=("test_schema", "test_faketensor"))
