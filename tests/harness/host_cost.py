"""What the host-cost checks run and count: a timm ViT at tiny sizes and its MJP copies, the position step of a
training step (forward and backward) plain and MJP, the sampler's call, and counters of dispatched operators and of
Triton launches.

tests/test_host_cost.py holds these counts to ceilings; bench/bench_host_cost.py also times the same steps. At tiny
sizes the kernels take no time, so what the steps cost is what a slow host pays per step on a GPU: Python, the
dispatcher and the launches. The steps (``position_steps``, ``sampler_steps``):

- ``plain``: timm's ``model._pos_embed(tokens)`` (class token, position add), backward.
- ``mjp``: the same step of the MJP model on the token path (``fused_patch_embed=False``), as a training step runs
  it: the sampler, the move of the tokens, the position term with ``unk_embed``, and the DAL loss attached to the
  tokens (at ``mjp_dal_weight``); backward of the tokens alone, which trains DAL too.
- ``mjp explicit``: the same, for a loop that also adds ``model.mjp_aux_loss()`` to its loss (its weight replaces
  the attached one): backward of the tokens and that loss.
- ``plain embed`` / ``mjp fused embed``: the patch embedding and the position step together: timm's
  ``PatchEmbed`` and ``_pos_embed``, against the MJP model's fused embedding (jigsaw and position term in the GEMM)
  with its DAL loss attached.
- ``sampler``: one call of the model's ``JigsawSampler`` against one ``torch.add`` of two tiny tensors.

Operations are counted with a ``TorchDispatchMode`` (every operator the dispatcher hands to Python: aten ops, views
included, and our operators, each once).
"""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

BATCH, DIM, IMAGE, PATCH = 2, 16, 16, 4  # a 4x4 grid: the kernels take no time, the host's work is what counts


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def tiny_models(device: torch.device | str = "cpu", backend: str | None = None) -> dict[str, torch.nn.Module]:
    """``plain`` (timm ViT, depth 0), ``mjp`` (its MJP copy on the token path) and ``mjp fused`` (fused embedding);
    MJP at ratio 0.5, prob 1.0 (every sample jigsawed), nonlinear DAL."""
    import timm

    import mjp_fast.timm as mjp_timm

    torch.manual_seed(0)
    plain = timm.create_model(
        "vit_tiny_patch16_224", img_size=IMAGE, patch_size=PATCH, embed_dim=DIM, depth=0, num_heads=2, num_classes=4
    ).to(device)
    settings = dict(ratio=0.5, prob=1.0, dal="nonlinear", min_block=2, backend=backend)
    models = {
        "plain": plain,
        "mjp": mjp_timm.convert(copy.deepcopy(plain), fused_patch_embed=False, **settings),
        "mjp fused": mjp_timm.convert(copy.deepcopy(plain), fused_patch_embed=True, **settings),
    }
    for model in models.values():
        model.train()
    return models


