"""Play kubelet for engine pods on the kwok test cluster: run the real `ddtree serve` for each pod.

kwok fakes pods (Running, Ready, an IP from 127.1.0.0/16) but runs no container. This runs the pod's
own container command and args (`ddtree serve ...` as the operator rendered them) as a local process
bound to the pod IP, and reports back what a kubelet would: Ready only once the engine's /ready answers
200, and on exit the termination message the engine wrote (else its log tail, as with
FallbackToLogsOnError). A bounded load generator sends completions so the engines' metrics move.

    python hack/kwok_engines.py --kubeconfig K --namespace default --instance smollm2-cpu --load --seconds 600

Only loopback pod IPs are ever contacted.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime
import ipaddress
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import kubernetes
import yaml

OWNER_LABEL = "ddtree.dev/speculativedeployment"
# Paths that only exist inside the engine image; the local process keeps the host's own.
IMAGE_ONLY_ENV = {"DDTREE_CACHE", "HF_HOME", "HF_HUB_OFFLINE"}
LOG_TAIL_BYTES = 4096
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a binary search tree is.",
    "List three uses of a paperclip.",
    "Describe the water cycle in two sentences.",
]


def serve_available() -> tuple[bool, str]:
    """Whether this environment has `ddtree serve` (the engine's HTTP server)."""
    probe = subprocess.run(
        [sys.executable, "-m", "ddtree", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    return probe.returncode == 0, (probe.stderr or probe.stdout).strip()[-500:]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _replace_flag(args: list[str], flag: str, value: str) -> list[str]:
    args = list(args)
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    return args


@dataclasses.dataclass
class EnginePod:
    name: str
    ip: str
    port: int
    model: str  # what clients name in requests
    process: subprocess.Popen
    termination_log: pathlib.Path
    log: pathlib.Path
    ready: bool = False
    finished: bool = False
    api_key: str | None = None  # the first key of a mounted API key file, for the traffic


class EngineRunner:
    """Runs one `ddtree serve` per Running pod of one SpeculativeDeployment, until stopped."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, instance: str, workdir: pathlib.Path):
        self.core = kubernetes.client.CoreV1Api(api)
        self.namespace = namespace
        self.instance = instance
        self.workdir = workdir
        self.pods: dict[str, EnginePod] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.requests_sent = 0
        self.request_errors: list[str] = []

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, load: bool = False, load_seconds: float = 900.0) -> EngineRunner:
        self._threads.append(threading.Thread(target=self._supervise, daemon=True))
        if load:
            self._threads.append(threading.Thread(target=self._load, args=(load_seconds,), daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        for pod in self.pods.values():
            if pod.process.poll() is None:
                pod.process.terminate()
                try:
                    pod.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pod.process.kill()
                    pod.process.wait()

    def __enter__(self) -> EngineRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ({p.log}) ---\n{p.log.read_text(errors='replace')[-3000:]}"
            for p in self.pods.values()
            if p.log.exists()
        )

    # -- kubelet ----------------------------------------------------------------------------------
    def _supervise(self) -> None:
        while not self._stop.is_set():
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"{OWNER_LABEL}={self.instance}")
            for pod in pods.items:
                if pod.metadata.deletion_timestamp is not None:
                    self._kill(pod.metadata.name)
                elif pod.metadata.name not in self.pods and pod.status.phase == "Running" and pod.status.pod_ip:
                    self._launch(pod)
            live = {p.metadata.name for p in pods.items}
            for name in list(self.pods):
                if name not in live:
                    self._kill(name)
            for engine in self.pods.values():
                self._check(engine)
            self._stop.wait(1.0)

    def _launch(self, pod) -> None:
        ip = pod.status.pod_ip
        if not ipaddress.ip_address(ip).is_loopback:
            raise RuntimeError(f"pod {pod.metadata.name} has IP {ip}: refusing anything but loopback")
        container = pod.spec.containers[0]
        command = list(container.command or []) + list(container.args or [])
        if command[:2] != ["ddtree", "serve"]:
            raise RuntimeError(f"pod {pod.metadata.name} does not run `ddtree serve`: {command}")
        termination_log = self.workdir / f"{pod.metadata.name}.termination-log"
        log = self.workdir / f"{pod.metadata.name}.log"
        secrets = self._local_secrets(pod)
        args, config = self._local_config(pod, command[1:], secrets)
        # flags override the configuration file: the pod's IP and a termination log on this machine
        args = _replace_flag(args, "--host", ip)
        args = _replace_flag(args, "--termination-log", str(termination_log))
        serving, model_ref = config.get("serving", {}), config.get("model", {})
        port = int(args[args.index("--port") + 1]) if "--port" in args else int(serving.get("port", 8000))
        if "--served-model-name" in args or "--model" in args:
            flag = "--served-model-name" if "--served-model-name" in args else "--model"
            model = args[args.index(flag) + 1]
        else:
            model = serving.get("served_model_name") or model_ref["id"]
        env = dict(os.environ)
        for var in container.env or []:
            if var.value is not None and var.name not in IMAGE_ONLY_ENV:
                env[var.name] = var.value
        # Not ready until the engine says so (kwok marked it Ready the moment it was scheduled).
        self._set_status(pod.metadata.name, ready=False, state={"running": {"startedAt": _now()}})
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "ddtree", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        key_file = serving.get("api_key_file")
        api_key = pathlib.Path(key_file).read_text().split()[0] if key_file else None
        self.pods[pod.metadata.name] = EnginePod(
            pod.metadata.name, ip, port, model, process, termination_log, log, api_key=api_key
        )

    def _local_secrets(self, pod) -> dict[str, str]:
        """The pod's Secret volumes written to this machine, as kubelet would mount them:
        {mount path in the pod: local folder}."""
        mounts = {m.name: m.mount_path for m in pod.spec.containers[0].volume_mounts or []}
        local = {}
        for volume in pod.spec.volumes or []:
            if volume.secret is None or volume.name not in mounts:
                continue
            data = self.core.read_namespaced_secret(volume.secret.secret_name, self.namespace).data or {}
            folder = self.workdir / f"{pod.metadata.name}.{volume.name}"
            folder.mkdir(exist_ok=True)
            items = volume.secret.items or [kubernetes.client.V1KeyToPath(key=k, path=k) for k in data]
            for item in items:
                (folder / item.path).write_bytes(base64.b64decode(data[item.key]))
            local[mounts[volume.name]] = str(folder)
        return local

    def _local_config(self, pod, args: list[str], secrets: dict[str, str]) -> tuple[list[str], dict]:
        """The pod's `--config` file, read from the ConfigMap mounted there, with paths into Secret volumes
        pointed at their local copies (`secrets`), written to this machine, and the arguments pointing at
        that copy; (args, {}) when the pod has no `--config`."""
        if "--config" not in args:
            return args, {}
        path = pathlib.PurePosixPath(args[args.index("--config") + 1])
        mounts = {m.name: m.mount_path for m in pod.spec.containers[0].volume_mounts or []}
        source = next(
            (
                v.config_map.name
                for v in pod.spec.volumes or []
                if v.config_map is not None and mounts.get(v.name) == str(path.parent)
            ),
            None,
        )
        if source is None:
            raise RuntimeError(f"pod {pod.metadata.name}: no ConfigMap mounted at {path.parent} for --config {path}")
        config = yaml.safe_load(self.core.read_namespaced_config_map(source, self.namespace).data[path.name])
        for section in config.values():
            for key, value in (section or {}).items():
                for mounted, folder in secrets.items():
                    if isinstance(value, str) and value.startswith(mounted + "/"):
                        section[key] = folder + value[len(mounted) :]
        local = self.workdir / f"{pod.metadata.name}.{path.name}"
        local.write_text(yaml.safe_dump(config))
        return _replace_flag(args, "--config", str(local)), config

    def _check(self, engine: EnginePod) -> None:
        if engine.finished:
            return
        code = engine.process.poll()
        if code is not None:
            engine.finished, engine.ready = True, False
            message = engine.termination_log.read_text().strip() if engine.termination_log.exists() else ""
            if not message and code != 0:  # FallbackToLogsOnError
                message = engine.log.read_bytes()[-LOG_TAIL_BYTES:].decode(errors="replace").strip()
            terminated = {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "message": message,
                "startedAt": _now(),
                "finishedAt": _now(),
            }
            self._set_status(engine.name, ready=False, state={"terminated": terminated})
            return
        ready = self._get(engine, "/ready") == 200
        if ready != engine.ready:
            engine.ready = ready
            self._set_status(engine.name, ready=ready, state={"running": {"startedAt": _now()}})

    def _kill(self, name: str) -> None:
        engine = self.pods.pop(name, None)
        if engine is not None and engine.process.poll() is None:
            engine.process.terminate()
            try:
                engine.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                engine.process.kill()

    def _set_status(self, name: str, ready: bool, state: dict) -> None:
        flag = "True" if ready else "False"
        # A strategic merge would keep the old state's key next to the new one: null the others.
        state = {key: state.get(key) for key in ("waiting", "running", "terminated")}
        body = {
            "status": {
                "conditions": [
                    {"type": "Ready", "status": flag, "lastTransitionTime": _now()},
                    {"type": "ContainersReady", "status": flag, "lastTransitionTime": _now()},
                ],
                "containerStatuses": [
                    {
                        "name": "engine",
                        "ready": ready,
                        "restartCount": 0,
                        "image": "ddtree-engine",
                        "imageID": "",
                        "state": state,
                        "started": "running" in state,
                    }
                ],
            }
        }
        try:
            self.core.patch_namespaced_pod_status(name, self.namespace, body)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:  # the pod may be gone already
                raise

    @staticmethod
    def _get(engine: EnginePod, path: str, timeout: float = 2.0) -> int | None:
        try:
            with urllib.request.urlopen(f"http://{engine.ip}:{engine.port}{path}", timeout=timeout) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None

    # -- traffic ----------------------------------------------------------------------------------
    def _load(self, seconds: float) -> None:
        """Sequential completions to ready engines, at most `seconds` long: metrics need traffic."""
        deadline = time.monotonic() + seconds
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        turn = 0
        while not self._stop.is_set() and time.monotonic() < deadline:
            ready = [p for p in self.pods.values() if p.ready and not p.finished]
            if not ready:
                self._stop.wait(1.0)
                continue
            engine = ready[turn % len(ready)]
            prompt = PROMPTS[turn % len(PROMPTS)]
            body = json.dumps({"model": engine.model, "prompt": prompt, "max_tokens": 32, "temperature": 0}).encode()
            headers = {"Content-Type": "application/json"}
            if engine.api_key:
                headers["Authorization"] = f"Bearer {engine.api_key}"
            request = urllib.request.Request(
                f"http://{engine.ip}:{engine.port}/v1/completions", data=body, headers=headers
            )
            turn += 1
            try:
                with opener.open(request, timeout=120) as response:
                    response.read()
                self.requests_sent += 1
            except OSError as exc:
                self.request_errors.append(f"{engine.name}: {exc}")
                self._stop.wait(1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--instance", required=True, help="name of the SpeculativeDeployment")
    parser.add_argument("--load", action="store_true", help="also send completions to ready engines")
    parser.add_argument("--seconds", type=float, default=600, help="stop after this long")
    args = parser.parse_args()
    ok, detail = serve_available()
    if not ok:
        print(f"`python -m ddtree serve` is not available: {detail}", file=sys.stderr)
        return 2
    api = kubernetes.config.new_client_from_config(config_file=args.kubeconfig)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop the engines too, not only this process
        signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="kwok-engines-") as work:
        with EngineRunner(api, args.namespace, args.instance, pathlib.Path(work)).start(args.load, args.seconds):
            stop.wait(args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
