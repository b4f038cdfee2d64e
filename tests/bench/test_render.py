"""``bench/render.py``'s plots: PNGs of the newest run per device beside ``docs/benchmarks.md``, linked from it.

Every test renders small synthetic results written to a temporary folder, in the format ``bench/run.py`` records.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `bench` is a folder of the checkout, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from bench import render  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VERSIONS = {"platform": "Linux", "python": "3.11", "torch": "2.14", "mjp_fast": "0.1", "backends": ["torch", "cpu"]}
CPU = {"device": "cpu", "cpu": "Test CPU", "cpu_count": 2, "torch_threads": 2, "gpu": None, "cuda": None} | VERSIONS
GPU = {"device": "cuda", "cpu": "Host", "cpu_count": 16, "torch_threads": 16, "gpu": "NVIDIA H200", "cuda": "13"}
GPU |= VERSIONS
# The train_step row's fields that only some variants fill (bench/bench_train_step.py records them all, as None).
TRAIN_STEP_FIELDS = (
    "overhead_median_pct overhead_p20_pct overhead_p80_pct overhead_ci95_low_pct overhead_ci95_high_pct "
    "overhead_of_medians_pct quiet_pairs quiet_overhead_median_pct isolated_extra_s isolated_overhead_pct "
    "overhead_vs_fast_median_pct overhead_vs_fast_p20_pct overhead_vs_fast_p80_pct overhead_vs_fast_ci95_low_pct "
    "overhead_vs_fast_ci95_high_pct"
).split()
SUFFIXES = {"train_step": "train-step-overhead", "sampler": "sampler", "patch_embed": "patch-embed"}


def _timing(median_s: float) -> dict:
    spread = {"p20_s": 0.9 * median_s, "p80_s": 1.2 * median_s, "min_s": 0.8 * median_s}
    return {"median_s": median_s, **spread, "samples": 5, "calls_per_sample": 1}


def sampler_section(backends: tuple[str, ...] = ("torch", "cpu"), batches: tuple[int, ...] = (4, 16)) -> dict:
    rows = []
    for ratio in (0.1, 0.5):
        for batch in batches:
            for name, per_mask in [("python loop", 50e-6)] + [(b, 1e-6 * (i + 1)) for i, b in enumerate(backends)]:
                per_mask *= 1 + ratio
                rows.append(
                    {
                        "batch": batch,
                        "grid": [14, 14],
                        "ratio": ratio,
                        "implementation": name,
                        **_timing(per_mask * batch),
                        "per_mask_median_s": per_mask,
                        "per_mask_p20_s": 0.9 * per_mask,
                        "per_mask_p80_s": 1.2 * per_mask,
                        "speedup_vs_python": 50e-6 * (1 + ratio) / per_mask,
                        "mean_masked": 19.0,
                        "target": 19,
                        "matches_oracle": None if name == "python loop" else True,
                    }
                )
    return {"config": {"grid": [14, 14]}, "backends": list(backends), "results": rows, "aims": []}


def patch_embed_section(backends: tuple[str, ...] = ("torch", "cpu"), batches: tuple[int, ...] = (64,)) -> dict:
    rows = []
    for mode, scale in (("forward", 1.0), ("forward+backward", 2.5)):
        for batch in batches:
            timm = 1e-5 * batch * scale
            rows.append({"mode": mode, "batch": batch, "implementation": "timm", "backend": None, **_timing(timm)})
            rows[-1] |= {"ratio_vs_timm": 1.0, "images_per_s": batch / timm, "max_abs_error_vs_ref": None}
            for index, backend in enumerate(backends):
                median = timm * (0.8 + 0.3 * index)
                rows.append(
                    {
                        "mode": mode,
                        "batch": batch,
                        "implementation": f"mjp[{backend}]",
                        "backend": backend,
                        **_timing(median),
                        "ratio_vs_timm": median / timm,
                        "images_per_s": batch / median,
                        "max_abs_error_vs_ref": 0.0,
                    }
                )
    config = {"batch": batches[0], "image_size": 224, "patch_size": 16, "dim": 384, "dtype": "float32"}
    return {"config": config, "backends": list(backends), "results": rows, "aims": []}


def train_step_section(*, against_fast: bool = True, judged: bool = True) -> dict:
    """Plain and MJP rows of two models; ``against_fast=False`` is the older format (overhead against plain timm
    only, as the first H200 run recorded it)."""
    rows = []
    for model, batch in (("deit_tiny_patch16_224", 32), ("deit_small_patch16_224", 8)):
        common = {"model": model, "batch": batch, "image_size": 224, "pairs": 5, "images_per_s": 1.0}
        common |= dict.fromkeys(TRAIN_STEP_FIELDS)
        rows.append(common | {"implementation": "plain", "prob": None, **_timing(1.0)})
        for prob, overhead in ((0.5, 0.4), (1.0, -1.2)):
            row = common | {"implementation": f"mjp prob={prob:g}", "prob": prob, "overhead_of_medians_pct": 1.0}
            row |= {"overhead_median_pct": overhead + 1, "overhead_p20_pct": overhead - 2, "overhead_p80_pct": 3.0}
            row |= {"overhead_ci95_low_pct": overhead, "overhead_ci95_high_pct": overhead + 2}
            if against_fast:
                row |= {"overhead_vs_fast_median_pct": overhead, "overhead_vs_fast_ci95_low_pct": overhead - 1}
                row |= {"overhead_vs_fast_ci95_high_pct": overhead + 1}
                row |= {"overhead_vs_fast_p20_pct": overhead - 2, "overhead_vs_fast_p80_pct": overhead + 2}
            rows.append(row | _timing(1.01))
    aims = [
        {
            "aim": f"DeiT-Tiny, batch 32, float32: MJP (prob {prob:g}) overhead at most 2%",
            "threshold": 2.0,
            "measured": 0.4 if judged else None,
            "unit": "%",
            "verdict": "PASS" if judged else "NOT RUN",
        }
        for prob in (0.5, 1.0)
    ]
    config = {"dtype": "float32", "autocast": False, "compile": False, "mjp_ratio": 0.1, "dal": "nonlinear"}
    config["image_size"] = 224
    return {"config": config, "backends": ["cpu"], "results": rows, "aims": aims}


def write_suite(folder: Path, name: str, device: dict, date: str, cases: dict[str, dict]) -> Path:
    payload = {"suite": "mjp_fast", "smoke": False, "date": date, "device": device, "cases": cases, "aims": []}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(payload))
    return path


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG header; fails unless the file starts as a PNG does."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def render_into(tmp_path: Path) -> tuple[str, Path]:
    """Renders ``tmp_path/results`` as ``tmp_path/docs/benchmarks.md`` through the command line; returns the page
    and the plots' folder."""
    out = tmp_path / "docs" / "benchmarks.md"
    assert render.main(["--results", str(tmp_path / "results"), "--out", str(out)]) == 0
    return out.read_text(encoding="utf-8"), out.parent / render.PLOTS_FOLDER


