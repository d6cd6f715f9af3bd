"""End to end with the real engine: the operator's pods are run as `python -m ddtree serve ...` processes
on their kwok pod IPs (hack/kwok_engines.py plays kubelet, Secret volumes included), and the resource
reaches Ready with acceptance length and tokens/s in `kubectl get specdeploy`.

Skipped, with the reason, only when this environment has no `ddtree serve`.
"""

import urllib.error
import urllib.request

import kubernetes
import pytest

from kube_testbed import load_hack_module, wait_for

kwok_engines = load_hack_module("kwok_engines")

pytestmark = pytest.mark.usefixtures("operator")

# CPU start-up of SmolLM2 (convert once, load, smoke test) plus a few scrape windows, on 2 busy cores.
READY_TIMEOUT_SECONDS = 600


@pytest.fixture(scope="module")
def ddtree_serve():
    ok, detail = kwok_engines.serve_available()
    if not ok:
        pytest.skip(f"`python -m ddtree serve --help` failed, so there is no engine to run: {detail}")


def test_smollm2_cpu_reaches_ready_with_acceptance_and_throughput(cluster, namespace, ddtree_serve, tmp_path):
    """With API keys from a Secret (spec.serving.apiKeySecret): the smoke test, readiness and the operator's
    scrapes need no key, the traffic carries one, and /v1 without it is refused."""
    cluster.core.create_namespaced_secret(
        namespace,
        kubernetes.client.V1Secret(metadata={"name": "engine-api-keys"}, string_data={"keys": "e2e-key-1\n"}),
    )
    cluster.apply_example(
        namespace, "smollm2-cpu.yaml", serving={"apiKeySecret": {"name": "engine-api-keys", "key": "keys"}}
    )
    runner = kwok_engines.EngineRunner(cluster.api, namespace, "smollm2-cpu", tmp_path)
    with runner.start(load=True, load_seconds=READY_TIMEOUT_SECONDS):

        def filled_in():
            row = cluster.get_row(namespace, "smollm2-cpu")
            done = row["PHASE"] == "Ready" and row["ACCLEN"] and row["TOK/S"] and float(row["TOK/S"]) > 0
            if any(p.finished for p in runner.pods.values()):
                pytest.fail(f"an engine exited; status: {cluster.status(namespace, 'smollm2-cpu')}")
            return done and row

        try:
            row = wait_for(filled_in, READY_TIMEOUT_SECONDS, "Ready with AccLen and Tok/s", interval=2)
        except pytest.fail.Exception as exc:
            pytest.fail(f"{exc}\nengine logs:\n{runner.logs()}")
        (engine,) = runner.pods.values()
        assert engine.api_key == "e2e-key-1"
        try:
            urllib.request.urlopen(f"http://{engine.ip}:{engine.port}/v1/models", timeout=30)
            pytest.fail("/v1/models answered without an API key")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
    assert float(row["ACCLEN"]) >= 1.0 and float(row["TOK/S"]) > 0
    assert runner.requests_sent > 0
    assert not [e for e in runner.request_errors if "401" in e], runner.request_errors
    status = cluster.status(namespace, "smollm2-cpu")
    assert status["smokeTest"]["result"] == "Passed"
    assert cluster.condition(namespace, "smollm2-cpu", "SmokeTestPassed")["status"] == "True"


def test_engine_start_failure_reports_the_engines_reason(cluster, namespace, ddtree_serve, tmp_path):
    cluster.apply_example(namespace, "smollm2-cpu.yaml", model={"uri": "no-such-model-anywhere"})
    with kwok_engines.EngineRunner(cluster.api, namespace, "smollm2-cpu", tmp_path).start() as runner:
        condition = wait_for(
            lambda: (
                (c := cluster.condition(namespace, "smollm2-cpu", "SmokeTestPassed")).get("status") == "False" and c
            ),
            300,
            "SmokeTestPassed=False from the exited engine",
        )
        logs = runner.logs()
    assert "no-such-model-anywhere" in condition["message"], logs
    assert cluster.status(namespace, "smollm2-cpu")["phase"] == "Failed"


def test_smoke_test_failure_surfaces_with_the_engines_reason(cluster, namespace, ddtree_serve, tmp_path):
    # `--smoke-fault corrupt-graph-input` is the engine's test hook: it corrupts the RoPE table for the
    # batched smoke rounds, so the smoke test finds mismatches, writes the reason and exits 1.
    cluster.apply_example(
        namespace, "smollm2-cpu.yaml", engine={"maxBatchSize": 2, "args": ["--smoke-fault", "corrupt-graph-input"]}
    )
    with kwok_engines.EngineRunner(cluster.api, namespace, "smollm2-cpu", tmp_path).start() as runner:
        condition = wait_for(
            lambda: (
                (c := cluster.condition(namespace, "smollm2-cpu", "SmokeTestPassed")).get("status") == "False" and c
            ),
            READY_TIMEOUT_SECONDS,
            "SmokeTestPassed=False from the engine's smoke test",
        )
        logs = runner.logs()
    assert condition["reason"] == "SmokeTestFailed", logs
    assert "smoke test failed" in condition["message"], logs
    assert cluster.status(namespace, "smollm2-cpu")["phase"] == "Failed"
    events = cluster.core.list_namespaced_event(namespace).items
    assert any(e.reason == "SmokeTestFailed" and "smoke test failed" in e.message for e in events)
