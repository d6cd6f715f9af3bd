"""Play kubelet for engine pods on the kwok test cluster: run the real `ddtree serve` for each pod.

kwok fakes pods (Running, Ready, an IP from 127.1.0.0/16) but runs no container. This runs the pod's
own container command and args (`ddtree serve ...` as the operator rendered them) bound to the pod IP,
and reports back what a kubelet would: Ready only once the engine's /ready answers 200, and on exit the
termination message the engine wrote (else its log tail, as with FallbackToLogsOnError). A bounded load
generator sends completions so the engines' metrics move.

By default the command runs as a local process of this environment's Python. With --podman it runs in
the pod's image instead, as a container on the host network with the pod's user, environment and
volumes (ConfigMap, Secret, emptyDir; /dev/shm), like a kubelet would start it.

    python hack/kwok_engines.py --kubeconfig K --namespace default --instance smollm2-cpu --load --seconds 600
    python hack/kwok_engines.py ... --podman "bash hack/images.sh podman"   # the engine image, not .venv

Only loopback pod IPs are ever contacted.
"""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import datetime
import ipaddress
import json
import os
import pathlib
import resource
import shlex
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
# Sandboxed hosts may refuse a container more processes than this even below the hard limit (seen: 65536
# refused, 32768 accepted, hard limit 96363); an engine needs far fewer.
NPROC_LIMIT = 32768
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


@dataclasses.dataclass(frozen=True)
class Podman:
    """Run pods in their images: `command` is podman with its global flags (storage, runtime)."""

    command: tuple[str, ...]

    def run_options(self) -> list[str]:
        """Options of every `podman run`: no host proxy settings (a pod has none), and resource limits that
        runc can set where even root may not raise them (podman's defaults are higher): this process's
        hard limit of open files, and at most NPROC_LIMIT processes."""
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], NPROC_LIMIT)
        return ["--http-proxy=false", f"--ulimit=nofile={nofile}:{nofile}", f"--ulimit=nproc={nproc}:{nproc}"]


def _podman_size(quantity: str) -> str:
    """A Kubernetes quantity (256Mi) as podman writes sizes (256m)."""
    for suffix, unit in (("Ki", "k"), ("Mi", "m"), ("Gi", "g")):
        if quantity.endswith(suffix):
            return quantity.removesuffix(suffix) + unit
    return quantity


def _local_path(path: str, secrets: dict[str, str]) -> str:
    """`path` in the pod, as its copy on this machine when it lies in a Secret volume ({mount path: folder})."""
    for mounted, folder in secrets.items():
        if path.startswith(mounted + "/"):
            return folder + path[len(mounted) :]
    return path


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
    container: str | None = None  # the podman container's name, when run in the pod's image
    ready: bool = False
    finished: bool = False
    api_key: str | None = None  # the first key of a mounted API key file, for the traffic


