"""`ddtree serve`: an OpenAI-compatible HTTP server with continuous batching.

Start-up: the HTTP server binds first (so /health answers while weights load), then a background
thread loads the weights, captures CUDA graphs (on a GPU), runs the smoke test (ddtree.runtime.smoke) and,
when it passes, starts the scheduler (ddtree.serving.scheduler) and flips /ready to 200. When the smoke test
(or loading) fails, the reason goes to the termination log and the process exits with status 1.

Tensor parallelism (--tensor-parallel N, or N torchrun processes): this process is rank 0 and runs
everything above; ranks 1..N-1 (`serve_follower`) load their shard, bind no port and replay rank 0's
engine calls (ddtree.runtime.parallel.Leader / follow). On shutdown rank 0 sends them a stop command.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent
events), GET /v1/models, GET /health, GET /ready, GET /metrics. Errors use OpenAI's body
{"error": {"message", "type", "param", "code"}}; every response carries an X-Request-Id header, which the
log lines about that request name.

Requests never make the event loop wait on CPU work: bodies are decoded and prompts tokenized on one
preparation thread with a bounded queue (ddtree.serving.prompts), generation runs on the scheduler's
thread. API keys (ddtree.serving.auth) guard /v1/*; connection limits and deadlines are in
ddtree.serving.connections.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import json
import logging
import signal
import sys
import threading
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..config import AUTO, EngineConfig

if TYPE_CHECKING:
    from ..runtime.parallel import Leader
    from ..runtime.smoke import SmokeReport
    from .connections import ConnectionGuard
    from .prompts import PromptEncoder
    from .scheduler import Scheduler
    from .tools import ToolCallFormat, ToolRequest
from .auth import OPEN_PREFIXES, authorized
from .protocol import COMPLETION_PATHS, APIError, Sampling, bad_request, chat_logprobs, completion_logprobs
from .relay import EventRelay

log = logging.getLogger("ddtree.server")

SMOKE_FAULTS = ("corrupt-graph-input",)
SMOKE_TEXTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time", "import numpy as np\n"]
MAX_BODY_BYTES = 64 * 1024 * 1024  # before the tokenizer is loaded; then a bound from the context (body_limit)

# ---- the server -----------------------------------------------------------------------------


def load_engine(config: EngineConfig, rank: int = 0, world: int = 1, bar=None):
    """(engine, tokenizer) of a resolved config; with world > 1 the target is this rank's shard (call it
    on every rank, after joining the group, so that all ranks build the same engine)."""
    from ..runtime.build import build_engine

    def note(text: str | None = None) -> None:
        if bar is not None:
            bar.set_postfix_str(text) if text else bar.update()

    return build_engine(config, rank, world, note=note)


def serve_follower(rank: int, world: int, config: EngineConfig) -> int:
    """Ranks 1..N-1 of `ddtree serve --tensor-parallel N`: load this rank's shard, build the same engine
    as rank 0 and replay rank 0's engine calls until it sends stop. No HTTP server, no port.

    SIGINT and SIGTERM are ignored: rank 0 gets them too (terminal, torchrun, kubelet) and ends the
    followers with the stop command. If rank 0 dies instead, a follower started by rank 0 gets SIGKILL
    (parent-death signal); under torchrun the broadcast it waits in fails on the closed connection."""
    from ..runtime.parallel import command_group, follow, init_from_env, leave_group

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    init_from_env(config.model.device.split(":")[0])  # a no-op when start_followers' process already joined
    group = command_group()
    engine, _ = load_engine(config, rank, world)
    follow(engine, group)
    leave_group(engine)  # at the same time as rank 0 (NCCL's teardown waits for every rank)
    return 0


class EngineServer:
    def __init__(
        self,
        config: EngineConfig,
        world: int = 1,
        smoke_fault: str | None = None,
        api_keys: tuple[bytes, ...] = (),
    ):
        """`config`: resolved (EngineConfig.resolve()); `world`: tensor parallel ranks (this one is 0);
        `api_keys`: what /v1/* requires (ddtree.serving.auth.load_api_keys; none: open)."""
        self.config, self.world, self.smoke_fault, self.api_keys = config, world, smoke_fault, api_keys
        self.graph_buckets, self.smoke_sizes = config.serve_batch_sizes()
        self.name = config.served_model_name
        from .metrics import ServerMetrics

        self.metrics = ServerMetrics(self.name)
        self.phase = "loading"  # loading -> capturing -> smoke_test -> ready | failed
        self.reason = ""
        self.report: SmokeReport | None = None
        self.engine: Any = None  # the Engine, or its parallel.Leader under tensor parallelism
        self.prompts: PromptEncoder | None = None  # used on the preparation thread only
        self.tool_format: ToolCallFormat | None = None  # how tool calls are read from the generated text
        self.tool_markers_special = False
        self.scheduler: Scheduler | None = None
        # body decoding and tokenizing: one thread, at most `preparing_limit` requests queued or running
        self.preparation = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ddtree-prepare")
        self.preparing = 0
        self.preparing_limit = config.serving.max_batch_size + config.serving.waiting_limit
        self.guard: ConnectionGuard | None = None
        self.stop_token_ids: tuple[int, ...] = ()
        self.exit_code = 0
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None
        self.relay = EventRelay()  # the engine thread's events to the request queues of the event loop
        self.stopped: asyncio.Event | None = None
        self.loader: threading.Thread | None = None
        self.leader: Leader | None = None  # when tensor parallel: the engine calls go through it
        self.followers: list = []  # follower processes this process started (not under torchrun)
        self.closing = False

    # ---- start-up (loader thread) ---------------------------------------------------------------

    def start_loading(self) -> None:
        self.loader = threading.Thread(target=self._load, name="ddtree-load", daemon=True)
        self.loader.start()
        if self.followers:
            threading.Thread(target=self._watch_followers, name="ddtree-followers", daemon=True).start()

    def _watch_followers(self) -> None:
        """A follower that ends before the shutdown leaves rank 0's collectives hanging or failing: stop."""
        from multiprocessing.connection import wait

        ended = wait([p.sentinel for p in self.followers])
        if self.closing:  # the stop command ended it (and the main thread reaps it)
            return
        dead = next(p for p in self.followers if p.sentinel in ended)
        self._fail(f"tensor parallel rank {dead.name.rsplit('-', 1)[-1]} exited with code {dead.exitcode}")

    def _load(self) -> None:
        config = self.config
        try:
            from tqdm import tqdm

            from ..runtime.build import stop_ids
            from ..runtime.smoke import run_smoke

            bar = tqdm(total=5, desc="ddtree serve", unit="step", file=sys.stderr, dynamic_ncols=True)
            if self.world > 1:
                from ..runtime.parallel import Leader, command_group, init_from_env

                bar.set_postfix_str(f"joining {self.world} tensor parallel ranks")
                init_from_env(config.model.device.split(":")[0])
                self.leader = Leader(None, command_group())
            engine, tokenizer = load_engine(config, 0, self.world, bar)
            target, max_seq_len = engine.target, engine.max_seq_len
            # the limit the engine was built with (default: 2048, or the model's context where shorter)
            self.config = replace(config, serving=replace(config.serving, max_seq_len=max_seq_len))
            if self.leader is not None:
                self.leader.engine = engine
                engine = self.leader
            self.metrics.spec_budget.set(engine.budget)
            for budget in sorted({p.budget for n in range(engine.max_batch_size) for p in engine.candidates(n + 1)}):
                self.metrics.num_drafts.labels(model=self.name, budget=str(budget))  # exported at 0 before a round
            bar.update()
            self.phase = "capturing"
            if engine.device.type == "cuda" and config.kernels.graphs:
                bar.set_postfix_str(f"capturing CUDA graphs (batch buckets {self.graph_buckets})")
                # greedy and sampling rounds; shapes outside the buckets run eagerly (and count as fallbacks)
                engine.capture_graphs(batch_buckets=self.graph_buckets, sampling=(False, True), fallback=True)
            if engine.budgets is not None:
                bar.set_postfix_str("timing the rounds of each budget (--budget auto)")
                engine.measure_budgets()
            bar.update()
            self.phase = "smoke_test"
            bar.set_postfix_str(f"smoke test (batch sizes {self.smoke_sizes})")
            limit = max(1, max_seq_len - 9)
            prompts = [tokenizer.encode(t)[:limit] for t in SMOKE_TEXTS]
            extra: dict[str, Any] = {"fault": self.smoke_fault} if self.smoke_fault else {}
            smoke = engine.smoke if self.leader is not None else functools.partial(run_smoke, engine)
            report = smoke(self.smoke_sizes, prompts, max_new_tokens=min(8, max_seq_len - limit), **extra)
            bar.update()
            bar.close()
        except BaseException as exc:  # any start-up failure ends the process with a reason
            log.exception("start-up failed")
            self._fail(f"start-up failed: {type(exc).__name__}: {exc}")
            return
        self.metrics.graph_capture_seconds.set(report.capture_seconds)
        if not report.passed:
            self.report = report
            self._fail(report.reason)
            return
        for row in range(engine.max_batch_size):
            engine.release(row)
        self.report = report
        self.start_serving(engine, tokenizer, stop_ids(tokenizer, target))
        self.metrics.smoke_test_passed.set(1)
        self.reason = report.reason
        self.phase = "ready"
        log.info(
            "%s; ready to serve %s (%s, budget %s, %d rows x %d tokens)",
            report.reason,
            self.name,
            config.speculation.method,
            AUTO if engine.budgets is not None else engine.budget,
            engine.max_batch_size,
            engine.max_seq_len,
        )

    def _kernel_compiled(self, kernel: str) -> None:
        self.metrics.kernel_compiles.inc()
        log.warning("kernel compiled while serving (a request shape start-up did not run): %s", kernel[:300])

    def start_serving(self, engine, tokenizer, stop_token_ids: tuple[int, ...]) -> None:
        """Take requests on a loaded engine: prompt preparation, the tool-call format, the scheduler."""
        from ..runtime import compiles
        from .grammar import Grammars
        from .prompts import PromptEncoder
        from .reasoning import CLOSE, OPEN, reasoning_parser
        from .scheduler import Scheduler
        from .token_bytes import TokenBytes
        from .tools import tool_call_format

        serving = self.config.serving
        self.engine, self.stop_token_ids = engine, stop_token_ids
        self.prompts = PromptEncoder(tokenizer, serving.seq_len, serving.parse_special_tokens)
        self.tool_format = tool_call_format(serving.tool_call_parser, tokenizer)
        self.grammars = Grammars(tokenizer, engine, stop_token_ids)
        # markers that are special tokens (Kimi's) are only text when decoding keeps special tokens
        self.tool_markers_special = self.tool_format is not None and bool(
            set(self.tool_format.markers) & set(self.prompts.control)
        )
        self.reads_reasoning = reasoning_parser(serving.reasoning_parser, tokenizer)
        self.reasoning_markers_special = self.reads_reasoning and bool({OPEN, CLOSE} & set(self.prompts.control))
        # decoding happens on the engine thread: give it its own tokenizer instance
        decoding = copy.deepcopy(tokenizer)
        self.scheduler = Scheduler(
            engine,
            decoding,
            self.metrics,
            serving.waiting_limit,
            serving.prefix_cache,
            flush=self.relay.flush,
            token_bytes=TokenBytes(decoding, self.grammars.ll_tokenizer),
        )
        compiles.on_compile(self._kernel_compiled)
        self.scheduler.start()

    def _fail(self, reason: str) -> None:
        self.phase, self.reason, self.exit_code = "failed", reason, 1
        self.metrics.smoke_test_passed.set(0)
        log.error("%s", reason)
        from ..runtime.smoke import write_termination_log

        try:
            write_termination_log(reason, self.config.serving.termination_log)
        except OSError as exc:
            log.error("could not write the termination log: %s", exc)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.stopped.set)

    def stop_followers(self, timeout: float = 30.0) -> bool:
        """After the HTTP server and the scheduler stopped: send the followers the stop command (unless a
        thread still uses the engine), wait for the ones this process started and kill what is left.
        True when the group was left cleanly."""
        busy = [t for t in (self.loader, self.scheduler and self.scheduler._thread) if t and t.is_alive()]
        clean = False
        if self.leader is not None and not busy:
            from ..runtime.parallel import RankFailure

            try:
                self.leader.stop()
                clean = True
            except RankFailure as exc:
                log.warning("could not stop the other ranks: %s", exc)
        leaving = None
        if clean:  # NCCL's teardown waits for every rank: leave together with the followers, then join them
            from ..runtime.parallel import leave_group

            leaving = threading.Thread(
                target=leave_group, args=(self.leader.engine,), name="ddtree-leave-group", daemon=True
            )
            leaving.start()
        for p in self.followers:
            p.join(timeout if clean else 5.0)
            if p.is_alive():
                log.warning("killing %s (pid %s): it did not stop", p.name, p.pid)
                p.kill()
                p.join()
        if leaving is not None:
            leaving.join(timeout)
            if leaving.is_alive():
                log.warning("leaving the tensor parallel group did not finish in %.0f s", timeout)
                clean = False
        return clean or self.leader is None

    # ---- HTTP --------------------------------------------------------------------------------

    def app(self):
        from aiohttp import web

        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    @property
    def _middleware(self):
        from aiohttp import web

        @web.middleware
        async def middleware(request, handler):
            counted = request.path in COMPLETION_PATHS
            request["ddtree_request_id"] = request_id = uuid.uuid4().hex
            if self.guard is not None:
                self.guard.request_started(request.transport)
            try:
                if self.api_keys and not request.path.startswith(OPEN_PREFIXES):
                    if not authorized(self.api_keys, request.headers.get("Authorization")):
                        raise APIError(
                            401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key"
                        )
                resp = await handler(request)
            except APIError as exc:
                resp = exc.response()
                if exc.status == 401:
                    resp.headers["WWW-Authenticate"] = "Bearer"
                elif exc.status in (429, 503):
                    resp.headers["Retry-After"] = "1"
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                resp = APIError(exc.status, f"{exc.reason}: {request.method} {request.path}").response()
            except asyncio.CancelledError:  # the client went away
                if counted:
                    self.metrics.request_finished(499)
                raise
            except ConnectionError:  # the client went away while its body was being read
                request["ddtree_status"] = 499
                resp = web.Response(status=499)
            except Exception:  # a bug: logged under the request id; the client gets no exception text
                log.exception("internal error on %s (request %s)", request.path, request_id)
                resp = APIError(500, f"internal error (request id {request_id})").response()
            finally:
                if self.guard is not None:
                    self.guard.request_finished(request.transport)
            if counted:
                self.metrics.request_finished(request.get("ddtree_status", resp.status))
            if not resp.prepared:  # a stream sent its headers (with the id) already
                resp.headers["X-Request-Id"] = request_id
            return resp

        return middleware

    def _engine_failed(self) -> bool:
        return self.phase == "ready" and self.scheduler.error is not None

    async def health(self, request):
        from aiohttp import web

        if self._engine_failed():  # the engine thread died: let the orchestrator restart us
            return web.json_response({"status": "engine_failed", "reason": str(self.scheduler.error)}, status=503)
        return web.json_response({"status": self.phase}, status=503 if self.phase == "failed" else 200)

    async def ready(self, request):
        from aiohttp import web

        if self.phase == "ready" and not self._engine_failed():
            return web.json_response(self.report.to_json())
        body = {
            "ready": False,
            "status": "engine_failed" if self._engine_failed() else self.phase,
            "reason": str(self.scheduler.error) if self._engine_failed() else self.reason,
        }
        if self.report is not None:
            body["smoke_report"] = self.report.to_json()
        return web.json_response(body, status=503)

    async def metrics_endpoint(self, request):
        from aiohttp import web

        if self.scheduler is not None:
            self.metrics.requests_waiting.set(self.scheduler.waiting)
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def models(self, request):
        from aiohttp import web

        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "ddtree",
                        "root": self.config.model.id,
                        "max_model_len": self.config.serving.seq_len,
                    }
                ],
            }
        )

    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def chat_completions(self, request):
        return await self._generate(request, chat=True)

    def body_limit(self) -> int:
        """Largest body taken: room for the longest prompt the context can hold, JSON-escaped, or 1 MiB."""
        if self.prompts is None:
            return MAX_BODY_BYTES
        return min(MAX_BODY_BYTES, max(1 << 20, 8 * self.prompts.max_chars))

    async def read_body(self, request) -> bytes:
        """The body, within body_limit() bytes (413 otherwise, before reading it when Content-Length says
        so) and serving.body_timeout seconds (408)."""
        limit = self.body_limit()
        if request.content_length is not None and request.content_length > limit:
            raise APIError(413, f"the request body has {request.content_length} bytes; the limit is {limit}")
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"the request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), self.config.serving.body_timeout)
        except asyncio.TimeoutError:
            timeout = self.config.serving.body_timeout
            raise APIError(408, f"the request body did not arrive within {timeout:g} s") from None
        return b"".join(chunks)

    def _token_constraint(self, s: Sampling, params, constrained: bool, keeps_logits: bool):
        """The request's constraint on single tokens, as a maker of one per choice (None: it has none):
        min_tokens holding its stop tokens back, allowed_token_ids. Both are held after the verify like a
        grammar (runtime/constrained.py): the kept logits choose what replaces a refused token. Refuses ids
        outside the vocabulary, a min_tokens past max_tokens, either with a grammar (which may need a token
        they refuse, or nothing but a stop) and an allowed set with nothing left while stops are held."""
        from ..runtime.constrained import AllOf, AllowedTokens, MinTokens

        for key in ("stop_token_ids", "allowed_token_ids"):  # (the vocabulary read only when asked)
            if outside := [t for t in getattr(s, key) if t >= self.grammars.vocab]:
                raise bad_request(f"'{key}': {outside[0]} is outside the vocabulary of {self.grammars.vocab}", key)
        if s.min_tokens > params.max_new_tokens:
            raise bad_request(
                f"'min_tokens' ({s.min_tokens}) is more than max_tokens ({params.max_new_tokens})", "min_tokens"
            )
        holds = s.min_tokens > 0 and bool(params.stop_token_ids)
        key = "min_tokens" if holds else "allowed_token_ids"
        if not (holds or s.allowed_token_ids):
            return None
        if constrained:
            raise bad_request(f"'{key}' cannot go with a grammar ('response_format' or a required tool call)", key)
        if not keeps_logits:
            raise bad_request(
                "this server keeps no logits to hold tokens back with (it was started with --max-logprobs 0)", key
            )
        if holds and s.allowed_token_ids and set(s.allowed_token_ids) <= set(params.stop_token_ids):
            raise bad_request("'allowed_token_ids' holds only stop tokens, which min_tokens holds back", "min_tokens")
        vocab = self.grammars.vocab

        def make():
            parts = [MinTokens(s.min_tokens, params.stop_token_ids, vocab)] if holds else []
            parts += [AllowedTokens(s.allowed_token_ids, vocab)] if s.allowed_token_ids else []
            return parts[0] if len(parts) == 1 else AllOf(*parts)

        return make

    async def prepare(self, work, *args):
        """Run `work(*args)` on the preparation thread (429 when its queue is full)."""
        if self.preparing >= self.preparing_limit:
            raise APIError(429, "too many requests are being prepared; retry later", code="queue_full")
        self.preparing += 1
        loop = asyncio.get_running_loop()
        future = self.preparation.submit(work, *args)
        # counted until the work really ends, even when the client leaves and this await is cancelled
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._prepared))
        return await asyncio.wrap_future(future)

    def _prepared(self) -> None:
        self.preparing -= 1

    async def _body(self, request) -> dict:
        from .prompts import decode_body

        body = await self.prepare(decode_body, await self.read_body(request))
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad_request("'model' must be a string", "model")
        if model is not None and model != self.name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.name}'",
                param="model",
                code="model_not_found",
            )
        return body

    async def _generate(self, request, chat: bool):
        from ..runtime.engine import SamplingParams
        from .grammar import response_format_grammar
        from .scheduler import NotRunning, QueueFull, Request
        from .tools import tool_call_grammar

        body = await self._body(request)
        if self.phase != "ready":
            raise APIError(503, f"the server is not ready ({self.phase}); poll /ready", code="not_ready")
        budget = AUTO if self.engine.budgets is not None else self.engine.budget  # what the server runs
        s = Sampling(body, chat, budget, self.config.serving.max_logprobs)
        if chat:
            prompt, tools, opened = await self.prepare(self._prepare_chat, body)
        else:
            prompt, tools, opened = await self.prepare(self.prompts.completion, body), None, False
        reads_calls = tools is not None and tools.rendered is not None  # tools rendered: calls parsed back
        keeps_logits = self.config.serving.max_logprobs > 0
        grammar = response_format_grammar(body, s.ignore_eos, keeps_logits)
        # "required" and a named tool_choice: a grammar of calls in the model's markup (not without the logits)
        if reads_calls and keeps_logits and self.tool_format is not None and not s.ignore_eos:
            calls = tool_call_grammar(self.tool_format, tools)
            if calls is not None and grammar is not None:
                raise bad_request(
                    "'response_format' cannot go with a 'tool_choice' that requires a call: the answer is the calls",
                    "response_format",
                )
            grammar = grammar or calls
        limit = self.config.serving.seq_len
        if len(prompt) >= limit:
            raise bad_request(
                f"the prompt has {len(prompt)} tokens; this server's context is {limit} tokens (prompt + max_tokens)",
                "prompt" if not chat else "messages",
            )
        # defaults: OpenAI's 16 for completions, the rest of the context for chat
        max_tokens = s.max_tokens if s.max_tokens is not None else limit - len(prompt)
        if s.max_tokens is None and not chat:
            max_tokens = min(16, max_tokens)
        if len(prompt) + max_tokens > limit:
            raise bad_request(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context of {limit} tokens",
                "max_tokens",
            )
        if s.n > self.scheduler.capacity:
            raise bad_request(
                f"'n' is {s.n}; this server holds at most {self.scheduler.capacity} requests at once "
                f"({self.engine.max_batch_size} running, {self.scheduler.max_waiting} waiting)",
                "n",
            )
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            seed=s.seed,
            stop_token_ids=tuple(dict.fromkeys((() if s.ignore_eos else self.stop_token_ids) + s.stop_token_ids)),
        )
        token_constraint = self._token_constraint(s, params, grammar is not None, keeps_logits)
        # reasoning is read out of chat answers a grammar does not shape; `opened`: the prompt opened it
        reasoning = opened if chat and self.reads_reasoning and grammar is None else None
        markers_special = (reads_calls and self.tool_markers_special) or (
            reasoning is not None and self.reasoning_markers_special
        )
        try:
            self.engine.check_request(prompt, params)
        except ValueError as exc:
            # what it checks beyond the fields above: the prompt's tokens (ids, cache pages)
            raise bad_request(str(exc), "messages" if chat else "prompt") from None

        # one scheduler request per choice; each event reaches the queue as (choice index, event)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        reqs: list[Request] = []
        for i in range(s.n):
            constraint = await self.prepare(self.grammars.constraint, grammar) if grammar is not None else None
            if token_constraint is not None:
                constraint = token_constraint()
            reqs.append(
                Request(
                    prompt,
                    params if i == 0 else replace(params, seed=None),  # a seed reseeds once
                    s.stop,
                    functools.partial(self._choice_event, loop, queue, i),  # called on the engine thread
                    skip_special_tokens=not markers_special,
                    logprobs=s.logprobs,
                    constraint=constraint,
                    shown_stop_ids=s.stop_token_ids,
                    include_stop_str=s.include_stop_str_in_output,
                    min_tokens=s.min_tokens,
                    first_choice=reqs[0] if reqs else None,
                )
            )
        try:
            self.scheduler.submit(*reqs)
        except QueueFull as exc:
            raise APIError(429, str(exc), code="queue_full") from None
        except NotRunning as exc:
            raise APIError(503, str(exc), code="not_running") from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        try:
            calls = tools if reads_calls else None
            if s.stream:
                return await self._stream(request, reqs, queue, rid, chat, s.include_usage, calls, reasoning)
            return await self._collect(reqs, queue, rid, chat, calls, reasoning)
        finally:
            for req in reqs:
                if req.finish_reason is None:
                    self.scheduler.cancel(req)

    def _choice_event(self, loop, queue: asyncio.Queue, index: int, event) -> None:
        self.relay.put(loop, queue, (index, event))

    def _prepare_chat(self, body: dict) -> tuple[list[int], ToolRequest, bool]:
        """Token ids and tool request of a chat body, and whether its prompt opens the answer's reasoning (on
        the preparation thread)."""
        from .reasoning import opens_reasoning
        from .tools import ToolRequest

        tools = ToolRequest.from_body(body)
        if tools.rendered and self.prompts.renders_tools and self.tool_format is None:
            raise bad_request(
                "this server reads no tool calls from this model's output: its chat template has no tool-call "
                "format this server knows (start it with --tool-call-parser hermes or kimi_k2 if the model "
                'writes one of those), or send "tool_choice": "none"',
                "tools",
            )
        ids = self.prompts.chat(body, tools.rendered)
        opened = self.reads_reasoning and opens_reasoning(self.prompts.tokenizer.decode(ids[-8:]))
        return ids, tools, opened

    @staticmethod
    def _usage(reqs, completion_tokens: int) -> dict:
        """The prompt counts once however many choices share it (as in OpenAI's API)."""
        p = len(reqs[0].prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}

    async def _collect(
        self, reqs, queue, rid: str, chat: bool, tools: ToolRequest | None = None, reasoning: bool | None = None
    ):
        """The whole response, a choice per request of `reqs`; `tools`: the request's, when tool calls are
        read from the text; `reasoning`: whether the prompt opened the reasoning, when it is read out (None:
        not read)."""
        from aiohttp import web

        from .reasoning import split_reasoning
        from .tools import split_tool_calls

        parts: list[list[str]] = [[] for _ in reqs]
        entries: list[list] = [[] for _ in reqs]  # TokenLogprob
        finishes: list[str | None] = [None] * len(reqs)
        completion_tokens = 0
        while None in finishes:
            i, ev = await queue.get()
            if ev.error is not None:
                raise APIError(ev.error_status, ev.error)
            parts[i].append(ev.text)
            entries[i] += ev.logprobs or []
            if ev.finish_reason is not None:
                finishes[i] = ev.finish_reason
                completion_tokens += ev.completion_tokens
        choices = []
        for i, finish in enumerate(finishes):
            text = "".join(parts[i])
            logprobs = None
            if reqs[i].logprobs is not None:
                logprobs = chat_logprobs(entries[i]) if chat else completion_logprobs(entries[i], 0)
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if reasoning is not None:
                    thought, message["content"] = split_reasoning(text, reasoning)
                    message["reasoning_content"] = thought or None
                    text = message["content"]
                if tools is not None:
                    message["content"], calls = split_tool_calls(self.tool_format, text, tools.parallel)
                    if calls:
                        message["tool_calls"] = [call.to_json() for call in calls]
                        finish = "tool_calls" if finish == "stop" else finish
                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
            else:
                choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish})
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.name,
                "choices": choices,
                "usage": self._usage(reqs, completion_tokens),
            }
        )

    async def _stream(
        self,
        request,
        reqs,
        queue,
        rid: str,
        chat: bool,
        include_usage: bool,
        tools: ToolRequest | None = None,
        reasoning: bool | None = None,
    ):
        """Server-sent events, each chunk one choice's (a choice per request of `reqs`); `tools`: the
        request's, when tool calls are read from the text (content streams as it comes, each call as
        `tool_calls` deltas once it is complete); `reasoning` as _collect's (`reasoning_content` deltas)."""
        from aiohttp import web

        from .reasoning import ReasoningSplitter
        from .tools import ToolCallSplitter

        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def splitter():
            return ToolCallSplitter(self.tool_format, tools.parallel) if tools is not None else None

        choices = [
            _StreamedChoice(i, chat, splitter(), ReasoningSplitter(reasoning) if reasoning is not None else None)
            for i in range(len(reqs))
        ]

        def chunk(choice: dict) -> dict:
            out = {"id": rid, "object": obj, "created": created, "model": self.name, "choices": [choice]}
            if include_usage:
                out["usage"] = None
            return out

        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        resp = web.StreamResponse(headers={**headers, "X-Request-Id": request["ddtree_request_id"]})
        try:
            await resp.prepare(request)

            async def send(obj_: dict) -> None:
                await resp.write(b"data: " + json.dumps(obj_, ensure_ascii=False).encode() + b"\n\n")

            if chat:
                for choice in choices:
                    await send(chunk(choice.delta(None, delta={"role": "assistant", "content": ""})))
            unfinished, completion_tokens = len(choices), 0
            while unfinished:
                i, ev = await queue.get()
                if ev.error is not None:
                    request["ddtree_status"] = ev.error_status
                    await send(APIError(ev.error_status, ev.error).body())
                    break
                for item in choices[i].feed(ev):
                    await send(chunk(item))
                if ev.finish_reason is not None:
                    unfinished -= 1
                    completion_tokens += ev.completion_tokens
            else:
                if include_usage:
                    await send(
                        {
                            "id": rid,
                            "object": obj,
                            "created": created,
                            "model": self.name,
                            "choices": [],
                            "usage": self._usage(reqs, completion_tokens),
                        }
                    )
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:  # the client went away mid-stream; the caller frees its engine rows
            request["ddtree_status"] = 499
        return resp


class _StreamedChoice:
    """One choice of a streamed response: its log-probabilities not yet sent, its text offset
    (completions), its reasoning and tool-call splitters; `feed` turns its events into chunk choices."""

    def __init__(self, index: int, chat: bool, splitter, reasoning=None):
        self.index, self.chat, self.splitter, self.reasoning = index, chat, splitter, reasoning
        self.pending: list = []  # log-probabilities of tokens no chunk has carried yet
        self.offset = 0  # completions: characters of the completion the chunks' log-probabilities covered

    def delta(self, text: str | None, finish: str | None = None, delta: dict | None = None) -> dict:
        logprobs = None
        if self.pending:
            logprobs = chat_logprobs(self.pending) if self.chat else completion_logprobs(self.pending, self.offset)
            self.offset += sum(e.chars for e in self.pending)
            self.pending.clear()
        if self.chat:
            if delta is None:
                delta = {"content": text} if text else {}
            return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def feed(self, ev):
        from .reasoning import REASONING
        from .tools import tool_call_deltas

        finish = ev.finish_reason
        self.pending.extend(ev.logprobs or [])
        content = ev.text
        if self.reasoning is not None:  # reasoning comes first, then content
            content = ""
            for kind, text in self.reasoning.feed(ev.text, final=finish is not None):
                if kind == REASONING:
                    yield self.delta(None, delta={"reasoning_content": text})
                else:
                    content += text
        if self.splitter is None:
            if content:
                yield self.delta(content)
        else:
            sent = len(self.splitter.calls)
            for item in self.splitter.feed(content, final=finish is not None):
                if isinstance(item, str):
                    yield self.delta(item)
                    continue
                for delta in tool_call_deltas(sent, item):
                    yield self.delta(None, delta=delta)
                sent += 1
            if self.splitter.calls and finish == "stop":
                finish = "tool_calls"
        if finish is not None:
            yield self.delta(None, finish)


async def serve_until_stopped(server: EngineServer) -> int:
    from aiohttp import web

    from .connections import ConnectionGuard

    settings = server.config.serving
    host, port = settings.host, settings.port
    server.loop = asyncio.get_running_loop()
    server.stopped = asyncio.Event()
    runner = web.AppRunner(
        server.app(),
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=settings.keepalive_timeout,
        shutdown_timeout=5.0,
    )
    await runner.setup()
    server.guard = ConnectionGuard(
        runner.server,
        settings.max_connections,
        settings.header_timeout,
        settings.keepalive_timeout,
        refused=server.metrics.connections_refused.inc,
        timed_out=server.metrics.connections_timed_out.inc,
    )
    try:
        listener = await server.loop.create_server(server.guard, host, port, backlog=1024)
    except OSError as exc:
        await runner.cleanup()
        server._fail(f"cannot listen on {host}:{port}: {exc}")
        return 1
    host, port = listener.sockets[0].getsockname()[:2]
    log.info("listening on http://%s:%s (model %s)", host if ":" not in host else f"[{host}]", port, server.name)
    for sig in (signal.SIGINT, signal.SIGTERM):
        server.loop.add_signal_handler(sig, server.stopped.set)
    server.start_loading()
    await server.stopped.wait()
    log.info("shutting down")
    server.closing = True
    listener.close()
    if server.scheduler is not None:
        await asyncio.to_thread(server.scheduler.stop)
    await runner.cleanup()
    server.preparation.shutdown(wait=False, cancel_futures=True)
    return server.exit_code
