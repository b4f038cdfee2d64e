#!/usr/bin/env bash
# The GPU checks of mjp_fast, in ONE call of the `device` tool (one H100 or H200; its image has torch 2.11,
# triton 3.6, timm 1.0.29, nvcc 13.0 and pytest, python 3.12, and nothing can be installed there). A session has
# 15 minutes of device time, start-up included, and one command may run 10, so everything below shares one
# deadline of DEADLINE_S seconds (default 540; 570 for reproduce) and each stage runs under `timeout` with at most
# its own limit of what is left. A stage that fails or times out is summarized (exit code, last lines of its log)
# and the next one runs; only a missing GPU, a failed build or a failed import end the run early.
#
#   run(command="bash bench/device_check.sh", timeout_s=600)
#
# Per stage: its limit (a stage gets at most what is left before the deadline), and what the newest GPU run that
# ran it took (H200, 2026-11-28, at 388dee0, shared/measurements/h200-2026-11-28), or an estimate (~).
#
#   stage                                                                       limit   expected on an H200
#   machine start-up, sending the tree, bringing $OUT back (outside the command)     -   ~90 s (60-120)
#   1. preflight: versions, nvcc, nvidia-smi, the GPU; a missing GPU ends the run 30 s    14 s
#   2. build the extension with CUDA for sm_90 (skipped when already built)       90 s    33 s
#   3. import mjp_fast and its extension; the backends                            30 s    12 s
#   4. every test with a CUDA or Triton variant, real kernels (TRITON_INTERPRET=0),
#      but max-autotune and the CUDA-graph compiles (the perf mode's: ~50 s
#      each); -v, so that a run cut short still names its failures               200 s   ~130 s (176 s with them)
#   5. `mjp train` with sync_debug=true (set_sync_debug_mode("error")), eager:
#      the digits preset, MJP from step 1, 32 steps of batch 32                    60 s    33 s
#   6. the same under torch.compile (inductor)                                    120 s   ~50 s
#   7. benchmarks, eager: train_step (batch 256), host_cost, kernels (the Triton
#      kernels under each setting in question); the JSON is written after each
#      case; train_step and host_cost measure each GPU backend built (triton,
#      cuda) in rounds of its own, five variants and steady-state blocks          200 s   ~190 s
#   8. train_step benchmark under torch.compile                                  the rest  ~60 s
#   9. benchmarks, eager: patch_embed, gathered_patch_embed (never run), sampler (what
#      time is left, if any)                                                     the rest  little or none
#   the command: 540 s. The timm-family sweep (one model in its 60 s on the last two runs) is a mode of its own.
#   the session: start-up + command + transfers                                         ~11 min of the 15
#   If stages 1-6 all ran to their limits (530 s) stages 7-9 would not run: the correctness checks come first.
#
# `bash bench/device_check.sh perf` runs stages 1-3, then what the default mode has no time for: Inductor's checks
# (tests/test_compile.py and the Inductor tests of tests/test_gpu.py, ~60-120 s), the eager train step, Triton
# kernels and host cost benchmarks (~160 s), and the compiled train-step benchmark in reduce-overhead mode (CUDA
# graphs) with the rest (~260 s; estimates: not yet run).
# `bash bench/device_check.sh sweep` runs stages 1-3, then the timm-family sweep (triton on cuda, one block per
# model, models round-robin over the families) with the rest of the deadline: ~36 s a model, about 12 models.
# `bash bench/device_check.sh tests` runs stages 1-4. `bash bench/device_check.sh reproduce [KEY=VALUE ...]` runs
# `mjp reproduce --preset gpu` alone, under a deadline of 570 s (the KEY=VALUE overrides go to mjp reproduce, e.g.
# epochs=3). It needs CIFAR-10: make the archive here once with `bash bench/device_check.sh pack-data`
# (runs/device-data/cifar10.tar.gz, about 20 MB, git-ignored) and carry it:
#
#   run(command="bash bench/device_check.sh reproduce", carry=["runs/device-data"], timeout_s=600)
#
#   stage                                                                       limit   expected on an H100/H200
#   machine start-up and transfers                                                   -   ~90 s
#   1-3. preflight, build, import                                              150 s   63 s (H200, 2026-11-28)
#   4. unpack CIFAR-10 (60,000 JPEGs) to /tmp                                      60 s   1 s
#   5. mjp reproduce --preset gpu: the throughput probe (2 epochs on 8,192
#      images, ~60 s with its first compiles), 12 runs sharing a 300 s budget
#      that counts 11 s per run besides its epochs (3 to 60 epochs each; 3 at
#      the H200's 9,190 images/s), the attack (CPU, float64, 12 s), the report     the rest  ~430 s
#   the command: ~500 s against its 570 s deadline. The H200's first run (2026-11-28) chose 4 epochs from a budget
#   that did not count each run's 4-14 s of evaluation and set-up, and was cut at the attack (the same command,
#   run again, reuses the finished runs: 54 s for the attack and the report). A run cut short brings back only the
#   logs: the report is written last. With `epochs=N` the training takes N x 12 x 50,000 images / throughput.
#
# `bash bench/device_check.sh loop` runs stages 1-3, then `mjp train` against timm's train.py (issue 21's GPU
# loop ratios; bench/bench_train_loop.py): CIFAR-10 (unpacked as for reproduce), then the embedded digits, each
# its own JSON, 2 alternating rounds of timm, mjp=false and mjp=true. timm's train.py is not in its wheel: make
# the data with `TIMM_TRAIN_PY=/path/to/train.py bash bench/device_check.sh pack-data`, which copies it to
# runs/device-data/timm-train.py, and carry runs/device-data as for reproduce. Estimates (not yet run): ~30-40 s a
# run (process start on the slow host, 100 steps of batch 256 or 40 of 32, 1,000 validation images), ~250 s
# per data set, ~540 s with the start.
#
# Dry run: DEVICE_CHECK_DRY_RUN=1 (or the argument `dry-run` before the mode) lets the run go on without a GPU, so
# that every stage shows it passes or fails fast with one clear line; bench/simulate_gpu_image.sh does that in a
# copy of the GPU image's versions on a machine without a GPU.
#
# Everything lands in $OUT (it comes back with the reply, at most 8 files): summary.txt (the lines printed last),
# logs.tar.gz (every stage's log), and the result JSON files (benchmarks, timm sweep; for reproduce the report,
# its JSON and PNGs). Copy the benchmark JSON into bench/results/ and run `python bench/render.py` on the
# development machine.
set -uo pipefail

