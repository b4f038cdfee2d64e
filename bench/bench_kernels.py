"""MJP's Triton kernels one by one: the GPU time of each kernel of the fused patch embedding's part of a training
step, with and without the jigsaw, under each pipeline setting still in question.

The part is the train-step case's isolated work (:func:`bench.bench_train_step.position_part`): the fused patch
embedding, the position step and, for MJP, the jigsaw and the DAL loss, forward and backward, bfloat16 autocast,
on the ``triton`` backend. For DeiT-Small at batch 256, per setting, two variants:

- ``plain + fast patch embed``: timm's model with the fused embedding (no jigsaw), the baseline;
- ``mjp prob=1``: MJP at ratio 0.1 with every sample jigsawed, DAL nonlinear.

The settings change module constants, in this process, for the duration of their measurement (the
position-gradient plans are made again on the way in and out):

- ``default``: the constants as shipped;
- ``partials unpipelined``: ``PARTIAL_STAGES = 1``: the position gradient's partials kernel without its software
  pipeline (its loop as before commit 93b2e73, which the H100 timed at 103 us, and 201 us with a mask);
- ``partials, more programs`` and ``partials, fewer programs``: the position gradient's partials kernel split into
  more batch chunks (``PROGRAMS_PER_SM = 16``, ``MAX_PARTIAL_SHARE = 0.4``: 1,650 programs of 3 steps at DeiT-S's
  batch of 256 on 132 SMs) or fewer (``PROGRAMS_PER_SM = 1``: 147 programs of 37 steps of one sample's 32 rows),
  against the default's 600 of 8: the H200 timed the default at 107 us (206 us with a mask) for 77 MB, 0.7 TB/s of
  its ~4.8, and these bracket it: more loads in flight, or longer loops with fewer partials;
- ``weight gradient, patches gathered``: ``WEIGHT_GRADIENT_BY_INVERSE = False``: the weight gradient with a jigsaw
  gathers the patches by the perm (as the H200 timed it on 2026-11-28: 454 us against 258 us without a jigsaw), not
  the gradient's rows by the perm's inverse (the default since issue 39);
- ``sampler at 1 warp``: ``SAMPLER_WARPS = 1``: a sample's program on one warp instead of Triton's default 4 (its
  rounds' reductions are shuffles, not barriers; the H100 timed the sampler at 19 us for 256 samples);
- ``DAL wider steps``: the DAL loss's kernels in fewer, wider steps (see the setting's comment).

One GPU run answers which setting each kernel should ship with, and checks that each setting computes what the
default does: each row records its parameters' gradients' largest difference from the default setting's, for the
same jigsaws (bit for bit where only the pipeline changes; within rounding where the tiles change the sums). The
GPU time is the profiler's (the summed durations of the kernels: no host time; on the lent machines' slow host a
small part is host-bound, and CUDA events around it would time the host), the median over interleaved rounds,
and each kernel's time per call. Each row also records what the launches resolved under its setting (the partials
kernel's plan, the weight gradient's stages), so a setting that did not reach the kernels shows. No aims: the
train-step case judges the work's total.

Stopped midway (a deadline's interrupt), the case hands the settings it finished to ``bench.run``, which records
them (``cut_short``) before the run stops.

The kernels run compiled on a GPU only. On the CPU, a smoke run (tiny shapes, the Triton interpreter) runs every
setting and variant and counts the launches; a full CPU run measures nothing and says so.

    python bench/bench_kernels.py [--smoke] [--repeats ROUNDS] [--out DIR] [--device cpu|cuda]
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `mjp_fast` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.bench_train_step import (
    FAST,
    MODEL_TITLES,
    _models,
    _top_kernels,
    device_busy_samples,
    part_inputs,
    position_part,
    variant_name,
)
from bench.common import (
    PartialResults,
    Timing,
    error_lines,
    format_seconds,
    markdown_table,
    measure,
    run_standalone,
    where_measured,
)

NAME = "kernels"
BACKEND = "triton"
PROB = 1.0  # every sample jigsawed: each kernel's jigsaw path runs for the whole batch
VARIANTS = (FAST, PROB)
# DeiT-S, where the aims are judged and the H100 timed the kernels; one model keeps the case within its share of the
# device check (each setting compiles its kernels again, seconds each on the lent machines' slow host)
RUNS = (("deit_small_patch16_224", 256),)
IMAGE_SIZE = 224
SMOKE_RUNS = (("deit_tiny_patch16_224", 2),)
SMOKE_SHAPE = {"image_size": 16, "overrides": {"patch_size": 4, "embed_dim": 16, "num_heads": 2}}  # a 4x4 grid
CALLS, ROUNDS = 10, 3  # profiled calls per round, interleaved rounds
TOP_KERNELS = 16
DEFAULT = "default"
# The settings still in question, each against the default. The H200's run of 2026-11-28 answered the earlier ones
# (DeiT-S, batch 256, bf16, prob 1, MJP's GPU busy time per step): the position partials unpipelined, 200 against
# 206 us (no difference: the pipeline stays); the weight gradient with a perm at 3 stages, 467 against 454 us at 5
# (5 stays); the sampler at 1 warp, 26.9 against 18.7 us (4 stay); DAL's wider steps, its backward 20.0 against
# 26.8 us (adopted: mjp_fast/triton/dal_loss.py) and its forward 31.6 against 20.3 us (not). What stays: the
# earlier DAL backward tiles, so that the next run confirms the adopted ones on the same GPU.
# The inverse-permutation weight gradient (issue 39) is designed from the floor and checked in the interpreter and in
# sm_90 TTGIR; the GPU has not timed it: the patches' gather stays as a setting, so that one run compares the two.
SETTINGS: dict[str, dict[str, object]] = {
    DEFAULT: {},
    "DAL backward, earlier tiles": {
        "mjp_fast.triton.dal_loss.BACKWARD_TILES": {"BLOCK_N": 16, "BLOCK_H": 32, "BLOCK_D": 64},
    },
    "weight gradient, patches gathered": {"mjp_fast.triton.patch_embed.WEIGHT_GRADIENT_BY_INVERSE": False},
    # The position gradient far from HBM's bandwidth (issue 39): which way the plan should move, measured.
    "partials, more programs": {
        "mjp_fast.triton.common.PROGRAMS_PER_SM": 16,
        "mjp_fast.triton.common.MAX_PARTIAL_SHARE": 0.4,
    },
    "partials, fewer programs": {"mjp_fast.triton.common.PROGRAMS_PER_SM": 1},
}


@contextlib.contextmanager
def applied(setting: dict[str, object]) -> Iterator[None]:
    """The module constants of ``setting`` (``"package.module.NAME": value``) set for the duration, restored after;
    the cached position-gradient plans, which read them, forgotten on the way in and out.

    Raises:
        ValueError: a name that is not a constant of its module.
    """
    from mjp_fast.triton import common

    saved = []
    try:
        for path, value in setting.items():
            module_name, _, attribute = path.rpartition(".")
            module = importlib.import_module(module_name) if module_name else None
            if module is None or not hasattr(module, attribute):
                raise ValueError(f"setting: {path!r} names no module constant")
            saved.append((module, attribute, getattr(module, attribute)))
            setattr(module, attribute, value)
        common._cached_plan.cache_clear()
        yield
    finally:
        for module, attribute, value in reversed(saved):
            setattr(module, attribute, value)
        common._cached_plan.cache_clear()


@contextlib.contextmanager
def resolved_launches() -> Iterator[dict[str, list]]:
    """Records what the launches inside resolve: ``"partials"``, the position-gradient plans as ``[num_stages,
    chunks, block_b, block_n, block_d]``, ``"grad_weight_stages"``, the weight gradient's stages as ``[has_perm,
    stages]``, and ``"grad_weight_path"``, how the weight gradient meets a jigsaw (``"inverse"``: the gradient's rows
    gathered by the perm's inverse; ``"gather"``: the patches gathered by the perm; ``"none"``: no jigsaw); each
    distinct value once, in the order seen."""
    from mjp_fast.triton import common, patch_embed

    seen: dict[str, list] = {"partials": [], "grad_weight_stages": [], "grad_weight_path": []}
    plan_of, stages_of = common._position_plan, patch_embed.grad_weight_stages
    weight_of = patch_embed._grad_weight_launch

    def note(key: str, value: list) -> None:
        if value not in seen[key]:
            seen[key].append(value)

    def plan(grad, **flags):
        made = plan_of(grad, **flags)
        note("partials", [made.num_stages, made.chunks, made.block_b, made.block_n, made.block_d])
        return made

    def stages(has_perm, device):
        chosen = stages_of(has_perm, device)
        note("grad_weight_stages", [bool(has_perm), chosen])
        return chosen

    def weight(grad_out, images, perm, *arguments, inverse=None):
        path = "none" if perm is None else ("inverse" if inverse is not None else "gather")
        note("grad_weight_path", path)
        return weight_of(grad_out, images, perm, *arguments, inverse)

    common._position_plan, patch_embed.grad_weight_stages = plan, stages
    patch_embed._grad_weight_launch = weight
    try:
        yield seen
    finally:
        common._position_plan, patch_embed.grad_weight_stages = plan_of, stages_of
        patch_embed._grad_weight_launch = weight_of


def _launch_counts(function: Callable[[], None]) -> dict[str, int]:
    """The Triton kernels one call of ``function`` launches, by name."""
    from tests.harness.host_cost import counting_triton_launches

    with counting_triton_launches() as launches:
        function()
    return dict(launches)


def _gradients(model: torch.nn.Module, function: Callable[[], None]) -> dict[str, torch.Tensor]:
    """Every parameter's gradient from one call of ``function`` (a :func:`position_part` of ``model``), an MJP
    model's sampler at the start of its stream, so that each setting's call draws the same jigsaws."""
    state = getattr(model, "mjp", None)
    if state is not None:
        state.sampler.sample_counter.zero_()
    function()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def relative_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest difference of any gradient from the expected one, over that gradient's largest magnitude (0 for
    bit-identical gradients; inf for a gradient missing or of another shape; NaN where a NaN or inf differs).

    Raises:
        ValueError: ``expected`` has no gradient.
    """
    if not expected:
        raise ValueError("expected: no gradient to compare with")
    worst = 0.0
    for name, reference in expected.items():
        value = got.get(name)
        if value is None or value.shape != reference.shape:
            return float("inf")
        difference = (value.double() - reference.double()).abs().max().item()
        if math.isnan(difference):  # a NaN on one side only, or inf against inf: never "the same"
            return math.nan
        if difference:
            worst = max(worst, difference / max(reference.double().abs().max().item(), 1e-30))
    return worst


def _measure_setting(
    setting: dict[str, object],
    models: dict,
    functions: dict[str, Callable[[], None]],
    default_gradients: dict[str, dict[str, torch.Tensor]],
    *,
    device: torch.device,
    calls: int,
    rounds: int,
) -> dict[str, dict]:
    """One setting's measurement of each variant (by label): its timing, kernels, launches, what its launches
    resolved, and its gradients' difference from ``default_gradients`` (filled here when empty: the default's)."""
    measured: dict[str, dict] = {}
    with applied(setting):
        for variant in VARIANTS:
            label = variant_name(variant)
            with resolved_launches() as seen:  # also compiles this setting's kernels
                gradients = _gradients(models[variant], functions[label])
            expected = default_gradients.setdefault(label, gradients)
            measured[label] = {"resolved": seen, "max_relative_difference": relative_difference(gradients, expected)}
        for label, function in functions.items():
            measured[label]["launches"] = _launch_counts(function)
        if device.type == "cuda":
            samples, kernels = device_busy_samples(functions, calls, rounds)
            timings = {label: Timing.from_samples(values, calls) for label, values in samples.items()}
        else:  # the smoke run's stand-in for the GPU's busy time: it only shows that each setting runs
            timings = measure(functions, repeats=rounds, warmup=1, min_sample_s=0.0, device=device)
            kernels = {label: {} for label in functions}
    for label, timing in timings.items():
        measured[label].update(timing.to_dict(), kernels=_top_kernels(kernels[label], TOP_KERNELS))
    return measured


def run_model(
    name: str,
    batch: int,
    *,
    device: torch.device,
    smoke: bool,
    rounds: int,
    errors: dict[str, str],
    rows: list[dict],
) -> None:
    """Every setting's rows of one model, appended to ``rows`` as each setting is measured: per setting, one row per
    variant (the MJP row with its extra GPU time over the baseline of the same setting, each row with its
    gradients' largest difference from the default setting's, for the same jigsaws). A setting other than the
    default that raises is left out, its error recorded in ``errors`` (the others are still measured); the
    default's error is raised (nothing to compare with)."""
    shape = SMOKE_SHAPE if smoke else {"image_size": IMAGE_SIZE, "overrides": {}}
    # depth 0: the blocks run nothing of MJP's and would only add kernels to the profile
    models = _models(name, shape["image_size"], device, depth=0, backend=BACKEND, overrides=shape["overrides"])
    images, grad = part_inputs(models[FAST], batch, device)
    functions = {variant_name(variant): position_part(models[variant], images, grad) for variant in VARIANTS}
    default_gradients: dict[str, dict[str, torch.Tensor]] = {}
    for setting_name, setting in SETTINGS.items():
        try:
            measured = _measure_setting(
                setting, models, functions, default_gradients, device=device, calls=1 if smoke else CALLS, rounds=rounds
            )
        except Exception as error:
            if setting_name == DEFAULT:
                raise
            errors[f"{_title(name)}, {setting_name}"] = f"{type(error).__name__}: {error}"
            continue
        baseline = measured[variant_name(FAST)]["median_s"]
        for variant in VARIANTS:
            label = variant_name(variant)
            row = {
                "model": name,
                "batch": batch,
                "image_size": shape["image_size"],
                "setting": setting_name,
                "constants": setting,
                "implementation": label,
                "prob": None if variant == FAST else variant,
                "timer": "profiler" if device.type == "cuda" else "wall clock",
                **measured[label],
            }
            row["extra_busy_s"] = None if variant == FAST else row["median_s"] - baseline
            rows.append(row)


def collect(*, smoke: bool, device: str, repeats: int | None = None) -> dict:
    """Measures the case; returns its section: ``config``, ``backends``, ``results``, ``aims`` (none), and
    ``note`` when nothing could be measured here. ``repeats``: interleaved rounds per setting."""
    import mjp_fast

    runs = SMOKE_RUNS if smoke else RUNS
    rounds = repeats or (1 if smoke else ROUNDS)
    config = {
        "runs": [{"model": name, "batch": batch} for name, batch in runs],
        "image_size": SMOKE_SHAPE["image_size"] if smoke else IMAGE_SIZE,
        "backend": BACKEND,
        "prob": PROB,
        "settings": SETTINGS,
        "calls_per_round": 1 if smoke else CALLS,
        "rounds": rounds,
        "autocast": "bfloat16" if device == "cuda" else None,
    }
    section = {"config": config, "backends": [BACKEND], "results": [], "aims": []}
    if BACKEND not in mjp_fast.available_backends():
        section["note"] = "the triton backend is not available here"
        return section
    if device != "cuda" and not smoke:
        section["note"] = "the Triton kernels run compiled on a GPU only: nothing to measure on the CPU"
        return section
    section["errors"] = {}
    try:
        for name, batch in runs:
            run_model(
                name,
                batch,
                device=torch.device(device),
                smoke=smoke,
                rounds=rounds,
                errors=section["errors"],
                rows=section["results"],
            )
    except KeyboardInterrupt as interrupt:  # a deadline: the settings measured so far are kept
        section["note"] = "stopped before every setting was measured"
        raise PartialResults(section) from interrupt
    return section


def _title(name: str) -> str:
    return MODEL_TITLES.get(name, name)


def table(rows: list[dict]) -> str:
    """Per model and setting: each variant's GPU busy time (wall time on the CPU), MJP's extra over the baseline of
    the same setting, and the resolved partials plans and weight-gradient stages."""
    headers = ["model", "setting", "implementation", "busy (median)", "MJP extra", "vs default", "partials plans"]
    headers.append("weight")
    body = []
    for row in rows:
        extra = row["extra_busy_s"]
        plans = "; ".join(" ".join(str(value) for value in plan) for plan in row["resolved"]["partials"])
        stages = ", ".join(
            f"{'perm' if perm else 'no perm'} {count}" for perm, count in row["resolved"]["grad_weight_stages"]
        )
        paths = row["resolved"].get("grad_weight_path")  # recorded since issue 39's inverse path
        if paths:
            stages += f" ({', '.join(paths)})"
        body.append(
            [
                f"{_title(row['model'])}, batch {row['batch']}",
                row["setting"],
                row["implementation"],
                format_seconds(row["median_s"]),
                "" if extra is None else ("-" if extra < 0 else "+") + format_seconds(abs(extra)),
                f"{row['max_relative_difference']:.1e}" if row["max_relative_difference"] else "same",
                plans or "-",
                stages or "-",
            ]
        )
    return markdown_table(headers, body)


def kernel_table(rows: list[dict], model: str) -> str:
    """One model's kernels (rows) by setting and variant (columns), GPU time per call; empty without timings."""
    mine = [row for row in rows if row["model"] == model and row["kernels"]]
    if not mine:
        return ""
    names: list[str] = []
    for row in mine:
        names += [kernel for kernel, _ in row["kernels"] if kernel not in names]
    columns = [(row["setting"], row["implementation"]) for row in mine]
    times = {(row["setting"], row["implementation"]): dict(row["kernels"]) for row in mine}
    headers = ["kernel"] + [f"{setting}: {'mjp' if label.startswith('mjp') else 'plain'}" for setting, label in columns]
    body = []
    for kernel in names:
        cells = [format_seconds(times[column][kernel]) if kernel in times[column] else "" for column in columns]
        body.append([kernel if len(kernel) <= 60 else kernel[:57] + "...", *cells])
    return markdown_table(headers, body)


def setting_lines(rows: list[dict]) -> list[str]:
    """One ``SETTING`` line per model and setting other than the default (what the device check's summary shows):
    MJP's extra time and the MJP variant's busy time against the default's, the gradients' difference, and the
    kernels whose time moved most (the MJP variant's, against the default setting's)."""
    lines = []
    defaults = {(row["model"], row["implementation"]): row for row in rows if row["setting"] == DEFAULT}
    for row in rows:
        default = defaults.get((row["model"], row["implementation"]))
        if row["setting"] == DEFAULT or row["extra_busy_s"] is None or default is None:
            continue
        before, after = dict(default["kernels"]), dict(row["kernels"])
        moved = sorted(set(before) | set(after), key=lambda name: -abs(after.get(name, 0.0) - before.get(name, 0.0)))

        def time_of(times: dict[str, float], name: str) -> str:
            return format_seconds(times[name]) if name in times else "not run"

        kernels = ", ".join(f"{name} {time_of(after, name)} (default {time_of(before, name)})" for name in moved[:3])
        difference = row["max_relative_difference"]
        lines.append(
            f"SETTING {row['setting']} ({_title(row['model'])}): MJP extra {format_seconds(row['extra_busy_s'])} "
            f"(default {format_seconds(default['extra_busy_s'])}), busy {format_seconds(row['median_s'])} (default "
            f"{format_seconds(default['median_s'])}), gradients {f'{difference:.1e}' if difference else 'same'}"
            + (f"; {kernels}" if kernels else "")
        )
    return lines


def report(section: dict, info: dict) -> str:
    """The printed Markdown: title, the busy-time table, one kernel table per model on a GPU."""
    config = section["config"]
    lines = [
        f"## Triton kernels of MJP's part of a step, by setting (backend {config['backend']}, prob "
        f"{config['prob']:g}, {config['image_size']} px; {where_measured(info)})",
        "",
    ]
    if not section["results"]:
        return "\n".join(lines + [f"NOT RUN: {section.get('note', 'no results')}"])
    timer = section["results"][0]["timer"]
    lines += [
        table(section["results"]),
        "",
        f"busy: {'the GPU time of its kernels (profiler)' if timer == 'profiler' else 'wall time (no GPU)'} per "
        f"call, the median over {config['rounds']} interleaved rounds of {config['calls_per_round']} calls; MJP "
        "extra: the MJP variant's over the baseline's under the same setting; vs default: the largest difference "
        "of its parameters' gradients from the default setting's (same jigsaws), over that gradient's largest "
        "magnitude (same: bit for bit); partials plans: the position-gradient "
        "plans the launches resolved ([stages, batch chunks, block_b, block_n, block_d]); weight: the weight "
        "gradient's stages.",
        "",
    ]
    for name in dict.fromkeys(row["model"] for row in section["results"]):
        kernels = kernel_table(section["results"], name)
        if kernels:
            lines += [f"{_title(name)}: GPU time per call of each kernel", "", kernels, ""]
    return "\n".join(lines + setting_lines(section["results"]) + error_lines(section)).rstrip()


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(NAME, __doc__.split("\n\n")[0], collect, report, argv)


if __name__ == "__main__":
    sys.exit(main())