def position_steps(
    models: dict[str, torch.nn.Module], device: torch.device | str = "cpu", autocast: bool | None = None
) -> dict[str, Callable]:
    """The timed steps: name -> a callable running one forward and backward (see the module's docstring), under
    bfloat16 autocast with bfloat16 tokens when ``autocast`` (default: on a GPU, as its training steps run; on the
    CPU the same operators are dispatched, so the CPU counts what a GPU's host does)."""
    device = torch.device(device)
    enabled = device.type == "cuda" if autocast is None else autocast
    generator = torch.Generator().manual_seed(1)
    plain = models["plain"]
    num_positions = plain.patch_embed.num_patches
    dtype = torch.bfloat16 if enabled else torch.float32
    tokens = torch.randn(BATCH, num_positions, DIM, generator=generator).to(device, dtype).requires_grad_(True)
    images = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator).to(device)
    grad = torch.randn(BATCH, num_positions + plain.num_prefix_tokens, DIM, generator=generator).to(device, dtype)
    grads = {dtype: grad.to(dtype) for dtype in (torch.float32, torch.bfloat16)}  # made once, not per step

    def step(model: torch.nn.Module, *, explicit: bool, embed: bool) -> Callable[[], None]:
        parameters = list(model.parameters())  # listed once: walking the modules is the harness's cost, not MJP's

        def run() -> None:
            for parameter in parameters:
                parameter.grad = None
            tokens.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled):
                out = model._pos_embed(model.patch_embed(images) if embed else tokens)
                aux = model.mjp_aux_loss() if explicit else None
            if aux is None:  # an MJP model's training forward attached its DAL loss to out
                out.backward(grads[out.dtype])
            else:
                torch.autograd.backward([out, aux], [grads[out.dtype], weight])

        return run

    weight = torch.full((), 0.01, device=device)  # the explicit loss's weight, as a loop's dal_weight * aux
    return {
        "plain": step(plain, explicit=False, embed=False),
        "mjp": step(models["mjp"], explicit=False, embed=False),
        "mjp explicit": step(models["mjp"], explicit=True, embed=False),
        "plain embed": step(plain, explicit=False, embed=True),
        "mjp fused embed": step(models["mjp fused"], explicit=False, embed=True),
    }


def sampler_steps(models: dict[str, torch.nn.Module], device: torch.device | str = "cpu") -> dict[str, Callable]:
    """One call of the MJP model's sampler against one tiny ``torch.add``."""
    device = torch.device(device)
    sampler = models["mjp"].mjp.sampler
    a, b = torch.ones(4, device=device), torch.ones(4, device=device)
    return {"torch.add": lambda: torch.add(a, b), "sampler": lambda: sampler(BATCH, device)}


def count_ops(function: Callable[[], object], warmup: int = 2) -> OpCounter:
    """The operators one call of ``function`` dispatches (after ``warmup`` calls, so caches are filled)."""
    for _ in range(warmup):
        function()
    with OpCounter() as counter:
        function()
    return counter


@contextlib.contextmanager
def counting_triton_launches() -> Iterator[collections.Counter[str]]:
    """Counts the Triton kernel launches (by kernel name) made inside the context: the compiled kernels' on a GPU,
    the interpreter's on the CPU."""
    import triton.runtime.interpreter as interpreter
    from triton.runtime.jit import JITFunction

    launches: collections.Counter[str] = collections.Counter()
    originals = {cls: cls.run for cls in (JITFunction, interpreter.InterpretedFunction)}

    def counting(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup"):
                launches[self.fn.__name__] += 1
            return original(self, *args, **kwargs)

        return run

    for cls, original in originals.items():
        cls.run = counting(original)
    try:
        yield launches
    finally:
        for cls, original in originals.items():
            cls.run = original


def count_ops_without_kernels(function: Callable[[], object], warmup: int = 1) -> OpCounter:
    """The operators one call of ``function`` dispatches with its Triton kernels not run (after ``warmup`` calls
    that run them): what the host dispatches on a GPU. The interpreter's own tensor work (copies of the kernels'
    arguments) is left out, and so is nothing else: the outputs' values are whatever the allocator gave."""
    import triton.runtime.interpreter as interpreter
    from triton.runtime.jit import JITFunction

    for _ in range(warmup):
        function()
    originals = {cls: cls.run for cls in (JITFunction, interpreter.InterpretedFunction)}
    for cls in originals:
        cls.run = lambda self, *args, **kwargs: None
    try:
        with OpCounter() as counter:
            function()
    finally:
        for cls, original in originals.items():
            cls.run = original
    return counter


def count_triton_launches(function: Callable[[], object], warmup: int = 1) -> collections.Counter[str]:
    """The Triton kernels one call of ``function`` launches, after ``warmup`` calls."""
    for _ in range(warmup):
        function()
    with counting_triton_launches() as launches:
        function()
    return launches
