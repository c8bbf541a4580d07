#!/usr/bin/env bash
# Runs every test of hsx. Works on a fresh machine: installs what is missing first.
#
#   0. the size limits (scripts/check_sizes.py): no source file over 700 lines, no function over 80
#   1. unit tests (GoogleTest, via ctest); CUDA tests skip, saying why, without a GPU
#   2. the GEMM and batch-invariance tests once per CPU GEMM kernel (HSX_CPU_GEMM)
#   3. under AddressSanitizer + UndefinedBehaviorSanitizer: the unit tests, then the
#      service, remote-dump, resume and device-loss suites against sanitized hsx-server/hsx-dump/hsx-verify
#   4. six libFuzzer targets (HSX_FUZZ_SECONDS in all, default 60), each with a coverage floor
#   5. the transformers oracle once more per non-default GEMM kernel
#   6. the device check's bundle (scripts/device-check.sh --prepare) and its run here, which must
#      say "no GPU" and exit 0 on a machine without one
#   7. the container image (scripts/image.sh): deploy/Dockerfile built with buildah on a cached
#      Debian base, the cpu-demo flow run inside it as uid 10001, broken Dockerfiles refused
#   8. the Python cross-checks against compressed-tensors and transformers, the deploy checks
#      (pytest; the image's binaries' flags included)
#   9. the trainers' own loaders on hsx output (scripts/trainers.sh: speculators, SpecForge,
#      ModelOpt in their own pinned environment, ~/.cache/hsx/trainers)
#
# Environment: HSX_VENV, HSX_BUILD_DIR (see setup.sh), HSX_FUZZ_SECONDS, HSX_IMAGE_CACHE (see
# image.sh), HSX_SKIP_IMAGE=1 (leave out stage 7; the image tests then skip, saying why).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build="${HSX_BUILD_DIR:-build}"
fuzz_seconds="${HSX_FUZZ_SECONDS:-60}"
venv="${HSX_VENV:-$HOME/.cache/hsx/venv}"
jobs=$(nproc)

# Each header says when its stage began (bash's SECONDS since the start), so
# that a slow run shows which stage took the time (CI's budget is 30 minutes).
stage() { printf '\n== %s (at %d:%02d)\n' "$*" $((SECONDS / 60)) $((SECONDS % 60)); }

stage "setup and build"
scripts/setup.sh --python

stage "size limits: files 700 lines, functions 80 (scripts/check_sizes.py)"
"$venv/bin/python" scripts/check_sizes.py

# The network-bound preparations of two later stages (the trainers' environment, the image's
# Debian base) run in the background while the CPU-bound stages run; each stage waits for its own.
prep_logs="$build/ci-prep"
mkdir -p "$prep_logs"
scripts/trainers.sh --install-only >"$prep_logs/trainers.log" 2>&1 &
trainers_prep=$!
if [[ "${HSX_SKIP_IMAGE:-0}" != 1 ]]; then
  scripts/image.sh --base-only >"$prep_logs/image.log" 2>&1 &
  image_prep=$!
fi
# Waits for a background preparation; prints its log; fails the run if it failed.
await() {
  local pid=$1 log=$2
  if ! wait "$pid"; then
    cat "$log"
    echo "test.sh: the background preparation logged above failed" >&2
    exit 1
  fi
  cat "$log"
}

if [[ -f "$build/kernels/cuda/libhsx_kernels_cuda.a" ]]; then
  stage "CUDA kernels: nvcc targets"
  ninja -C "$build" -t commands hsx_kernels_cuda | grep -o -- '-gencode=[^ ]*' | sort -u
  echo "SASS in libhsx_kernels_cuda.a:" \
    "$(strings "$build/kernels/cuda/libhsx_kernels_cuda.a" | grep -o -- '-arch sm_[0-9a-z]*' | sort -u | tr '\n' ' ')"
fi

stage "unit tests"
ctest --test-dir "$build" --output-on-failure -j "$jobs"

# The GEMM kernels this CPU can run, widest (the default) first.
gemm_kernels() {
  local flags
  flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
  [[ " $flags " == *" avx512f "* ]] && echo avx512
  [[ " $flags " == *" avx2 "* && " $flags " == *" fma "* ]] && echo avx2
  echo scalar
}
mapfile -t kernels < <(gemm_kernels)

