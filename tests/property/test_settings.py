"""The profiles that README promises: ``ci`` by default (20 deterministic examples a test), ``fuzz`` on request."""

import subprocess
import sys

import pytest
from hypothesis import settings

from tests.harness.isolated import ROOT, child_environment
from tests.property.settings import CI_EXAMPLES


def test_ci_is_the_default_profile_small_and_deterministic():
    ci = settings.get_profile("ci")
    assert ci.max_examples == CI_EXAMPLES == 20 and ci.derandomize and ci.deadline is None


@pytest.mark.slow
def test_the_fuzz_profile_is_chosen_on_the_command_line_with_its_budget(tmp_path):
    # The README's command: --hypothesis-profile fuzz, 1,000 random examples (MJP_FAST_FUZZ_EXAMPLES changes it).
    # The probe lives outside tests/, so the test set-up that registers the profiles is loaded as a plugin.
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "from hypothesis import settings\n\n\n"
        "def test_probe():\n"
        "    print('profile', settings.default.max_examples, settings.default.derandomize)\n"
    )
    for extra, expected in (({}, "profile 1000 False"), ({"MJP_FAST_FUZZ_EXAMPLES": "7"}, "profile 7 False")):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "no:xdist",
             "-p", "tests.conftest", str(probe), "--hypothesis-profile", "fuzz"],
            cwd=ROOT, env={**child_environment(), **extra}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert expected in done.stdout, done.stdout


def test_the_suite_collects_without_hypothesis(tmp_path):
    # The lent GPU machine's image has no hypothesis and cannot install it (bench/simulate_gpu_image.sh found the
    # whole GPU test stage failing at collection): there the property tests are left out, every other test runs.
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n\n\n"
        "class NoHypothesis:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'hypothesis':\n"
        "            raise ImportError('no hypothesis here')\n\n\n"
        "sys.meta_path.insert(0, NoHypothesis())\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-p", "no:hypothesispytest", "tests/property", "tests/test_versions.py"],
        cwd=ROOT, env={**child_environment(), "PYTHONPATH": f"{tmp_path}:{ROOT}"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tests/property" not in done.stdout and "test_versions.py" in done.stdout, done.stdout
