"""Build of mjp_fast: the pure-Python package plus the optional compiled extension mjp_fast._C.

    pip install --no-build-isolation -e .       # builds against the torch already installed

Environment:
    MJP_FAST_SKIP_EXTENSION=1   install the pure-Python package only (the 'torch' backend runs everywhere).
    MJP_FAST_SKIP_CUDA=1        build the CPU kernels only, even when nvcc is there.
    MJP_FAST_REQUIRE_EXTENSION=1  fail the install if the extension does not build (default: warn and go on).
    TORCH_CUDA_ARCH_LIST        GPU architectures of the CUDA kernels; default "8.0;9.0".
    MAX_JOBS                    parallel compile jobs (ninja); default 2.

The CUDA kernels compile whenever nvcc is found, even on a machine without a GPU.
"""

from __future__ import annotations

import glob
import os
import runpy
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"
CPU_SOURCES = [
    "bindings.cpp",
    "sampler_cpu.cpp",
    "patch_embed_cpu.cpp",
    "pos_embed_cpu.cpp",
    "dal_loss.cpp",
    "autograd_ops.cpp",
]
CUDA_SOURCES = ["cuda_ops.cpp", "sampler_cuda.cu", "patch_embed_cuda.cu", "pos_embed_cuda.cu", "dal_loss_cuda.cu"]
HEADERS = ["ops.h", "row_layout.h", "sampler.h", "sampler_lanes.h", "cuda_kernels.h", "cuda_grid.cuh"]


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _say(message: str) -> None:
    print(f"mjp_fast setup: {message}", file=sys.stderr, flush=True)


def _cuda_home(cpp_extension) -> str | None:
    """A CUDA toolkit root with bin/nvcc, or None.

    torch guesses CUDA_HOME from the location of `nvcc` on PATH; when that is a wrapper script (say
    /usr/local/bin/nvcc) the guess has no include/ directory, so the usual toolkit locations are tried as well.
    """

    def has_nvcc(root: str | None) -> bool:
        return bool(root) and os.path.isfile(os.path.join(root, "bin", "nvcc"))

    def is_toolkit(root: str | None) -> bool:
        return has_nvcc(root) and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h"))

    guessed = cpp_extension.CUDA_HOME
    if is_toolkit(guessed) or os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return guessed if has_nvcc(guessed) else None
    candidates = ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True), "/opt/cuda"]
    for root in candidates:
        if is_toolkit(root):
            return root
    return guessed if has_nvcc(guessed) else None


