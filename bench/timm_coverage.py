"""Which timm ViTs MJP covers, and how: a sweep over timm's ViT families, and ``docs/timm-coverage.md`` from it.

For every small model of timm's ViT families (``vit_*``, ``deit*``, ``eva*``, ``beit*``, ``flexivit*`` whose name
says tiny, small, little, ...), built with ``pretrained=False`` at its own input size (its pretrained config's),
the sweep does what a new user would:

1. ``mjp_fast.timm.convert(model, ratio=0.1, prob=1.0)``;
2. eval mode: the output must equal the unconverted model's (within float tolerance: the fused embedding sums
   in another order);
3. one training step as timm's ``train.py`` takes it: forward, cross-entropy, backward (the DAL loss rides on the
   output at ``mjp_dal_weight``); every parameter that requires a gradient must get one, MJP's ``unk_embed`` and
   DAL regressor included;
4. ``mjp_eval(ratio=0.5)``: the consistency protocol's jigsawed eval must run and give finite outputs.

It records what MJP does there (the unknown embedding on the absolute table, the identity rotation for RoPE, or
the pixel-space jigsaw), whether the patch embedding runs fused, and the timm version, then writes JSON and the
Markdown page::

    python bench/timm_coverage.py                      # every small model, full depth (minutes on 2 CPU cores)
    python bench/timm_coverage.py --depth 1 --models 'eva*'   # quicker: one block each, a subset
    TRITON_INTERPRET=1 python bench/timm_coverage.py --examples --backend triton --models deit_tiny_patch16_224 \
        --json /tmp/timm-coverage.json --doc /tmp/timm-coverage.md   # the tiny test model, Triton interpreted
    python bench/timm_coverage.py --device cuda --backend triton --depth 1 --time-limit 60 \
        --json $OUT/timm-coverage-cuda.json --doc /tmp/timm-coverage-cuda.md   # the GPU machine's sweep

With ``--time-limit`` the models are taken round-robin over the families, so a sweep cut short still reaches every
family; the models it did not start are listed as not run (they are no failure).

The test suite runs :data:`EXAMPLES`, one tiny model per family, through :func:`check_model` (tests/timm/).
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
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

    if isinstance(model, mjp_timm.MJPPixelModel):
        return "pixel jigsaw"
    parts = []
    if isinstance(getattr(model, "patch_embed", None), HybridEmbed):  # a CNN stem: its input images are jigsawed
        parts.append("pixel jigsaw")
    if getattr(model, "pos_embed", None) is not None:
        parts.append("UNK on the table" if model.mjp.unk_embed is not None else "table, naive shuffle")
    if getattr(model, "rope", None) is not None:
        parts.append("RoPE identity" if parts else "RoPE identity + UNK on the tokens")
    return " + ".join(parts) if parts else "tokens moved"


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
) -> dict[str, Any]:
    """Converts, trains one step, and evaluates one timm model; returns the record of what happened.

    Args:
        name: a timm model name. overrides: keywords for ``timm.create_model`` (smaller sizes for tests).
        side: the input side in pixels (default: the model's own).
        backend: MJP's backend (default automatic).

    Returns:
        A JSON-ready dict: ``name``, ``timm_class``, ``input_size``, ``mjp`` (what MJP does), ``fused``, ``ok``,
        ``steps`` (each step's outcome: ``True`` or the error's first line), ``eval_max_diff``, ``seconds``.
    """
    import mjp_fast.timm as mjp_timm
    from mjp_fast.train.models import input_size

    start = time.perf_counter()
    record: dict[str, Any] = {"name": name, "overrides": overrides or {}, "steps": {}}
    torch.manual_seed(seed)
    try:
        base = timm.create_model(name, pretrained=False, num_classes=10, **(overrides or {})).to(device)
    except Exception as error:  # noqa: BLE001 - recorded: the sweep goes on
        record.update(ok=False, error=f"create: {_first_line(error)}", seconds=time.perf_counter() - start)
        return record
    record["timm_class"] = type(base).__name__
    side = side or input_size(base)  # the model's own: its patch embedding's image size, else its config's
    record["input_size"] = side
    images = torch.randn(batch, 3, side, side, device=device)
    targets = torch.randint(0, 10, (batch,), device=device)
    steps = record["steps"]
    try:
        model = mjp_timm.convert(copy.deepcopy(base), ratio=0.1, prob=1.0, backend=backend)
        steps["convert"] = True
        record["mjp"] = what_mjp_does(model)
        record["fused"] = mjp_timm.is_fused(model.patch_embed) if hasattr(model, "patch_embed") else False
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
        steps["train step"] = True
        with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=0):
            jigsawed = _logits(model(images))
        if not torch.isfinite(jigsawed).all():
            raise RuntimeError("mjp_eval gave non-finite outputs")
        steps["mjp_eval"] = True
    except Exception as error:  # noqa: BLE001 - recorded: the sweep goes on
        failed = next(step for step in ("convert", "eval = timm", "train step", "mjp_eval") if step not in steps)
        steps[failed] = _first_line(error)
        record["traceback"] = traceback.format_exc(limit=4)
    record["ok"] = all(value is True for value in steps.values()) and len(steps) == 4
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def render(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """``docs/timm-coverage.md`` from the sweep's records."""
    families: dict[tuple[str, str, str], list[str]] = {}
    for record in records:
        key = (record.get("timm_class", "?"), record.get("mjp", "-"), "yes" if record.get("fused") else "no")
        families.setdefault(key, []).append(record["name"])
    lines = [
        "# MJP across timm's ViT families",
        "",
        "Generated by `python bench/timm_coverage.py` (do not edit by hand). Each small model of timm's ViT families",
        "(`vit_*`, `deit*`, `eva*`, `beit*`, `flexivit*` with tiny, small, little, ... in the name) was built with",
        "`pretrained=False` at its own input size, converted with `mjp_fast.timm.convert(model, ratio=0.1,",
        "prob=1.0)`, compared with the unconverted model in eval mode, trained one step as timm's `train.py` does",
        "(the cross-entropy's backward alone; the DAL loss rides on the output, and every parameter, MJP's",
        "included, must get a gradient), and evaluated under `mjp_eval(ratio=0.5)`.",
        "",
        f"Run: timm {meta['timm']}, torch {meta['torch']}, {meta['device']}, backend {meta['backend']}, "
        f"{meta['depth_note']}, {meta['date']}. {sum(r['ok'] for r in records)} of {len(records)} models pass "
        "every step.",
        "",
        "What MJP does: **UNK on the table**: the shuffled positions get the learned unknown embedding instead of",
        "their row of the absolute position table, and DAL regresses the table (the paper's method). **RoPE",
        "identity**: the shuffled positions get no rotation (cos 1, sin 0), the rotary analogue of the unknown",
        "embedding; **UNK on the tokens**: without a table, the shuffled tokens get the unknown embedding added, as",
        "a marker (docs/design.md section 7). **pixel jigsaw**: the model keeps its positions in relative biases",
        "(or has no position table), so there is no row to replace: its input images are jigsawed, as the paper's",
        "Swin and ResNet rows. A hybrid ViT (a CNN stem, whose receptive fields cross the patches' borders) gets its",
        "images jigsawed too, one block of pixels per token, and the unknown embedding on its table. **fused**: the",
        "patch embedding, the jigsaw and the position term run as one `mjp_patch_embed` call (timm's standard",
        "`PatchEmbed` and an absolute table).",
        "",
        "| timm class | what MJP does | fused embedding | models |",
        "|---|---|---|---|",
    ]
    for (timm_class, mjp, fused), names in sorted(families.items()):
        lines.append(f"| `{timm_class}` | {mjp} | {fused} | {', '.join(f'`{n}`' for n in names)} |")
    lines += ["", "## Every model", "", "| model | input | timm class | what MJP does | fused | result | s |"]
    lines.append("|---|---|---|---|---|---|---|")
    for record in records:
        failed = [f"{step}: {value}" for step, value in record["steps"].items() if value is not True]
        result = "ok" if record["ok"] else "; ".join(failed) or record.get("error", "failed")
        lines.append(
            f"| `{record['name']}` | {record.get('input_size', '-')} | `{record.get('timm_class', '-')}` | "
            f"{record.get('mjp', '-')} | {'yes' if record.get('fused') else 'no'} | {result} | {record['seconds']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="*", help="fnmatch pattern over the small models (default: all)")
    parser.add_argument("--depth", type=int, default=None, help="build each model with this many blocks")
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

    depth = {"depth": args.depth} if args.depth is not None else {}
    if args.examples:  # name -> (keyword overrides, input side)
        models = {name: ({**overrides, **depth}, side) for name, overrides, side in EXAMPLES.values()}
    else:
        models = {name: (depth, None) for name in small_models()}
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
        record = check_model(name, overrides, side, backend=args.backend, device=args.device)
        records.append(record)
        status = "ok" if record["ok"] else "FAILED " + json.dumps(record["steps"] or record.get("error"))
        print(f"{name:48s} {record.get('mjp', '-'):28s} {record['seconds']:7.1f} s  {status}", flush=True)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    meta = {
        "timm": timm.__version__,
        "torch": torch.__version__,
        "device": args.device,
        "backend": args.backend or mjp_fast.backend.resolve_backend(None, torch.device(args.device)),
        "depth_note": f"{args.depth} block(s) per model" if args.depth is not None else "full depth",
        "date": date,
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
    print(f"{sum(r['ok'] for r in records)} of {len(records)} pass{skipped}; wrote {path} and {args.doc}")
    return 0 if all(record["ok"] for record in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