if [[ ${1:-} == dry-run ]]; then
  export DEVICE_CHECK_DRY_RUN=1
  shift
fi
mode=${1:-all}
shift || true

pack_data() {
  local source=${1:-../shared/data/cifar10}
  [[ -d $source/train ]] || {
    echo "pack-data: $source has no train/ folder: give the CIFAR-10 ImageFolder root" >&2
    exit 2
  }
  mkdir -p runs/device-data
  tar -C "$(dirname "$source")" -czf runs/device-data/cifar10.tar.gz "$(basename "$source")"
  echo "runs/device-data/cifar10.tar.gz: $(du -h runs/device-data/cifar10.tar.gz | cut -f1); carry runs/device-data"
  # timm's train.py for `loop` (not in timm's wheel; see bench/bench_train_loop.py), when TIMM_TRAIN_PY names it
  if [[ -n ${TIMM_TRAIN_PY:-} ]]; then
    [[ -f $TIMM_TRAIN_PY ]] || {
      echo "pack-data: TIMM_TRAIN_PY=$TIMM_TRAIN_PY is not a file" >&2
      exit 2
    }
    cp "$TIMM_TRAIN_PY" runs/device-data/timm-train.py
    echo "runs/device-data/timm-train.py: from $TIMM_TRAIN_PY"
  fi
  exit 0
}
[[ $mode == pack-data ]] && pack_data "$@"

