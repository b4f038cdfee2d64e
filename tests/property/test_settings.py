"""The profiles that README promises: ``ci`` by default (20 deterministic examples a test), ``fuzz`` on request."""

import subprocess
import sys

from hypothesis import settings

from tests.harness.isolated import ROOT, child_environment
from tests.property.settings import CI_EXAMPLES


def test_ci_is_the_default_profile_small_and_deterministic():
    ci = settings.get_profile("ci")
    assert ci.max_examples == CI_EXAMPLES == 20 and ci.derandomize and ci.deadline is None


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
