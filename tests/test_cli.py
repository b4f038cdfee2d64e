"""The ``mjp`` command: ``mjp demo`` writes the picture it promises, bad arguments fail clearly, ``mjp backends``."""

import argparse
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import mjp_fast
from mjp_fast.cli import main
from mjp_fast.demo import GAP, OUTLINE_COLOR, demo_canvas_size, load_picture

SMALL = ["--size", "64", "--patch-size", "8"]
REPO_ROOT = Path(__file__).resolve().parent.parent
CPU_BACKENDS = [name for name in mjp_fast.available_backends() if name in ("torch", "cpu")]


def _demo(tmp_path: Path, *extra: str, name: str = "demo.png") -> tuple[int, Path]:
    out = tmp_path / name
    return main(["demo", *SMALL, "--out", str(out), *extra]), out


def _panel(picture: np.ndarray, index: int, size: int = 64) -> np.ndarray:
    x0 = GAP + index * (size + GAP)
    return picture[GAP : GAP + size, x0 : x0 + size]


def test_demo_writes_a_png_of_the_expected_size(tmp_path, capsys):
    status, out = _demo(tmp_path, "--ratios", "0.1", "0.5")
    assert status == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(out) as image:
        image.verify()
    with Image.open(out) as image:
        assert image.format == "PNG" and image.mode == "RGB"
        assert image.size == demo_canvas_size(64, 2)
        picture = np.asarray(image)
    assert [path.name for path in tmp_path.iterdir()] == ["demo.png"]  # no temporary file left behind
    printed = capsys.readouterr().out
    assert str(out) in printed
    assert "ratio 0.1:" in printed and "ratio 0.5:" in printed

    # The first panel is the photo itself, unmarked; the jigsawed panels outline their masked patches.
    np.testing.assert_array_equal(_panel(picture, 0), load_picture("astronaut", 64))
    outlined = [int((_panel(picture, index) == OUTLINE_COLOR).all(-1).sum()) for index in range(3)]
    assert outlined[0] == 0 and outlined[1] > 0 and outlined[2] > outlined[1]


def test_demo_is_deterministic_and_the_same_on_every_backend(tmp_path):
    pictures = []
    for index, backend in enumerate([*CPU_BACKENDS, "torch"]):
        status, out = _demo(tmp_path, "--seed", "3", "--backend", backend, name=f"{index}.png")
        assert status == 0
        with Image.open(out) as image:
            pictures.append(np.asarray(image))
    for picture in pictures[1:]:
        np.testing.assert_array_equal(picture, pictures[0])


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize("umask, expected", [(0o022, 0o644), (0o077, 0o600)])
def test_demo_png_gets_the_mode_of_a_plain_write(tmp_path, umask, expected):
    previous = os.umask(umask)
    try:
        status, out = _demo(tmp_path, "--ratios", "0.5")
    finally:
        os.umask(previous)
    assert status == 0
    assert stat.S_IMODE(out.stat().st_mode) == expected


def test_demo_reads_an_image_file(tmp_path):
    source = tmp_path / "photo.jpg"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (50, 90, 3), dtype=np.uint8)).save(source)
    status, out = _demo(tmp_path, "--image", str(source), "--ratios", "0.3")
    assert status == 0
    with Image.open(out) as image:
        assert image.size == demo_canvas_size(64, 1)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--size", "60"], "multiple of patch_size"),
        (["--image", "no/such/photo.png"], "is neither"),
        (["--ratios", "1.5"], "ratio must be in [0, 1]"),
        (["--ratios", "half"], "ratio must be a number"),
        (["--patch-size", "0"], "positive integer"),
        (["--seed", "-1"], "seed must be an integer"),
        (["--backend", "gpu"], "invalid choice"),
    ],
)
def test_demo_refuses_bad_arguments(tmp_path, capsys, arguments, message):
    status, out = _demo(tmp_path, *arguments)
    assert status == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_demo_refuses_an_unreadable_image_and_a_non_png_output(tmp_path, capsys):
    broken = tmp_path / "broken.png"
    broken.write_text("not a picture")
    status, _ = _demo(tmp_path, "--image", str(broken))
    assert status == 2
    assert "cannot read" in capsys.readouterr().err

    status = main(["demo", *SMALL, "--out", str(tmp_path / "demo.jpg")])
    assert status == 2
    assert "must be a .png" in capsys.readouterr().err


