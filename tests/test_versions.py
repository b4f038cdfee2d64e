"""The supported torch range: declared once, refused clearly below it."""

import re
import subprocess
import sys

import pytest

from mjp_fast._versions import TORCH_MINIMUM, TORCH_REQUIREMENT, check_torch


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.14.1+cu130", "2.15.0.dev20261101", "2.20.0"])
def test_supported_versions_pass(version):
    check_torch(version)


@pytest.mark.parametrize("version", ["2.4.1", "2.10.0+cu128", "2.9.0a0", "1.13.1", "3.0.0"])
def test_unsupported_versions_are_refused_by_name(version):
    with pytest.raises(ImportError, match=re.escape(f"torch {version} is installed")) as error:
        check_torch(version)
    assert "torch >=2.11" in str(error.value)


def test_the_metadata_declares_the_same_floor():
    floor = re.search(r"torch>=(\d+)\.(\d+)", TORCH_REQUIREMENT)
    assert (int(floor[1]), int(floor[2])) == TORCH_MINIMUM
    setup_text = open("setup.py").read()
    assert "TORCH_REQUIREMENT" in setup_text and '"torch>=' not in setup_text  # one source


def test_importing_with_an_old_torch_raises_one_clear_error():
    code = "import torch; torch.__version__ = '2.8.0+cu126'; import mjp_fast"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError: mjp_fast needs torch >=2.11,<3 but torch 2.8.0+cu126 is installed")
