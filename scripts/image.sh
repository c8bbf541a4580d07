#!/usr/bin/env bash
# Builds the CPU-only container image from deploy/Dockerfile without a Docker engine, and runs
# the cpu-demo flow inside it as the image's user:
#
#   1. a Debian bookworm minbase root filesystem made with mmdebstrap, cached in
#      $HSX_IMAGE_CACHE/debian-bookworm-minbase.tar and imported as localhost/hsx-base:bookworm
#      (both reused when present; --refresh-base makes them again);
#   2. buildah bud --isolation chroot --layers deploy/Dockerfile with that base for both stages
#      and HSX_ENABLE_CUDA=OFF, tagged with the cpu-demo overlay's image (localhost/hsx-cpu:0.1.0,
#      read from deploy/k8s/overlays/cpu-demo/kustomization.yaml); unchanged steps come from the
#      layer cache;
#   3. checks of the image: user 10001, entrypoint hsx-server, no compiler or linker (gcc cc
#      c++ g++ clang clang++ nvcc ld), every binary's libraries resolve;
#   4. in a container of the image (buildah run --isolation chroot --user 10001:10001):
#      hsx-make-model --preset tiny, hsx-server in the background, hsx-dump --server against it
#      with the cpu-demo samples, hsx-verify --strict, SIGTERM (the server drains, exits 0);
#   5. two deliberately broken copies of the Dockerfile (a COPY of a missing path before the
#      compile, one after it) must fail to build (--skip-broken leaves this out).
#
# --base-only stops after step 1 (the network-bound part; scripts/test.sh runs it in the
# background while the CPU-bound stages run).
#
# Prints the image size and the time of each step. Exits non-zero, saying what failed, on any
# failure; removes the containers it created. Needs root (or sudo) for buildah and mmdebstrap.
#
# podman run does not work on these machines (crun: "cgroups in hybrid mode not supported"),
# hence buildah's chroot isolation for running things in the image.
#
# Environment: HSX_IMAGE_CACHE (default ~/.cache/hsx/image), HSX_DEBIAN_MIRROR (default
# http://deb.debian.org/debian; security updates come from its -security sibling,
# HSX_DEBIAN_SECURITY_MIRROR), HSX_IMAGE_TIMEOUT (seconds for the demo, default 600).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

refresh_base=0
check_broken=1
base_only=0
for arg in "$@"; do
  case "$arg" in
    --refresh-base) refresh_base=1 ;;
    --skip-broken) check_broken=0 ;;
    --base-only) base_only=1 ;;  # tools and the cached base only (test.sh starts this early, in the background)
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "image.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

fail() { printf 'image.sh: FAILED: %s\n' "$*" >&2; exit 1; }
t_start=$(date +%s)
step_start=$t_start
step() {
  local now; now=$(date +%s)
  [[ -n "${step_name:-}" ]] && printf '   (%s: %ss)\n' "$step_name" "$((now - step_start))" && timings+=("$step_name $((now - step_start))s")
  step_name=$1; step_start=$now
  printf '\n== image: %s\n' "$1"
}
timings=()

