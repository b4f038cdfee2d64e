"""Hypothesis profiles of the property tests (tests/property).

``ci`` is the default: a small, fixed number of examples per test, drawn deterministically (``derandomize``), so a
CI run is repeatable and its time bounded. ``fuzz`` is the larger campaign, run on purpose:

    python -m pytest tests/property --hypothesis-profile fuzz          # 1,000 random examples per test
    MJP_FAST_FUZZ_EXAMPLES=5000 python -m pytest tests/property --hypothesis-profile fuzz

Registered from ``tests/conftest.py``, because Hypothesis loads the profile named by ``--hypothesis-profile``
when pytest configures itself, before the conftest files below ``tests/`` are read.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

CI_EXAMPLES = 20


def register_profiles() -> None:
    """Registers ``ci`` and ``fuzz`` and loads ``ci`` (``--hypothesis-profile`` overrides it afterwards)."""
    # Kernels in the Triton interpreter take seconds on a first call: no deadline, and no health check that
    # judges a slow data generation (the draws are cheap; the calls are not).
    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
    settings.register_profile("ci", max_examples=CI_EXAMPLES, derandomize=True, **common)
    settings.register_profile(
        "fuzz", max_examples=int(os.environ.get("MJP_FAST_FUZZ_EXAMPLES", "1000")), derandomize=False, **common
    )
    settings.load_profile("ci")
