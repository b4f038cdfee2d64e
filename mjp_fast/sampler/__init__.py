"""The jigsaw sampler: block-wise masks and permutations, one per sample (docs/design.md section 3,
docs/sampler.md).

One file per part, in the order a jigsaw is made:

- ``jigsaw.py``: the ``Jigsaw(mask, perm)`` type every operation consumes, and its check;
- ``reference.py``: docs/sampler.md in plain PyTorch: constants, Philox, the integer tables, the oracle;
- ``triton_kernel.py``: the Triton kernel (the compiled ones are ``csrc/sampler.h``, ``sampler_cpu.cpp`` and
  ``sampler_cuda.cu``);
- ``dispatch.py``: the public ``sample_jigsaw`` (and ``sample_jigsaw_ref``, the same on the oracle), the plan
  that runs one kernel per call, and the kernels' ``torch.library`` operators;
- ``module.py``: ``JigsawSampler``, the per-step stream that the modules own.
"""

from mjp_fast.sampler.dispatch import sample_jigsaw, sample_jigsaw_ref
from mjp_fast.sampler.jigsaw import Jigsaw, check_jigsaw
from mjp_fast.sampler.module import JigsawSampler

__all__ = ["Jigsaw", "JigsawSampler", "check_jigsaw", "sample_jigsaw", "sample_jigsaw_ref"]
