"""Both images end to end on the local control plane: the operator image runs as the chart's Deployment
would run it (its command, non-root, read-only root filesystem, the chart's ServiceAccount), and the engine
pod it creates for examples/smollm2-cpu.yaml runs as a container of the engine image (hack/kwok_engines.py
--podman) until the resource is Ready with acceptance length and tokens/s."""

import socket
import subprocess
import urllib.request
import uuid

import pytest
import yaml

from kube_testbed import CLOSED_PORT_URL, load_hack_module, wait_for

kwok_engines = load_hack_module("kwok_engines")

# CPU start-up of SmolLM2 in the container (convert, load, smoke test) plus a few scrape windows.
READY_TIMEOUT_SECONDS = 600
KUBECONFIG_IN_CONTAINER = "/etc/ddtree/kubeconfig"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _operator_command(chart_installed: str, liveness_port: int) -> list[str]:
    """The chart's operator container command, its liveness endpoint on a free loopback port (the
    container shares the host's network)."""
    (deployment,) = (d for d in yaml.safe_load_all(chart_installed) if d and d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    command = [*container["command"], *container["args"]]
    liveness = [a for a in command if a.startswith("--liveness=")]
    assert liveness, f"the chart's operator has no --liveness endpoint: {command}"
    return [f"--liveness=http://127.0.0.1:{liveness_port}/healthz" if a in liveness else a for a in command]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def operator_container(podman, operator_image, engine_image, chart_installed, operator_kubeconfig, tmp_path_factory):
    """The operator image under podman, with the chart's ServiceAccount token, engine image = the one built."""
    name = f"ddtree-operator-{uuid.uuid4().hex[:8]}"
    liveness_port = _free_port()
    command = _operator_command(chart_installed, liveness_port)
    log = tmp_path_factory.mktemp("operator-container") / "operator.log"
    options = [
        *("--rm", f"--name={name}", "--pull=never", "--network=host", *podman.run_options()),
        # the chart's securityContext: non-root (the image's user), read-only root, no capabilities
        *("--read-only", "--cap-drop=ALL", "--security-opt=no-new-privileges"),
        f"--volume={operator_kubeconfig}:{KUBECONFIG_IN_CONTAINER}:ro",
        f"--env=KUBECONFIG={KUBECONFIG_IN_CONTAINER}",
        f"--env=DDTREE_ENGINE_IMAGE={engine_image}",
        "--env=DDTREE_ENGINE_IMAGE_PULL_POLICY=Never",
        "--env=NO_PROXY=127.0.0.1,localhost",
        f"--env=HF_ENDPOINT={CLOSED_PORT_URL}",  # the fit check's hub: refused at once
        f"--entrypoint={command[0]}",
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [*podman.command, "run", *options, operator_image, *command[1:]],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        healthz = f"http://127.0.0.1:{liveness_port}/healthz"
        wait_for(lambda: process.poll() is not None or _healthy(healthz), 120, f"operator container {healthz}")
        assert process.poll() is None, f"the operator container exited:\n{log.read_text()[-4000:]}"
        yield process, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        subprocess.run([*podman.command, "rm", "--force", "--ignore", name], capture_output=True, timeout=120)
    assert "Traceback" not in log.read_text(), log.read_text()[-6000:]


def test_operator_image_deploys_the_engine_image_to_ready(
    cluster, namespace, operator_container, podman, engine_image, tmp_path
):
    process, log = operator_container
    cluster.apply_example(namespace, "smollm2-cpu.yaml")
    runner = kwok_engines.EngineRunner(cluster.api, namespace, "smollm2-cpu", tmp_path, podman=podman)
    with runner.start(load=True, load_seconds=READY_TIMEOUT_SECONDS):

        def filled_in():
            row = cluster.get_row(namespace, "smollm2-cpu")
            done = row["PHASE"] == "Ready" and row["ACCLEN"] and row["TOK/S"] and float(row["TOK/S"]) > 0
            if any(p.finished for p in runner.pods.values()):
                pytest.fail(f"an engine exited; status: {cluster.status(namespace, 'smollm2-cpu')}")
            if process.poll() is not None:
                pytest.fail(f"the operator container exited:\n{log.read_text()[-4000:]}")
            return done and row

        try:
            row = wait_for(filled_in, READY_TIMEOUT_SECONDS, "Ready with AccLen and Tok/s", interval=2)
        except pytest.fail.Exception as exc:
            pytest.fail(f"{exc}\nengine logs:\n{runner.logs()}\noperator log:\n{log.read_text()[-4000:]}")
        (engine,) = runner.pods.values()
        assert engine.container is not None  # a container of the pod's image, not a host process
    # rendered by the operator in the container: its DDTREE_ENGINE_IMAGE (the test process runs none)
    (pod,) = cluster.engine_pods(namespace, "smollm2-cpu")
    assert pod.spec.containers[0].image == engine_image
    assert float(row["ACCLEN"]) >= 1.0 and float(row["TOK/S"]) > 0
    assert runner.requests_sent > 0
    assert cluster.status(namespace, "smollm2-cpu")["smokeTest"]["result"] == "Passed"