dry_run=${DEVICE_CHECK_DRY_RUN:-0}
out=${OUT:-/tmp/mjp-device-out}
work=$(mktemp -d "${TMPDIR:-/tmp}/mjp-device-check.XXXXXX")  # the logs, packed into $OUT/logs.tar.gz at the end
mkdir -p "$out"
export HF_HUB_OFFLINE=1
export PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0  # the real kernels (tests/conftest.py sets the interpreter only where no GPU is visible)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # Hopper: H100 and H200
export MAX_JOBS=${MAX_JOBS:-16}
# DEVICE_CHECK_LIMIT_SCALE multiplies the deadline and every stage's limit: for a dry run on a slow shared CPU
# (bench/simulate_gpu_image.sh), never on the lent machine
scale=${DEVICE_CHECK_LIMIT_SCALE:-1}
deadline_default=540
[[ $mode == reproduce || $mode == loop ]] && deadline_default=570 # one long stage: all but packing $OUT
deadline_s=$((${DEADLINE_S:-$deadline_default} * scale))
deadline=$((SECONDS + deadline_s))
summary=()
failures=0

# seconds a stage may take: its own limit (times the scale), or what is left before the deadline (at least 1)
budget() {
  local left=$((deadline - SECONDS)) limit=$(($1 * scale))
  ((left < 1)) && left=1
  ((left < limit)) && echo "$left" || echo "$limit"
}

note() {
  summary+=("$1")
  echo "$1"
}

# stage NAME LIMIT LOG COMMAND...: runs COMMAND under `timeout` with its budget (SIGINT first, so Python says
# where it was, then SIGKILL 10 s later), its output in $work/LOG; one summary line: ok, FAILED or TIMED OUT, with
# the exit code, the seconds and the log's last line; on failure the log's last lines are printed too.
stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  local seconds
  seconds=$(budget "$limit")
  if ((deadline - SECONDS < 5)); then
    note "$name: NOT RUN (the $deadline_s s deadline is reached)"
    failures=$((failures + 1))
    return 1
  fi
  local shown="$*"
  shown=${shown//$'\n'/ }
  echo "== $name (at most $seconds s): ${shown:0:200}"
  local start=$SECONDS status
  timeout -s INT -k 10 "$seconds" "$@" >"$work/$log" 2>&1
  status=$?
  local took=$((SECONDS - start))
  local last
  last=$(grep -v '^[[:space:]]*$' "$work/$log" | tail -n 1 | cut -c1-220)
  if ((status == 0)); then
    note "$name: ok in $took s"
    return 0
  fi
  failures=$((failures + 1))
  if ((status == 124 || status == 137)); then
    note "$name: TIMED OUT after $took s (limit $seconds s; exit $status): $last"
  else
    note "$name: FAILED (exit $status) in $took s: $last"
  fi
  tail -n 20 "$work/$log" | sed 's/^/    | /'
  return "$status"
}

preflight() {
  {
    echo "date: $(date -u +%FT%TZ); host: $(uname -srm); cpus: $(nproc); disk free: $(df -h . | awk 'NR==2 {print $4}')"
    echo "python3: $(command -v python3)"
    echo "nvcc: $(timeout 10 nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'not found')"
    echo "nvidia-smi: $(timeout 10 nvidia-smi -L 2>&1 | head -n 2 | tr '\n' ' ')"
    echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>} TRITON_INTERPRET=$TRITON_INTERPRET dry run: $dry_run"
  } >"$work/preflight.log" 2>&1
  stage "preflight" 30 preflight-python.log python3 -c "
import sys, torch, triton, timm
print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| timm',
      timm.__version__, '| cuda', torch.version.cuda)
if not torch.cuda.is_available():
    sys.exit('PREFLIGHT: no CUDA GPU visible to torch (torch.cuda.is_available() is False)')
print('gpu:', torch.cuda.get_device_name(), '| capability', torch.cuda.get_device_capability(), '|',
      round(torch.cuda.get_device_properties(0).total_memory / 2**30), 'GiB')
"
  local status=$?
  cat "$work/preflight.log" "$work/preflight-python.log" | tee "$work/device.txt"
  if ((status != 0)); then
    if [[ $dry_run == 1 ]]; then
      note "preflight: DRY RUN, going on without a GPU: every stage below must pass or fail fast"
    else
      finish 3
    fi
  fi
}

