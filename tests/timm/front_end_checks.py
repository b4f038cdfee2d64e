"""The checks every token-path front end's tests share (tests/timm/test_{pit,tnt,nest,...}.py): a converted model's
MJP state, eval equal to timm's, a training step whose output alone reaches every parameter, ``mjp_eval``, DAL and
``mjp_aux_loss``, FX graphs, ``forward_intermediates``, ``features_only``, checkpoints both ways, pickling and
copying, and the coverage sweep's check. Each helper asserts what its docstring says; what is particular to a family
(its table's name, its shapes, its swapped modules) stays in the family's test file."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from timm.layers import get_notrace_functions, is_notrace_module
from torch import nn

import mjp_fast.timm as mjp_timm
from bench.timm_coverage import check_model
from mjp_fast.timm.convert import runs_fused

Loss = Callable[[Any], torch.Tensor]


def logsumexp_loss(out: torch.Tensor) -> torch.Tensor:
    """A loss of the output alone, ``logsumexp(-1).mean()``: DAL rides on it (the forward attached it)."""
    return out.logsumexp(-1).mean()


def jigsaw_ref(images: torch.Tensor, perm: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    """Pure torch: the top-left ``rows x cols`` blocks of ``block`` pixels of ``images`` moved as ``perm`` says
    (position n gets block ``perm[n]``), the other pixels where they were."""
    out = images.clone()
    for b in range(images.shape[0]):
        for n in range(rows * cols):
            src = int(perm[b, n])
            (i, j), (si, sj) = divmod(n, cols), divmod(src, cols)
            out[b, :, i * block : (i + 1) * block, j * block : (j + 1) * block] = images[
                b, :, si * block : (si + 1) * block, sj * block : (sj + 1) * block
            ]
    return out


class TimmLeafTracer(torch.fx.Tracer):
    """torch.fx's tracer as timm's feature extractor traces: the modules timm marks as not traceable kept as calls
    and, with ``notrace_functions``, the functions timm marks so (NesT's ``deblockify``, CrossViT's ``scale_image``)
    kept as one call each."""

    def __init__(self, notrace_functions: bool = False) -> None:
        super().__init__(autowrap_functions=tuple(get_notrace_functions()) if notrace_functions else ())

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return is_notrace_module(type(module)) or super().is_leaf_module(module, qualified_name)


def missing_grads(model: nn.Module) -> list[str]:
    """The names of ``model``'s trainable parameters that have no gradient."""
    return [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]


def assert_every_parameter_has_a_grad(model: nn.Module) -> None:
    """Every trainable parameter of ``model`` got a gradient (the failure names those that did not)."""
    missing = missing_grads(model)
    assert not missing, missing


def assert_token_path_state(
    model: nn.Module,
    *,
    patch_size: int,
    grid: Sequence[int] | None = None,
    dim: int | None = None,
    fused: bool | None = False,
) -> None:
    """A token-path model's ``mjp``: an ``unk_embed`` (of width ``dim`` if given) and a DAL regressor, the jigsaw's
    ``patch_size``, the sampler's ``grid`` (if given), ``mjp.unk_embed`` among the parameters without weight decay,
    and the embedding running fused or not as ``fused`` says (None: not checked)."""
    state = model.mjp
    assert state.unk_embed is not None and state.dal_regressor is not None
    assert state.patch_size == patch_size, state.patch_size
    if grid is not None:
        assert tuple(state.sampler.grid_size) == tuple(grid), state.sampler.grid_size
    if dim is not None:
        assert state.unk_embed.shape[-1] == dim, state.unk_embed.shape
    assert "mjp.unk_embed" in model.no_weight_decay()
    if fused is not None:
        assert runs_fused(model) == fused


