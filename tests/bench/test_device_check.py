"""bench/device_check.sh: one call of the device tool must fit its 10-minute limit and the 15-minute session."""

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "device_check.sh"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_one_deadline_inside_one_call():
    text = SCRIPT.read_text()
    deadline = int(re.search(r"DEADLINE_S:-(\d+)", text)[1])
    assert deadline <= 570  # a run(timeout_s=600) call, with room to copy $OUT back
    # every stage asks the shared deadline for its time: none can overrun it by its own limit
    assert all(f"$(budget {limit})" in text for limit in (90, 150, 200, 600))
    assert "steps)" not in text  # no second call planned


def test_the_gpu_tests_it_runs_exist():
    text = SCRIPT.read_text()
    for path in re.findall(r"tests/[\w/]+(?:\.py)?", text):  # files and folders
        assert (SCRIPT.parents[1] / path).exists(), path
