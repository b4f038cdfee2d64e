"""Property tests of the DAL loss a converted timm model attaches to its tokens in training (issue 42;
mjp_fast/ops/aux_loss.py, mjp_fast/timm/state.py): on tiny ViTs and Evas of random geometry, prefix tokens and
settings (DAL kind, reduction, normalisation, unk or the naive shuffle, the jigsaw on or off, fused or not, every
backend that runs on CPU tensors here), a backward of the output alone, ``output.backward(g)``, gives every
parameter (the DAL regressor's and the position table among them) the gradients of ``<output, g> + w * dal`` at the
model's ``mjp_dal_weight`` ``w``, where ``dal`` is the public :func:`mjp_fast.dal_loss` of the stored table over the
positions the forward's jigsaw left unmasked (torch backend, nothing attached: ``mjp_dal_weight = 0``); and a loop
that adds ``w2 * model.mjp_aux_loss()`` to its loss gets those of ``w2`` in place of the attached weight (never
both). The models hold the same weights and the same place in the jigsaw stream, so they draw the same jigsaws.
"""

from __future__ import annotations

import copy

import timm
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import mjp_fast
import mjp_fast.timm as mjp_timm
from tests.conftest import backends_for
from tests.property.common import vit_prefix_kwargs

BACKENDS = backends_for("cpu")
EVAS = {"eva02": "eva02_tiny_patch14_224", "rope_mixed_ape": "vit_small_patch16_rope_mixed_ape_224"}
# Properties that build models run unshrunk: shrinking a failing example would build models for minutes.
UNSHRUNK = (Phase.explicit, Phase.reuse, Phase.generate)
weights = st.one_of(st.sampled_from((0.0, 0.01, 1.0)), st.floats(0.0, 3.0))


@st.composite
def cases(draw: st.DrawFn) -> dict:
    family = draw(st.sampled_from(("vit", "vit", *sorted(EVAS))))
    dal = draw(st.sampled_from(("nonlinear", "linear", "pca")))
    patch, rows, cols = draw(st.sampled_from((2, 4))), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    if dal == "pca" and rows * cols == 1:  # a table of one row: see test_pca_on_a_table_of_one_position_...
        cols = 2
    kwargs = dict(img_size=(rows * patch, cols * patch), patch_size=patch, embed_dim=draw(st.sampled_from((8, 16))))
    kwargs.update(depth=1, num_heads=2, num_classes=3)
    if family == "vit":
        kwargs.update(vit_prefix_kwargs(draw))
    jigsaw_on = draw(st.booleans())
    return dict(
        family=family,
        kwargs=kwargs,
        grid=(rows, cols),
        settings=dict(
            ratio=draw(st.floats(0.05, 1.0)) if jigsaw_on else draw(st.sampled_from((0.0, 0.5))),
            prob=1.0 if jigsaw_on else 0.0,
            dal=dal,
            dal_reduction=draw(st.sampled_from(("mean", "sum"))),
            dal_normalize=draw(st.booleans()),
            unk=draw(st.booleans()),
            min_block=1,
            shared=draw(st.booleans()),
            backend=draw(st.sampled_from(BACKENDS)),
            fused_patch_embed=draw(st.sampled_from((None, False))),
            seed=draw(st.integers(0, 2**16)),
        ),
        batch=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
    )


def make_model(case: dict) -> nn.Module:
    torch.manual_seed(case["seed"])
    if case["family"] == "vit":
        plain = VisionTransformer(**case["kwargs"])
    else:
        plain = timm.create_model(EVAS[case["family"]], pretrained=False, **case["kwargs"])
    return mjp_timm.convert(plain, **case["settings"]).train()