build() {
  local check="import mjp_fast._C as C, sys; sys.exit(0 if C.has_cuda() else 1)"
  # an extension left by an earlier call is used only if no source is newer (the tool lays the tree anew, so a
  # changed csrc/ is always rebuilt: a stale kernel would be measured otherwise)
  local built
  built=$(find mjp_fast -maxdepth 1 -name '_C*.so' -print -quit)
  if [[ -n $built && -z $(find csrc setup.py CMakeLists.txt -newer "$built" -print -quit 2>/dev/null) ]] &&
    timeout -k 5 "$(budget 60)" python3 -c "$check" 2>/dev/null; then
    note "build: already built on this machine, from these sources"
  else
    export MJP_FAST_REQUIRE_EXTENSION=1
    if ! stage "build" 90 build.log python3 -m pip install --no-build-isolation --no-deps --no-index -e .; then
      finish 1
    fi
    unset MJP_FAST_REQUIRE_EXTENSION
  fi
  # the package imports under the image's versions, and its extension has the CUDA kernels
  stage "import" 30 import.log python3 -c "
import sys, mjp_fast, mjp_fast._C as C, mjp_fast.timm, mjp_fast.train.loop, mjp_fast.reproduce
print('mjp_fast', getattr(mjp_fast, '__version__', ''), '| backends', mjp_fast.available_backends(),
      '| extension with CUDA:', C.has_cuda())
sys.exit(0 if C.has_cuda() else 'the extension was built without its CUDA kernels')
" || finish 1
  cat "$work/import.log" >>"$work/device.txt"
}

tests() {
  # max-autotune benchmarks many GEMM configurations per graph (minutes on its own): the default mode runs here,
  # the same test with max-autotune where a longer check has the time
  # the CUDA-graph compiles (reduce_overhead, ~50 s each) run in the perf mode's compile checks
  local selection=(tests/ops tests/test_compile.py tests/test_timm.py tests/test_timm_patch_embed.py tests/test_nn.py
    tests/sampler tests/test_host_cost.py tests/test_gpu.py
    -k "(cuda or triton or compile or gpu) and not max-autotune and not reduce_overhead")
  if [[ $dry_run == 1 ]]; then  # no GPU: the selection is collected under the image's versions, not run
    stage "tests (dry run: collection only)" 150 tests.log \
      python3 -m pytest -q -p no:cacheprovider --co "${selection[@]}"
  else
    # -v: each test's name and outcome as it ends (the H100's first run, 2026-11-26, was stopped at its limit with
    # 13 failures that -q had not yet named); --timeout: a test that hangs fails with its stack after 100 s
    # instead of holding its worker to the stage's end; -n 12 of the 16 cores, the others for the GPU's host work
    stage "tests" 200 tests.log python3 -m pytest -v -p no:cacheprovider -n 12 --timeout 100 --durations 15 -rfE \
      --tb=short "${selection[@]}"
  fi
  grep -E "^(FAILED|ERROR) |Timeout" "$work/tests.log" | cut -c1-200 | head -n 40
  grep -E "slowest|^[0-9.]+s (call|setup)" "$work/tests.log" | head -n 16
  local counts
  counts=$(grep -Eo '[0-9/]+ (passed|failed|skipped|errors?|tests? collected)' "$work/tests.log" | tr '\n' ' ')
  [[ -z $counts ]] && counts="$(grep -c ' PASSED ' "$work/tests.log") passed, $(grep -c ' FAILED ' \
"$work/tests.log") failed before the stage ended"
  summary+=("  tests: $counts")
  local failed
  failed=$(grep -E "^FAILED |\] FAILED " "$work/tests.log" | grep -Eo "tests/[^ ]+" | sort -u | head -n 30)
  [[ -n $failed ]] && summary+=("  failed: ${failed//$'\n'/ }")
  return 0
}

sync_train() {
  # A few steps of the real loop of `mjp train` (the digits preset: no data needed), MJP on from the first step,
  # with sync_debug=true: the batches between the loop's own reads of its losses run under
  # torch.cuda.set_sync_debug_mode("error"), so a host sync inside a step raises.
  local name=$1 slug=$2 limit=$3 compile=$4
  stage "$name" "$limit" "$slug.log" python3 -m mjp_fast.cli train --output "$work/$slug" device=cuda epochs=1 \
    warmup_epochs=0 compare=false mjp=true max_train_samples=1024 max_val_samples=256 log_interval=8 progress=off \
    compile="$compile" sync_debug=true
}

