"""CUDA graphs of whole rounds, one per (batch bucket, attention-span bucket, sampling, candidate plan).

A graph replays `Engine.round` on rows [0, bucket): draft at block_size tokens per sequence, verify
at budget + 1, walk and compaction, all reading and writing the engine's persistent buffers, so a
replay needs no input copies. Widths come from the bucket's round plan (`Engine.plan`: drafter block
when it drafts, tree size from its budget) and are recorded with each graph; a replay for a shape that
was not captured raises GraphShapeError naming both shapes, or runs eagerly when `fallback` is set.
With budget auto, every candidate plan of a bucket (Engine.candidates) gets its graphs, and
`time_replays` measures each one for the budget controller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch


class GraphShapeError(RuntimeError):
    pass


@dataclass(frozen=True)
class RoundShape:
    batch: int  # sequences per replay (rows [0, batch))
    span: int  # cache slots attended over
    draft_tokens: int  # drafter queries per sequence (block_size; 0 without a draft)
    verify_tokens: int  # target tokens per sequence (this batch's budget + 1)
    sampling: bool

    def describe(self) -> str:
        return (
            f"batch {self.batch} x span {self.span}, draft {self.draft_tokens} / verify "
            f"{self.verify_tokens} tokens per sequence, {'sampling' if self.sampling else 'greedy'}"
        )


def default_span_buckets(max_slots: int, smallest: int = 256) -> list[int]:
    spans, s = [], smallest
    while s < max_slots:
        spans.append(s)
        s *= 2
    return spans + [max_slots]


def median_replay_ms(graph: torch.cuda.CUDAGraph, repeats: int, after_each: Callable[[], None] | None = None) -> float:
    """Median device time of one replay of `graph` in ms (CUDA events around each timed replay), after an
    untimed one; `after_each` runs after every replay, outside the timing (round_profile's rewind)."""
    graph.replay()
    if after_each:
        after_each()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        if after_each:
            after_each()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[repeats // 2]


def plan_buckets(engine, batch: int) -> list[int]:
    """The fewest batch buckets RoundGraphs accepts for rounds on `batch` rows: `batch`, and each smaller
    row count where a budget per batch size ends a plan."""
    return sorted({batch} | {p.batch for p in engine.plans[:batch] if p.batch < batch})


class RoundGraphs:
    def __init__(self, engine, batch_buckets: list[int], span_buckets: list[int] | None = None, fallback: bool = False):
        bad = [b for b in batch_buckets if not 1 <= b <= engine.max_batch_size]
        if bad:
            raise GraphShapeError(f"batch buckets {bad} outside 1..max_batch_size={engine.max_batch_size}")
        self.engine = engine
        self.batch_buckets = sorted(set(batch_buckets))
        # a replay runs the bucket's round, so a plan that ends between two buckets (a budget that changes
        # there) would differ from the eager round on the same rows
        last = self.batch_buckets[-1]
        off = sorted({p.batch for p in engine.plans if p.batch not in self.batch_buckets and p.batch < last})
        if off:
            raise GraphShapeError(
                f"the budget per batch size changes at batch sizes {off}, which are not graph "
                f"batch buckets {self.batch_buckets}; use bucket sizes"
            )
        # a span never exceeds the cache (its last slot, the trash slot, is never attended)
        self.span_buckets = sorted(
            {min(s, engine.max_slots) for s in span_buckets or default_span_buckets(engine.max_slots)}
        )
        self.fallback = fallback
        self.graphs: dict[RoundShape, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # the memory pool handle of the first captured graph
        self.capture_seconds = 0.0
        self.fallbacks = 0

    def shape(self, batch: int, span: int, sampling: bool) -> RoundShape:
        plan = self.engine.plan(batch)  # block 0: this bucket decodes plainly
        return RoundShape(batch, span, plan.block, plan.tree_size, sampling)

    @torch.inference_mode()
    def capture(self, sampling: tuple[bool, ...] = (False,)) -> float:
        """Capture every (batch bucket, span bucket, sampling) graph. Must run while no request is active:
        warm-up prefills into row 0, and every row's length is reset afterwards."""
        e = self.engine
        if e.device.type != "cuda":
            raise GraphShapeError(f"CUDA graphs need a CUDA device (engine is on {e.device})")
        if any(e.host_active):
            raise RuntimeError("capture graphs before admitting requests")
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for samp in sampling:
            for span in self.span_buckets:
                for batch in self.batch_buckets:
                    for plan in e.candidates(batch):
                        with e.pinned_plan(plan):
                            self._capture(batch, span, samp, stream)
        torch.cuda.synchronize()
        e.lengths.zero_()
        e.ctx_count.zero_()
        self.capture_seconds += time.perf_counter() - start
        return self.capture_seconds

    def _capture(self, batch: int, span: int, sampling: bool, stream: torch.cuda.Stream) -> None:
        e = self.engine
        with torch.cuda.stream(stream):
            e.round(batch, span, sampling)  # warm-up: allocator and kernel selection
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if sampling:
            graph.register_generator_state(e.generator)
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            e.round(batch, span, sampling)
        self.pool = graph.pool()  # graphs never run concurrently: share one memory pool
        self.graphs[self.shape(batch, span, sampling)] = graph

    @torch.inference_mode()
    def time_replays(self, repeats: int = 3) -> dict[tuple[int, int], dict[int, float]]:
        """The median replay time of every greedy graph, {(batch, span): {budget: seconds}} (budget: verify
        tokens - 1). Must run while no request is active, like capture."""
        e = self.engine
        costs: dict[tuple[int, int], dict[int, float]] = {}
        for shape, graph in self.graphs.items():
            if shape.sampling:
                continue
            seconds = median_replay_ms(graph, repeats) / 1000
            costs.setdefault((shape.batch, shape.span), {})[shape.verify_tokens - 1] = seconds
        e.lengths.zero_()
        e.ctx_count.zero_()
        return costs

    def run(self, n: int, span_needed: int, sampling: bool) -> bool:
        """Replay the smallest captured graph covering n sequences and span_needed slots.
        Returns False (caller runs eagerly) only in fallback mode."""
        batch = next((b for b in self.batch_buckets if b >= n), None)
        span = next((s for s in self.span_buckets if s >= span_needed), None)
        shape = self.shape(batch or n, span or span_needed, sampling)
        graph = self.graphs.get(shape) if batch and span else None
        if graph is None:
            if self.fallback:
                self.fallbacks += 1
                return False
            raise GraphShapeError(
                f"no CUDA graph captured for {shape.describe()}; captured: "
                + ("; ".join(s.describe() for s in list(self.graphs)[:4]) or "none")
                + (f" ... ({len(self.graphs)} graphs)" if len(self.graphs) > 4 else "")
            )
        graph.replay()
        return True

    def captured(self) -> list[dict]:
        return [asdict(s) for s in self.graphs]
