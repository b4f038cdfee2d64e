"""Which timm models MJP covers, and how: a sweep over timm's families, and ``docs/timm-coverage.md`` from it.

By default the sweep takes one small model of every timm family (a family: a timm model module,
``timm.models.<module>``; :func:`family_models` says how the smallest-looking one is chosen); ``--vit-sweep`` takes
every small model of timm's ViT families instead (``vit_*``, ``deit*``, ``eva*``, ``beit*``, ``flexivit*`` whose name
says tiny, small, little, ...). Each model is built with ``pretrained=False`` at its own input size (its
pretrained config's), and the sweep does what a new user would:

1. ``mjp_fast.timm.convert(model, ratio=0.1, prob=1.0)``; a refusal (a TypeError or ValueError: a learned absolute
   position table the token path does not cover yet, a stride that cannot cut the input, ...) is recorded with its
   reason, as the model's path, and is no failure;
2. eval mode: the output must equal the unconverted model's (within float tolerance: the fused embedding sums
   in another order);
3. one training step as timm's ``train.py`` takes it: forward, cross-entropy, backward (the DAL loss rides on the
   output at ``mjp_dal_weight``); every parameter that requires a gradient must get one, MJP's ``unk_embed`` and
   DAL regressor included;
4. ``mjp_eval(ratio=0.5)``: the consistency protocol's jigsawed eval must give finite outputs that differ from the
   plain eval's (where the sampler masked something: a grid below its ``min_block`` of 8 positions masks nothing);
5. the state dict: loaded into another conversion of the same timm model, it must give the same ``mjp_eval``
   outputs.

It records the path (token: MJP's unknown embedding on the model's table or RoPE; pixel: the pixel-space jigsaw;
refused, and why), what MJP does there, the jigsaw's patch size, whether the patch embedding runs fused, and the
timm version, then writes JSON and the Markdown page::

    python bench/timm_coverage.py                      # one model per timm family, full depth (minutes on 2 CPU cores)
    python bench/timm_coverage.py --vit-sweep          # every small model of the ViT families
    python bench/timm_coverage.py --vit-sweep --depth 1 --models 'eva*'   # quicker: one block each, a subset
    TRITON_INTERPRET=1 python bench/timm_coverage.py --examples --backend triton --models deit_tiny_patch16_224 \
        --json /tmp/timm-coverage.json --doc /tmp/timm-coverage.md   # the tiny test model, Triton interpreted
    python bench/timm_coverage.py --vit-sweep --device cuda --backend triton --depth 1 --time-limit 60 \
        --json $OUT/timm-coverage-cuda.json --doc /tmp/timm-coverage-cuda.md   # the GPU machine's sweep

``--depth N`` builds each model with ``depth=N`` where its timm entry point takes that keyword (the ViT-like
families); a model that does not is built at its own depth, and its row says so. With ``--time-limit`` the models
are taken round-robin over the families, so a sweep cut short still reaches every family; the models it did not
start are listed as not run (they are no failure).

The test suite runs :data:`EXAMPLES`, one tiny model per ViT family, through :func:`check_model` (tests/timm/), and
tests/timm/test_pixel_families.py a tiny model of several pixel-space families.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import math
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `mjp_fast` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import timm
import torch
from timm.layers import HybridEmbed
from timm.models.eva import Eva
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "timm-coverage.md"
RESULTS = ROOT / "bench" / "results"
FAMILY_PATTERNS = ("vit_*", "deit*", "eva*", "beit*", "flexivit*")
# What a name says about its size: the "small models" (tiny, small, little, ... in the name).
SMALL_WORDS = re.compile(r"tiny|small|little|mediumd|betwixt|wee|micro|nano")

# One tiny model per family for the test suite: (timm name, keyword overrides, input side or None for the
# model's own). The overrides keep each step to a fraction of a second on a CPU; the family's code paths stay.
TINY = dict(embed_dim=32, depth=2, num_heads=2)
EXAMPLES: dict[str, tuple[str, dict[str, Any], int | None]] = {
    "ViT, class token": ("deit_tiny_patch16_224", dict(img_size=32, patch_size=4, **TINY), None),
    "ViT, registers, global pool": (
        "vit_betwixt_patch16_reg4_gap_256",
        dict(img_size=32, patch_size=4, **TINY),
        None,
    ),
    "ViT, no_embed_class (DeiT III)": ("deit3_small_patch16_224", dict(img_size=32, patch_size=4, **TINY), None),
    "ViT at 518 px (DINOv2)": ("vit_small_patch14_reg4_dinov2", dict(embed_dim=32, depth=1, num_heads=2), None),
    "ViT, dynamic_img_size": (
        "vit_tiny_patch16_224",
        dict(img_size=32, patch_size=4, dynamic_img_size=True, **TINY),
        48,
    ),
    "ViT, hybrid (ResNet stem)": ("vit_tiny_r_s16_p8_224", dict(img_size=32, depth=2), None),
    "distilled DeiT": ("deit_tiny_distilled_patch16_224", dict(img_size=32, patch_size=4, **TINY), None),
    "EVA-02 (table + RoPE)": ("eva02_tiny_patch14_224", dict(img_size=28, patch_size=4, **TINY), None),
    "RoPE ViT": ("vit_small_patch16_rope_224", dict(img_size=32, patch_size=4, **TINY), None),
    "RoPE ViT, mixed + table": ("vit_small_patch16_rope_mixed_ape_224", dict(img_size=32, patch_size=4, **TINY), None),
    "DINOv3": ("vit_small_patch16_dinov3", dict(img_size=32, patch_size=4, **TINY), None),
    "PE core": ("vit_pe_core_tiny_patch16_384", dict(img_size=32, patch_size=4, **TINY), None),
    "relative-position ViT": ("vit_relpos_small_patch16_224", dict(img_size=32, patch_size=4, **TINY), None),
    "BEiT": ("beit_base_patch16_224", dict(img_size=32, patch_size=4, **TINY), None),
}


# What a name says about its size, smallest first: timm's own test models, then the size words timm's names use.
# A word's rank is its place here; a name without one ranks after all of them.
SIZE_RANKS = (
    "test", "atto", "femto", "pico", "zepto", "nano", "micro", "xxtiny", "xxs", "xxsmall", "tiny", "xtiny", "xs",
    "xsmall", "mini", "wee", "lite", "little", "small", "s",
)  # fmt: skip
# The names of a family compared by their parameter counts (on the meta device: no memory, no weights): the first few
# by name, so that a family's pick costs a few builds.
FAMILY_CANDIDATES = 6


def family_of(name: str) -> str:
    """The timm family of a model name: the module of ``timm.models`` that registers it."""
    return _families()[name]


def _families() -> dict[str, str]:
    if not _FAMILY_OF:
        for module in timm.list_modules():
            _FAMILY_OF.update(dict.fromkeys(timm.list_models(module=module), module))
    return _FAMILY_OF


_FAMILY_OF: dict[str, str] = {}


def name_rank(name: str) -> tuple[int, list[int]]:
    """How small a model's name says it is, smallest first: the smallest size word in it (``test``, ``atto``, ...,
    ``small``; none: after them all), then the numbers in it in order (``resnet18`` before ``resnet50``,
    ``efficientnet_b0`` before ``b3``, ``regnetx_002`` before ``004``)."""
    words = re.split(r"[_\-.]", name)
    ranks = [SIZE_RANKS.index(word) for word in words if word in SIZE_RANKS]
    return min(ranks, default=len(SIZE_RANKS)), [int(number) for number in re.findall(r"\d+", name)]


def parameter_count(name: str) -> float:
    """The parameter count of timm's ``name`` at its defaults, built on the meta device; infinity where it cannot be
    built there."""
    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
    except Exception:  # noqa: BLE001 - a model the meta device cannot build is never the pick
        return math.inf
    return float(sum(parameter.numel() for parameter in model.parameters()))


def _input_side(name: str) -> int:
    config = timm.models.get_pretrained_cfg(name)
    return int(config.input_size[-1]) if config is not None and config.input_size else 224


def _is_timms(name: str) -> bool:
    """Whether timm's entry point for ``name`` is timm's own (not one another package registered)."""
    return timm.models.model_entrypoint(name).__module__.startswith("timm.")


def family_models(families: list[str] | None = None) -> dict[str, str]:
    """One small model of each timm family (``timm.list_modules()``, or ``families``): ``{family: model name}``.

    The pick: the family's :data:`FAMILY_CANDIDATES` smallest names by :func:`name_rank` (timm's ``test_*`` models
    first, then size words, then the numbers in the name), of which the one with the fewest parameters (built on the
    meta device), ties broken by the smaller input side. Names alone mislead (``fastvit_t8`` has no size word),
    parameter counts of every model would build all 1,300 of them: a few builds per family, about a minute on 2
    CPU cores. Parameters are not compute: ``xcit_nano_12_p8_224`` wins over ``_p16`` (slightly fewer parameters,
    four times the tokens), and the sweep's time follows.
    """
    picks = {}
    for family in families if families is not None else timm.list_modules():
        # timm's own models only: importing mjp_fast registers its mjp_* models with timm too (module "registry")
        names = [name for name in timm.list_models(module=family) if _is_timms(name)]
        candidates = sorted(names, key=name_rank)[:FAMILY_CANDIDATES]
        if candidates:
            picks[family] = min(candidates, key=lambda name: (parameter_count(name), _input_side(name)))
    return picks


def small_models(patterns: tuple[str, ...] = FAMILY_PATTERNS) -> list[str]:
    """The small models of timm's ViT families, in timm's order, without duplicates."""
    names = dict.fromkeys(name for pattern in patterns for name in timm.list_models(pattern))
    return [name for name in names if SMALL_WORDS.search(name)]


def round_robin(names: list[str], patterns: tuple[str, ...] = FAMILY_PATTERNS) -> list[str]:
    """``names`` reordered one family at a time (the first of each family, then the second of each, ...), so that
    a sweep cut short by a time limit has reached every family. A name belongs to the first pattern it matches."""
    families: dict[str, list[str]] = {pattern: [] for pattern in (*patterns, "*")}
    for name in names:
        family = next(pattern for pattern in families if fnmatch.fnmatch(name, pattern))
        families[family].append(name)
    queues = [members for members in families.values() if members]
    ordered = []
    for rank in range(max((len(members) for members in queues), default=0)):
        ordered += [members[rank] for members in queues if rank < len(members)]
    return ordered


def what_mjp_does(model: nn.Module) -> str:
    """How a converted model applies MJP, in the coverage table's words."""
    import mjp_fast.timm as mjp_timm
    from mjp_fast.timm.pixel import absolute_position_tables

    if isinstance(model, mjp_timm.MJPPixelModel):
        return "pixel jigsaw"
    parts = []
    if isinstance(getattr(model, "patch_embed", None), HybridEmbed):  # a CNN stem: its input images are jigsawed
        parts.append("pixel jigsaw")
    if absolute_position_tables(model):  # pos_embed, or a family's own (pos_embed_0, patch_pos, embeds.pos_embed)
        parts.append("UNK on the table" if model.mjp.unk_embed is not None else "table, naive shuffle")
    if isinstance(model, Eva) and model.rope is not None:  # the one front end that changes the rotary embedding
        parts.append("RoPE identity" if parts else "RoPE identity + UNK on the tokens")
    return " + ".join(parts) if parts else "tokens moved"