class EngineRunner:
    """Runs one `ddtree serve` per Running pod of one SpeculativeDeployment, until stopped: a local process,
    or with `podman` a container of the pod's image."""

    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        namespace: str,
        instance: str,
        workdir: pathlib.Path,
        podman: Podman | None = None,
    ):
        self.core = kubernetes.client.CoreV1Api(api)
        self.podman = podman
        self.namespace = namespace
        self.instance = instance
        self.workdir = workdir
        self.pods: dict[str, EnginePod] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.requests_sent = 0
        self.request_errors: list[str] = []

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, load: bool = False, load_seconds: float = 900.0, ignore_eos: bool = False) -> EngineRunner:
        """`ignore_eos`: every completion runs its whole max_tokens (the engine's extension), so each request
        adds the same number of speculative rounds whatever the prompt."""
        self._threads.append(threading.Thread(target=self._supervise, daemon=True))
        if load:
            self._threads.append(threading.Thread(target=self._load, args=(load_seconds, ignore_eos), daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        for engine in self.pods.values():
            self._terminate(engine)

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
        args, config = command[1:], self._pod_config(pod, command[1:])
        if self.podman is None:
            args = self._local_config(pod, args, config, secrets)
            args = _replace_flag(args, "--termination-log", str(termination_log))
        # the pod's IP overrides the configuration file's host (0.0.0.0: every address of the pod)
        args = _replace_flag(args, "--host", ip)
        serving, model_ref = config.get("serving", {}), config.get("model", {})
        port = int(args[args.index("--port") + 1]) if "--port" in args else int(serving.get("port", 8000))
        if "--served-model-name" in args or "--model" in args:
            flag = "--served-model-name" if "--served-model-name" in args else "--model"
            model = args[args.index(flag) + 1]
        else:
            model = serving.get("served_model_name") or model_ref["id"]
        if self.podman is None:
            argv, env, name = [sys.executable, "-m", "ddtree", *args], self._local_env(container), None
        else:
            name = f"kwok-{pod.metadata.name}"
            argv, env = self._container_command(pod, name, [command[0], *args], termination_log, secrets), None
        # Not ready until the engine says so (kwok marked it Ready the moment it was scheduled).
        self._set_status(pod.metadata.name, ready=False, state={"running": {"startedAt": _now()}})
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        key_file = serving.get("api_key_file")
        api_key = pathlib.Path(_local_path(key_file, secrets)).read_text().split()[0] if key_file else None
        self.pods[pod.metadata.name] = EnginePod(
            pod.metadata.name, ip, port, model, process, termination_log, log, container=name, api_key=api_key
        )

    @staticmethod
    def _local_env(container) -> dict[str, str]:
        env = dict(os.environ)
        for var in container.env or []:
            if var.value is not None and var.name not in IMAGE_ONLY_ENV:
                env[var.name] = var.value
        return env

    def _container_command(
        self, pod, name: str, command: list[str], termination_log: pathlib.Path, secrets: dict[str, str]
    ) -> list[str]:
        """`podman run` of the pod's container: its image, user, security settings, environment and volumes,
        on the host network (the engine binds the pod's IP, a loopback address)."""
        container = pod.spec.containers[0]
        argv = [*self.podman.command, "run", "--rm", "--replace", f"--name={name}", "--pull=never", "--network=host"]
        argv += self.podman.run_options()
        security = pod.spec.security_context
        if security is not None and security.run_as_user is not None:
            group = f":{security.run_as_group}" if security.run_as_group is not None else ""
            argv.append(f"--user={security.run_as_user}{group}")
        if security is not None and security.fs_group is not None:
            argv.append(f"--group-add={security.fs_group}")
        context = container.security_context
        if context is not None:
            if context.allow_privilege_escalation is False:
                argv.append("--security-opt=no-new-privileges")
            for capability in (context.capabilities.drop or []) if context.capabilities else []:
                argv.append(f"--cap-drop={capability}")
            if context.read_only_root_filesystem:
                argv.append("--read-only")
        # The termination message file, a file of this machine (the engine runs as the pod's user).
        termination_log.write_text("")
        termination_log.chmod(0o666)
        argv.append(f"--volume={termination_log}:{container.termination_message_path}")
        argv += self._container_volumes(pod, secrets)
        for var in container.env or []:
            if var.value is not None:
                argv.append(f"--env={var.name}={var.value}")
        return [*argv, f"--entrypoint={command[0]}", container.image, *command[1:]]

    def _container_volumes(self, pod, secrets: dict[str, str]) -> list[str]:
        """--volume / --shm-size options for the pod's volume mounts, from folders of this machine: the
        Secrets' copies, the ConfigMaps' files, emptyDirs owned by the pod's fsGroup (as kubelet makes them)."""
        volumes = {v.name: v for v in pod.spec.volumes or []}
        security = pod.spec.security_context
        fs_group = security.fs_group if security is not None else None
        options = []
        for mount in pod.spec.containers[0].volume_mounts or []:
            volume = volumes[mount.name]
            folder = self.workdir / f"{pod.metadata.name}.{volume.name}"
            if volume.secret is not None:
                folder = pathlib.Path(secrets[mount.mount_path])
            elif volume.config_map is not None:
                data = self.core.read_namespaced_config_map(volume.config_map.name, self.namespace).data or {}
                folder.mkdir(exist_ok=True)
                items = volume.config_map.items or [kubernetes.client.V1KeyToPath(key=k, path=k) for k in data]
                for item in items:
                    (folder / item.path).write_text(data[item.key])
            elif (
                volume.empty_dir is not None and volume.empty_dir.medium == "Memory" and mount.mount_path == "/dev/shm"
            ):
                options.append(f"--shm-size={_podman_size(volume.empty_dir.size_limit or '64Mi')}")
                continue
            elif volume.empty_dir is not None:
                folder.mkdir(exist_ok=True)
                if fs_group is not None:
                    os.chown(folder, -1, fs_group)
                    folder.chmod(0o2775)
            else:
                raise RuntimeError(
                    f"pod {pod.metadata.name}: volume {volume.name} is not a Secret, ConfigMap or emptyDir"
                )
            options.append(f"--volume={folder}:{mount.mount_path}:{'ro' if mount.read_only else 'rw'}")
        return options

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

    def _pod_config(self, pod, args: list[str]) -> dict:
        """The pod's `--config` file, read from the ConfigMap mounted there; {} without `--config`."""
        if "--config" not in args:
            return {}
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
        return yaml.safe_load(self.core.read_namespaced_config_map(source, self.namespace).data[path.name])

    def _local_config(self, pod, args: list[str], config: dict, secrets: dict[str, str]) -> list[str]:
        """The pod's configuration with paths into Secret volumes pointed at their local copies (`secrets`),
        written to this machine, and the arguments pointing at that copy."""
        if "--config" not in args:
            return args
        local_config = copy.deepcopy(config)
        for section in local_config.values():
            for key, value in (section or {}).items():
                if isinstance(value, str):
                    section[key] = _local_path(value, secrets)
        name = pathlib.PurePosixPath(args[args.index("--config") + 1]).name
        local = self.workdir / f"{pod.metadata.name}.{name}"
        local.write_text(yaml.safe_dump(local_config))
        return _replace_flag(args, "--config", str(local))

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
        if engine is not None:
            self._terminate(engine)

    def _terminate(self, engine: EnginePod) -> None:
        """SIGTERM (`podman run` passes it on to the container), SIGKILL after 20 s."""
        if engine.process.poll() is None:
            engine.process.terminate()
            try:
                engine.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                engine.process.kill()
                engine.process.wait()
        if engine.container is not None:  # gone already (--rm), unless podman itself was killed
            remove = [*self.podman.command, "rm", "--force", "--ignore", engine.container]
            subprocess.run(remove, capture_output=True, timeout=120)

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
    def _load(self, seconds: float, ignore_eos: bool = False) -> None:
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
            payload = {"model": engine.model, "prompt": prompt, "max_tokens": 32, "temperature": 0}
            if ignore_eos:
                payload["ignore_eos"] = True
            body = json.dumps(payload).encode()
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
    parser.add_argument(
        "--podman",
        metavar="COMMAND",
        help="run the pods' images with this podman command (e.g. 'bash hack/images.sh podman'), "
        "not `ddtree serve` of this Python",
    )
    args = parser.parse_args()
    podman = Podman(tuple(shlex.split(args.podman))) if args.podman else None
    if podman is None:
        ok, detail = serve_available()
        if not ok:
            print(f"`python -m ddtree serve` is not available: {detail}", file=sys.stderr)
            return 2
    api = kubernetes.config.new_client_from_config(config_file=args.kubeconfig)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop the engines too, not only this process
        signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="kwok-engines-") as work:
        runner = EngineRunner(api, args.namespace, args.instance, pathlib.Path(work), podman)
        with runner.start(args.load, args.seconds):
            stop.wait(args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
