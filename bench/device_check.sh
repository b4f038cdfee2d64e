#!/usr/bin/env bash
# The GPU checks of mjp_fast, in ONE call of the `device` tool (one H100 or H200; its image has torch, triton,
# timm, nvcc and pytest, and nothing can be installed there). A session has 15 minutes of device time, start-up
# included, and one command may run 10, so everything below shares one deadline of DEADLINE_S seconds (default
# 540) and each stage gets at most its own limit of what is left:
#
#   run(command="bash bench/device_check.sh", timeout_s=600)
#
#   1. build the extension with CUDA for sm_90 (23 s on the H200)                                       <= 90 s
#   2. every test with a CUDA or Triton variant, on the GPU, real kernels (TRITON_INTERPRET=0)          <= 150 s
#   3. benchmarks, eager: sampler, patch_embed, host_cost, train_step (plain, plain + fast patch
#      embedding, MJP), bf16, batch 256                                                                   <= 200 s
#   4. train_step again under torch.compile                                                               the rest
#
# Everything lands in $OUT (it comes back with the reply): build.log, tests.log, the benchmark logs and JSON
# files. Copy the JSON into bench/results/ and run `python bench/render.py` on the development machine. The last
# lines printed are a summary. `bash bench/device_check.sh tests` runs stages 1-2 only.
set -uo pipefail

mode=${1:-all}
out=${OUT:-/tmp/mjp-device-out}
mkdir -p "$out"
export HF_HUB_OFFLINE=1
export TRITON_INTERPRET=0  # the real kernels (tests/conftest.py sets the interpreter only where no GPU is visible)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # Hopper: H100 and H200
export MAX_JOBS=${MAX_JOBS:-16}
deadline=$((SECONDS + ${DEADLINE_S:-540}))
summary=()

# seconds a stage may take: its own limit, or what is left before the deadline (at least 1)
budget() {
  local left=$((deadline - SECONDS))
  ((left < 1)) && left=1
  ((left < $1)) && echo "$left" || echo "$1"
}

build() {
  if python3 -c "import mjp_fast._C as C, sys; sys.exit(0 if C.has_cuda() else 1)" 2>/dev/null; then
    summary+=("build: already built on this machine")
    return 0
  fi
  local start=$SECONDS
  if ! MJP_FAST_REQUIRE_EXTENSION=1 timeout "$(budget 90)" python3 -m pip install --no-build-isolation --no-deps -e . \
    >"$out/build.log" 2>&1; then
    tail -40 "$out/build.log"
    echo "BUILD FAILED (log: build.log)"
    exit 1
  fi
  summary+=("build: $((SECONDS - start)) s")
}

tests() {
  python3 -c "import torch, triton, timm, mjp_fast; print('torch', torch.__version__, '| triton', triton.__version__, \
'| timm', timm.__version__, '|', torch.cuda.get_device_name(), '|', mjp_fast.available_backends())" | tee "$out/device.txt"
  local start=$SECONDS
  timeout "$(budget 150)" python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops tests/test_compile.py tests/test_timm.py \
    tests/test_timm_patch_embed.py tests/test_nn.py tests/sampler tests/test_host_cost.py tests/test_gpu.py \
    -k "cuda or triton or compile or gpu" >"$out/tests.log" 2>&1
  local status=$?
  tail -25 "$out/tests.log"
  summary+=("tests: exit $status in $((SECONDS - start)) s ($(grep -Eo '[0-9]+ (passed|failed|skipped|errors?)' "$out/tests.log" | tr '\n' ' '))")
}

benchmarks() {
  local start=$SECONDS
  timeout "$(budget 200)" python3 -m bench.run --device cuda --cases sampler,patch_embed,host_cost,train_step \
    --repeats 30 --out "$out" >"$out/bench_eager.log" 2>&1
  summary+=("benchmarks, eager: exit $? in $((SECONDS - start)) s")
  grep -E "^(PASS|FAIL|NOT RUN|NOISY|ERROR)" "$out/bench_eager.log" | head -30
  start=$SECONDS
  timeout "$(budget 600)" python3 -m bench.run --device cuda --cases train_step --compile --repeats 20 --out "$out" \
    >"$out/bench_compiled.log" 2>&1
  summary+=("benchmarks, torch.compile: exit $? in $((SECONDS - start)) s")
  grep -E "^(PASS|FAIL|NOT RUN|NOISY|ERROR)" "$out/bench_compiled.log" | head -20
}

case "$mode" in
  all)
    build
    tests
    benchmarks
    ;;
  tests)
    build
    tests
    ;;
  *)
    echo "usage: bash bench/device_check.sh [all|tests]" >&2
    exit 2
    ;;
esac

printf '%s\n' "${summary[@]}"