def explicit_dal(model: nn.Module, case: dict) -> torch.Tensor:
    """The DAL loss of the model's last forward from the public function on the torch backend: its stored table's
    patch rows, over the positions its jigsaw left unmasked (every one without a jigsaw)."""
    prefix = 0 if model.no_embed_class else model.num_prefix_tokens
    jigsaw = model.mjp.last_jigsaw
    return mjp_fast.dal_loss(
        model.pos_embed[:, prefix:], model.mjp.dal_regressor, case["grid"], jigsaw.mask if jigsaw is not None else None,
        case["settings"]["dal_normalize"], reduction=case["settings"]["dal_reduction"], backend="torch",
    )  # fmt: skip


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: parameter.grad for name, parameter in model.named_parameters()}


@given(cases(), weights, st.one_of(st.none(), weights))
def test_the_outputs_backward_gives_the_gradients_of_the_explicit_loss(case, attached_weight, loop_weight):
    """``loop_weight`` None: the loop back-propagates the output alone (DAL at the attached weight); else it adds
    ``loop_weight * model.mjp_aux_loss()``, which replaces the attached weight."""
    model = make_model(case)
    reference = copy.deepcopy(model)  # the same weights, the same place in the jigsaw stream
    images = torch.randn(case["batch"], 3, *case["kwargs"]["img_size"], generator=torch.Generator().manual_seed(1))

    model.mjp_dal_weight = attached_weight
    out = model(images)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    loss = (out * g).sum()
    if loop_weight is not None:
        loss = loss + loop_weight * model.mjp_aux_loss()
    loss.backward()

    reference.mjp_dal_weight = 0.0  # nothing attached: the loss from the public function, added explicitly
    expected_out = reference(images)
    weight = attached_weight if loop_weight is None else loop_weight
    ((expected_out * g).sum() + weight * explicit_dal(reference, case)).backward()

    jigsaw, expected_jigsaw = model.mjp.last_jigsaw, reference.mjp.last_jigsaw
    assert (jigsaw is None) == (expected_jigsaw is None) == (case["settings"]["prob"] == 0.0)
    if jigsaw is not None:
        assert torch.equal(jigsaw.mask, expected_jigsaw.mask) and torch.equal(jigsaw.perm, expected_jigsaw.perm)
    torch.testing.assert_close(out, expected_out, rtol=1e-4, atol=1e-5)  # the attached loss changes no value
    got, expected = grads(model), grads(reference)
    assert got.keys() == expected.keys()
    assert [name for name, grad in got.items() if grad is None] == []  # every parameter, from the output
    assert any(name.startswith("mjp.dal_regressor.") for name in got) or case["settings"]["dal"] == "pca"
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=lambda text, name=name: f"{name}: {text}")


@settings(max_examples=max(1, settings.default.max_examples // 4), phases=UNSHRUNK)
@given(cases(), weights, st.sampled_from(("one position", "equal rows")))
def test_pca_on_a_table_of_one_position_or_equal_rows_gives_finite_gradients(case, attached_weight, table):
    """A degenerate table (the pca regressor's projection has no direction): the attached DAL gradients are finite,
    and at weight 0 every parameter's gradient is the model's without DAL."""
    case = copy.deepcopy(case)
    if table == "one position":
        case["kwargs"]["img_size"] = (case["kwargs"]["patch_size"],) * 2
        case["grid"] = (1, 1)
    case["settings"]["dal"] = "pca"
    model = make_model(case)
    if table == "equal rows":
        with torch.no_grad():
            model.pos_embed.copy_(model.pos_embed[:, -1:].expand_as(model.pos_embed))
    without_dal = copy.deepcopy(model)
    without_dal.mjp.dal_regressor = None
    images = torch.randn(case["batch"], 3, *case["kwargs"]["img_size"], generator=torch.Generator().manual_seed(1))
    model.mjp_dal_weight = attached_weight
    for each in (model, without_dal):
        out = each(images)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
    for name, grad in grads(model).items():
        assert grad is not None and bool(torch.isfinite(grad).all()), name
        if attached_weight == 0.0 and not name.startswith("mjp.dal_regressor."):
            torch.testing.assert_close(grad, grads(without_dal)[name], rtol=1e-5, atol=1e-7)
