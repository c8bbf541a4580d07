#!/usr/bin/env bash
# Runs every test of hsx. Works on a fresh machine: installs what is missing first.
#
#   1. unit tests (GoogleTest, via ctest); CUDA tests skip, saying why, without a GPU
#   2. the same unit tests under AddressSanitizer + UndefinedBehaviorSanitizer
#   3. the safetensors header fuzzer (libFuzzer) for HSX_FUZZ_SECONDS (default 60)
#   4. the device check's bundle (scripts/device-check.sh --prepare) and its run here, which must
#      say "no GPU" and exit 0 on a machine without one
#   5. the container image (scripts/image.sh): deploy/Dockerfile built with buildah on a cached
#      Debian base, the cpu-demo flow run inside it as uid 10001, broken Dockerfiles refused
#   6. the Python cross-checks against compressed-tensors and transformers, the deploy checks
#      (pytest; the image's binaries' flags included)
#   7. the trainers' own loaders on hsx output (scripts/trainers.sh: speculators, SpecForge,
#      ModelOpt in their own pinned environment, ~/.cache/hsx/trainers)
#
# Environment: HSX_VENV, HSX_BUILD_DIR (see setup.sh), HSX_FUZZ_SECONDS, HSX_IMAGE_CACHE (see
# image.sh), HSX_SKIP_IMAGE=1 (leave out stage 4; the image tests then skip, saying why).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build="${HSX_BUILD_DIR:-build}"
fuzz_seconds="${HSX_FUZZ_SECONDS:-60}"
venv="${HSX_VENV:-$HOME/.cache/hsx/venv}"
jobs=$(nproc)

stage() { printf '\n== %s\n' "$*"; }

stage "setup and build"
scripts/setup.sh --python

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

stage "unit tests under AddressSanitizer + UndefinedBehaviorSanitizer"
asan_build="${build}-asan"
if [[ ! -f "$asan_build/build.ninja" ]]; then
  cmake -S . -B "$asan_build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DHSX_ENABLE_CUDA=OFF \
    -DHSX_SANITIZE=address,undefined >/dev/null
fi
cmake --build "$asan_build" -j "$jobs" --target hsx_unit_tests
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$asan_build/bin/hsx_unit_tests" --gtest_brief=1

stage "fuzzing the safetensors header parser for ${fuzz_seconds}s"
fuzz_build="${build}-fuzz"
if [[ ! -f "$fuzz_build/build.ninja" ]]; then
  CC=clang CXX=clang++ cmake -S . -B "$fuzz_build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DHSX_ENABLE_CUDA=OFF -DHSX_BUILD_FUZZERS=ON -DHSX_SANITIZE=address,undefined >/dev/null
fi
cmake --build "$fuzz_build" -j "$jobs" --target safetensors_header_fuzzer
corpus=$(mktemp -d)
trap 'rm -rf "$corpus"' EXIT
cp tests/fuzz/seeds/* "$corpus/"
"$fuzz_build/bin/safetensors_header_fuzzer" "$corpus" -max_total_time="$fuzz_seconds" \
  -max_len=4096 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 2>&1 | tail -n 12

stage "device check: the bundle for a GPU machine, and its run here"
start=$SECONDS
scripts/device-check.sh --prepare --build-dir "$build"
device_report=$(mktemp -d)
trap 'rm -rf "$corpus" "$device_report"' EXIT
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
  # The image is there now: its tests in test_deploy.py must run, not skip.
  export HSX_IMAGE_TESTS=required
fi

stage "Python tests: oracle (transformers, compressed-tensors), service, clients, deploy"
HSX_BIN_DIR="$root/$build/bin" "$venv/bin/python" -m pytest tests/python -q

stage "trainers: speculators, SpecForge and ModelOpt loaders on hsx output (docs/trainers.md)"
await "$trainers_prep" "$prep_logs/trainers.log"
HSX_BUILD_DIR="$build" scripts/trainers.sh