timm_sweep() {
  # no model started after what is left less 60 s (a model takes ~36 s on the H200)
  local start_limit=$(($(budget 600) - 60))
  ((start_limit < 30)) && start_limit=30
  stage "timm sweep, triton on cuda" 600 timm-sweep.log python3 bench/timm_coverage.py --device cuda --backend triton \
    --depth 1 --time-limit "$start_limit" --json "$out/timm-coverage-cuda-triton.json" \
    --doc "$work/timm-coverage-cuda-triton.md"
  grep -E "pass|FAILED" "$work/timm-sweep.log" | tail -n 12
}

benchmarks() {
  # each case's own repeats (sampler and host_cost 15); the JSON is written after every case, so a case cut at
  # the deadline loses only itself (the kernels case keeps the settings it finished). The judged cases first, then
  # the compiled train step, then the cases whose kernels earlier runs measured, with what is left.
  stage "benchmarks, eager" 200 bench_eager.log python3 -m bench.run --device cuda \
    --cases train_step,host_cost,kernels --out "$out"
  grep -E "^(PASS|FAIL|NOT RUN|NOISY|ERROR|SETTING)" "$work/bench_eager.log" | cut -c1-400 | head -n 60
  stage "benchmarks, torch.compile" 600 bench_compiled.log python3 -m bench.run --device cuda --cases train_step \
    --compile --repeats 20 --out "$out"
  grep -E "^(PASS|FAIL|NOT RUN|NOISY|ERROR)" "$work/bench_compiled.log" | head -n 20
  stage "benchmarks, eager, the rest" 600 bench_rest.log python3 -m bench.run --device cuda \
    --cases patch_embed,gathered_patch_embed,sampler --out "$out"
  grep -E "^(PASS|FAIL|NOT RUN|NOISY|ERROR)" "$work/bench_rest.log" | cut -c1-400 | head -n 20
}

compile_checks() {
  # perf mode: the compiled models' gradients first (a wrong result outranks any timing), with the report of how
  # each DAL gradient relates to the eager one (tests/test_compile.py)
  stage "compile checks" 150 compile-tests.log python3 -m pytest -v -p no:cacheprovider -n 8 --timeout 120 -rfE \
    --tb=short tests/test_compile.py tests/test_gpu.py -k "dal or inductor or reduce_overhead"
  grep -E "^(FAILED|ERROR) |MISMATCH|compiled/eager|DAL loss" "$work/compile-tests.log" | cut -c1-200 | head -n 40
}

perf_benchmarks() {
  # perf mode: what the default mode's 540 s leave out: the eager train step again (with the GPU busy time of
  # MJP's work), the Triton kernels and the host cost, then the compiled train step with all the time that is left
  stage "benchmarks, eager" 220 bench_eager.log python3 -m bench.run --device cuda \
    --cases train_step,kernels,host_cost --out "$out"
  grep -E "^(PASS|FAIL|NOT RUN|NOISY|ERROR|SETTING)" "$work/bench_eager.log" | cut -c1-400 | head -n 60
  # reduce-overhead: CUDA graphs, so the slow host's launches leave the compiled steps (what a user on such a host
  # would run; Inductor's default mode still launches each kernel from the host)
  stage "benchmarks, torch.compile" 600 bench_compiled.log python3 -m bench.run --device cuda --cases train_step \
    --compile --compile-mode reduce-overhead --repeats 20 --out "$out"
  grep -E "^(PASS|FAIL|NOT RUN|NOISY|ERROR)" "$work/bench_compiled.log" | head -n 20
}

# CIFAR-10 for `reproduce` and `loop`, into data_dir: a directory given as MJP_REPRODUCE_DATA, the carried
# archive (unpacked to /tmp), or ../shared/data/cifar10 (the development machine).
cifar_data() {
  local archive=runs/device-data/cifar10.tar.gz
  if [[ -n ${MJP_REPRODUCE_DATA:-} ]]; then
    data_dir=$MJP_REPRODUCE_DATA
  elif [[ -f $archive ]]; then
    data_dir=${TMPDIR:-/tmp}/mjp-device-data/cifar10
    if [[ ! -d $data_dir/train ]]; then
      mkdir -p "$(dirname "$data_dir")"
      stage "unpack CIFAR-10" 60 unpack.log tar -xzf "$archive" -C "$(dirname "$data_dir")" || return 1
    fi
  elif [[ -d ../shared/data/cifar10 ]]; then
    data_dir=../shared/data/cifar10
  else
    note "$mode: NOT RUN: no CIFAR-10: no MJP_REPRODUCE_DATA, no $archive (make it with \`bash \
bench/device_check.sh pack-data\` and carry runs/device-data), no ../shared/data/cifar10"
    failures=$((failures + 1))
    return 1
  fi
}