@pytest.fixture
def results(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    return folder


def test_each_case_gets_a_valid_png_linked_from_the_page(tmp_path, results):
    cases = {"sampler": sampler_section(), "patch_embed": patch_embed_section(), "train_step": train_step_section()}
    write_suite(results, "cpu-test-cpu-2000-01-02", CPU, "2000-01-02T00:00:00+00:00", cases)
    page, plots = render_into(tmp_path)

    names = sorted(path.name for path in plots.iterdir())
    assert names == sorted(f"cpu-test-cpu-{suffix}.png" for suffix in SUFFIXES.values())
    for name in names:
        width, height = png_size(plots / name)
        assert 400 <= width <= 1200 and 300 <= height <= 800, (name, width, height)  # dpi 100, a few inches
        assert 10_000 < (plots / name).stat().st_size < 120_000, name  # drawn, and small enough to commit
        assert f"](benchmarks/{name})" in page  # a relative link, from docs/ to docs/benchmarks/
    assert "## Plots: the newest run per device" in page
    assert "### cpu-test-cpu: Test CPU, 2 torch threads" in page
    assert "from `bench/results/cpu-test-cpu-2000-01-02.json` (2000-01-02)" in page
    # the plots sit between the summary and the runs
    assert page.index("## Plots") < page.index("## cpu-test-cpu-2000-01-02")


def test_a_case_no_run_holds_gets_no_plot_and_no_link(tmp_path, results):
    broken = {"error": "RuntimeError: boom", "config": {}, "backends": [], "results": [], "aims": []}
    cases = {"sampler": sampler_section(), "train_step": broken}  # no patch_embed at all; train_step raised
    write_suite(results, "cpu-test-cpu-2000-01-02-suite-sampler-train_step", CPU, "2000-01-02T00:00:00+00:00", cases)
    page, plots = render_into(tmp_path)

    assert [path.name for path in plots.iterdir()] == ["cpu-test-cpu-sampler.png"]
    assert "sampler.png)" in page
    assert "patch-embed.png" not in page and "train-step-overhead.png" not in page


def test_no_plottable_run_gives_no_plot_section(tmp_path, results):
    broken = {"error": "RuntimeError: boom", "config": {}, "backends": [], "results": [], "aims": []}
    write_suite(results, "cpu-test-cpu-2000-01-02", CPU, "2000-01-02T00:00:00+00:00", {"sampler": broken})
    page, plots = render_into(tmp_path)
    assert "## Plots" not in page
    assert not list(plots.glob("*.png"))


def test_two_devices_give_two_sets(tmp_path, results):
    cpu_cases = {"sampler": sampler_section(), "patch_embed": patch_embed_section(), "train_step": train_step_section()}
    gpu_cases = {
        "sampler": sampler_section(("torch", "triton", "cuda"), batches=(64, 256, 1024)),
        # several batch sizes, and the torch variant ~100x slower than the rest (a log axis)
        "patch_embed": patch_embed_section(("torch", "cuda", "triton"), batches=(32, 64, 256)),
        "train_step": train_step_section(against_fast=False, judged=False),  # the first H200 run's format
    }
    gpu_cases["patch_embed"]["results"][1]["median_s"] *= 100
    write_suite(results, "cpu-test-cpu-2000-01-02", CPU, "2000-01-02T00:00:00+00:00", cpu_cases)
    write_suite(results, "nvidia-h200-2000-01-01", GPU, "2000-01-01T00:00:00+00:00", gpu_cases)
    page, plots = render_into(tmp_path)

    names = {path.name for path in plots.iterdir()}
    for device in ("cpu-test-cpu", "nvidia-h200"):
        assert {f"{device}-{suffix}.png" for suffix in SUFFIXES.values()} <= names
        assert f"### {device}: " in page
    assert len(names) == 6
    for name in names:
        png_size(plots / name)
    # devices in a stable (sorted) order
    assert page.index("### cpu-test-cpu") < page.index("### nvidia-h200")


def test_the_newest_run_of_each_device_is_drawn_per_case(tmp_path, results):
    old_date, new_date = "2000-01-01T10:00:00+00:00", "2000-01-03T09:00:00+00:00"
    write_suite(
        results,
        "cpu-test-cpu-2000-01-01",
        CPU,
        old_date,
        {"sampler": sampler_section(), "train_step": train_step_section()},
    )
    write_suite(results, "cpu-test-cpu-2000-01-03-suite-sampler", CPU, new_date, {"sampler": sampler_section()})
    single = {"benchmark": "patch_embed", "smoke": False, "date": "2000-01-02T00:00:00+00:00", "device": CPU}
    (results / "cpu-test-cpu-2000-01-02-patch_embed.json").write_text(json.dumps(single | patch_embed_section()))
    # a newer smoke run is never drawn; a CPU run at one thread is a device of its own
    smoke = {
        "suite": "mjp_fast",
        "smoke": True,
        "date": "2000-01-09",
        "device": CPU,
        "cases": {"sampler": sampler_section()},
    }
    (results / "cpu-test-cpu-2000-01-09-smoke.json").write_text(json.dumps(smoke))
    write_suite(
        results,
        "cpu-test-cpu-2000-01-05-threads1",
        CPU | {"torch_threads": 1},
        "2000-01-05",
        {"sampler": sampler_section()},
    )

    chosen = render.newest_per_device(render.load_results(results))
    assert list(chosen) == ["cpu-test-cpu", "cpu-test-cpu-threads1"]
    sources = {case: path.name for case, (path, _) in chosen["cpu-test-cpu"].items()}
    assert sources == {
        "train_step": "cpu-test-cpu-2000-01-01.json",  # only the older run has it
        "sampler": "cpu-test-cpu-2000-01-03-suite-sampler.json",  # newest by the recorded date
        "patch_embed": "cpu-test-cpu-2000-01-02-patch_embed.json",  # a single-case run counts too
    }
    page, plots = render_into(tmp_path)
    assert "Jigsaw sampler: time per mask, from `bench/results/cpu-test-cpu-2000-01-03-suite-sampler.json`" in page
    assert "training-step overhead, from `bench/results/cpu-test-cpu-2000-01-01.json`" in page
    assert "### cpu-test-cpu-threads1: Test CPU, 1 torch thread\n" in page
    assert (plots / "cpu-test-cpu-threads1-sampler.png").exists()
    assert len(list(plots.glob("*.png"))) == 4


def test_rendering_again_gives_the_same_bytes_and_drops_stale_plots(tmp_path, results):
    cases = {"sampler": sampler_section(), "patch_embed": patch_embed_section(), "train_step": train_step_section()}
    write_suite(results, "cpu-test-cpu-2000-01-02", CPU, "2000-01-02T00:00:00+00:00", cases)
    page, plots = render_into(tmp_path)
    first = {path.name: path.read_bytes() for path in plots.iterdir()}
    assert all(b"Software" not in data and b"matplotlib" not in data for data in first.values())
    (plots / "gone-device-sampler.png").write_bytes(PNG_SIGNATURE)  # a device no longer in the results
    (plots / "notes.txt").write_text("not ours")

    assert render_into(tmp_path)[0] == page
    again = {path.name: path.read_bytes() for path in plots.iterdir()}
    assert again == first | {"notes.txt": b"not ours"}


def test_no_plots_writes_the_page_alone(tmp_path, results):
    write_suite(results, "cpu-test-cpu-2000-01-02", CPU, "2000-01-02T00:00:00+00:00", {"sampler": sampler_section()})
    out = tmp_path / "docs" / "benchmarks.md"
    assert render.main(["--results", str(results), "--out", str(out), "--no-plots"]) == 0
    assert "## Plots" not in out.read_text() and not (out.parent / render.PLOTS_FOLDER).exists()
    assert "## Plots" not in render.render(results)  # the library call draws only when asked


def test_an_aim_is_drawn_over_the_group_it_names():
    groups = [("deit_tiny_patch16_224", 256, "triton"), ("deit_small_patch16_224", 256, "triton")]
    aim = "on an H100/H200, DeiT-Small, batch 256, bfloat16: MJP (ratio 0.1, prob 0.5, DAL) overhead at most 0.25%"
    assert render._aim_group(aim, groups) == 1
    assert render._aim_group(aim.replace("DeiT-Small", "DeiT-Tiny"), groups) == 0
    assert render._aim_group("DeiT-Small, batch 8, float32", groups) is None  # not measured here: a full line
    # a run of two backends: the aim's text names its backend's group
    groups += [("deit_tiny_patch16_224", 256, "cuda"), ("deit_small_patch16_224", 256, "cuda")]
    assert render._aim_group(aim + " (backend cuda)", groups) == 3
    assert render._aim_group(aim + " (backend triton)", groups) == 1
    assert render._aim_group(aim, groups) is None


def test_a_run_of_two_backends_draws_a_group_per_backend(tmp_path, results):
    section = train_step_section()
    cuda_rows = [dict(row, backend="cuda") for row in section["results"]]
    section["results"] = [dict(row, backend="triton") for row in section["results"]] + cuda_rows
    section["backends"] = ["triton", "cuda"]
    section["aims"] = [
        dict(aim, aim=aim["aim"] + f" (backend {backend})") for aim in section["aims"] for backend in ("triton", "cuda")
    ]
    write_suite(
        results, "cpu-test-2000-01-01-suite-train_step", CPU, "2000-01-01T00:00:00+00:00", {"train_step": section}
    )
    page, plots = render_into(tmp_path)
    (png,) = plots.glob("*train-step-overhead*.png")
    width, _ = png_size(png)
    section["results"] = [
        row for row in section["results"] if row["backend"] == "triton"
    ]  # one backend: half the groups
    write_suite(
        results, "cpu-test-2000-01-01-suite-train_step", CPU, "2000-01-01T00:00:00+00:00", {"train_step": section}
    )
    render_into(tmp_path)
    assert png_size(png)[0] < width


def test_plot_device_names():
    assert render.plot_device(CPU) == "cpu-test-cpu"
    assert render.plot_device(CPU | {"torch_threads": 1}) == "cpu-test-cpu-threads1"
    assert render.plot_device(GPU) == "nvidia-h200"  # the host's threads do not matter on a GPU


def test_patch_embed_panels_widen_with_the_batch_sweep_and_turn_crowded_labels():
    assert render.patch_embed_layout(1, 5) == (render.PANEL_WIDTH, False)  # one batch: the plots recorded so far
    assert render.patch_embed_layout(2, 5) == (render.PANEL_WIDTH, False)  # the CPU sweep: labels still fit
    widths = [render.patch_embed_layout(batches, 7)[0] for batches in range(1, 9)]
    assert widths == sorted(widths) and widths[-1] == render.PANEL_WIDTH_MAX
    assert render.patch_embed_layout(5, 7) == (render.PANEL_WIDTH_MAX, True)  # a GPU sweep with sampling variants


def test_a_patch_embed_sweep_marks_the_batch_its_aim_judged(tmp_path, results):
    one = patch_embed_section(("torch", "cuda", "triton"))
    sweep = patch_embed_section(("torch", "cuda", "triton"), batches=(32, 64, 128, 256, 512))
    sweep["results"] += [
        row | {"implementation": f"{row['implementation']} + sampling", "median_s": 1.3 * row["median_s"]}
        for row in sweep["results"]
        if row["mode"] == "forward+backward" and row["backend"]
    ]
    aim = {"aim": "cpu backend forward+backward at most 1.10x the timm baseline, batch 64", "threshold": 1.1}
    sweep["aims"] = [aim | {"measured": 0.9, "unit": "x", "verdict": "PASS", "batch": 64}]
    modes = ["forward", "forward+backward"]
    assert render._judged_batches(sweep, "forward+backward", modes) == {64}
    assert render._judged_batches(sweep, "forward", modes) == set()  # "forward" is not a word of "forward+backward"
    assert render._judged_batches(one, "forward+backward", modes) == set()  # recorded aims name no batch
    not_run = sweep | {"aims": [sweep["aims"][0] | {"verdict": "NOT RUN", "measured": None}]}
    assert render._judged_batches(not_run, "forward+backward", modes) == set()

    write_suite(results, "nvidia-h200-2000-01-01", GPU, "2000-01-01T00:00:00+00:00", {"patch_embed": one})
    write_suite(results, "cpu-test-cpu-2000-01-01", CPU, "2000-01-01T00:00:00+00:00", {"patch_embed": sweep})
    _, plots = render_into(tmp_path)
    one_width, one_height = png_size(plots / "nvidia-h200-patch-embed.png")
    sweep_width, sweep_height = png_size(plots / "cpu-test-cpu-patch-embed.png")
    assert one_width < sweep_width <= 1400 and one_height <= sweep_height <= 800


def _with_aim(section: dict, verdict: str, measured: float) -> dict:
    aim = {"aim": f"sampler aim judged {verdict}", "threshold": 50.0, "measured": measured, "unit": "x"}
    return section | {"aims": [aim | {"verdict": verdict}]}


def test_the_page_shows_the_newest_run_of_each_case_per_device_and_the_history_the_rest(tmp_path, results):
    # cpu-test-cpu: an old suite (a sampler FAIL, the only train_step), the sampler measured again (PASS), an
    # older single-case sampler run (superseded whole), a newer suite whose sampler raised; a 1-thread run and a
    # GPU run, older than all of them, each a device of its own.
    write_suite(
        results,
        "cpu-test-cpu-2000-01-02",
        CPU,
        "2000-01-02T00:00:00+00:00",
        {"sampler": _with_aim(sampler_section(), "FAIL", 20.0), "train_step": train_step_section()},
    )
    write_suite(
        results,
        "cpu-test-cpu-2000-01-03-suite-sampler",
        CPU,
        "2000-01-03T00:00:00+00:00",
        {"sampler": _with_aim(sampler_section(), "PASS", 60.0)},
    )
    single = {"benchmark": "sampler", "smoke": False, "date": "2000-01-01T00:00:00+00:00", "device": CPU}
    single |= _with_aim(sampler_section(), "FAIL", 10.0)
    (results / "cpu-test-cpu-2000-01-01-sampler.json").write_text(json.dumps(single))
    broken = {"error": "RuntimeError: boom", "config": {}, "backends": [], "results": [], "aims": []}
    write_suite(results, "cpu-test-cpu-2000-01-04-suite-sampler", CPU, "2000-01-04T00:00:00+00:00", {"sampler": broken})
    write_suite(
        results,
        "cpu-test-cpu-2000-01-01-threads1",
        CPU | {"torch_threads": 1},
        "2000-01-01T00:00:00+00:00",
        {"sampler": _with_aim(sampler_section(), "FAIL", 30.0)},
    )
    write_suite(results, "nvidia-h200-2000-01-01", GPU, "2000-01-01T00:00:00+00:00", {"sampler": sampler_section()})

    runs = render.load_results(results)
    assert render.shown_cases(runs) == {
        "cpu-test-cpu-2000-01-03-suite-sampler.json": ["sampler"],  # the newest sampler that ran
        "cpu-test-cpu-2000-01-02.json": ["train_step"],  # its sampler was measured again
        "cpu-test-cpu-2000-01-01-threads1.json": ["sampler"],
        "nvidia-h200-2000-01-01.json": ["sampler"],
    }
    newest = render.newest_per_case(runs)
    assert list(newest) == [
        ("cpu-test-cpu", "sampler"),
        ("cpu-test-cpu", "train_step"),
        ("cpu-test-cpu-threads1", "sampler"),
        ("nvidia-h200", "sampler"),
    ]

    out = tmp_path / "docs" / "benchmarks.md"
    assert render.main(["--results", str(results), "--out", str(out), "--no-plots"]) == 0
    page, history = out.read_text(), (out.parent / "benchmarks-history.md").read_text()
    shown = ["cpu-test-cpu-2000-01-03-suite-sampler", "cpu-test-cpu-2000-01-02", "cpu-test-cpu-2000-01-01-threads1"]
    for stem in [*shown, "nvidia-h200-2000-01-01"]:
        assert f"## {stem}\n" in page
    for stem in ("cpu-test-cpu-2000-01-01-sampler", "cpu-test-cpu-2000-01-04-suite-sampler"):
        assert f"## {stem}\n" not in page and f"## {stem}\n" in history

    # the superseded FAILs are in the history alone; the 1-thread one is that device's newest
    assert "judged PASS: 60.00x" in page and "judged FAIL: 30.00x" in page
    assert "20.00x" not in page and "10.00x" not in page
    assert "judged FAIL: 20.00x" in history and "judged FAIL: 10.00x" in history
    summary = page[page.index("## Summary") : page.index("## cpu-test-cpu-2000-01-03-suite-sampler")]
    assert summary.count("sampler aim judged") == 2  # cpu-test-cpu and its 1-thread run; the GPU's has none
    # a run shown in part says what it leaves out and where it is in full
    assert (
        "- left out here, measured again in a newer run: jigsaw sampler (this run in full: "
        "[benchmarks-history](benchmarks-history.md#cpu-test-cpu-2000-01-02))" in page
    )
    assert "the 3 runs it does not show in full" in page
    assert "[benchmarks-history](benchmarks-history.md)" in page
    old = history[history.index("## cpu-test-cpu-2000-01-02\n") :]
    assert "- superseded by `bench/results/cpu-test-cpu-2000-01-03-suite-sampler.json`: jigsaw sampler" in old
    assert "- still the newest, shown on [benchmarks](benchmarks.md): training step" in old
    assert history.index("## cpu-test-cpu-2000-01-04") < history.index("## cpu-test-cpu-2000-01-02")  # newest first
    failed = history[history.index("## cpu-test-cpu-2000-01-04") : history.index("## cpu-test-cpu-2000-01-02")]
    newest_sampler = "`bench/results/cpu-test-cpu-2000-01-03-suite-sampler.json`"
    assert f"- did not run (an error), the page shows {newest_sampler} instead: jigsaw sampler" in failed


def test_a_history_with_nothing_superseded_says_so(tmp_path, results):
    write_suite(results, "cpu-test-cpu-2000-01-02", CPU, "2000-01-02T00:00:00+00:00", {"sampler": sampler_section()})
    out = tmp_path / "docs" / "benchmarks.md"
    history = tmp_path / "elsewhere" / "old.md"
    assert render.main(["--results", str(results), "--out", str(out), "--no-plots", "--history", str(history)]) == 0
    assert "No earlier runs." in history.read_text() and "](../docs/benchmarks.md)" in history.read_text()
    assert "does not show in full" not in out.read_text()


def test_device_check_logs_are_linked_from_the_page(tmp_path):
    # A GPU check whose JSON was lost is kept as its printed output: the page links it, relative to where it lives.
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "nvidia-h100-2026-11-26-device-check.md").write_text("# Device check on an H100\n\ntables\n")
    (results / "notes.md").write_text("# not a device check\n")
    page = render.render(results, page_dir=tmp_path / "docs")
    assert "## GPU checks kept as logs" in page
    assert "- [Device check on an H100](../bench/results/nvidia-h100-2026-11-26-device-check.md)" in page
    assert "not a device check" not in page
    assert "GPU checks kept as logs" not in render.render(tmp_path / "empty-results")


