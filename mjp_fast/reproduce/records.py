"""The records of ``mjp reproduce`` as JSON: values made JSON-ready, records read and written, and each test image's
top-1 hit packed into a string. Below both the runs (:mod:`mjp_fast.reproduce.run`), which write them, and the
report (:mod:`mjp_fast.reproduce.report`), which reads them."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from mjp_fast._atomic import write_atomically


def json_ready(value: Any) -> Any:
    """JSON-ready: NaN/inf -> None, tuples -> lists, NumPy scalars -> Python numbers, paths -> strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (np.floating, np.integer)):
        return json_ready(value.item())
    if isinstance(value, dict):
        return {str(key): json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON record at ``path``; None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(data: Any, path: Path) -> None:
    """Writes ``data`` (made :func:`json_ready`) to ``path`` atomically, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with write_atomically(path, text=True) as file:
        file.write(json.dumps(json_ready(data), indent=1, allow_nan=False) + "\n")


def pack_hits(hits: np.ndarray) -> str:
    """bool ``[n]`` -> base64 of the packed bits (a 10,000-image test set in 1,668 characters)."""
    return base64.b64encode(np.packbits(hits.astype(bool)).tobytes()).decode("ascii")


def unpack_hits(text: str, count: int) -> np.ndarray:
    """The inverse of :func:`pack_hits`."""
    return np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8))[:count].astype(bool)