reproduce() {
  cifar_data || return 1
  # device=cuda: without a GPU the preset must fail at once, not train on the CPU
  stage "mjp reproduce --preset gpu" 600 reproduce.log python3 -m mjp_fast.cli reproduce --preset gpu \
    --data "$data_dir" --output "$work/reproduce-gpu" --report "$out/reproduction.md" device=cuda "$@"
  grep -E "throughput|epochs per run|\] .*top-1|claim|wrote" "$work/reproduce.log" | tail -n 25
}

# `mjp train` against timm's train.py on the GPU (bench/bench_train_loop.py): the embedded digits and CIFAR-10,
# training images per second of timm (prefetcher, pinned memory), mjp=false and mjp=true, 2 alternating rounds.
# timm's train.py: the carried runs/device-data/timm-train.py (pack-data copies $TIMM_TRAIN_PY there), else
# $TIMM_TRAIN_PY; without one the timm rows are NOT RUN and the mjp rows still run.
train_loop() {
  cifar_data || return 1
  local train_py=${TIMM_TRAIN_PY:-}
  [[ -f runs/device-data/timm-train.py ]] && train_py=$PWD/runs/device-data/timm-train.py
  [[ -z $train_py ]] && note "loop: no timm train.py carried (runs/device-data/timm-train.py): its rows NOT RUN"
  # one JSON per data set, CIFAR-10 first (the aims judge it), so that a run cut at the deadline keeps the other
  local data
  for data in cifar10 embedded; do
    stage "train loop benchmark, $data" 330 "train-loop-$data.log" env TIMM_TRAIN_PY="$train_py" \
      python3 bench/bench_train_loop.py --device cuda --datasets "$data" --cifar10 "$data_dir" --repeats 2 --out "$out"
    grep -E "^(PASS|FAIL|NOT RUN|ERROR)" "$work/train-loop-$data.log" | head -n 10
  done
}

# The summary, every log packed into one file (the device tool brings back 8 files at most), and the exit code.
finish() {
  local code=${1:-0}
  ((code == 0 && failures > 0)) && code=1
  local how=$mode
  [[ $dry_run == 1 ]] && how+=", dry run"
  ((scale != 1)) && how+=", limits x$scale"
  summary+=("device check ($how): $failures failed stage(s), exit $code, $SECONDS s of the $deadline_s s deadline")
  printf '%s\n' "${summary[@]}" >"$out/summary.txt"
  cp "$out/summary.txt" "$work/summary.txt"
  tar -czf "$out/logs.tar.gz" -C "$work" --exclude='*.pt' --exclude='*/checkpoints' . 2>/dev/null
  local files
  files=$(find "$out" -type f | wc -l)
  ((files > 8)) && echo "WARNING: $files files in $out: the device tool brings back 8 at most"
  echo "---- summary (also $out/summary.txt; logs in $out/logs.tar.gz)"
  printf '%s\n' "${summary[@]}"
  exit "$code"
}

case "$mode" in
  all)
    preflight
    build
    tests
    sync_train "sync-debug train, eager" sync-eager 60 false
    sync_train "sync-debug train, compiled" sync-compiled 120 true
    benchmarks
    ;;
  sweep)
    preflight
    build
    timm_sweep
    ;;
  tests)
    preflight
    build
    tests
    ;;
  perf)
    preflight
    build
    compile_checks
    perf_benchmarks
    ;;
  reproduce)
    preflight
    build
    reproduce "$@"
    ;;
  loop)
    preflight
    build
    train_loop
    ;;
  *)
    echo "usage: bash bench/device_check.sh [dry-run] [all|tests|perf|sweep|reproduce [KEY=VALUE ...]|loop|pack-data [DIR]]" >&2
    exit 2
    ;;
esac
finish 0