def mjp_path(model: nn.Module) -> str:
    """``"pixel"`` for a model whose input images MJP jigsaws (and nothing else), ``"token"`` for one whose table or
    rotary embedding MJP changes (a hybrid ViT's images are jigsawed too, as its tokens' pixels)."""
    import mjp_fast.timm as mjp_timm

    return "pixel" if isinstance(model, mjp_timm.MJPPixelModel) else "token"


def _logits(output: Any) -> torch.Tensor:
    """The classifier output of a timm model's forward (a distilled DeiT in distilled training gives two)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def check_model(
    name: str,
    overrides: dict[str, Any] | None = None,
    side: int | None = None,
    *,
    backend: str | None = None,
    device: str = "cpu",
    batch: int = 2,
    seed: int = 0,
    optional: dict[str, Any] | None = None,
    convert_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Converts, trains one step, evaluates and reloads one timm model; returns the record of what happened.

    Args:
        name: a timm model name. overrides: keywords for ``timm.create_model`` (smaller sizes for tests).
        side: the input side in pixels (default: the model's own).
        backend: MJP's backend (default automatic).
        optional: keywords for ``timm.create_model`` that are dropped where the model's entry point refuses them
            (``--depth``: ``depth`` is a ViT's keyword, not a CNN's); the record's ``dropped`` lists them.
        convert_options: more keywords for :func:`mjp_fast.timm.convert` (``pixel_jigsaw=True``, ``patch_size``).

    Returns:
        A JSON-ready dict: ``name``, ``family``, ``timm_class``, ``input_size``, ``path`` (``token``, ``pixel`` or
        ``refused``), ``mjp`` (what MJP does), ``patch_size``, ``fused``, ``ok``, ``refused`` (the reason, where
        convert refused the model), ``mjp_eval_jigsawed`` (whether ``mjp_eval`` masked any position; a
        sentence where the model's output ignores its input), ``steps``
        (each step's outcome: ``True`` or the error's first line), ``eval_max_diff``, ``seconds``.
    """
    import mjp_fast.timm as mjp_timm
    from mjp_fast.timm.convert import runs_fused
    from mjp_fast.train.models import input_size

    start = time.perf_counter()
    record: dict[str, Any] = {"name": name, "family": _families().get(name, "-"), "overrides": overrides or {}}
    record["steps"] = {}
    torch.manual_seed(seed)
    try:
        base, record["dropped"] = _create(name, {**(overrides or {})}, optional or {}, device)
    except Exception as error:  # noqa: BLE001 - recorded: the sweep goes on
        record.update(ok=False, error=f"create: {_first_line(error)}", seconds=round(time.perf_counter() - start, 2))
        return record
    record["timm_class"] = type(base).__name__
    side = side or input_size(base)  # the model's own: its patch embedding's image size, else its config's
    record["input_size"] = side
    images = torch.randn(batch, 3, side, side, device=device)
    targets = torch.randint(0, 10, (batch,), device=device)
    steps = record["steps"]
    settings = dict(ratio=0.1, prob=1.0, backend=backend, **(convert_options or {}))
    try:
        try:
            model = mjp_timm.convert(copy.deepcopy(base), **settings)
        except (TypeError, ValueError) as refusal:  # a model MJP refuses, and says why: the coverage's answer
            record.update(path="refused", refused=_first_line(refusal).split(": ", 1)[1], mjp="-", ok=False)
            record["seconds"] = round(time.perf_counter() - start, 2)
            return record
        steps["convert"] = True
        record.update(path=mjp_path(model), mjp=what_mjp_does(model), patch_size=model.mjp.patch_size)
        record["fused"] = runs_fused(model)
        # Before the training step, whose forward moves BatchNorm statistics (the hybrid ViTs' ResNet stems).
        model.eval()
        base.eval()
        with torch.no_grad():
            expected, got = _logits(base(images)), _logits(model(images))
        difference = (expected - got).abs().max().item()
        record["eval_max_diff"] = difference
        scale = expected.abs().max().item() + 1e-6
        if not difference <= 1e-4 * scale + 1e-5:
            raise RuntimeError(f"eval output differs from timm's by {difference:.3g}")
        steps["eval = timm"] = True
        model.train()
        logits = _logits(model(images))
        loss = nn.functional.cross_entropy(logits, targets)  # DAL rides on it: no mjp_aux_loss() needed
        loss.backward()
        if not torch.isfinite(loss):
            raise RuntimeError(f"the loss is {loss.item()}")
        missing = [key for key, p in model.named_parameters() if p.requires_grad and p.grad is None]
        if missing:
            raise RuntimeError(f"no gradient reached {', '.join(missing)}")
        # The step itself, as train.py takes it: at initialization some models hardly see where things are (a
        # RegNet's zero-initialized last BatchNorm of each block leaves strided 1x1 shortcuts and a global pool,
        # blind to a jigsaw at the stem's stride), and the check below needs trained weights to tell.
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01).step()
        steps["train step"] = True
        model.eval()  # the plain eval output after the step, against which the jigsawed eval must differ
        with torch.no_grad():
            plain = _logits(model(images))
            with model.mjp_eval(ratio=0.5, seed=0):
                jigsawed = _logits(model(images))
        if not torch.isfinite(jigsawed).all():
            raise RuntimeError("mjp_eval gave non-finite outputs")
        # A grid smaller than the sampler's min_block (the tests' 2x2 grids) masks nothing: nothing to tell then.
        record["mjp_eval_jigsawed"] = model.mjp.last_jigsaw is not None and bool(model.mjp.last_jigsaw.mask.any())
        if record["mjp_eval_jigsawed"] and torch.equal(jigsawed, plain):
            # Unless the model all but ignores its input (cspnext at initialization: features of 1e-10 under the
            # head's bias, which other images change by float rounding only), the jigsaw did not reach it.
            with torch.no_grad():
                other = _logits(model(torch.randn_like(images)))
            if (other - plain).abs().max() > 1e-6 * plain.abs().max():
                raise RuntimeError("mjp_eval gave the plain eval output: the jigsaw did not reach the model")
            record["mjp_eval_jigsawed"] = "the model's output does not depend on its input at initialization"
        steps["mjp_eval"] = True
        # The trained model's state dict in another conversion of the same timm model (base, converted in place):
        # the same weights and MJP state, so the same jigsawed outputs for the same seed.
        reloaded = mjp_timm.convert(base, **settings)
        reloaded.load_state_dict(model.state_dict())
        reloaded.eval()
        with torch.no_grad(), reloaded.mjp_eval(ratio=0.5, seed=0):
            again = _logits(reloaded(images))
        # Equal within float rounding: a cache made from the weights (LeViT's attention biases in timm 1.0.29) may
        # sum in another order than the model that trained; a weight or MJP state not reloaded moves far more.
        scale = float(jigsawed.abs().max()) if jigsawed.numel() else 1.0
        if not torch.allclose(again, jigsawed, rtol=1e-4, atol=1e-4 * max(scale, 1e-6)):
            raise RuntimeError(f"the reloaded state dict gives other outputs (by {(again - jigsawed).abs().max():.3g})")
        steps["state dict"] = True
    except Exception as error:  # noqa: BLE001 - recorded: the sweep goes on
        failed = next(step for step in STEPS if step not in steps)
        steps[failed] = _first_line(error)
        record["traceback"] = traceback.format_exc(limit=4)
    record["ok"] = all(value is True for value in steps.values()) and len(steps) == len(STEPS)
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