def assert_refuses_fused_and_pixel_jigsaw(make_plain: Callable[[], nn.Module], *, fused: str, model: str) -> None:
    """:func:`mjp_fast.timm.convert` refuses, with a ValueError that says why, ``fused_patch_embed=True`` (the
    message goes on with ``fused``, a pattern of the family's reason) and ``pixel_jigsaw=True`` (the token path
    covers the model, whose class name matches the pattern ``model``), each on a fresh ``make_plain()``."""
    with pytest.raises(ValueError, match=f"fused_patch_embed=True: {fused}"):
        mjp_timm.convert(make_plain(), fused_patch_embed=True)
    with pytest.raises(ValueError, match=f"pixel_jigsaw=True: model .*{model}.* token path covers"):
        mjp_timm.convert(make_plain(), pixel_jigsaw=True)


def assert_eval_equals_timm(model: nn.Module, plain: nn.Module, images: Any) -> torch.Tensor:
    """Both models in eval mode: the converted ``model`` gives timm's ``plain`` output on ``images`` exactly (outside
    ``mjp_eval``, MJP is off). Returns that output."""
    model.eval(), plain.eval()
    with torch.no_grad():
        expected = plain(images)
        torch.testing.assert_close(model(images), expected, rtol=0, atol=0)
    return expected


def assert_state_learned(state: nn.Module) -> None:
    """After a training step's backward: ``state`` (an ``MJPState``) attached a DAL loss and jigsawed (some position
    masked), its DAL regressor got a non-zero gradient (DAL's, not a zero kept in the graph), and so did its
    ``unk_embed``."""
    assert state.last_dal_loss is not None and state.last_jigsaw.mask.any()
    assert any(p.grad.abs().sum() > 0 for p in state.dal_regressor.parameters())
    assert state.unk_embed.grad.abs().sum() > 0


def assert_training_step_reaches_every_parameter(
    model: nn.Module, images: Any, *, loss: Loss = logsumexp_loss, tables: Sequence[torch.Tensor] = ()
) -> None:
    """A training step on ``loss`` of the output alone (DAL rides on it): every trainable parameter gets a gradient,
    ``model.mjp`` learned (:func:`assert_state_learned`) and each of ``tables`` (the family's position tables, the
    model's parameters) got a non-zero gradient."""
    model.train()
    loss(model(images)).backward()
    assert_every_parameter_has_a_grad(model)
    assert_state_learned(model.mjp)
    for table in tables:
        assert table.grad.abs().sum() > 0


def assert_aux_loss_handed_out_once(model: nn.Module) -> None:
    """After a training forward: ``mjp_aux_loss`` hands out the loss the forward attached (the very tensor), once;
    called again it computes the same loss afresh (finite, and equal to the first)."""
    claimed = model.mjp_aux_loss()
    assert torch.equal(claimed, model.mjp.last_dal_loss)
    again = model.mjp_aux_loss()
    assert torch.isfinite(again)
    torch.testing.assert_close(again, claimed)


def assert_mjp_eval_jigsaws(
    model: nn.Module, plain: nn.Module, images: Any, expected: torch.Tensor, *, min_change: float | None = None
) -> None:
    """Inside ``mjp_eval(ratio=0.5, seed=0)`` the model masks some position and its output moves from timm's
    ``expected`` (``min_change`` None: not ``allclose``; else the largest change exceeds it); outside, in eval mode,
    it is ``plain``'s again, exactly."""
    model.eval()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=0):
        jigsawed = model(images)
    assert model.mjp.last_jigsaw.mask.any()
    if min_change is None:
        assert not torch.allclose(jigsawed, expected)
    else:
        assert (jigsawed - expected).abs().max() > min_change
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)


def assert_aux_loss_at_a_weight_replaces_the_attached_one(
    model: nn.Module, images: Any, expected_dal: Callable[[nn.Module], torch.Tensor], weight: float = 0.5
) -> None:
    """A training forward attaches ``expected_dal(model)`` (computed after the forward) as ``mjp.last_dal_loss``;
    a loop that adds ``weight * mjp_aux_loss()`` counts DAL at ``weight`` in place of the attached weight (never
    both): every parameter's gradient is that of a twin whose attached weight is ``weight`` and whose loop adds
    nothing."""
    model.train()
    twin = copy.deepcopy(model)
    out = model(images)
    torch.testing.assert_close(model.mjp.last_dal_loss, expected_dal(model).detach())
    (out.sum() + weight * model.mjp_aux_loss()).backward()
    twin.mjp_dal_weight = weight
    twin(images).sum().backward()
    for (name, got), want in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=lambda message, name=name: f"{name}: {message}")