def _extension_build() -> tuple[list, dict]:
    """The ext_modules and cmdclass to build mjp_fast._C, or none when it cannot or should not be built."""
    if _flag("MJP_FAST_SKIP_EXTENSION"):
        _say("MJP_FAST_SKIP_EXTENSION=1: installing the pure-Python package only (no mjp_fast._C)")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension

        torch_cuda_version = torch.version.cuda
    except Exception as error:  # noqa: BLE001 - any failure to import torch means: no extension
        if _flag("MJP_FAST_REQUIRE_EXTENSION"):
            raise RuntimeError(f"MJP_FAST_REQUIRE_EXTENSION=1 but torch is not importable here: {error}") from error
        _say(f"torch is not importable ({error}); installing the pure-Python package only (no mjp_fast._C)")
        return [], {}

    os.environ.setdefault("MAX_JOBS", "2")
    # -g0 overrides the -g of Python's CFLAGS (debug info doubles compile time); the C++ standard is torch's.
    cxx_flags = ["-O3", "-g0", "-fopenmp"]
    link_flags = ["-fopenmp"]
    sources = [f"{CSRC}/{name}" for name in CPU_SOURCES]
    depends = [f"{CSRC}/{name}" for name in HEADERS]
    define_macros = []

    with_cuda = False
    cuda_home = None if _flag("MJP_FAST_SKIP_CUDA") else _cuda_home(cpp_extension)
    if _flag("MJP_FAST_SKIP_CUDA"):
        _say("MJP_FAST_SKIP_CUDA=1: building the CPU kernels only")
    elif cuda_home is None:
        _say("nvcc not found (no CUDA_HOME, no nvcc on PATH, no /usr/local/cuda): building the CPU kernels only")
    elif torch_cuda_version is None:
        _say("torch was built without CUDA: building the CPU kernels only")
    else:
        with_cuda = True
        # torch.utils.cpp_extension reads its module-level CUDA_HOME when it builds the nvcc command lines.
        cpp_extension.CUDA_HOME = cuda_home
        os.environ["CUDA_HOME"] = cuda_home
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        _say(
            f"building the CUDA kernels with {cuda_home}/bin/nvcc for "
            f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']} (no GPU is needed to build)"
        )

    extra_compile_args: dict[str, list[str]] = {"cxx": cxx_flags}
    if with_cuda:
        sources += [f"{CSRC}/{name}" for name in CUDA_SOURCES]
        define_macros.append(("MJP_WITH_CUDA", None))
        extra_compile_args["nvcc"] = ["-O3", "-DMJP_WITH_CUDA"]
        extension_class = cpp_extension.CUDAExtension
    else:
        extension_class = cpp_extension.CppExtension

    extension = extension_class(
        name="mjp_fast._C",
        sources=sources,
        depends=depends,
        include_dirs=[str(ROOT / CSRC)],
        define_macros=define_macros,
        extra_compile_args=extra_compile_args,
        extra_link_args=link_flags,
    )

    class BuildExtension(cpp_extension.BuildExtension):
        """torch's BuildExtension (ninja) that, unless MJP_FAST_REQUIRE_EXTENSION=1, turns a failed compile of the
        optional extension into a warning, so the pure-Python package still installs."""

        def finalize_options(self) -> None:
            super().finalize_options()
            if getattr(self, "editable_mode", False):
                # pip's editable install builds in a fresh temporary folder each time, so every reinstall (the
                # README's test command after its install command) compiled everything again, about 90 s here. In
                # one folder of the checkout ninja rebuilds only what changed: it keeps each object's command line
                # and header dependencies, so a changed source, header, flag, torch or architecture list rebuilds.
                self.build_temp = str(ROOT / "build" / f"editable-{sys.implementation.cache_tag}")

        def run(self) -> None:
            try:
                super().run()
            except Exception as error:  # noqa: BLE001 - compiler errors come in many types
                if _flag("MJP_FAST_REQUIRE_EXTENSION"):
                    raise
                _say(
                    f"WARNING: building mjp_fast._C failed ({error}); installing the pure-Python package only. "
                    "Set MJP_FAST_REQUIRE_EXTENSION=1 to make this an error."
                )

    return [extension], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extension_build()
# Read from the file itself: importing the package would import torch, which the metadata must not need.
TORCH_REQUIREMENT = runpy.run_path(str(ROOT / "mjp_fast" / "_versions.py"))["TORCH_REQUIREMENT"]

# timm's readers for data=wds/... (WebDataset shards) and data=hfds/... (Hugging Face datasets): optional.
DATA_EXTRA = ["webdataset>=1.0.2,<2", "datasets>=5.2,<6"]

setup(
    name="mjp_fast",
    version="0.1.0",
    description="Masked Jigsaw Puzzle position embeddings for ViTs: fast per-sample jigsaw sampling and fused "
    "patch embedding",
    python_requires=">=3.10",
    packages=find_packages(include=["mjp_fast", "mjp_fast.*"]),
    # The bundled recipes (`mjp train --config deit_s`) are read from inside the installed package.
    package_data={"mjp_fast": ["configs/*.yaml"]},
    install_requires=[
        # The tested torch range, from mjp_fast/_versions.py (which also refuses an older torch at import).
        TORCH_REQUIREMENT,
        # timm 1.0.17 is the first with timm.layers.register_notrace_module; tested up to 1.0.31 (timm 2 may
        # change the model internals that mjp_fast.timm subclasses).
        "timm>=1.0.17,<2",
        "numpy",
        "scikit-image",
        "scikit-learn",
        "matplotlib",
        "pyyaml",
        "tqdm",
        # Tested with Pillow 11.3, 12.2 and 13.0 (which refuses RandAugment's 0-bit posterize: see train/augment.py).
        "pillow>=11",
    ],
    extras_require={
        # the test extra carries the data readers: their tests read a WebDataset and a saved Hugging Face dataset;
        # hypothesis drives the property tests of the public API under hostile input (tests/property)
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis>=6.100", *DATA_EXTRA],
        "data": DATA_EXTRA,
        "bench": ["pytest-benchmark"],
        "umap": ["umap-learn"],
        "tensorboard": ["tensorboard"],
    },
    entry_points={"console_scripts": ["mjp = mjp_fast.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
