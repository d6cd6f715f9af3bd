"""Engine /metrics samples and the windowed numbers the status reports (pure, no I/O)."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

DRAFTS = "ddtree_spec_decode_num_drafts_total"
ACCEPTED = "ddtree_spec_decode_num_accepted_tokens_total"
GENERATED = "ddtree_generation_tokens_total"
SMOKE_PASSED = "ddtree_smoke_test_passed"
GRAPH_CAPTURE = "ddtree_graph_capture_seconds"


@dataclasses.dataclass(frozen=True)
class EngineSample:
    """One scrape of one engine pod: cumulative counters and a few gauges, all summed over `model` labels."""

    time: float  # monotonic seconds when scraped
    drafts: float
    accepted: float
    generated: float
    smoke_test_passed: bool | None = None
    graph_capture_seconds: float | None = None


def parse_engine_metrics(text: str, time: float) -> EngineSample:
    """Reads the counters the status needs from Prometheus text exposition; raises ValueError on bad text."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    missing = [name for name in (DRAFTS, ACCEPTED, GENERATED) if name not in totals]
    if missing:
        raise ValueError(f"engine metrics lack {', '.join(missing)}")
    return EngineSample(
        time=time,
        drafts=totals[DRAFTS],
        accepted=totals[ACCEPTED],
        generated=totals[GENERATED],
        smoke_test_passed=bool(totals[SMOKE_PASSED]) if SMOKE_PASSED in totals else None,
        graph_capture_seconds=totals.get(GRAPH_CAPTURE),
    )


@dataclasses.dataclass(frozen=True)
class Window:
    """Rates between two scrapes, over every pod that was scraped both times."""

    acceptance_length: float | None  # None: no drafts in the window (idle, or method none)
    tokens_per_second: float


def window(previous: dict[str, EngineSample], current: dict[str, EngineSample]) -> Window | None:
    """Windowed acceptance length (1 + Δaccepted/Δdrafts) and tokens/s (Σ Δgenerated/Δt) over pods.

    Keys are pod UIDs. A pod without an earlier sample, or whose counters went backwards (the engine
    restarted), contributes nothing to this window. Returns None when no pod has two samples yet.
    """
    drafts = accepted = 0.0
    tokens_per_second = 0.0
    paired = False
    for uid, now in current.items():
        before = previous.get(uid)
        if before is None or now.time <= before.time:
            continue
        deltas = (now.drafts - before.drafts, now.accepted - before.accepted, now.generated - before.generated)
        if min(deltas) < 0:
            continue
        paired = True
        drafts += deltas[0]
        accepted += deltas[1]
        tokens_per_second += deltas[2] / (now.time - before.time)
    if not paired:
        return None
    acceptance_length = 1.0 + accepted / drafts if drafts > 0 else None
    return Window(acceptance_length=acceptance_length, tokens_per_second=tokens_per_second)