stage "GEMM and batch-invariance tests once per GEMM kernel: ${kernels[*]}"
for kernel in avx512 avx2; do
  [[ " ${kernels[*]} " == *" $kernel "* ]] || echo "skipped: this CPU cannot run the $kernel kernel"
done
for kernel in "${kernels[@]}"; do
  echo "HSX_CPU_GEMM=$kernel"
  HSX_CPU_GEMM="$kernel" "$build/bin/hsx_unit_tests" --gtest_brief=1 \
    --gtest_filter='GemmKernel.*:Gemm.*:InvarianceTest.*'
done

stage "unit tests under AddressSanitizer + UndefinedBehaviorSanitizer"
asan_build="${build}-asan"
if [[ ! -f "$asan_build/build.ninja" ]]; then
  cmake -S . -B "$asan_build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DHSX_ENABLE_CUDA=OFF \
    -DHSX_SANITIZE=address,undefined >/dev/null
fi
cmake --build "$asan_build" -j "$jobs" --target hsx_unit_tests hsx-server hsx-dump hsx-verify \
  hsx-make-model hsx-inspect
# One gtest shard per core (the tests run one at a time within a binary: in one process they took
# 3.7 min of this stage), each shard's output printed after it ends.
shard_logs=$(mktemp -d)
shard_pids=()
for ((shard = 0; shard < jobs; shard++)); do
  GTEST_TOTAL_SHARDS=$jobs GTEST_SHARD_INDEX=$shard \
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$asan_build/bin/hsx_unit_tests" --gtest_brief=1 >"$shard_logs/$shard.log" 2>&1 &
  shard_pids+=($!)
done
shards_failed=0
for shard in "${!shard_pids[@]}"; do
  wait "${shard_pids[$shard]}" || shards_failed=$((shards_failed + 1))
  printf -- '-- shard %d of %d\n' $((shard + 1)) "$jobs"
  cat "$shard_logs/$shard.log"
done
rm -rf "$shard_logs"
if ((shards_failed > 0)); then
  echo "test.sh: $shards_failed of $jobs shards of the sanitized unit tests failed (above)" >&2
  exit 1
fi

stage "server and clients under AddressSanitizer + UndefinedBehaviorSanitizer"
# All of the three suites but their five slowest tests (45-80 s each under ASan; they wait on
# kills, restarts and drains rather than run other code): on the loaded development machine all
# 55 took 8.5 min, these 50 took 1.5 to 3.7 min (docs/testing.md). Every sanitizer report goes to
# a file, so one counts even where a test does not look at the exit status of its process.
sanitized_subset="not slow_reader_memory and not server_killed_and_restarted and not kill9_server \
and not sigterm_server_during_dump and not sigterm_drains"
sanitizer_logs=$(mktemp -d)
# log_exe_name: each report's file names its program (a report cut short, by a test that kills
# the process while it is still symbolizing, otherwise says nothing of where it came from).
ASAN_OPTIONS="detect_leaks=1:log_path=$sanitizer_logs/asan:log_exe_name=1" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$sanitizer_logs/ubsan:log_exe_name=1" \
HSX_BIN_DIR="$root/$asan_build/bin" "$venv/bin/python" -m pytest -q \
  tests/python/test_server.py tests/python/test_server_limits.py tests/python/test_server_tls.py \
  tests/python/test_server_drain.py tests/python/test_remote_dump.py tests/python/test_resume.py \
  tests/python/test_device_loss.py -k "$sanitized_subset"
if compgen -G "$sanitizer_logs/*" >/dev/null; then
  ls -l "$sanitizer_logs"
  for report in "$sanitizer_logs"/*; do printf '\n-- %s\n' "${report##*/}"; head -n 200 "$report"; done
  echo "sanitizer reports above (from $sanitizer_logs)" >&2
  exit 1
fi
rm -rf "$sanitizer_logs"

stage "fuzzing: six parsers, ${fuzz_seconds}s in all, each with a coverage floor"
fuzz_build="${build}-fuzz"
if [[ ! -f "$fuzz_build/build.ninja" ]]; then
  CC=clang CXX=clang++ cmake -S . -B "$fuzz_build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DHSX_ENABLE_CUDA=OFF -DHSX_BUILD_FUZZERS=ON -DHSX_SANITIZE=address,undefined >/dev/null
