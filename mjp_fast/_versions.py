"""The torch versions mjp_fast supports, and the check that refuses an older one at import with a clear message.

One source for both: ``setup.py`` reads ``TORCH_REQUIREMENT`` from this file (without importing torch), and
``mjp_fast/__init__.py`` calls :func:`check_torch` before anything else touches torch's newer APIs.

The floor is the oldest torch this package is tested on: 2.11 (the GPU machines' image: torch 2.11, triton 3.6).
Older ones lack or change APIs used here (``torch.library.triton_op`` and ``wrap_triton``, the custom-operator
autograd registration, ``torch.compiler.set_stance``); the first failure would be deep inside an operator.
"""

from __future__ import annotations

TORCH_MINIMUM = (2, 11)
TORCH_REQUIREMENT = "torch>=2.11,<3"


def _release(version: str) -> tuple[int, int]:
    """``"2.14.1+cu130"`` -> ``(2, 14)``; pre-release and local parts ignored."""
    parts = version.split("+")[0].split(".")
    numbers = []
    for part in parts[:2]:
        digits = "".join(character for character in part if character.isdigit()) or "0"
        numbers.append(int(digits))
    while len(numbers) < 2:
        numbers.append(0)
    return numbers[0], numbers[1]


def check_torch(version: str | None = None) -> None:
    """Raises ImportError naming the installed and the required torch when ``version`` (default: torch's) is older
    than :data:`TORCH_MINIMUM` or from another major version."""
    if version is None:
        import torch

        version = torch.__version__
    release = _release(str(version))
    if release < TORCH_MINIMUM or release[0] != TORCH_MINIMUM[0]:
        raise ImportError(
            f"mjp_fast needs {TORCH_REQUIREMENT.replace('torch', 'torch ')} but torch {version} is installed; "
            f"install a supported one, e.g. `pip install 'torch>={TORCH_MINIMUM[0]}.{TORCH_MINIMUM[1]}'`, "
            "then reinstall mjp_fast (`pip install --no-build-isolation .`) so its extension is built against it"
        )