STEPS = ("convert", "eval = timm", "train step", "mjp_eval", "state dict")


def with_depth_companions(name: str, optional: dict[str, Any]) -> dict[str, Any]:
    """``optional`` plus the keywords a model needs beside a smaller ``depth`` to use all its parameters: ConViT joins
    its class token after ``local_up_to_layer`` blocks (10 by default), so with fewer blocks timm's own model leaves
    the token unused; the last block then is a global one, as the last two of ConViT's own twelve."""
    if "depth" in optional and name.startswith("convit"):
        return {**optional, "local_up_to_layer": max(0, optional["depth"] - 1)}
    return optional


def _create(name: str, overrides: dict[str, Any], optional: dict[str, Any], device: str) -> tuple[nn.Module, list]:
    """timm's ``name`` with ``overrides`` and ``optional``, else (its entry point refusing a keyword of
    ``optional``) without ``optional``; returns the model and the optional keywords dropped."""
    try:
        model = timm.create_model(name, pretrained=False, num_classes=10, **overrides, **optional)
        return model.to(device), []
    except Exception:  # noqa: BLE001 - retried without the optional keywords; a second failure is raised
        if not optional:
            raise
    model = timm.create_model(name, pretrained=False, num_classes=10, **overrides)
    return model.to(device), sorted(optional)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def render(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """``docs/timm-coverage.md`` from the sweep's records."""
    passed = sum(record["ok"] for record in records)
    refused = [record for record in records if record.get("path") == "refused"]
    failed = len(records) - passed - len(refused)
    families: dict[tuple[str, str, str], list[str]] = {}
    for record in records:
        key = (record.get("timm_class", "?"), record.get("mjp", "-"), "yes" if record.get("fused") else "no")
        families.setdefault(key, []).append(record["name"])
    vit_sweep = meta.get("sweep") == "vit"
    chosen = (
        "Each small model of timm's ViT families (`vit_*`, `deit*`, `eva*`, `beit*`, `flexivit*` with tiny, small,"
        "\nlittle, ... in the name, `--vit-sweep`)"
        if vit_sweep
        else "One small model of each timm family (a family: a timm model module, `timm.models.<module>`; the pick:"
        "\nthe fewest parameters among the six smallest-looking names, `family_models` in the script)"
    )
    lines = [
        "# MJP across timm's families",
        "",
        f"Generated by `python bench/timm_coverage.py{' --vit-sweep' if vit_sweep else ''}` (do not edit by hand). "
        f"{chosen} was built with",
        "`pretrained=False` at its own input size, converted with `mjp_fast.timm.convert(model, ratio=0.1,",
        "prob=1.0)`, compared with the unconverted model in eval mode, trained one step as timm's `train.py` does",
        "(the cross-entropy's backward alone; the DAL loss rides on the output, and every parameter, MJP's",
        "included, must get a gradient), evaluated under `mjp_eval(ratio=0.5)` (finite, and not the plain output),",
        "and its state dict loaded into another conversion of the same model (the same `mjp_eval` outputs).",
        "",
        f"Run: timm {meta['timm']}, torch {meta['torch']}, {meta['device']}, backend {meta['backend']}, "
        f"{meta['depth_note']}, {meta['date']}. {passed} of {len(records)} models pass every step; "
        f"{len(refused)} refused by `convert` (the reason below); {failed} failed.",
        "",
        "Paths: **token**: MJP changes the model's position embedding (the paper's method). **UNK on the table**: the",
        "shuffled positions get the learned unknown embedding instead of their row of the absolute position table,",
        "and DAL regresses the table. **RoPE identity**: the shuffled positions get no rotation (cos 1, sin 0), the",
        "rotary analogue of the unknown embedding; **UNK on the tokens**: without a table, the shuffled tokens get",
        "the unknown embedding added, as a marker (docs/design.md section 7). A model whose stem sees across the",
        "patches' borders (a hybrid ViT's CNN, Hiera's, PiT's, VOLO's convolutions) gets its images jigsawed too, one",
        "block of pixels per token, and the unknown embedding on its table. **pixel**: the model keeps its positions",
        "in relative biases, convolutions or a computed encoding (or has none), so there is no row to replace: its",
        "input images are jigsawed in patches of the given size (its first downsampling stage's stride; ResNet, Swin,",
        "ConvNeXt, the relative-position ViTs and BEiT: their patch embedding's, else 16 pixels), as the paper's Swin",
        "and ResNet rows. **refused**: `convert` raises, saying why (a learned absolute position table that MJP's",
        "token path does not cover yet, which `convert(..., pixel_jigsaw=True)` jigsaws in pixel space instead; no",
        "stage that downsamples, where `patch_size=` can choose). **fused**: the patch embedding, the jigsaw and the",
        "position term run as one fused call (`mjp_patch_embed`, or NaFlexVit's `mjp_gathered_patch_embed`).",
        "",
        "| timm class | what MJP does | fused embedding | models |",
        "|---|---|---|---|",
    ]
    for (timm_class, mjp, fused), names in sorted(families.items()):
        if mjp != "-":
            lines.append(f"| `{timm_class}` | {mjp} | {fused} | {', '.join(f'`{n}`' for n in names)} |")
    header = "| family | model | input | timm class | path | what MJP does | patch | fused | result | s |"
    lines += ["", "## Every model", "", header]
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for record in records:
        failures = [f"{step}: {value}" for step, value in record["steps"].items() if value is not True]
        if record["ok"]:
            result = "ok"
        elif record.get("path") == "refused":
            result = f"refused: {record['refused']}"
        else:
            result = "; ".join(failures) or record.get("error", "failed")
        if record.get("dropped"):
            result += f" (built without {', '.join(record['dropped'])})"
        lines.append(
            f"| {record.get('family', '-')} | `{record['name']}` | {record.get('input_size', '-')} | "
            f"`{record.get('timm_class', '-')}` | {record.get('path', '-')} | {record.get('mjp', '-')} | "
            f"{record.get('patch_size', '-')} | {'yes' if record.get('fused') else 'no'} | "
            f"{result.replace('|', '/')} | {record['seconds']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="*", help="fnmatch pattern over the swept models (default: all)")
    parser.add_argument(
        "--depth",
        type=int,
        default=None,
        help="build each model with this many blocks, where its timm entry point takes depth= (others: their own)",
    )
    parser.add_argument(
        "--vit-sweep",
        action="store_true",
        help="every small model of timm's ViT families (vit_*, deit*, eva*, beit*, flexivit*) instead of one small "
        "model of every timm family",
    )
    parser.add_argument(
        "--examples",
        action="store_true",
        help="the test suite's tiny model of each family (EXAMPLES: 32 px, width 32) instead of timm's small models at "
        "their own size: seconds each, also in the Triton interpreter",
    )
    parser.add_argument("--backend", default=None, help="MJP's backend (default automatic)")
    parser.add_argument("--device", default="cpu", help="where the models run: cpu, cuda, cuda:N (default cpu)")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no model after this many seconds; the models then go round-robin over the families",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="default bench/results/timm-coverage-<device>-<date>.json"
    )
    parser.add_argument("--doc", type=Path, default=DOC, help="the Markdown page to write (default %(default)s)")
    args = parser.parse_args(argv)

    import mjp_fast.backend

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: torch sees no CUDA GPU (torch {torch.__version__})")
        # Like with like: timm's convolution patch embedding would otherwise round through TF32 while the fused
        # one multiplies float32 exactly, and "eval = timm" compares the two.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if args.backend is not None and args.backend not in mjp_fast.available_backends():
        parser.error(f"--backend {args.backend}: not available here (available: {mjp_fast.available_backends()})")

    if args.examples and args.vit_sweep:
        parser.error("--examples and --vit-sweep: choose one set of models")
    depth = {"depth": args.depth} if args.depth is not None else {}
    if args.examples:  # name -> (keyword overrides, input side)
        models = {name: ({**overrides, **depth}, side) for name, overrides, side in EXAMPLES.values()}
        optional: dict[str, Any] = {}
    else:
        # --depth for the ViT sweep as before (every model there takes it); for the families, where it is taken
        names = small_models() if args.vit_sweep else list(family_models().values())
        models = {name: ({} if not args.vit_sweep else depth, None) for name in names}
        optional = {} if args.vit_sweep else depth
    names = [name for name in models if fnmatch.fnmatch(name, args.models)]
    if args.time_limit is not None:
        names = round_robin(names)
    records = []
    not_run: list[str] = []
    started = time.perf_counter()
    for name in names:
        if args.time_limit is not None and time.perf_counter() - started > args.time_limit:
            not_run.append(name)
            continue
        overrides, side = models[name]
        record = check_model(
            name,
            overrides,
            side,
            backend=args.backend,
            device=args.device,
            optional=with_depth_companions(name, optional),
        )
        records.append(record)
        if record["ok"]:
            status = "ok"
        elif record.get("path") == "refused":
            status = f"refused: {record['refused']}"
        else:
            status = "FAILED " + json.dumps(record["steps"] or record.get("error"))
        print(f"{name:48s} {record.get('mjp', '-'):28s} {record['seconds']:7.1f} s  {status[:160]}", flush=True)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    meta = {
        "timm": timm.__version__,
        "torch": torch.__version__,
        "device": args.device,
        "backend": args.backend or mjp_fast.backend.resolve_backend(None, torch.device(args.device)),
        "depth_note": "full depth"
        if args.depth is None
        else f"{args.depth} block(s) per model"
        + (
            "" if args.vit_sweep or args.examples else " whose timm entry point takes depth= (the others at full depth)"
        ),
        "date": date,
        "sweep": "examples" if args.examples else "vit" if args.vit_sweep else "families",
    }
    if args.examples:
        meta["depth_note"] = "the test suite's tiny models (EXAMPLES)" + (f", {meta['depth_note']}" if depth else "")
    if not_run:
        meta["depth_note"] += f", time limit {args.time_limit:g} s ({len(not_run)} of {len(names)} models not run)"
    path = args.json or RESULTS / f"timm-coverage-{args.device}-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "records": records, "not_run": not_run}, indent=1) + "\n")
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    args.doc.write_text(render(records, meta))
    skipped = f"; {len(not_run)} not run (time limit {args.time_limit:g} s)" if not_run else ""
    refused = sum(record.get("path") == "refused" for record in records)
    failed = len(records) - refused - sum(record["ok"] for record in records)
    print(
        f"{sum(r['ok'] for r in records)} of {len(records)} pass, {refused} refused, {failed} failed{skipped}; "
        f"wrote {path} and {args.doc}"
    )
    return 0 if failed == 0 else 1  # a refusal is the coverage's answer for that model, not a failure


if __name__ == "__main__":
    raise SystemExit(main())
