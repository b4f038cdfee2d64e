"""Triton kernels of the MJP operations (GPU; on the CPU through ``TRITON_INTERPRET=1``).

One module per operation (``patch_embed``, ``pos_embed``, ``dal_loss``); what they share (the interpreter switch,
launches and operators, tile settings, row-layout checks, the position gradient) is in ``common``, the one module
they import from. :func:`interpreting`, :func:`launcher`, :func:`operator`, :func:`define_operator`, the host
arithmetic (:func:`cdiv`, :func:`next_power_of_2`) and :func:`warp_count` are re-exported here for kernels outside
this package (the sampler's).
"""

from __future__ import annotations

from mjp_fast.triton.common import (
    cdiv,
    define_operator,
    interpreting,
    launcher,
    next_power_of_2,
    operator,
    warp_count,
)

__all__ = ["cdiv", "define_operator", "interpreting", "launcher", "next_power_of_2", "operator", "warp_count"]
