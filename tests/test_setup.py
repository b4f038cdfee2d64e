"""setup.py's build of the extension: where an editable install compiles (a reinstall must not compile again)."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import pytest
import setuptools
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def setup_script(monkeypatch):
    """setup.py's ``setup()`` keywords, read without building or installing anything (the variables it sets in
    the environment, such as TORCH_CUDA_ARCH_LIST, are undone after the test)."""
    environment = dict(os.environ)
    captured: dict = {}
    monkeypatch.delenv("MJP_FAST_SKIP_EXTENSION", raising=False)
    monkeypatch.setattr(setuptools, "setup", lambda **keywords: captured.update(keywords))
    monkeypatch.chdir(ROOT)
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
        if not captured.get("cmdclass"):
            pytest.skip("setup.py builds no extension here (torch not importable)")
        yield captured
    finally:
        os.environ.clear()
        os.environ.update(environment)


def _build_ext(keywords: dict, *, editable: bool):
    distribution = Distribution({"name": "mjp_fast", "ext_modules": keywords["ext_modules"]})
    command = keywords["cmdclass"]["build_ext"](distribution)
    command.initialize_options()
    command.editable_mode = editable
    command.finalize_options()
    return command


def test_an_editable_build_compiles_in_one_folder_of_the_checkout(setup_script):
    """pip gives an editable build a new temporary folder each time; setup.py puts the objects in build/ instead,
    the same folder every time, so ninja recompiles only what changed."""
    first = _build_ext(setup_script, editable=True)
    second = _build_ext(setup_script, editable=True)
    assert Path(first.build_temp).parent == ROOT / "build"
    assert Path(first.build_temp).name.startswith("editable-")
    assert first.build_temp == second.build_temp


def test_a_regular_build_keeps_setuptools_folder(setup_script):
    command = _build_ext(setup_script, editable=False)
    assert not Path(command.build_temp).name.startswith("editable-")