fi
mapfile -t fuzz_floors < <(grep -v '^#' tests/fuzz/coverage_floors.txt)
fuzz_targets=()
for entry in "${fuzz_floors[@]}"; do fuzz_targets+=("${entry%% *}"); done
cmake --build "$fuzz_build" -j "$jobs" --target "${fuzz_targets[@]}"
per_target=$(( fuzz_seconds / ${#fuzz_targets[@]} ))
(( per_target >= 1 )) || per_target=1
fuzz_work=$(mktemp -d)
trap 'rm -rf "$fuzz_work"' EXIT
for entry in "${fuzz_floors[@]}"; do
  read -r target floor max_len <<<"$entry"
  mkdir -p "$fuzz_work/$target"
  cp tests/fuzz/seeds/"$target"/* "$fuzz_work/$target/"
  "$fuzz_build/bin/$target" "$fuzz_work/$target" -max_total_time="$per_target" -max_len="$max_len" \
    -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$fuzz_work/$target-" \
    >"$fuzz_work/$target.log" 2>&1 || {
    tail -n 40 "$fuzz_work/$target.log"; echo "$target failed" >&2; exit 1; }
  # libFuzzer's last status line ("#N DONE cov: C ft: F corp: ...") gives the
  # edges reached; below the floor the fuzzer no longer sees inside the parser.
  cov=$(grep -o 'cov: [0-9]*' "$fuzz_work/$target.log" | tail -n 1 | cut -d' ' -f2)
  runs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$fuzz_work/$target.log" | cut -d' ' -f2)
  printf '%-28s %7s runs  cov %5s  (floor %s)\n' "$target" "${runs:-?}" "${cov:-?}" "$floor"
  if [[ -z "$cov" || "$cov" -lt "$floor" ]]; then
    echo "$target: coverage ${cov:-none} is under its floor $floor (tests/fuzz/coverage_floors.txt)" >&2
    exit 1
  fi
done

stage "transformers oracle under the other GEMM kernels: ${kernels[*]:1}"
for kernel in "${kernels[@]:1}"; do
  echo "HSX_CPU_GEMM=$kernel"
  HSX_CPU_GEMM="$kernel" HSX_BIN_DIR="$root/$build/bin" "$venv/bin/python" -m pytest -q \
    tests/python/test_oracle.py -k "not guard"
done

stage "device check: the bundle for a GPU machine, and its run here"
start=$SECONDS
scripts/device-check.sh --prepare --build-dir "$build"
device_report=$(mktemp -d)
trap 'rm -rf "$fuzz_work" "$device_report"' EXIT
scripts/device-check.sh --run --out "$device_report" >/dev/null
cat "$device_report/report.md"
if ! nvidia-smi -L >/dev/null 2>&1; then
  grep -q '^- no GPU: ' "$device_report/report.md" ||
    { echo "device check: no 'no GPU: <reason>' line in its report on a machine without a GPU" >&2; exit 1; }
fi
echo "device check: prepare and run took $((SECONDS - start)) s"

if [[ "${HSX_SKIP_IMAGE:-0}" == 1 ]]; then
  stage "container image: skipped (HSX_SKIP_IMAGE=1)"
else
  stage "container image: build (cached Debian base, layer cache) and the cpu-demo flow inside it"
  await "$image_prep" "$prep_logs/image.log"
  scripts/image.sh
  # The image is there now: its tests in test_deploy_image.py must run, not skip.
  export HSX_IMAGE_TESTS=required
fi

stage "Python tests: oracle (transformers, compressed-tensors), service, clients, deploy"
HSX_BIN_DIR="$root/$build/bin" "$venv/bin/python" -m pytest tests/python -q

stage "trainers: speculators, SpecForge and ModelOpt loaders on hsx output (docs/trainers.md)"
await "$trainers_prep" "$prep_logs/trainers.log"
HSX_BUILD_DIR="$build" scripts/trainers.sh
printf '\n== all stages passed in %d:%02d\n' $((SECONDS / 60)) $((SECONDS % 60))
