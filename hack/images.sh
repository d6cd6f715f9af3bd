#!/usr/bin/env bash
# Builds the engine and operator images of the Dockerfile without a Docker daemon or a registry, as CI
# does (`make images`): buildah and podman (installed with apt-get when missing; needs root), a Debian
# base bootstrapped with debootstrap instead of pulled, and layer caching, so a second run rebuilds only
# what changed.
#
#   bash hack/images.sh                 # build localhost/ddtree-engine:dev and localhost/ddtree-operator:dev
#   bash hack/images.sh podman ARGS...  # podman on the same storage, e.g. `podman images`, `podman run ...`
#
# Everything (image storage, the base's tarball) stays in DDTREE_IMAGES_DIR, default
# ~/.cache/ddtree/images, outside the repository; delete that folder to start from nothing.
# Env: DEBIAN_MIRROR (default: the first Debian mirror of this machine's apt sources).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
W=$(realpath -m "${DDTREE_IMAGES_DIR:-$HOME/.cache/ddtree/images}")
# The Debian release of the Dockerfile's default BASE (debian:bookworm-slim), bootstrapped here.
RELEASE=bookworm
BASE_IMAGE=localhost/debian-base:$RELEASE
ENGINE_IMAGE=localhost/ddtree-engine:dev
OPERATOR_IMAGE=localhost/ddtree-operator:dev
# This kernel mixes cgroup v1 and v2, which crun refuses: RUN steps in a chroot, containers under runc.
export BUILDAH_ISOLATION=chroot
BUILDAH=(buildah --root "$W/storage" --runroot "$W/run")
PODMAN=(podman --root "$W/storage" --runroot "$W/run" --tmpdir "$W/libpod" --runtime runc)

if [[ "${1:-}" == podman ]]; then
  shift
  exec "${PODMAN[@]}" "$@"
fi
[[ $# -eq 0 ]] || { echo "usage: $0 [podman ARGS...]" >&2; exit 2; }

say() { printf '==> %s\n' "$*"; }
debian_mirror() { # the first Debian archive of this machine's apt sources (one-line or deb822 format)
  local file
  for file in /etc/apt/sources.list /etc/apt/sources.list.d/*; do
    [[ -f "$file" ]] && grep -m1 -oE 'https?://[^ ]+/debian/?( |$)' "$file" | tr -d ' ' && return
  done
  echo http://deb.debian.org/debian
}
started=$SECONDS

if [[ $(id -u) -ne 0 ]]; then
  echo "hack/images.sh: needs root (apt-get, debootstrap, and buildah/podman with their storage in $W)" >&2
  exit 1
fi
tools=(buildah podman runc debootstrap)
missing=()
for tool in "${tools[@]}"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [[ ${#missing[@]} -gt 0 ]]; then
  say "installing ${missing[*]} (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${tools[@]}" >/dev/null
fi
mkdir -p "$W"

cleanup() { "${BUILDAH[@]}" rm --all >/dev/null 2>&1 || true; }  # working containers of a failed step
trap cleanup EXIT

if ! "${PODMAN[@]}" image exists "$BASE_IMAGE"; then
  tarball=$W/debian-$RELEASE.tar
  if [[ ! -f "$tarball" ]]; then
    mirror=${DEBIAN_MIRROR:-$(debian_mirror)}
    say "bootstrapping Debian $RELEASE from $mirror (a minute or two)"
    rootfs=$(mktemp -d "$W/rootfs.XXXXXX")
    debootstrap --variant=minbase "$RELEASE" "$rootfs" "$mirror" >"$W/debootstrap.log" 2>&1 \
      || { tail -n 20 "$W/debootstrap.log" >&2; rm -rf "$rootfs"; exit 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" --numeric-owner --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' \
      -cf "$tarball.part" .
    rm -rf "$rootfs"
    mv "$tarball.part" "$tarball"
  fi
  say "committing $BASE_IMAGE from $tarball"
  container=$("${BUILDAH[@]}" from scratch)
  "${BUILDAH[@]}" add "$container" "$tarball" / >/dev/null
  "${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/bash "$container"
  "${BUILDAH[@]}" commit --quiet --rm "$container" "$BASE_IMAGE" >/dev/null
fi

# pip inside RUN steps verifies PyPI with this machine's CA bundle (HTTPS may be re-signed by a proxy); the
# bundle is mounted for the build only and does not end up in an image.
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
build_args=(--build-arg "BASE=$BASE_IMAGE")
if [[ -f "$CA_BUNDLE" ]]; then
  build_args+=(-v "$CA_BUNDLE:/run/ci-ca.crt:ro" --build-arg PIP_CERT=/run/ci-ca.crt)
fi
for target in operator engine; do
  image=$OPERATOR_IMAGE
  [[ $target == engine ]] && image=$ENGINE_IMAGE
  say "building $image (--target $target)"
  t0=$SECONDS
  log=$W/build-$target.log
  # progress: the steps, and which of them came from the layer cache; the whole output goes to $log
  if ! "${BUILDAH[@]}" bud --layers --pull=never --network host "${build_args[@]}" \
      --target "$target" -t "$image" "$REPO" 2>&1 | tee "$log" | grep --line-buffered -E "^(\[[0-9]+/[0-9]+\] )?STEP|Using cache"; then
    echo "building $image failed; the end of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  say "$image: $(("${PODMAN[@]}" image inspect --format '{{.Size}}' "$image") | numfmt --to=iec) in $((SECONDS - t0)) s"
done
# Layers that no tag names any more (an older build's): reclaimed, or storage grows with every change.
"${PODMAN[@]}" image prune --force >/dev/null
say "images ready in $((SECONDS - started)) s (storage: $W; podman: bash hack/images.sh podman ...)"