def assert_fx_graph_is_the_model(
    model: nn.Module,
    images: torch.Tensor,
    tracer: torch.fx.Tracer,
    *,
    mjp_nodes: int,
    out_shape: Sequence[int],
    **trace_arguments: Any,
) -> torch.fx.GraphModule:
    """``model`` traced by ``tracer`` (in its current mode): ``mjp_nodes`` calls of ``mjp`` in training, none in eval.
    In eval the graph's output is the model's exactly; in training it has ``out_shape``, the model jigsawed, and the
    graph's MJP is the model's (from the same sampler stream position: the same output, exactly). Returns the graph."""
    training = model.training
    graph = torch.fx.GraphModule(model, tracer.trace(model, **trace_arguments))
    targets = [node.target for node in graph.graph.nodes if node.op == "call_module"]
    assert targets.count("mjp") == (mjp_nodes if training else 0), targets
    with torch.no_grad():
        if not training:
            torch.testing.assert_close(graph(images), model(images), rtol=0, atol=0)
            return graph
        out = graph(images)
        assert tuple(out.shape) == tuple(out_shape) and model.mjp.last_jigsaw.mask.any()
        model.mjp.sampler.sample_counter.zero_()
        eager = model(images)
        model.mjp.sampler.sample_counter.zero_()
        torch.testing.assert_close(graph(images), eager, rtol=0, atol=0)
    return graph


def assert_forward_intermediates(
    plain: nn.Module,
    model: nn.Module,
    images: torch.Tensor,
    *,
    shapes: Sequence[Sequence[int]],
    differs_at: int = 0,
    seed: int = 0,
    **arguments: Any,
) -> None:
    """``forward_intermediates(images, **arguments)`` in eval mode: the final output and every intermediate are
    timm's exactly; inside ``mjp_eval(ratio=0.5, seed=seed)`` the intermediates end in ``shapes`` (their trailing
    dimensions), the model jigsawed, and intermediate ``differs_at`` moves; in training the final output's backward
    reaches ``unk_embed`` and DAL is attached."""
    plain.eval(), model.eval()
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(images, **arguments)
        expected_final, expected = plain.forward_intermediates(images, **arguments)
        torch.testing.assert_close(final, expected_final, rtol=0, atol=0)
        for got, want in zip(intermediates, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5, seed=seed):
            _, jigsawed = model.forward_intermediates(images, **arguments)
    assert model.mjp.last_jigsaw.mask.any()
    assert [tuple(f.shape[-len(shape) :]) for f, shape in zip(jigsawed, shapes, strict=True)] == [
        tuple(shape) for shape in shapes
    ]
    assert not torch.allclose(jigsawed[differs_at], expected[differs_at])
    model.train()
    final, _ = model.forward_intermediates(images, **arguments)
    final.sum().backward()
    assert model.mjp.unk_embed.grad is not None and model.mjp.last_dal_loss is not None


