"""Continuous batching over the Engine's batch rows (one running request per row).

One engine thread owns the Engine. Each iteration it
  1. drops cancelled requests (a disconnected client frees its row between rounds),
  2. admits waiting requests into free rows, lowest row first, while the KV cache has their pages
     (`engine.begin`),
  3. prefills at most one chunk's worth of prompt tokens (`engine.prefill_many`, prefill_chunk tokens,
     oldest admitted request first, several requests' chunks in one forward); a request whose prompt is
     all in gets its first token and starts running,
  4. gives every running row the KV cache pages its round can fill (`engine.grow`), preempting the
     request admitted last while the pool has too few, then runs one round on rows [0, n), n = highest
     running row + 1 (`engine.step`), and holds the tokens of requests with a grammar to it
     (runtime/constrained.py),
  5. truncates each request's tokens at stop tokens, stop strings and max_tokens, detokenizes
     incrementally and hands the new text to the request's sink,
  6. releases finished rows.
So a long prompt costs the running requests one chunk's forward per round, not a whole prefill.
Requests join and leave only between rounds. The sink is called on the engine thread; the server
passes one that keeps events for an asyncio queue, and a `flush` that the scheduler calls after each batch
of them and that wakes the event loop once for the batch (relay.EventRelay), so that the event loop never
waits on torch and the engine thread does not hand the GIL to the loop once per event.

Memory: a request is admitted when a row is free and the KV cache has the pages its prompt and its first
round can fill (less the pages of its prompt's start that the page index shares: runtime/pages.py), with
a page to spare for each running request; a running request takes pages as its text grows, before each
round. When the pool has too few, the request admitted last is preempted: it gives its row and pages back
(their full pages stay indexed) and waits at the head of the queue, to resume from its prompt and the
tokens it generated, whose pages the index maps back unless new text needed them meanwhile; its client
sees a pause, not a change. Requests are admitted in arrival order: one that waits for pages holds back
those behind it. Beyond the rows there is a bounded waiting queue; a full queue is refused (QueueFull ->
HTTP 429) instead of growing without bound.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from ..config import PAGE_SIZE
from ..runtime.constrained import Constraint, constrain
from ..runtime.engine import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .token_bytes import TextOffsets, TokenBytes

log = logging.getLogger("ddtree.scheduler")


class QueueFull(Exception):
    """The waiting queue is at its bound."""


class NotRunning(Exception):
    """The scheduler is not (or no longer) accepting requests."""


@dataclass
class Event:
    """What a request's sink receives: new text, and at the end the finish reason (or an error)."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None  # "stop" | "length" once finished
    error: str | None = None  # set (with error_status) when the request failed
    error_status: int = 500
    # with logprobs: one entry per completion token since the last event (TokenLogprob)
    logprobs: list[TokenLogprob] | None = None


@dataclass
class TokenLogprob:
    """A completion token's name (token_bytes.TokenBytes.name), bytes and log-probability, with the most
    likely tokens at its position, and the characters it adds to the completion's text."""

    token: str
    raw_bytes: bytes
    logprob: float
    top: list[tuple[str, bytes, float]]
    chars: int


_ids = itertools.count()