def _with_linear_and_steady(patch_embed: dict, train_step: dict) -> tuple[dict, dict]:
    """The two sections as runs since the linear baselines and the steady state record them: a ``linear`` row per
    mode and batch and a ``ratio_vs_linear`` on every row; a ``plain + linear embed`` row per model, the overheads
    against it, the steady-state figures, and a GPU aim judged on the steady state."""
    rows = []
    for row in patch_embed["results"]:
        if row["implementation"] == "timm":
            linear = 0.5 * row["median_s"]
            rows += [row, {**row, "implementation": "linear", **_timing(linear), "ratio_vs_timm": 0.5}]
        else:
            rows.append(row)
    for row in rows:
        timm = next(
            r for r in rows if (r["mode"], r["batch"], r["implementation"]) == (row["mode"], row["batch"], "timm")
        )
        row["ratio_vs_linear"] = row["median_s"] / (0.5 * timm["median_s"])
    patch_embed = {**patch_embed, "results": rows}
    rows = []
    for row in train_step["results"]:
        steady = {"steady_blocks": 2, "steady_steps": 3, "steady_images_per_s": 30.0}
        steady |= {"steady_images_per_s_blocks": [29.0, 31.0], "steady_overhead_median_pct": None}
        steady |= {"steady_overhead_vs_fast_median_pct": None, "steady_overhead_vs_linear_median_pct": None}
        if row["prob"] is None:
            rows += [row | steady, row | steady | {"implementation": "plain + linear embed", "prob": "linear"}]
            rows[-1] |= {"overhead_median_pct": 3.0, "overhead_p20_pct": 2.0, "overhead_p80_pct": 4.0}
            rows[-1] |= {"steady_overhead_median_pct": 2.5, "overhead_of_medians_pct": 3.0}
        else:
            rows.append(row | steady | {"steady_overhead_median_pct": 1.0, "steady_overhead_vs_fast_median_pct": 0.125})
            rows[-1] |= {"steady_overhead_vs_linear_median_pct": -7.5, "overhead_vs_linear_median_pct": -6.0}
            rows[-1] |= {"overhead_vs_linear_p20_pct": -8.0, "overhead_vs_linear_p80_pct": -4.0}
    steady_aim = {
        "aim": "on an H100/H200, DeiT-Small, batch 8, bfloat16: MJP (ratio 0.1, prob 0.5, DAL) training-step overhead "
        "in the steady state (steps back to back) at most 0.25% against plain timm with the same fast patch embedding",
        "threshold": 0.25,
        "measured": 0.125,
        "unit": "%",
        "verdict": "PASS",
    }
    return patch_embed, {**train_step, "results": rows, "aims": train_step["aims"] + [steady_aim]}


