"""kopf handlers: thin glue between the API server and the pure render/status functions.

    kopf run --standalone --all-namespaces -m ddtree_operator.handlers

- validate (the admission webhook, when its certificate is configured): the config checks (admission.py; hub
  configs fetched here with a short timeout) refuse a spec whose drafter or split does not fit, or whose
  model does not fit its GPUs; a config that cannot be had in time admits it.
- create/update/resume: the same checks (admission.py, fit.py; hub configs fetched here, cached), then
  server-side apply the rendered children (idempotent; restart-safe) and delete the optional ones no longer
  rendered (PodMonitor, PodDisruptionBudget, HorizontalPodAutoscaler, ScaledObject), or nothing when a
  check fails.
- a timer per resource: scrape ready engines, recompute the status, patch only what changed.
- indexes keep the engine Deployments and pods in memory, so ticks cost no LIST calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf
import kubernetes
import pydantic
import urllib3

from . import api, canary
from .admission import SpecChecks, config_refs, run_checks
from .fit import ConfigRef
from .metrics import EngineSample, Window, parse_engine_metrics, window
from .render import MANAGED_BY, OWNER_LABEL, Owner, engine_defaults_from_env
from .status import PodView, compute_status, deployment_view, pod_view, status_patch

FIELD_MANAGER = "ddtree-operator"
STATUS_TICK_SECONDS = 5.0  # status follows pods this fast; scraping has its own per-resource interval
API_RETRY_SECONDS = 10.0  # an apply the API server did not take (down, restarting, busy) is tried again this soon
SCRAPE_TIMEOUT_SECONDS = 3.0
HUB_TIMEOUT_SECONDS = 10.0  # one config.json; a slow or unreachable hub skips the fit check, never blocks
# The webhook's fetch of the config.json files, well inside the API server's webhook timeout (the chart's
# webhook.timeoutSeconds, 10 by default): past it the spec is admitted and reconcile checks it.
ADMISSION_HUB_TIMEOUT_SECONDS = 4.0
WEBHOOK_ID = "validate-spec"  # the handler's id: the path the webhook configuration calls (/validate-spec)
DEFAULT_WEBHOOK_PORT = 9443
HUB_MAX_CONFIG_BYTES = 4 << 20
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
RESOURCE = (api.GROUP, api.VERSION, api.PLURAL)
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
APPLY = "application/apply-patch+yaml"
# Children that only some specs have, as (group, version, plural): applied when rendered, else deleted.
OPTIONAL_CHILDREN = {
    "PodMonitor": ("monitoring.coreos.com", "v1", "podmonitors"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("autoscaling", "v2", "horizontalpodautoscalers"),
    "ScaledObject": ("keda.sh", "v1alpha1", "scaledobjects"),
}
# Kinds of other projects' CRDs, which a cluster may lack: the engines run without them, and an Event says why
# the object is missing.
MISSING_CRD_MESSAGES = {
    "PodMonitor": "spec.metrics.podMonitor is true but the PodMonitor API (monitoring.coreos.com/v1) is not installed",
    "ScaledObject": "spec.autoscaling is set and the operator's autoscalingProvider is keda, but the ScaledObject "
    "API (keda.sh/v1alpha1) is not installed",
}


# (connect, read) seconds of every call the operator makes to the API server, unless the call gives its own: a
# stalled API server fails the apply, which is retried (_failures_are_temporary), instead of holding a handler's
# thread forever
API_TIMEOUT_SECONDS = (5.0, 30.0)


class TimedApiClient(kubernetes.client.ApiClient):
    """An ApiClient whose calls time out after API_TIMEOUT_SECONDS (the package's default is to wait forever)."""

    def call_api(self, *args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        # the generated API methods of every supported kubernetes release pass _request_timeout by keyword
        kwargs["_request_timeout"] = _request_timeout or API_TIMEOUT_SECONDS
        return super().call_api(*args, **kwargs)


def _api_client() -> kubernetes.client.ApiClient:
    configuration = kubernetes.client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    else:
        # Read $KUBECONFIG now: the kubernetes package's own default is frozen when it is imported.
        kubernetes.config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG", "~/.kube/config"), client_configuration=configuration
        )
    return TimedApiClient(configuration)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The same credentials as `_api_client`, with kopf's own readers (in-cluster, else $KUBECONFIG)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Keep kopf's bookkeeping under our own group instead of kopf.zalando.org.
    settings.persistence.finalizer = f"{api.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # Events for problems only, not for every handler run
    # Never sit on a silently dead watch connection.
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.watching.connect_timeout = 5
    memo.api = _api_client()
    try:
        memo.defaults = engine_defaults_from_env(os.environ)
    except ValueError as exc:  # the operator stops: every resource would be rendered with a wrong setting
        raise kopf.PermanentError(str(exc)) from exc
    memo.hub_endpoint = (os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT).rstrip("/")
    # config.json by (endpoint, repo, revision), shared by every resource (kopf copies this memo shallowly)
    memo.hub_configs = {}
    settings.admission.server = webhook_server(os.environ)


def webhook_server(env: Mapping[str, str]) -> Any:
    """The admission webhook's HTTPS endpoint: on DDTREE_WEBHOOK_PORT (default 9443) of every interface, with
    the certificate and key DDTREE_WEBHOOK_CERT_DIR holds as tls.crt and tls.key (a mounted kubernetes.io/tls
    Secret; kopf reloads them when they are renewed). The webhook configuration is the chart's, not kopf's
    (settings.admission.managed stays unset), so the operator needs no access to webhook configurations.
    Without a certificate directory nothing listens: kopf refuses admission handlers with no server at all."""
    cert_dir = env.get("DDTREE_WEBHOOK_CERT_DIR")
    if not cert_dir:
        return _no_webhook_server
    return kopf.WebhookServer(
        port=int(env.get("DDTREE_WEBHOOK_PORT") or DEFAULT_WEBHOOK_PORT),
        certfile=os.path.join(cert_dir, "tls.crt"),
        pkeyfile=os.path.join(cert_dir, "tls.key"),
    )


async def _no_webhook_server(fn: Any) -> AsyncIterator[Any]:
    await asyncio.Event().wait()  # serves nothing, for as long as the operator runs
    yield  # an async generator, as kopf expects of a server


def _parse_spec(spec: Any) -> api.SpeculativeDeploymentSpec:
    try:
        return api.SpeculativeDeploymentSpec.model_validate(dict(spec))
    except pydantic.ValidationError as exc:
        # The CRD schema should have rejected it; an outdated CRD is the usual cause.
        raise kopf.PermanentError(f"invalid spec (is the installed CRD older than the operator?): {exc}") from exc


def server_side_apply(client: kubernetes.client.ApiClient, obj: dict[str, Any]) -> None:
    """Create or converge `obj`; fields we applied before and no longer render are removed."""
    name, namespace = obj["metadata"]["name"], obj["metadata"]["namespace"]
    options: dict[str, Any] = {"field_manager": FIELD_MANAGER, "force": True, "_content_type": APPLY}
    if obj["kind"] == "Deployment":
        kubernetes.client.AppsV1Api(client).patch_namespaced_deployment(name, namespace, obj, **options)
    elif obj["kind"] == "Service":
        kubernetes.client.CoreV1Api(client).patch_namespaced_service(name, namespace, obj, **options)
    elif obj["kind"] == "ConfigMap":
        kubernetes.client.CoreV1Api(client).patch_namespaced_config_map(name, namespace, obj, **options)
    elif obj["kind"] in OPTIONAL_CHILDREN:
        group, version, plural = OPTIONAL_CHILDREN[obj["kind"]]
        kubernetes.client.CustomObjectsApi(client).patch_namespaced_custom_object(
            group, version, namespace, plural, name, obj, **options
        )
    else:
        raise ValueError(f"no apply path for kind {obj['kind']}")


def _missing_kind(exc: kubernetes.client.ApiException) -> str | None:
    """The kind a 404's Status names as missing ("namespaces" when the namespace itself is gone)."""
    try:
        return json.loads(exc.body or "{}").get("details", {}).get("kind")
    except (ValueError, AttributeError):
        return None


def _status_message(exc: kubernetes.client.ApiException) -> str:
    """The message of the Status an API error carries, or its HTTP reason."""
    try:
        return json.loads(exc.body or "{}").get("message") or exc.reason
    except (ValueError, AttributeError):
        return exc.reason


@contextlib.contextmanager
def _failures_are_temporary(owner: Owner) -> Iterator[None]:
    """A request of the apply that failed (the API server restarting: connections refused, then 403 until its
    authorizer has synced; overloaded: 429; a webhook down: 500) is retried in API_RETRY_SECONDS, as kopf
    retries any error, but said in one line (the log and the Event) instead of a traceback of the HTTP
    exchange, and a status tick does not wait kopf's default minute of backoff for it."""
    try:
        yield
    except urllib3.exceptions.HTTPError as exc:
        reason = getattr(exc, "reason", None) or exc  # MaxRetryError: the last connection error
        raise kopf.TemporaryError(
            f"applying {owner.namespace}/{owner.name}: API server unreachable: {reason}", delay=API_RETRY_SECONDS
        ) from exc
    except kubernetes.client.ApiException as exc:
        raise kopf.TemporaryError(
            f"applying {owner.namespace}/{owner.name}: HTTP {exc.status} {exc.reason}: {_status_message(exc)}",
            delay=API_RETRY_SECONDS,
        ) from exc


def _canary_state(status: Any) -> api.DrafterCanaryStatus | None:
    value = (status or {}).get("drafterCanary")
    return api.DrafterCanaryStatus.model_validate(value) if value else None


def apply_children(
    memo: kopf.Memo,
    owner: Owner,
    spec: api.SpeculativeDeploymentSpec,
    canary_state: api.DrafterCanaryStatus | None,
    body: Any,
) -> None:
    with _failures_are_temporary(owner):
        _apply_children(memo, owner, spec, canary_state, body)
    # what the children of this spec now run: the status timer applies again when its canary step changes it
    memo.applied = (spec, canary.plan(spec, canary_state))


def _apply_children(
    memo: kopf.Memo,
    owner: Owner,
    spec: api.SpeculativeDeploymentSpec,
    canary_state: api.DrafterCanaryStatus | None,
    body: Any,
) -> None:
    client: kubernetes.client.ApiClient = memo.api
    children = canary.render(owner, spec, canary_state, memo.defaults)
    for child in children:
        try:
            server_side_apply(client, child)
        except kubernetes.client.ApiException as exc:
            if exc.status == 403 and "NamespaceTerminating" in (exc.body or ""):
                # The namespace controller is about to delete this resource as well.
                raise kopf.TemporaryError(f"namespace {owner.namespace} is being deleted", delay=10) from exc
            if exc.status == 404 and _missing_kind(exc) == "namespaces":
                # Gone with its namespace: a status tick that ran before the watch saw the deletion.
                raise kopf.TemporaryError(f"namespace {owner.namespace} is gone", delay=60) from exc
            if child["kind"] in MISSING_CRD_MESSAGES and exc.status == 404:
                kopf.warn(body, reason=f"{child['kind']}Unavailable", message=MISSING_CRD_MESSAGES[child["kind"]])
                continue
            raise
    rendered = {child["kind"] for child in children}
    for kind, resource in OPTIONAL_CHILDREN.items():
        if kind not in rendered:
            _delete_if_owned(client, owner, *resource)
    if not any(child["metadata"]["name"] == canary.canary_name(owner.name) for child in children):
        _delete_if_owned(client, owner, "apps", "v1", "deployments", canary.canary_name(owner.name))


def _delete_if_owned(
    client: kubernetes.client.ApiClient, owner: Owner, group: str, version: str, plural: str, name: str | None = None
) -> None:
    """Delete an optional child the spec no longer asks for (named like the resource unless `name` is given).
    An object of that name that the resource does not own (say, an HPA a user made before `spec.autoscaling`
    existed) is left alone."""
    objects = kubernetes.client.CustomObjectsApi(client)
    name = name or owner.name
    try:
        existing: dict[str, Any] = objects.get_namespaced_custom_object(  # type: ignore[assignment]
            group, version, owner.namespace, plural, name
        )
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:  # never made, already gone, or no such API
            return
        raise
    refs = existing["metadata"].get("ownerReferences") or []
    if not any(ref.get("uid") == owner.uid and ref.get("controller") for ref in refs):
        return
    try:  # the precondition: not a same-named object made since the read
        objects.delete_namespaced_custom_object(
            group,
            version,
            owner.namespace,
            plural,
            name,
            body=kubernetes.client.V1DeleteOptions(
                preconditions=kubernetes.client.V1Preconditions(uid=existing["metadata"]["uid"])
            ),
        )
    except kubernetes.client.ApiException as exc:
        if exc.status not in (404, 409):  # 409: the precondition failed
            raise


class ConfigFetchError(Exception):
    """A config.json could not be had from the hub."""


async def _fetch_config(session: aiohttp.ClientSession, endpoint: str, ref: ConfigRef) -> dict[str, Any]:
    url = f"{endpoint}/{ref.repo}/resolve/{quote(ref.revision, safe='')}/config.json"
    try:
        async with session.get(url) as response:
            if response.status != 200:
                raise ConfigFetchError(f"HTTP {response.status} from {url}")
            body = await response.content.read(HUB_MAX_CONFIG_BYTES + 1)
        if len(body) > HUB_MAX_CONFIG_BYTES:
            raise ConfigFetchError(f"{url} is larger than {HUB_MAX_CONFIG_BYTES} bytes")
        config = json.loads(body)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise ConfigFetchError(f"{url}: {str(exc) or type(exc).__name__}") from exc
    if not isinstance(config, dict):
        raise ConfigFetchError(f"{url} is not a JSON object")
    return config


async def _configs(
    refs: list[ConfigRef], memo: kopf.Memo, timeout: float = HUB_TIMEOUT_SECONDS
) -> dict[ConfigRef, dict[str, Any] | str]:
    """Each ref's config.json, or why it could not be fetched; successes are cached for the operator's life
    (a pinned revision never changes; `main` rarely does, and a restart refreshes it)."""
    endpoint: str = memo.hub_endpoint
    cache: dict[tuple[str, ConfigRef], dict[str, Any]] = memo.hub_configs
    out: dict[ConfigRef, dict[str, Any] | str] = {r: cache[(endpoint, r)] for r in refs if (endpoint, r) in cache}
    wanted = [r for r in dict.fromkeys(refs) if r not in out]
    if wanted:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            results = await asyncio.gather(
                *(_fetch_config(session, endpoint, r) for r in wanted), return_exceptions=True
            )
        for ref, result in zip(wanted, results, strict=True):
            if isinstance(result, ConfigFetchError):
                out[ref] = str(result)
            elif isinstance(result, BaseException):
                raise result
            else:
                out[ref] = cache[(endpoint, ref)] = result
    return out


async def spec_checks(spec: api.SpeculativeDeploymentSpec, memo: kopf.Memo, logger: Any) -> SpecChecks:
    """The config checks and the fit check of this spec, made once per spec (the per-resource memo keeps the
    last ones). The lock makes the create handler and the first status tick, which start together, share one
    fetch."""
    key = spec.model_dump_json()
    async with memo.setdefault("spec_checks_lock", asyncio.Lock()):
        if memo.get("spec_checks_key") == key:
            return memo.spec_checks
        checks = run_checks(spec, await _configs(config_refs(spec), memo))
        logger.info(f"memory plan: {checks.memory.result}: {checks.memory.message}")
        logger.info(f"config checks: {checks.compatibility.message}")
        memo.spec_checks_key, memo.spec_checks = key, checks
        return checks


# kopf passes `old` and `operation` through **kwargs, which its WebhookFn protocol can't express.
@kopf.on.validate(*RESOURCE, id=WEBHOOK_ID, operations=["CREATE", "UPDATE"])  # type: ignore[arg-type]
async def validate(spec: Any, old: Any, operation: str, memo: kopf.Memo, warnings: list[str], **_: Any) -> None:
    """Refuse a spec the config checks fail, with their one message. Only a changed spec is checked: an update
    of metadata alone (kopf's finalizer, a label) must go through even where the hub now says more."""
    if operation == "UPDATE" and old is not None and dict(old.get("spec") or {}) == dict(spec):
        return
    try:
        parsed = api.SpeculativeDeploymentSpec.model_validate(dict(spec))
    except pydantic.ValidationError:
        return  # the CRD's schema speaks for itself; an outdated CRD is reconcile's to report
    checks = run_checks(parsed, await _configs(config_refs(parsed), memo, ADMISSION_HUB_TIMEOUT_SECONDS))
    refusal = checks.refusal()
    if refusal is not None:
        raise kopf.AdmissionError(refusal, code=422)
    warnings.extend(
        f"not checked: {why}; the operator checks again and reports it in the Compatible condition"
        for why in checks.compatibility.unchecked
    )


# A failed apply (API server busy, webhook down) is retried after 10 s, not kopf's default minute.
@kopf.on.resume(*RESOURCE, backoff=API_RETRY_SECONDS)
@kopf.on.create(*RESOURCE, backoff=API_RETRY_SECONDS)
@kopf.on.update(*RESOURCE, field="spec", backoff=API_RETRY_SECONDS)
async def reconcile(
    name: str, namespace: str, uid: str, spec: Any, status: Any, body: Any, memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    parsed = _parse_spec(spec)
    # A spec that fails a check (its model does not fit, its drafter does not fit the model) gets no objects,
    # and an existing Deployment keeps its last good spec: pods that can never load would only hold GPUs. The
    # status timer reports it (Ready=False DoesNotFit or Incompatible).
    if (await spec_checks(parsed, memo, logger)).blocks:
        return
    owner = Owner(name, namespace, uid)
    await asyncio.to_thread(apply_children, memo, owner, parsed, _canary_state(status), body)


@kopf.index("pods", labels=MANAGED)
def engine_pods(namespace: str, labels: Any, body: Any, **_: Any) -> dict[tuple[str, str], PodView] | None:
    owner = labels.get(OWNER_LABEL)
    return {(namespace, owner): pod_view(body)} if owner else None


@kopf.index("deployments", labels={**MANAGED, canary.TRACK_LABEL: kopf.ABSENT})
def engine_deployments(namespace: str, name: str, body: Any, **_: Any) -> dict[tuple[str, str], Any]:
    return {(namespace, name): deployment_view(body)}


@kopf.index("deployments", labels={**MANAGED, canary.TRACK_LABEL: canary.CANARY_TRACK})
def canary_deployments(namespace: str, labels: Any, body: Any, **_: Any) -> dict[tuple[str, str], Any] | None:
    owner = labels.get(OWNER_LABEL)
    return {(namespace, owner): deployment_view(body)} if owner else None


class ScrapeError(Exception):
    """An engine's /metrics could not be read or understood."""


async def _scrape(session: aiohttp.ClientSession, ip: str, port: int) -> EngineSample:
    url = f"http://{f'[{ip}]' if ':' in ip else ip}:{port}/metrics"
    try:
        async with session.get(url) as response:
            response.raise_for_status()
            text = await response.text()
        return parse_engine_metrics(text, time.monotonic())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise ScrapeError(f"{url}: {str(exc) or type(exc).__name__}") from exc


async def _scrape_if_due(
    spec: api.SpeculativeDeploymentSpec,
    pods: list[PodView],
    memo: kopf.Memo,
    logger: Any,
) -> tuple[dict[str, EngineSample], Window | None]:
    """This tick's samples of ready pods and the window since the previous scrape (per-resource memo)."""
    now = time.monotonic()
    if now - memo.get("scraped_at", float("-inf")) < spec.metrics.scrape_interval_seconds:
        return {}, None
    memo.scraped_at = now
    ready = [p for p in pods if p.ready and p.ip]
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results = await asyncio.gather(
            *(_scrape(session, p.ip, spec.metrics.port) for p in ready), return_exceptions=True
        )
    samples: dict[str, EngineSample] = {}
    unreachable: set[str] = set()
    for pod, result in zip(ready, results, strict=True):
        if isinstance(result, ScrapeError):
            unreachable.add(pod.uid)
            if pod.uid not in memo.get("unreachable", set()):  # say it once, not every tick
                logger.warning(f"cannot scrape the metrics of pod {pod.name}: {result}")
        elif isinstance(result, BaseException):
            raise result
        else:
            samples[pod.uid] = result
    memo.unreachable = unreachable
    previous, memo.samples = memo.get("samples", {}), samples
    return samples, window(previous, samples)


def _condition(conditions: list[Any], type_: str) -> dict[str, Any]:
    return next((c for c in conditions if c.get("type") == type_), {})


# kopf passes the indices by name through **kwargs, which its TimerFn protocol can't express. A tick that
# fails is tried again at the next tick, not after kopf's default minute of backoff (status would freeze).
@kopf.timer(*RESOURCE, interval=STATUS_TICK_SECONDS, backoff=STATUS_TICK_SECONDS)  # type: ignore[arg-type]
async def refresh_status(
    name: str,
    namespace: str,
    uid: str,
    spec: Any,
    status: Any,
    meta: Any,
    body: Any,
    memo: kopf.Memo,
    patch: kopf.Patch,
    engine_pods: kopf.Index,
    engine_deployments: kopf.Index,
    canary_deployments: kopf.Index,
    logger: Any,
    **_: Any,
) -> None:
    parsed = _parse_spec(spec)
    checks = await spec_checks(parsed, memo, logger)
    memory = checks.memory
    key = (namespace, name)
    owner = Owner(name, namespace, uid)
    canary_state = _canary_state(status)
    deployments = list(engine_deployments.get(key, []))
    canaries = list(canary_deployments.get(key, []))
    if not deployments and not checks.blocks:
        # Deleted behind our back (or not seen yet): re-apply; a no-op when it does exist.
        await asyncio.to_thread(apply_children, memo, owner, parsed, canary_state, body)
    pods = list(engine_pods.get(key, []))
    samples, metrics_window = await _scrape_if_due(parsed, pods, memo, logger)
    current = dict(status)
    now = datetime.datetime.now(datetime.timezone.utc)
    desired = compute_status(
        name=name,
        generation=meta.get("generation", 0),
        spec=parsed,
        deployment=canary.combined(deployments[0] if deployments else None, canaries[0] if canaries else None),
        pods=pods,
        samples=samples,
        window=metrics_window,
        previous=current,
        now=now,
        memory=memory,
        compatibility=checks.compatibility,
    )
    await _step_canary(
        owner, parsed, canary_state, pods, current, desired, memo, body, now, checks.blocks, engine_deployments
    )
    changes = status_patch(current, desired)
    for field, value in changes.items():
        patch.status[field] = value
    # One Event per new failure reason, not one per tick.
    old_smoke = _condition(current.get("conditions") or [], "SmokeTestPassed")
    new_smoke = _condition(desired["conditions"], "SmokeTestPassed")
    newly_failed = (old_smoke.get("status"), old_smoke.get("message")) != ("False", new_smoke["message"])
    if new_smoke["status"] == "False" and newly_failed:
        kopf.warn(body, reason=new_smoke["reason"], message=new_smoke["message"])
    old_plan = current.get("memoryPlan") or {}
    if memory.blocks and (old_plan.get("result"), old_plan.get("message")) != (memory.result, memory.message):
        kopf.warn(body, reason="DoesNotFit", message=memory.message)
    compatibility = checks.compatibility
    said = _condition(current.get("conditions") or [], "Compatible")
    if compatibility.blocks and (said.get("status"), said.get("message")) != ("False", compatibility.message):
        kopf.warn(body, reason="Incompatible", message=compatibility.message)


async def _step_canary(
    owner: Owner,
    spec: api.SpeculativeDeploymentSpec,
    state: api.DrafterCanaryStatus | None,
    pods: list[PodView],
    current: dict[str, Any],
    desired: dict[str, Any],
    memo: kopf.Memo,
    body: Any,
    now: datetime.datetime,
    blocked: bool,
    engine_deployments: kopf.Index,
) -> None:
    """The drafter canary's tick: its next state and condition into `desired`, an Event when it starts or
    ends, and the children applied again when what they should run changed. Only for the spec they were last
    applied for: a tick that read the resource before a spec change must not undo the reconcile of it."""
    step = canary.step(
        spec=spec,
        state=state,
        pods=pods,
        latest=memo.get("samples", {}),
        baselines=memo.get("canary_baselines", {}),
        now=now,
        name_taken=(owner.namespace, canary.canary_name(owner.name)) in engine_deployments,
    )
    memo.canary_baselines = step.baselines
    desired["drafterCanary"] = canary.status_value(step.state)
    if condition := canary.condition(step.state, current.get("conditions") or [], desired["observedGeneration"], now):
        desired["conditions"].append(condition)
    if step.event is not None:
        type_, reason, message = step.event
        kopf.event(body, type=type_, reason=reason, message=message)
    applied_spec, applied_plan = memo.get("applied", (None, None))
    if not blocked and applied_spec == spec and applied_plan != canary.plan(spec, step.state):
        await asyncio.to_thread(apply_children, memo, owner, spec, step.state, body)