class Request:
    """One generation request as the scheduler sees it."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: list[str] | None,
        sink: Callable[[Event], None],
        skip_special_tokens: bool = True,  # off: special tokens are text too (tool-call markers of some models)
        logprobs: int | None = None,  # log-probabilities of the completion tokens, with this many top tokens
        constraint: Constraint | None = None,  # a grammar: response_format, a required tool choice (constrained.py)
        first_choice: Request | None = None,  # for a later choice of an API request (`n`), its first one
        shown_stop_ids: Iterable[int] = (),  # stop tokens whose text ends the completion (the request's own)
        include_stop_str: bool = False,  # a stop string that ends the completion stays in its text
        min_tokens: int = 0,  # stop strings are looked for from this many tokens on (stop tokens: a constraint)
    ):
        self.id = next(_ids)
        self.first_choice = first_choice
        self.admitted = 0  # admission order: the request admitted last is preempted first
        self.resumed = False  # preempted: it resumes from prompt_ids + token_ids (engine_prompt)
        self.constraint = constraint
        self.logprobs = logprobs
        self.pending_logprobs: list[TokenLogprob] = []  # of the tokens being delivered
        self.text_offsets: TextOffsets | None = None  # with logprobs: the characters each token adds
        self.skip_special_tokens = skip_special_tokens
        self.prompt_ids = prompt_ids
        self.params = params
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.shown_stop_ids = frozenset(shown_stop_ids)
        self.include_stop_str = include_stop_str
        self.min_tokens = min_tokens
        self.stop = [s for s in (stop or []) if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.sink = sink
        self.cancelled = False
        self.arrival = time.perf_counter()
        self.row: int | None = None  # the engine row while admitted
        self.prefilled = 0  # prompt tokens in the engine's caches
        self.token_ids: list[int] = []
        self.text = ""  # complete text so far (cut at a stop string)
        self.sent = 0  # characters of self.text already handed to the sink
        self.finish_reason: str | None = None
        self.last_token_at = 0.0
        self.detok: IncrementalDetokenizer | None = None

    @property
    def engine_prompt(self) -> list[int]:
        """What the engine prefills: the prompt, and after a preemption the tokens generated before it."""
        return self.prompt_ids + self.token_ids if self.resumed else self.prompt_ids

    @property
    def engine_params(self) -> SamplingParams:
        if not self.resumed:
            return self.params
        return replace(self.params, max_new_tokens=self.params.max_new_tokens - len(self.token_ids))


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


class Scheduler:
    def __init__(
        self,
        engine,
        tokenizer,
        metrics,
        max_waiting: int = 32,
        prefix_cache: bool = True,
        flush: Callable[[], None] = lambda: None,
        token_bytes: TokenBytes | None = None,
    ):
        self.engine = engine
        self.token_bytes = token_bytes or TokenBytes(tokenizer)  # log-probabilities' token bytes
        # called after each batch of sink calls (the prefill's first tokens, a round's text, failures): the
        # server's sinks keep events until then (relay.EventRelay)
        self.flush = flush
        self.tokenizer = tokenizer  # used on the engine thread only (decoding)
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.prefix_cache = prefix_cache  # Engine.begin(reuse=...): prompt starts the rows' caches hold
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: dict[int, Request] = {}  # engine row -> request; engine thread only
        self._prefilling: dict[int, Request] = {}  # engine row -> request whose prompt is going in, oldest first
        self._admitting: list[Request] = []  # taken from the queue, not yet in an engine row; engine thread only
        self.prefill_budget = engine.prefill_sizes[-1]  # prompt tokens prefilled per iteration
        self._free = engine.max_batch_size  # rows not claimed by a request (guarded by _cv)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._admissions = itertools.count(1)
        self.rounds = 0
        self.error: BaseException | None = None

    # ---- any thread -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ddtree-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop after the current round; waiting and running requests get a 503 error event."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def capacity(self) -> int:
        """Requests this scheduler holds at most: a row each, and the waiting queue."""
        return self.engine.max_batch_size + self.max_waiting

    def submit(self, *reqs: Request) -> None:
        """Queue `reqs` (the choices of one API request: all of them or none)."""
        with self._cv:
            if self._stopping or self._thread is None or not self._thread.is_alive():
                raise NotRunning("the engine is not running")
            if len(self._waiting) + len(reqs) > self.max_waiting + self._free:
                raise QueueFull(  # clients have always read "slots" here: the engine's rows
                    f"{len(self._waiting)} requests are already waiting for one of "
                    f"{self.engine.max_batch_size} slots; retry later"
                )
            self._waiting.extend(reqs)
            self.metrics.requests_waiting.set(len(self._waiting))
            self._set_load()
            self._cv.notify_all()

    def cancel(self, req: Request) -> None:
        """Abandon a request (its client went away); its row is freed before the next round."""
        with self._cv:
            if req.cancelled or req.finish_reason is not None:
                return
            req.cancelled = True
            try:
                self._waiting.remove(req)
                self.metrics.requests_waiting.set(len(self._waiting))
                self._set_load()
            except ValueError:  # running: the engine thread releases its row before the next round
                self._cv.notify_all()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests holding an engine row (generating, or having their prompt prefilled)."""
        return len(self._running) + len(self._prefilling)

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a broken engine: fail everything, refuse new work
            log.exception("engine thread failed")
            self.error = exc
            with self._cv:
                self._stopping = True
        finally:
            self._fail_all(
                503,
                "the server is shutting down"
                if self.error is None
                else f"engine failure: {type(self.error).__name__}: {self.error}",
            )

    def _loop(self) -> None:
        engine = self.engine
        while True:
            for req in [r for r in (*self._running.values(), *self._prefilling.values()) if r.cancelled]:
                self._finish(req, None)
            with self._cv:
                if not (self._stopping or self._waiting or self.running):
                    self._update_gauges()
                while not (self._stopping or self._waiting or self.running):
                    self._cv.wait()
                if self._stopping:
                    return
                taken = self._running.keys() | self._prefilling.keys()
                free = [row for row in range(engine.max_batch_size) if row not in taken]
                # admission by free KV cache pages too, in arrival order, with a page to spare for each
                # request that runs (its text grows into new pages)
                pages = engine.page_pool.available - self.running
                while free and self._waiting:
                    req = self._waiting[0]
                    if self._after_first_choice(req):
                        break
                    prompt, params = req.engine_prompt, req.engine_params
                    need = engine.pages_needed(prompt, params, self.prefix_cache)
                    # one that never fits goes to begin, which refuses it; one alone always goes in
                    fits = engine.request_pages(prompt, params) <= engine.page_pool.pages
                    if fits and need + 1 > pages and (self.running or self._admitting):
                        break
                    pages -= need + 1
                    self._waiting.popleft()
                    # the lowest free row: a round runs rows [0, highest running + 1), so rows stay packed
                    req.row = free.pop(0)
                    self._free -= 1
                    self._admitting.append(req)
                self.metrics.requests_waiting.set(len(self._waiting))
                self._set_load()
            start = time.perf_counter()
            admits = list(self._admitting)
            for req in admits:
                if req.cancelled:
                    self._finish(req, None)
                else:
                    self._admit(req.row, req)
                self._admitting.remove(req)  # after: an engine failure in _admit leaves it to _fail_all
            self._prefill()
            self.flush()
            self.metrics.requests_running.set(self.running)
            self._set_load()
            busy = bool(admits or self.running)
            if self._running:
                self._make_room()
            if self._running:
                self._round()
            self.flush()
            if busy:
                self.metrics.scheduler_iteration_seconds.observe(time.perf_counter() - start)
            self._update_gauges()

    def _update_gauges(self) -> None:
        engine = self.engine
        self.metrics.requests_running.set(self.running)
        self._set_load()
        pool = engine.page_pool
        self.metrics.kv_cache_usage_ratio.set(pool.used / pool.pages)
        self.metrics.kv_pages_used.set(pool.used)
        self.metrics.kv_pages_total.set(pool.pages)

    def _set_load(self) -> None:
        """ddtree_load: rows claimed (requests running, or admitted and about to prefill) plus requests
        waiting, over the engine's rows."""
        rows = self.engine.max_batch_size
        self.metrics.load.set((rows - self._free + len(self._waiting)) / rows)

    def _after_first_choice(self, req: Request) -> bool:
        """Whether `req`, a later choice of a request, waits (and the queue behind it) until its first
        choice's prompt is in the cache, to map the prompt's pages from there rather than prefill it again."""
        first = req.first_choice
        if first is None or not self.prefix_cache or req.resumed or len(req.prompt_ids) <= PAGE_SIZE:
            return False
        return first.detok is None and first.finish_reason is None and not first.cancelled

    def _admit(self, row: int, req: Request) -> None:
        try:
            reused = self.engine.begin(row, req.engine_prompt, req.engine_params, reuse=self.prefix_cache)
        except ValueError as exc:  # validated by the server already; kept as a safety net
            self.engine.release(row)
            self._error(req, 400, str(exc))
            return
        req.prefilled = reused
        req.admitted = next(self._admissions)
        if not req.resumed:
            self.metrics.prefix_cache_hit_tokens.inc(reused)
        self._prefilling[row] = req

    def _make_room(self) -> None:
        """Give every running row the pages its next round can fill, oldest request first; while the pool
        has too few, preempt the request admitted last (the one short of pages, if it is that one)."""
        engine = self.engine
        for row, req in sorted(self._running.items(), key=lambda item: item[1].admitted):
            # asked locally (no broadcast under tensor parallelism); grow runs only when pages are taken
            while req.row == row and engine.pages_wanted(row) > engine.page_pool.available:
                victims = [*self._running.values(), *self._prefilling.values()]
                self._preempt(max(victims, key=lambda r: r.admitted))
            if req.row == row and engine.pages_wanted(row) > 0:
                engine.grow(row)

    def _preempt(self, req: Request) -> None:
        """Give `req`'s row and pages back and queue it first, to resume from engine_prompt."""
        log.info("request %s preempted after %d tokens: the KV cache is full", req.id, len(req.token_ids))
        req.resumed = req.detok is not None  # it has tokens out: it resumes after them
        self._finish(req, None)
        req.finish_reason = None
        self.metrics.preemptions.inc()
        with self._cv:
            self._waiting.appendleft(req)
            self.metrics.requests_waiting.set(len(self._waiting))

    def _prefill(self) -> None:
        """Prefill up to prefill_budget prompt tokens, oldest admitted request first, the chunks of several
        requests in one forward (engine.prefill_many); requests whose prompt is all in start running with
        their first token."""
        budget, takes = self.prefill_budget, []
        for row, req in self._prefilling.items():
            if budget <= 0:
                break
            take = min(len(req.engine_prompt) - req.prefilled, budget)
            takes.append((row, take))
            budget -= take
        if not takes:
            return
        t0 = time.perf_counter()
        try:
            firsts = self.engine.prefill_many(takes)
        except RuntimeError as exc:  # out of memory during the prefill, and friends: refuse, keep serving
            log.warning("prefill failed: %s", exc)
            for row, _ in takes:
                self._error(self._prefilling[row], 503, f"prefill failed: {type(exc).__name__}: {exc}")
            _empty_cache(self.engine)
            return
        now = time.perf_counter()
        self.metrics.prefill_seconds.observe(now - t0)
        for (row, take), first in zip(takes, firsts):
            req = self._prefilling[row]
            req.prefilled += take
            if first is None:
                continue
            if req.constraint is not None:
                first_tokens = {row: [first]}
                if self._constrain(first_tokens, {row: req}):  # failed: the request has its error
                    continue
                first = first_tokens[row][0]
            del self._prefilling[row]
            self._logprobs(row, req, [first])
            self._running[row] = req
            if req.resumed:  # its next token, after a pause
                self._deliver(req, [first], now)
                continue
            self.metrics.prompt_tokens.inc(len(req.prompt_ids))
            self.metrics.time_to_first_token.observe(now - req.arrival)
            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.skip_special_tokens)
            self._deliver(req, [first], now, first=True)

    def _round(self) -> None:
        engine, m = self.engine, self.metrics
        n = max(self._running) + 1
        t0 = time.perf_counter()
        try:
            out = engine.step(n)
        except RuntimeError as exc:  # the round's state is unusable: fail its requests, keep serving
            log.exception("engine round failed")
            for req in list(self._running.values()):
                self._error(req, 500, f"engine round failed: {type(exc).__name__}: {exc}")
            _empty_cache(engine)
            return
        constrained = {row: req for row, req in self._running.items() if req.constraint is not None}
        if constrained:
            self._constrain(out, constrained)
        now = time.perf_counter()
        self.rounds += 1
        m.engine_step_seconds.observe(now - t0)
        k, plan = len(self._running), engine.last_plan  # the plan the round ran (budget auto: its choice)
        m.num_drafts.labels(model=m.model, budget=str(plan.budget)).inc(k)
        m.num_draft_tokens.inc(k * (plan.tree_size - 1))
        m.forecast_accepted_tokens.inc(engine.last_forecast if engine.budgets is not None else 0.0)
        m.spec_budget.set(plan.budget)
        accepted = 0
        for row, req in list(self._running.items()):
            toks = out[row]
            accepted += max(0, len(toks) - 1)
            m.acceptance_length.observe(len(toks))
            self._logprobs(row, req, toks)
            self._deliver(req, toks, now)
        m.num_accepted_tokens.inc(accepted)

    def _constrain(self, emitted, requests: dict[int, Request]) -> set[int]:
        """Hold the tokens rows just emitted to their requests' grammars (runtime/constrained.py); returns
        the rows whose grammar failed, whose requests fail with a 500 while the others go on."""
        constraints: dict[int, Constraint] = {row: req.constraint for row, req in requests.items() if req.constraint}
        replaced, failed = constrain(self.engine, emitted, constraints)
        self.metrics.grammar_replaced_tokens.inc(replaced)
        for row, why in failed.items():
            log.warning("request %s: %s", requests[row].id, why)
            self._error(requests[row], 500, why)
        return set(failed)

    def _logprobs(self, row: int, req: Request, toks: list[int]) -> None:
        """Stage the log-probabilities of the tokens row `row` just emitted (before the next round overwrites
        them), for requests that asked; tokens past max_tokens are cut with them in _deliver."""
        if req.logprobs is None or not toks:
            return
        name = self.token_bytes.name
        if req.text_offsets is None:
            req.text_offsets = TextOffsets(self.token_bytes, req.skip_special_tokens)
        for t, (lp, top) in zip(toks, self.engine.token_logprobs(row, toks, req.logprobs)):
            token, data = name(t)
            alternatives = [(*name(i), v) for i, v in top]
            req.pending_logprobs.append(TokenLogprob(token, data, lp, alternatives, req.text_offsets.chars(t, data)))

    def _append_text(self, req: Request, piece: str) -> bool:
        """Add decoded text; True when a stop string completed (the text is then cut before it). Before
        min_tokens tokens a stop string does not count (vLLM's rule)."""
        if not piece:
            return False
        start = max(0, len(req.text) - req.max_stop + 1)
        req.text += piece
        if not req.stop or len(req.token_ids) < req.min_tokens:
            return False
        hits = [(i, -len(s)) for i, s in ((req.text.find(s, start), s) for s in req.stop) if i >= 0]
        if hits:
            at, minus_length = min(hits)  # the first stop string, the longest of those starting there
            req.text = req.text[: at - minus_length if req.include_stop_str else at]
            return True
        return False

    def _deliver(self, req: Request, toks: list[int], now: float, first: bool = False) -> None:
        before = len(req.token_ids)
        finish, by_string = None, False
        for t in toks[: req.params.max_new_tokens - before]:
            req.token_ids.append(t)
            if t in req.stop_token_ids:  # counted as a completion token; only the request's own have text
                if t in req.shown_stop_ids:
                    self._append_text(req, req.detok.push(t))
                finish = "stop"
                break
            if self._append_text(req, req.detok.push(t)):
                finish, by_string = "stop", True
                break
        if finish is None and len(req.token_ids) >= req.params.max_new_tokens:
            finish = "length"
        if finish is not None and not by_string and self._append_text(req, req.detok.flush()):
            finish = "stop"
        new = len(req.token_ids) - before
        logprobs = None
        if req.logprobs is not None:  # the entries of the tokens kept (toks may run past max_tokens or a stop)
            logprobs, req.pending_logprobs = req.pending_logprobs[:new], []
        m = self.metrics
        m.generation_tokens.inc(new)
        if not first and new:
            gap = (now - req.last_token_at) / new
            for _ in range(new):
                m.inter_token_latency.observe(gap)
        req.last_token_at = now
        upto = len(req.text) if finish else len(req.text) - _held_back(req.text, req.stop)
        delta = req.text[req.sent : upto] if upto > req.sent else ""
        req.sent = max(req.sent, upto)
        if finish:
            m.request_latency.observe(now - req.arrival)
            self._finish(req, finish)
            req.sink(Event(delta, len(req.token_ids), finish, logprobs=logprobs))
        elif delta or logprobs:
            req.sink(Event(delta, len(req.token_ids), logprobs=logprobs))

    def _finish(self, req: Request, reason: str | None) -> None:
        req.finish_reason = reason or "cancelled"
        row, req.row = req.row, None
        if row is None:
            return
        for rows in (self._running, self._prefilling):
            if rows.get(row) is req:
                self.engine.release(row)
                del rows[row]
        with self._cv:
            self._free += 1

    def _error(self, req: Request, status: int, message: str) -> None:
        self._finish(req, None)
        req.sink(Event("", len(req.token_ids), None, error=message, error_status=status))

    def _fail_all(self, status: int, message: str) -> None:
        with self._cv:
            waiting, self._waiting = list(self._waiting), deque()
        admitting, self._admitting = self._admitting, []
        for req in [*self._running.values(), *self._prefilling.values(), *admitting, *waiting]:
            if not req.cancelled:
                self._error(req, status, message)
            else:
                self._finish(req, None)
        self.flush()
        self.metrics.requests_running.set(0)
        self.metrics.requests_waiting.set(0)
        self.metrics.load.set(0)


def _empty_cache(engine) -> None:
    try:
        import torch

        if getattr(getattr(engine, "device", None), "type", None) == "cuda":
            torch.cuda.empty_cache()
    except RuntimeError as exc:  # best effort
        log.debug("empty_cache failed: %s", exc)
