"""Runs code that may kill its process (a segfault, an abort, a floating-point trap) in a child process, so that a
crash fails one test instead of the whole test worker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Isolated:
    """What a child process did: ``returncode`` is negative when a signal ended it (``-11`` SIGSEGV, ``-8``
    SIGFPE, ``-6`` SIGABRT), as ``subprocess`` reports it."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def crashed(self) -> bool:
        return self.returncode < 0

    def explain(self) -> str:
        out, err = self.stdout[-4000:], self.stderr[-4000:]
        return f"exit code {self.returncode}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"


def child_environment() -> dict[str, str]:
    """The test process's environment for a child: the same Triton interpreter setting (conftest sets it before
    the package is imported), offline hub, and the repository first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.pop("MJP_FAST_BACKEND", None)
    return env


def run_isolated(source: str, *, timeout: float = 600.0, env: dict[str, str] | None = None) -> Isolated:
    """Runs ``source`` (dedented) with ``python -c`` in the repository root and returns what happened. ``env``:
    variables set in the child besides the test process's."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        cwd=ROOT,
        env={**child_environment(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Isolated(done.returncode, done.stdout, done.stderr)


def run_pytest_isolated(*args: str, timeout: float = 900.0, env: dict[str, str] | None = None) -> Isolated:
    """Runs ``python -m pytest -q -p no:cacheprovider ARGS`` in a child process (one process for a whole module of
    property tests, so the start-up is paid once) and returns what happened; a crash in any test ends the child
    with a signal, which the caller reports. ``env``: variables set in the child besides the test process's."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
        cwd=ROOT,
        env={**child_environment(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Isolated(done.returncode, done.stdout, done.stderr)