def test_the_linear_baselines_and_the_steady_state_render_and_older_runs_as_before(tmp_path, results):
    old = {"patch_embed": patch_embed_section(), "train_step": train_step_section()}
    write_suite(results, "cpu-test-cpu-2000-01-01", CPU, "2000-01-01T00:00:00+00:00", old)
    runs = render.render(results).split("## cpu-test-cpu-2000-01-01")[1]  # the run, below the introduction
    assert "vs linear" not in runs and "linear embed" not in runs and "Steady state" not in runs  # no empty columns
    assert "| vs timm | images/s |" in runs

    patch_embed, train_step = _with_linear_and_steady(patch_embed_section(), train_step_section())
    new = {"patch_embed": patch_embed, "train_step": train_step}
    write_suite(results, "nvidia-h200-2000-01-02", GPU, "2000-01-02T00:00:00+00:00", new)
    page, plots = render_into(tmp_path)
    new_run = page[page.index("## nvidia-h200-2000-01-02") :]
    assert "| vs timm | vs linear | images/s |" in new_run and "| linear " in new_run
    assert "overhead vs linear embed: median [p20, p80]" in new_run and "-6.00% [-8.00%, -4.00%]" in new_run
    assert "| plain + linear embed" in new_run and "steady images/s: median [min, max]" in new_run
    assert "30.0 [29.0, 31.0]" in new_run and "+0.12%" in new_run and "-7.50%" in new_run
    assert "in the steady state (steps back to back) at most 0.25%" in page.split("## Plots")[0]  # in the summary
    old_run = page[page.index("## cpu-test-cpu-2000-01-01") :]
    assert "vs linear" not in old_run and "Steady state" not in old_run
    for name in ("nvidia-h200-patch-embed.png", "nvidia-h200-train-step-overhead.png"):
        assert png_size(plots / name)[0] > 0
