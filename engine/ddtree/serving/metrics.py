"""Prometheus metrics of the engine server (`ddtree serve`).

The names below are a contract: the operator and dashboards read them, so keep them stable.
Every series carries a `model` label (the served model name). Each server instance owns a private
CollectorRegistry, so several servers (or tests) can live in one process.

Speculative decoding counters, per sequence and round:
  ddtree_spec_decode_num_drafts_total          verify rounds (one per running sequence per round)
  ddtree_spec_decode_num_draft_tokens_total    drafted tokens offered (tree size - 1; 0 for `ar`)
  ddtree_spec_decode_num_accepted_tokens_total accepted drafts (tokens emitted in the round - the bonus)
so the mean acceptance length over a window is 1 + d(accepted) / d(drafts).

The process's own series (process_resident_memory_bytes, process_open_fds, process_cpu_seconds_total, ...)
are exported too, without the model label: `ddtree soak` and leak alerts read them.

Load, for autoscaling (docs/operator.md, "Autoscaling"):
  ddtree_load   (requests holding an engine row + requests waiting) / max batch size

Besides the contract, three histograms split a scheduler round into engine time and serving
overhead (used by `bench-serve`): ddtree_engine_step_seconds, ddtree_prefill_seconds and
ddtree_scheduler_iteration_seconds.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
ROUND_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
ACCEPTANCE_BUCKETS = tuple(float(x) for x in (*range(1, 17), 20, 24, 32, 48, 64))


class ServerMetrics:
    """The server's metrics, bound to one `model` label value."""

    def __init__(self, model: str):
        self.model = model
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        m = ["model"]

        def counter(name, doc, labels=m):
            return Counter(name, doc, labels, registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, m, registry=r).labels(model=model)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model=model)

        self.num_drafts = counter(
            "ddtree_spec_decode_num_drafts",
            "Verify rounds, one per running sequence per round, by the round's budget (0: no draft)",
            ["model", "budget"],
        )
        self.num_draft_tokens = counter(
            "ddtree_spec_decode_num_draft_tokens", "Drafted tokens offered for verification (tree size minus the root)"
        ).labels(model=model)
        self.num_accepted_tokens = counter(
            "ddtree_spec_decode_num_accepted_tokens",
            "Accepted drafted tokens (tokens emitted per round minus the bonus)",
        ).labels(model=model)
        self.generation_tokens = counter("ddtree_generation_tokens", "Completion tokens returned to clients").labels(
            model=model
        )
        self.prompt_tokens = counter(
            "ddtree_prompt_tokens", "Prompt tokens of started requests (prefilled or taken from the prefix cache)"
        ).labels(model=model)
        self.prefix_cache_hit_tokens = counter(
            "ddtree_prefix_cache_hit_tokens",
            "Prompt tokens not prefilled because the KV cache's page index held them (serving.prefix_cache)",
        ).labels(model=model)
        self._requests = counter(
            "ddtree_requests", "Completion requests by HTTP status (499: the client disconnected)", ["model", "status"]
        )

        self.requests_running = gauge("ddtree_requests_running", "Requests holding an engine row")
        self.requests_waiting = gauge("ddtree_requests_waiting", "Requests queued for an engine row")
        self.load = gauge(
            "ddtree_load",
            "Requests holding or waiting for an engine row, over the rows (max batch size): 1 = full batches, "
            "above 1 = requests queue",
        )
        self.smoke_test_passed = gauge("ddtree_smoke_test_passed", "1 once the start-up smoke test passed")
        self.graph_capture_seconds = gauge("ddtree_graph_capture_seconds", "Time spent capturing CUDA graphs")
        self.kernel_compiles = counter(
            "ddtree_kernel_compiles",
            "Triton kernels compiled after the smoke test passed: request shapes start-up did not run (a stall each)",
        ).labels(model=model)
        self.spec_budget = gauge("ddtree_spec_budget", "DDTree node budget B of the last round (0 for ar)")
        self.forecast_accepted_tokens = counter(
            "ddtree_spec_decode_forecast_accepted_tokens",
            "Budget auto: drafted tokens the draft expected to be accepted in its rounds (compare with "
            "ddtree_spec_decode_num_accepted_tokens: the draft's calibration)",
        ).labels(model=model)
        self.grammar_replaced_tokens = counter(
            "ddtree_grammar_replaced_tokens",
            "response_format, required tool calls, min_tokens, allowed_token_ids: tokens the target chose that "
            "the request's constraint refused, replaced by its best allowed token (each ends its round's accepted "
            "path there)",
        ).labels(model=model)
        self.connections_refused = counter(
            "ddtree_connections_refused", "Connections answered 503 and closed: max_connections were open"
        ).labels(model=model)
        self.connections_timed_out = counter(
            "ddtree_connections_timed_out", "Connections closed because a request's headers did not arrive in time"
        ).labels(model=model)
        self.kv_cache_usage_ratio = gauge(
            "ddtree_kv_cache_usage_ratio", "KV cache pages held by requests / pages in the pool"
        )
        self.kv_pages_used = gauge(
            "ddtree_kv_pages_used", "KV cache pages held by requests (running, or being prefilled)"
        )
        self.kv_pages_total = gauge("ddtree_kv_pages_total", "KV cache pages (of 16 tokens) in the pool")
        self.preemptions = counter(
            "ddtree_preemptions",
            "Running requests that gave their engine row and KV cache pages back because the pool ran out, "
            "to resume later from their prompt and generated tokens",
        ).labels(model=model)

        self.acceptance_length = histogram(
            "ddtree_acceptance_length", "Tokens committed per sequence per round, bonus included", ACCEPTANCE_BUCKETS
        )
        self.time_to_first_token = histogram(
            "ddtree_time_to_first_token_seconds",
            "Arrival to first token (queueing and prefill included)",
            LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "ddtree_inter_token_latency_seconds",
            "Time between a request's rounds, divided over the tokens it emitted (one observation per token)",
            TOKEN_LATENCY_BUCKETS,
        )
        self.request_latency = histogram(
            "ddtree_request_latency_seconds", "Arrival to last token of finished requests", LATENCY_BUCKETS
        )

        self.engine_step_seconds = histogram(
            "ddtree_engine_step_seconds", "Time inside engine.step per round", ROUND_BUCKETS
        )
        self.prefill_seconds = histogram(
            "ddtree_prefill_seconds",
            "Time inside engine.prefill_many per scheduler iteration that prefilled (the chunks of every request "
            "it prefilled)",
            ROUND_BUCKETS,
        )
        self.scheduler_iteration_seconds = histogram(
            "ddtree_scheduler_iteration_seconds",
            "Wall time of one busy scheduler iteration (admission + prefills + round + delivery)",
            ROUND_BUCKETS,
        )

    def request_finished(self, status: int | str) -> None:
        self._requests.labels(model=self.model, status=str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """(exposition body, content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def read_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted label pairs): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and want <= set(lbl))