def test_backends_command(capsys):
    assert main(["backends"]) == 0
    printed = capsys.readouterr().out
    assert "available backends: " + ", ".join(mjp_fast.available_backends()) in printed
    assert "compiled extension mjp_fast._C: " in printed


def test_help_and_missing_command(capsys):
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["demo", "--help"]) == 0
    assert "--ratios" in capsys.readouterr().out
    assert main([]) == 2
    assert "required" in capsys.readouterr().err


def test_python_dash_m_runs_the_command():
    result = subprocess.run(
        [sys.executable, "-m", "mjp_fast.cli", "demo", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "usage: mjp demo" in result.stdout


def test_demo_png_and_its_earlier_name_out_write_the_same_picture(tmp_path):
    status_png = main(["demo", *SMALL, "--ratios", "0.5", "--png", str(tmp_path / "a.png")])
    status_out = main(["demo", *SMALL, "--ratios", "0.5", "--out", str(tmp_path / "b.png")])
    assert status_png == status_out == 0
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


@pytest.mark.parametrize(
    "arguments, dest",
    [
        (["demo", "--png", "x.png"], "png"),
        (["demo", "--out", "x.png"], "png"),
        (["attack", "--png", "x.png"], "png"),
        (["attack", "--grid", "x.png"], "png"),
        (["bench", "--output", "x"], "out"),  # bench/run.py's name for it
        (["bench", "--out", "x"], "out"),
    ],
)
def test_earlier_option_names_are_aliases_of_the_shared_ones(arguments, dest):
    from mjp_fast.cli import build_parser

    assert getattr(build_parser().parse_args(arguments), dest) == arguments[-1]


# The shared meaning of each output option: one name, whichever subcommand takes it.
OUTPUT_OPTION_NAMES = {"--output": "DIR", "--json": "PATH", "--png": "PATH"}


def _subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    from mjp_fast.cli import build_parser

    (commands,) = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(commands.choices)


def test_every_subcommand_names_its_outputs_alike():
    """``--output DIR`` a folder, ``--json PATH`` a JSON file, ``--png PATH`` a picture, in every subcommand; the
    earlier names (``--out``, ``--grid``) are only ever second spellings of these."""
    seen = set()
    for name, parser in _subcommand_parsers().items():
        for action in parser._actions:
            strings = action.option_strings
            if any(option in strings for option in ("--out", "--grid")):
                assert strings[0] in OUTPUT_OPTION_NAMES, f"mjp {name} {strings}"
            if strings and strings[0] in OUTPUT_OPTION_NAMES:
                assert action.metavar in (OUTPUT_OPTION_NAMES[strings[0]], None), f"mjp {name} {strings}"
                seen.add((name, strings[0]))
    expected = {("train", "--output"), ("eval", "--output"), ("attack", "--output"), ("reproduce", "--output")}
    expected |= {
        ("bench", "--output"),
        ("eval", "--json"),
        ("attack", "--json"),
        ("demo", "--png"),
        ("attack", "--png"),
    }
    assert expected <= seen


REQUIRED = {"eval": ["--checkpoint", "x.pt"], "reproduce": ["--preset", "smoke", "--data", "x"]}


@pytest.mark.parametrize("command", ["demo", "backends", "bench", "attack", "train", "eval", "reproduce"])
def test_an_unknown_option_shows_the_subcommands_usage(command, capsys):
    """argparse would hand a subcommand's unknown option to the top-level parser, which showed ``mjp``'s usage."""
    status = main([command, *REQUIRED.get(command, []), "--no-such-option"])
    assert status == 2
    error = capsys.readouterr().err
    assert error.startswith(f"usage: mjp {command} ")
    assert f"mjp {command}: error: unrecognized arguments: --no-such-option" in error
    assert "COMMAND" not in error  # not the top-level usage


def test_a_subcommands_usage_on_errors_from_a_fresh_process():
    result = subprocess.run(
        [sys.executable, "-m", "mjp_fast.cli", "attack", "--no-such-option", "x.png"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("usage: mjp attack ") and "--png PATH" in result.stderr


@pytest.mark.parametrize(
    "arguments",
    [["attack", "--out", "x.png"], ["eval", "--checkpoint", "x.pt", "--out", "folder"], ["demo", "--rat", "0.5"]],
)
def test_options_are_taken_by_their_whole_names_only(arguments, capsys):
    """No prefix matching: ``--out`` is demo's and bench's earlier name, so in attack it must not become --output."""
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"usage: mjp {arguments[0]} ") and "unrecognized arguments: " in error
