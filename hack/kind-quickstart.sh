#!/usr/bin/env bash
# The quickstart of docs/operator.md for a machine with Docker, kind, kubectl and helm: a kind cluster,
# both images built and loaded, the chart installed, the CPU example applied, some traffic, and
# `kubectl get specdeploy` with AccLen and Tok/s. (CI cannot run it: it has no Docker engine; CI and
# hack/demo.sh use a kind-free local control plane instead.)
#
#   bash hack/kind-quickstart.sh          # KIND_CLUSTER=ddtree by default; delete with `kind delete cluster --name ddtree`
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CLUSTER=${KIND_CLUSTER:-ddtree}
TAG=0.1.0

kind create cluster --name "$CLUSTER"
docker build --target engine -t "ddtree-engine:$TAG" .
docker build --target operator -t "ddtree-operator:$TAG" .
kind load docker-image --name "$CLUSTER" "ddtree-engine:$TAG" "ddtree-operator:$TAG"
helm install ddtree charts/ddtree --namespace ddtree-system --create-namespace --wait
kubectl apply -f examples/smollm2-cpu.yaml
# First start converts the built-in SmolLM2 (its GGUF is in the engine image) and runs the engine's smoke test.
kubectl wait --for=jsonpath='{.status.phase}'=Ready specdeploy/smollm2-cpu --timeout=30m

kubectl port-forward svc/smollm2-cpu 8000:8000 >/dev/null &
FORWARD=$!
sleep 3
# Traffic in the background, so acceptance length and tokens/s have something to measure.
for i in $(seq 60); do
  curl -sf http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
    -d "{\"model\": \"smollm2\", \"prompt\": \"Count to $i in words.\", \"max_tokens\": 48}" >/dev/null
done &
TRAFFIC=$!
trap 'kill $TRAFFIC $FORWARD 2>/dev/null' EXIT
sleep 20  # a few scrape windows (spec.metrics.scrapeIntervalSeconds is 5 in the example)
kubectl get specdeploy
