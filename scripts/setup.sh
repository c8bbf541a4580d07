#!/usr/bin/env bash
# Installs what hsx needs (idempotently), then configures and builds into build/.
#
#   scripts/setup.sh             Debian packages + build
#   scripts/setup.sh --python    also the Python test tools (virtual environment)
#   scripts/setup.sh --targets "hsx-server hsx-dump"   build only these targets (default: all)
#
# Environment: HSX_VENV (default ~/.cache/hsx/venv) for the Python tools,
# HSX_BUILD_DIR (default build) for the build tree.
set -euo pipefail
cd "$(dirname "$0")/.."

with_python=0
targets=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) with_python=1; shift ;;
    --targets)
      [[ $# -ge 2 && -n "$2" ]] || { echo "setup.sh: --targets needs a list of build targets" >&2; exit 2; }
      read -r -a targets <<<"$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

# Debian packages (bookworm): compilers, build tools and the libraries hsx links.
packages=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev nlohmann-json3-dev libxxhash-dev libgtest-dev libgmock-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  prometheus-cpp-dev grpc-proto clang libclang-rt-14-dev python3-venv
  patchelf  # scripts/device-check.sh --prepare: the bundle's RPATH
  pybind11-dev python3-dev  # the Python client's native receive path (client/python/native/)
  ccache    # reuses unchanged files' compiles across fresh clones (CMakeLists.txt)
)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
# kubectl renders the Kubernetes manifests in the tests; Debian's kubernetes-client
# provides it unless another kubectl is already installed (it would conflict).
command -v kubectl >/dev/null 2>&1 || missing+=(kubernetes-client)
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

if ((with_python)); then
  venv="${HSX_VENV:-$HOME/.cache/hsx/venv}"
  requirements=tests/python/requirements.txt
  stamp="$venv/.hsx-requirements"
  if [[ ! -x "$venv/bin/python" ]]; then
    echo "setup: creating the Python test environment in $venv"
    python3 -m venv "$venv"
  fi
  if ! cmp -s "$requirements" "$stamp"; then
    echo "setup: installing Python test tools (pinned, $requirements)"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q -r "$requirements"
    cp "$requirements" "$stamp"
  fi
  # The cuDNN frontend's C++ headers (cudnn_frontend.h, header-only) for the CUDA
  # backend's --attention=cudnn; CMake finds them in this venv at configure time,
  # so this comes before the configure below. --no-deps: only the headers are
  # used (the package's Python side pulls in large CUTLASS wheels).
  cudnn_frontend=nvidia-cudnn-frontend==1.32.0
  if ! "$venv/bin/pip" show -q nvidia-cudnn-frontend 2>/dev/null ||
     [[ $("$venv/bin/pip" show nvidia-cudnn-frontend | sed -n 's/^Version: //p') != "${cudnn_frontend#*==}" ]]; then
    echo "setup: installing the cuDNN frontend headers ($cudnn_frontend)"
    "$venv/bin/pip" install -q --no-deps "$cudnn_frontend"
  fi
fi

build="${HSX_BUILD_DIR:-build}"
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
jobs=$(nproc)
if ((${#targets[@]})); then
  cmake --build "$build" -j "$jobs" --target "${targets[@]}"
else
  cmake --build "$build" -j "$jobs"
fi

if ((with_python)); then
  # The Python package itself (client/python), rebuilt each time: its stubs come
  # from proto/, and its native receive path (hsx._native) from this build.
  native=$(ls "$build"/python/hsx/_native.*.so 2>/dev/null | head -n 1 || true)
  HSX_NATIVE_MODULE="${native:+$(realpath "$native")}" "$venv/bin/pip" install -q ./client/python
fi
