#!/usr/bin/env bash
# The GPU checks of mjp_fast, for the machine that the `device` tool lends (one H100 or H200; its image has
# torch, triton, timm, nvcc and pytest, but nothing can be installed there). A session has about 15 minutes of
# device time, start-up included, and one command may run 10: so two calls, the second straight after the first
# while the machine is still warm (it keeps the build):
#
#   run(command="bash bench/device_check.sh tests", timeout_s=590)   # build, GPU tests, kernel benchmarks
#   run(command="bash bench/device_check.sh steps", timeout_s=420)   # training steps, the H100 aim
#
# Everything lands in $OUT (comes back with the reply): the build log, test output, and the benchmark JSON files
# (copy them into bench/results/ and run `python bench/render.py` here). The last lines printed are a summary.
set -uo pipefail

mode=${1:-tests}
out=${OUT:-/tmp/mjp-device-out}
mkdir -p "$out"
export HF_HUB_OFFLINE=1
export TRITON_INTERPRET=0  # the real kernels: tests/conftest.py only sets the interpreter when this is unset
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # Hopper: H100 and H200
export MAX_JOBS=${MAX_JOBS:-16}
summary=()

build() {
  if python3 -c "import mjp_fast._C as C, sys; sys.exit(0 if C.has_cuda() else 1)" 2>/dev/null; then
    return 0  # built by an earlier call on this machine
  fi
  local start=$SECONDS
  if ! MJP_FAST_REQUIRE_EXTENSION=1 python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1; then
    tail -40 "$out/build.log"
    echo "BUILD FAILED (log: build.log)"
    exit 1
  fi
  summary+=("build: $((SECONDS - start)) s")
}

case "$mode" in
  tests)
    build
    python3 -c "import torch, mjp_fast; print('torch', torch.__version__, '|', torch.cuda.get_device_name(), '|', mjp_fast.available_backends())" \
      | tee "$out/device.txt"
    start=$SECONDS
    # Every test that has a CUDA or Triton variant, on the GPU, with the real kernels.
    timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops tests/test_compile.py tests/test_timm.py \
      tests/test_nn.py tests/test_sampler.py -k "cuda or triton or compile or gpu" >"$out/tests.log" 2>&1
    status=$?
    tail -25 "$out/tests.log"
    summary+=("tests: exit $status in $((SECONDS - start)) s ($(grep -Eo '[0-9]+ (passed|failed|skipped|error)' "$out/tests.log" | tr '\n' ' '))")
    start=$SECONDS
    timeout 240 python3 -m bench.run --device cuda --cases sampler,patch_embed,jigsaw_apply --out "$out" \
      >"$out/bench_kernels.log" 2>&1
    summary+=("kernel benchmarks: exit $? in $((SECONDS - start)) s")
    grep -E "^(PASS|FAIL|NOT RUN)|^- \[" "$out/bench_kernels.log" | head -20
    ;;
  steps)
    build
    start=$SECONDS
    timeout 400 python3 -m bench.run --device cuda --cases train_step --out "$out" >"$out/bench_steps.log" 2>&1
    summary+=("training steps: exit $? in $((SECONDS - start)) s")
    sed -n '/## Training step/,/train_step:/p' "$out/bench_steps.log" | grep -v "^NOISY" | tail -20
    ;;
  *)
    echo "usage: bash bench/device_check.sh tests|steps" >&2
    exit 2
    ;;
esac

printf '%s\n' "${summary[@]}"
