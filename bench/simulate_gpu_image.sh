#!/usr/bin/env bash
# A dry run of bench/device_check.sh in a copy of the lent GPU machine's software, on this machine (no GPU): to
# catch, before a call of the device tool spends its 15 minutes, what only fails there: an import or an API that
# the image's older versions lack, a script error, a stage that hangs instead of failing.
#
# The image, as /work/.library/device/KINDS.md and the first GPU run (shared/measurements/h200-2026-11-26) saw
# it: python 3.12, torch 2.11.0+cu130, triton 3.6.0, timm 1.0.29, torchvision 0.26.0, nvcc 13.0, pytest with
# xdist, timeout and benchmark, numpy, scikit-image, scikit-learn, matplotlib, pyyaml, tqdm, pillow; nothing can
# be installed there, and mjp_fast is not installed (device_check.sh installs it, editable, without deps).
#
#   bash bench/simulate_gpu_image.sh            # makes the venv once (about 3 GB of wheels), then the dry run
#   bash bench/simulate_gpu_image.sh reproduce  # the same for `device_check.sh reproduce`
#
# What it does:
#   1. a venv at $SIM_VENV (default /tmp/mjp-gpu-image, outside the repository) with those versions, made once;
#   2. a copy of the working tree as the device tool sends it (tracked and untracked-not-ignored files, and the
#      carried paths in SIM_CARRY, default runs/device-data) in $SIM_ROOT/tree, so the editable install and its
#      build stay out of the checkout; the last run's build outputs are kept there unless SIM_FRESH=1;
#   3. `bash bench/device_check.sh` there, with the GPU hidden (CUDA_VISIBLE_DEVICES=), the real Triton
#      kernels (TRITON_INTERPRET=0), pip cut off from every index, and DEVICE_CHECK_DRY_RUN=1 so the missing GPU
#      does not end the run at the preflight: every stage must then pass (the build, the imports, the test
#      collection) or fail fast with a clear line. Its output lands in $SIM_ROOT/out, its log in
#      $SIM_ROOT/dry-run.log.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${SIM_VENV:-/tmp/mjp-gpu-image}
root=${SIM_ROOT:-/tmp/mjp-gpu-image-run}
mode=${1:-all}

# The image's versions, where KINDS.md's pip list or the first GPU run named them; the rest unpinned.
packages=(
  torch==2.11.0 triton==3.6.0 timm==1.0.29 torchvision==0.26.0 huggingface_hub==1.33.0 safetensors==0.8.0
  numpy scikit-image scikit-learn matplotlib pyyaml tqdm "pillow>=11"
  pytest pytest-xdist pytest-timeout pytest-benchmark
  "setuptools<82" wheel ninja
)

pick_python() {
  local candidate
  for candidate in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 python3.11 python3; do
    if "$candidate" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  echo "simulate_gpu_image: no python3.12 (nor 3.11) found" >&2
  return 1
}

make_venv() {
  local stamp="$venv/.mjp-gpu-image"
  if [[ -f $stamp && $(cat "$stamp") == "${packages[*]}" ]]; then
    return 0
  fi
  local python
  python=$(pick_python)
  echo "simulate_gpu_image: making $venv with $("$python" --version) (a one-time download of about 3 GB)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "${packages[@]}"
  echo "${packages[*]}" >"$stamp"
}

copy_tree() {
  # SIM_FRESH=1: a bare machine (the extension is built again, minutes here); by default the build outputs of the
  # last dry run stay, as on a machine still warm from the last call
  [[ ${SIM_FRESH:-0} == 1 ]] && rm -rf "$root/tree"
  rm -rf "$root/out"
  mkdir -p "$root/tree" "$root/out"
  cd "$repo"
  # what the device tool sends: tracked files and untracked files that git does not ignore (those that exist),
  # and the ignored paths a call would carry (SIM_CARRY, default runs/device-data where it exists)
  git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' path; do [[ -f $path ]] && printf '%s\0' "$path"; done |
    xargs -0 -r cp --parents -t "$root/tree"
  local carried
  for carried in ${SIM_CARRY-runs/device-data}; do
    if [[ -e $carried ]]; then cp -r --parents "$carried" "$root/tree"; fi
  done
  cd - >/dev/null
}

make_venv
"$venv/bin/python" -c "import sys, torch, triton, timm; print('simulated image: python', sys.version.split()[0], \
'| torch', torch.__version__, '| triton', triton.__version__, '| timm', timm.__version__)"
copy_tree

cd "$root/tree"
start=$SECONDS
set +e
# The limits stretched (x6 by default): this machine's 2 shared cores build and import far slower than the lent
# machine's 16; MAX_JOBS=2 for the same reason.
env PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" OUT="$root/out" CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=0 \
  DEVICE_CHECK_DRY_RUN=1 DEVICE_CHECK_LIMIT_SCALE="${DEVICE_CHECK_LIMIT_SCALE:-6}" MAX_JOBS="${MAX_JOBS:-2}" \
  PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PYTHONNOUSERSITE=1 \
  bash bench/device_check.sh "$mode" 2>&1 | tee "$root/dry-run.log"
status=${PIPESTATUS[0]}
set -e
echo "simulate_gpu_image: device_check.sh $mode exited $status after $((SECONDS - start)) s; log $root/dry-run.log, \
files $root/out"
exit "$status"
