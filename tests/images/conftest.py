"""Fixtures for the tests of the built images (`make images`): hack/images.sh builds them into its own
podman storage, and these tests run them there with podman, as CI has no Docker daemon.

The control-plane fixtures (cluster, chart_installed, operator_kubeconfig, namespace) are the operator
tests' own, from tests/operator/conftest.py. Without the images these tests skip locally and fail under
CI=true, as the operator tests do without their binaries.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

OPERATOR_TESTS = pathlib.Path(__file__).resolve().parents[1] / "operator"
sys.path.insert(0, str(OPERATOR_TESTS))  # kube_testbed, the operator tests' helper module

from kube_testbed import HACK, load_hack_module  # noqa: E402

# What hack/images.sh tags.
ENGINE_IMAGE = "localhost/ddtree-engine:dev"
OPERATOR_IMAGE = "localhost/ddtree-operator:dev"

kwok_engines = load_hack_module("kwok_engines")


def _load_operator_fixtures():
    spec = importlib.util.spec_from_file_location("operator_fixtures", OPERATOR_TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_operator_fixtures = _load_operator_fixtures()
cluster = _operator_fixtures.cluster
chart_installed = _operator_fixtures.chart_installed
operator_kubeconfig = _operator_fixtures.operator_kubeconfig
namespace = _operator_fixtures.namespace


@pytest.fixture(scope="session")
def podman() -> kwok_engines.Podman:
    """podman on hack/images.sh's storage, once both images are there."""
    podman = kwok_engines.Podman(("bash", str(HACK / "images.sh"), "podman"))
    for image in (ENGINE_IMAGE, OPERATOR_IMAGE):
        found = subprocess.run([*podman.command, "image", "exists", image], capture_output=True, timeout=120)
        if found.returncode != 0:
            message = f"image {image} is missing; build it with `bash hack/images.sh` (or `make images`)"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
    return podman


@pytest.fixture(scope="session")
def engine_image(podman) -> str:
    return ENGINE_IMAGE


@pytest.fixture(scope="session")
def operator_image(podman) -> str:
    return OPERATOR_IMAGE


@pytest.fixture(scope="session")
def run_image(podman):
    """`podman run --rm` of an image with `options` (before the image) and `args` (after it)."""

    def run(image: str, *args: str, options: tuple[str, ...] = (), timeout: float = 600):
        command = [*podman.command, "run", "--rm", "--pull=never", *podman.run_options(), *options, image, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)

    return run