sudo_cmd=()
[[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
buildah() { "${sudo_cmd[@]}" env BUILDAH_ISOLATION=chroot buildah "$@"; }

# --- tools -------------------------------------------------------------------------------------
step "tools"
# buildah brings uidmap, containers-common and the image libraries; as root the overlay storage
# driver works natively on ext4/xfs (no fuse-overlayfs), and chroot isolation needs no OCI
# runtime (crun/runc) and no cgroups.
missing=()
for package in mmdebstrap buildah; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  echo "installing ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null || fail "apt-get install ${missing[*]}"
fi
echo "$(buildah --version), mmdebstrap $(mmdebstrap --version | awk '{print $2}')"

# The image name and tag the cpu-demo overlay deploys (images: - name: hsx, newName, newTag).
kustomization=deploy/k8s/overlays/cpu-demo/kustomization.yaml
image_name=$(sed -n 's/^ *newName: *//p' "$kustomization" | head -n 1)
image_tag=$(sed -n 's/^ *newTag: *//p' "$kustomization" | head -n 1)
[[ -n "$image_name" && -n "$image_tag" ]] || fail "$kustomization: no images: newName/newTag"
image="localhost/$image_name:$image_tag"

# --- base --------------------------------------------------------------------------------------
step "Debian bookworm minbase base image"
cache="${HSX_IMAGE_CACHE:-$HOME/.cache/hsx/image}"
mirror="${HSX_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security="${HSX_DEBIAN_SECURITY_MIRROR:-${mirror}-security}"
base=localhost/hsx-base:bookworm
rootfs="$cache/debian-bookworm-minbase.tar"
mkdir -p "$cache"
if ((refresh_base)) || [[ -d "$rootfs" ]]; then  # (a directory: left by an earlier version)
  rm -rf "$rootfs"
  buildah rmi -f "$base" >/dev/null 2>&1 || true
fi
if [[ ! -f "$rootfs" ]]; then
  echo "mmdebstrap --variant=minbase bookworm (from $mirror) -> $rootfs"
  # Like Debian's -slim images: no manual pages, info, translations or docs (the copyright
  # files stay); the dpkg options are kept in the base, so the image's own apt-get installs
  # follow them too.
  rm -rf "$cache/rootfs.tmp.tar"
  "${sudo_cmd[@]}" mmdebstrap --quiet --variant=minbase --mode=root --format=tar \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    bookworm "$cache/rootfs.tmp.tar" \
    "deb $mirror bookworm main" "deb $mirror bookworm-updates main" "deb $security bookworm-security main" \
    </dev/null || fail "mmdebstrap could not make the base (mirror $mirror)"
  mv "$cache/rootfs.tmp.tar" "$rootfs"
  buildah rmi -f "$base" >/dev/null 2>&1 || true
else
  echo "cached: $rootfs ($(du -m "$rootfs" | cut -f1) MB, $(date -u -r "$rootfs" '+%F %H:%M UTC'))"
fi
if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
  echo "importing $rootfs as $base"
  ctr=$(buildah from --pull=never scratch)
  buildah add "$ctr" "$rootfs" / >/dev/null && buildah config --cmd /bin/bash "$ctr" &&
    buildah commit -q "$ctr" "$base" >/dev/null || { buildah rm "$ctr" >/dev/null; fail "importing $rootfs"; }
  buildah rm "$ctr" >/dev/null
else
  echo "present: $base"
fi
if ((base_only)); then
  echo "image.sh: base ready ($(($(date +%s) - t_start)) s)"
  exit 0
fi

# --- build -------------------------------------------------------------------------------------
build_args=(--build-arg "BUILD_IMAGE=$base" --build-arg "RUNTIME_IMAGE=$base" --build-arg HSX_ENABLE_CUDA=OFF)
bud() {  # bud DOCKERFILE TAG LOG: the image build, niced (the compile shares the machine); each
         # STEP line of the log is prefixed with the seconds since the build started
  local t0 line
  t0=$(date +%s)
  nice -n 5 "${sudo_cmd[@]}" env BUILDAH_ISOLATION=chroot buildah bud --isolation chroot --layers --pull=never \
    --force-rm --ignorefile deploy/Dockerfile.dockerignore -f "$1" "${build_args[@]}" -t "$2" . 2>&1 |
    while IFS= read -r line; do
      if [[ "$line" == *"STEP "[0-9]* || "$line" == *"Using cache"* || "$line" == *"COMMIT "* ]]; then
        printf '%5ss %s\n' "$(($(date +%s) - t0))" "$line"
      else
        printf '%s\n' "$line"
      fi
    done >"$3"
  return "${PIPESTATUS[0]}"
}
step "buildah bud deploy/Dockerfile -> $image"
log="$cache/build.log"
if ! bud deploy/Dockerfile "$image" "$log"; then
  tail -n 40 "$log" >&2
  fail "the image build failed (whole log: $log)"
fi
grep -E '^ *[0-9]+s |runtime packages for' "$log" | cut -c1-160 | sed 's/^/  /' || true

# --- checks of the image ---------------------------------------------------------------------------
step "image configuration and contents"
user=$(buildah inspect --type image --format '{{.OCIv1.Config.User}}' "$image")
entry=$(buildah inspect --type image --format '{{.OCIv1.Config.Entrypoint}}' "$image")
size=$(buildah images --format '{{.Size}}' "$image" | head -n 1)
echo "image $image: $size, user $user, entrypoint $entry"
[[ "$user" == 10001:10001 ]] || fail "the image's user is '$user', not 10001:10001"
[[ "$entry" == '[/usr/local/bin/hsx-server]' ]] || fail "the image's entrypoint is $entry"

containers=()
cleanup() {
  for c in "${containers[@]}"; do buildah rm "$c" >/dev/null 2>&1 || true; done
  [[ -n "${broken_dir:-}" ]] && rm -rf "$broken_dir"
}
trap cleanup EXIT
ctr=$(buildah from --pull=never "$image") || fail "buildah from $image"
containers+=("$ctr")
run() { buildah run --isolation chroot "$@"; }

run "$ctr" -- sh -c 'found=0
  for c in gcc cc c++ g++ clang clang++ nvcc ld; do
    if command -v "$c"; then found=1; fi
  done
  exit "$found"' || fail "the runtime image holds a compiler or linker (listed above)"
echo "no compiler or linker in the image: gcc cc c++ g++ clang clang++ nvcc ld all absent"
run "$ctr" -- sh -c 'for b in /usr/local/bin/hsx-*; do
    if ldd "$b" | grep "not found"; then exit 1; fi; done' || fail "a binary lacks a shared library"
echo "installed runtime packages (derived from ldd in the build stage):" \
  $(run "$ctr" -- cat /usr/local/share/hsx/runtime-packages.txt)

# --- the cpu-demo flow, as the image's user ------------------------------------------------------
step "cpu-demo flow inside the image as uid 10001"
buildah copy --chown 10001:10001 "$ctr" deploy/k8s/overlays/cpu-demo/samples.jsonl /tmp/demo-input/samples.jsonl >/dev/null
demo_log="$cache/demo.log"
demo_script='set -eu
echo "running as uid $(id -u) gid $(id -g)"
[ "$(id -u)" = 10001 ] || { echo "not uid 10001"; exit 1; }
cd /tmp
hsx-make-model --preset tiny --seed 0 --out /tmp/models/tiny
hsx-server --model=/tmp/models/tiny --device=cpu --threads=2 --capture=eagle3 \
  --listen=127.0.0.1:0 --drain-timeout=20s 2>/tmp/server.log &
server=$!
address=""
i=0
while [ $i -lt 600 ]; do
  address=$(sed -n "s/.*hsx-server: listening on \([^ ]*\).*/\1/p" /tmp/server.log | head -n 1)
  if [ -n "$address" ] && grep -q ready /tmp/server.log; then break; fi
  kill -0 $server 2>/dev/null || { cat /tmp/server.log; echo "hsx-server exited during start-up"; exit 1; }
  sleep 0.1; i=$((i + 1))
done
grep -q ready /tmp/server.log || { cat /tmp/server.log; echo "hsx-server did not become ready"; exit 1; }
echo "hsx-server (pid $server) ready on $address"
hsx-dump --server "$address" --input /tmp/demo-input/samples.jsonl --out /tmp/out --concurrency 8 \
  --progress=none
hsx-verify /tmp/out --input /tmp/demo-input/samples.jsonl --strict
kill -TERM $server
status=0; wait $server || status=$?
tail -n 3 /tmp/server.log
[ $status -eq 0 ] || { echo "hsx-server exited with status $status after SIGTERM, not 0"; exit 1; }
grep -q drain /tmp/server.log || { echo "no drain in the server log after SIGTERM"; exit 1; }
echo "files written: $(ls /tmp/out | grep -c safetensors) safetensors + manifest.jsonl"'
if ! timeout "${HSX_IMAGE_TIMEOUT:-600}" "${sudo_cmd[@]}" env BUILDAH_ISOLATION=chroot \
     buildah run --isolation chroot --user 10001:10001 "$ctr" -- sh -c "$demo_script" >"$demo_log" 2>&1; then
  tail -n 40 "$demo_log" >&2
  fail "the cpu-demo flow inside the image failed (log: $demo_log)"
fi
sed 's/^/  /' "$demo_log"

# --- broken Dockerfiles must fail --------------------------------------------------------------
if ((check_broken)); then
  step "deliberately broken Dockerfiles fail to build"
  broken_dir=$(mktemp -d)
  # One COPY before the compile (the sources), one after it (a binary from the build stage).
  mutations=('s|^COPY \. \.$|COPY ./no-such-dir-hsx .|'
             's|/out/bin/hsx-verify |/out/bin/hsx-verfy |')
  missing_paths=(no-such-dir-hsx hsx-verfy)
  for i in "${!mutations[@]}"; do
    broken="$broken_dir/Dockerfile.$i"
    sed "${mutations[$i]}" deploy/Dockerfile >"$broken"
    cmp -s deploy/Dockerfile "$broken" && fail "mutation '${mutations[$i]}' changed nothing in deploy/Dockerfile"
    t0=$(date +%s)
    if bud "$broken" "localhost/hsx-broken:$i" "$broken_dir/log.$i"; then
      buildah rmi "localhost/hsx-broken:$i" >/dev/null 2>&1 || true
      fail "deploy/Dockerfile with '${mutations[$i]}' built without error"
    fi
    grep -q "${missing_paths[$i]}" "$broken_dir/log.$i" ||
      { tail -n 20 "$broken_dir/log.$i" >&2; fail "the broken build failed without naming ${missing_paths[$i]}"; }
    echo "'${mutations[$i]}': build failed in $(($(date +%s) - t0))s:" \
      "$(grep -m1 -iE 'error|no such' "$broken_dir/log.$i" | cut -c1-200)"
  done
fi

now=$(date +%s)
timings+=("$step_name $((now - step_start))s")
printf '\n== image: OK: %s (%s) built and ran the cpu-demo flow as uid 10001 in %ss\n' \
  "$image" "$size" "$((now - t_start))"
printf '   steps: %s\n' "$(IFS=,; echo "${timings[*]}" | sed 's/,/, /g')"