def assert_features_only(
    wrapper: nn.Module,
    images: torch.Tensor,
    settings: dict[str, Any],
    *,
    differs_at: int = 0,
    shape: Sequence[int] | None = None,
    min_change: float | None = None,
) -> nn.Module:
    """timm's ``features_only`` ``wrapper`` converted with ``settings``: its ``mjp`` is its model's (where it wraps
    one), the features in eval mode are the plain wrapper's exactly; inside ``mjp_eval`` feature ``differs_at`` (of
    ``shape``, if given) moves (``min_change`` None: not ``allclose``; else by more than it); a training step on the
    features reaches ``unk_embed`` and DAL is attached. Returns the converted wrapper (in training mode)."""
    plain = copy.deepcopy(wrapper).eval()
    model = mjp_timm.convert(wrapper, **settings).eval()
    state = model.mjp
    if isinstance(getattr(model, "model", None), nn.Module):
        assert model.model.mjp is state
    with torch.no_grad():
        expected = plain(images)
        for got, want in zip(model(images), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5):
            jigsawed = model(images)
    assert state.last_jigsaw.mask.any()
    if shape is not None:
        assert tuple(jigsawed[differs_at].shape) == tuple(shape)
    if min_change is None:
        assert not torch.allclose(jigsawed[differs_at], expected[differs_at])
    else:
        assert (jigsawed[differs_at] - expected[differs_at]).abs().max() > min_change
    model.train()
    sum(feature.square().mean() for feature in model(images)).backward()
    assert state.unk_embed.grad is not None and state.last_dal_loss is not None
    return model


def assert_checkpoints_both_ways(
    plain: nn.Module, model: nn.Module, make_plain: Callable[[], nn.Module], images: Any
) -> None:
    """Checkpoints both ways (``unk_embed`` drawn at random first, so that it is no initial value): loading plain
    timm's into the MJP ``model`` misses only ``mjp.*`` keys (some) and meets no unexpected one; loading the MJP
    model's into a fresh ``make_plain()`` whose parameters were all zeroed meets only ``mjp.*`` unexpected keys
    (some) and misses none, and that model then gives the MJP model's eval output exactly."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith("mjp.") and name.endswith("unk_embed"):
                parameter.normal_()
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert missing and all(key.startswith("mjp.") for key in missing) and not unexpected, (missing, unexpected)
    other = make_plain().eval()
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.zero_()
    missing, unexpected = other.load_state_dict(model.state_dict(), strict=False)
    assert unexpected and all(key.startswith("mjp.") for key in unexpected) and not missing, (missing, unexpected)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(other(images), model(images), rtol=0, atol=0)


def pickled(model: nn.Module) -> nn.Module:
    """``model`` through ``torch.save`` and ``torch.load`` (a whole-module pickle)."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def assert_pickles_and_copies(
    model: nn.Module, images: Any, check_clone: Callable[[nn.Module], None], *, backward: bool = False
) -> tuple[nn.Module, nn.Module]:
    """After a training forward (with ``backward``, its backward too), which keeps tensors of its graph for
    ``mjp_aux_loss``: the model pickles and deep-copies, and ``check_clone`` (the family's checks: its swapped
    modules point at the clone, its kept table rows are empty) passes on each clone before it runs. The pickled clone
    gives the model's output inside ``mjp_eval(seed=2)`` exactly; the deep copy takes a training step of its own whose
    ``mjp_aux_loss`` is finite. Returns ``(loaded, copied)``."""
    model.train()
    out = model(images)
    if backward:
        out.sum().backward()
    model.eval()
    loaded = pickled(model)
    check_clone(loaded)
    with torch.no_grad(), model.mjp_eval(seed=2), loaded.mjp_eval(seed=2):
        assert torch.equal(loaded(images), model(images))
    copied = copy.deepcopy(model)
    check_clone(copied)
    copied.train()
    copied(images).sum().backward()
    assert torch.isfinite(copied.mjp_aux_loss())
    return loaded, copied


def assert_coverage_sweep_passes(
    name: str, overrides: dict[str, Any], size: int, *, patch_size: int, mjp: str = "UNK on the table"
) -> None:
    """The coverage sweep's check of timm's ``name`` (with ``overrides``, on ``size``-pixel images) passes: the token
    path, ``mjp`` as its MJP, the jigsaw's ``patch_size``, not fused, and ``mjp_eval`` jigsawed."""
    record = check_model(name, overrides, size)
    assert record["ok"], f"{record['steps']}\n{record.get('traceback', '')}"
    assert (record["path"], record["mjp"], record["patch_size"], record["fused"]) == ("token", mjp, patch_size, False)
    assert record["mjp_eval_jigsawed"] is True
