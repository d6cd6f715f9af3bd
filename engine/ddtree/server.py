"""`ddtree serve`: an OpenAI-compatible HTTP server with continuous batching.

Start-up: the HTTP server binds first (so /health answers while weights load), then a background
thread loads the weights, captures CUDA graphs (on a GPU), runs the smoke test (ddtree.smoke) and,
when it passes, starts the scheduler (ddtree.scheduler) and flips /ready to 200. When the smoke test
(or loading) fails, the reason goes to the termination log and the process exits with status 1.

Tensor parallelism (--tensor-parallel N, or N torchrun processes): this process is rank 0 and runs
everything above; ranks 1..N-1 (`serve_follower`) load their shard, bind no port and replay rank 0's
engine calls (ddtree.parallel.Leader / follow). On shutdown rank 0 sends them a stop command.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent
events), GET /v1/models, GET /health, GET /ready, GET /metrics. Errors use OpenAI's body
{"error": {"message", "type", "param", "code"}}.

Also here: `bench_serve`, a load generator for a running server (`ddtree bench-serve`).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid

from .cli import (
    KERNEL_CHOICES,
    KERNELS_HELP,
    UNSET,
    UsageError,
    add_device_flags,
    add_model_flags,
    add_parallel_flags,
)
from .config import FLAGS, EngineConfig

log = logging.getLogger("ddtree.server")

SMOKE_FAULTS = ("corrupt-graph-input",)
SMOKE_TEXTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time", "import numpy as np\n"]
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


# ---- errors -----------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(
        self, status: int, message: str, type_: str | None = None, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self):
        from aiohttp import web

        return web.json_response(self.body(), status=self.status)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ---- request parsing ------------------------------------------------------------------------


def _get_int(body: dict, key: str, default=None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"'{key}' must be an integer, got {type(v).__name__}", key)
    return v


def _get_float(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(f"'{key}' must be a finite number", key)
    return float(v)


def _get_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be a boolean", key)
    return v


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Fields we cannot honour are refused rather than silently ignored (their neutral values pass)."""
    neutral = {
        "logprobs": (None, False, 0),
        "top_logprobs": (None, 0),
        "echo": (None, False),
        "best_of": (None, 1),
        "presence_penalty": (None, 0, 0.0),
        "frequency_penalty": (None, 0, 0.0),
        "suffix": (None, ""),
        "tools": (None, []),
        "functions": (None, []),
        "logit_bias": (None, {}),
    }
    for key, ok in neutral.items():
        v = body.get(key)
        if isinstance(v, (list, dict)):
            if v:
                raise _bad(f"'{key}' is not supported by this server", key)
        elif not any(v is o or (type(v) is type(o) and v == o) for o in ok):
            raise _bad(f"'{key}' is not supported by this server", key)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("'response_format' other than text is not supported", "response_format")


class Sampling:
    """The validated generation fields of a request (prompt and max_tokens default aside)."""

    def __init__(self, body: dict, chat: bool, engine_budget: int):
        self.max_tokens = _get_int(
            body, "max_completion_tokens" if chat and body.get("max_tokens") is None else "max_tokens"
        )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise _bad(f"'max_tokens' must be >= 1, got {self.max_tokens}", "max_tokens")
        self.temperature = _get_float(body, "temperature", 1.0)
        if not 0 <= self.temperature <= 2:
            raise _bad(f"'temperature' must be in [0, 2], got {self.temperature}", "temperature")
        self.top_p = _get_float(body, "top_p", 1.0)
        if not 0 < self.top_p <= 1:
            raise _bad(f"'top_p' must be in (0, 1], got {self.top_p}", "top_p")
        self.seed = _get_int(body, "seed")
        n = _get_int(body, "n", 1)
        if n != 1:
            raise _bad(f"only n=1 is supported, got n={n}", "n")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
            raise _bad("'stop' must be a non-empty string or a list of up to 16 non-empty strings", "stop")
        self.stop = stop
        self.stream = _get_bool(body, "stream")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        self.include_usage = _get_bool(opts or {}, "include_usage")
        self.ignore_eos = _get_bool(body, "ignore_eos")  # extension (as in vLLM): for benchmarks
        budget = _get_int(body, "budget")
        if budget is not None and budget != engine_budget:
            raise _bad(f"per-request 'budget' is not supported: this server runs budget {engine_budget}", "budget")
        _refuse_unsupported(body, chat)


def _chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise _bad(f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(p["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": m["role"], "content": content})
    return out


# ---- the server -----------------------------------------------------------------------------


def load_engine(config: EngineConfig, rank: int = 0, world: int = 1, bar=None):
    """(engine, tokenizer) of a resolved config; with world > 1 the target is this rank's shard (call it
    on every rank, after joining the group, so that all ranks build the same engine)."""
    from .build import build_engine

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
    from .parallel import command_group, follow, init_from_env, leave_group

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    init_from_env(config.model.device.split(":")[0])  # a no-op when start_followers' process already joined
    group = command_group()
    engine, _ = load_engine(config, rank, world)
    follow(engine, group)
    leave_group(engine)  # at the same time as rank 0 (NCCL's teardown waits for every rank)
    return 0


class EngineServer:
    def __init__(self, config: EngineConfig, world: int = 1, smoke_fault: str | None = None):
        """`config`: resolved (EngineConfig.resolve()); `world`: tensor parallel ranks (this one is 0)."""
        self.config, self.world, self.smoke_fault = config, world, smoke_fault
        self.graph_buckets, self.smoke_sizes = config.serve_batch_sizes()
        self.name = config.served_model_name
        from .metrics import ServerMetrics

        self.metrics = ServerMetrics(self.name)
        self.phase = "loading"  # loading -> capturing -> smoke_test -> ready | failed
        self.reason = ""
        self.report = None
        self.engine = self.tokenizer = self.scheduler = None
        self.stop_token_ids: tuple[int, ...] = ()
        self.exit_code = 0
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopped: asyncio.Event | None = None
        self.loader: threading.Thread | None = None
        self.leader = None  # parallel.Leader when tensor parallel: the engine calls go through it
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
        max_seq_len = config.serving.seq_len
        try:
            from tqdm import tqdm

            from .build import stop_ids
            from .smoke import run_smoke

            bar = tqdm(total=5, desc="ddtree serve", unit="step", file=sys.stderr, dynamic_ncols=True)
            if self.world > 1:
                from .parallel import Leader, command_group, init_from_env

                bar.set_postfix_str(f"joining {self.world} tensor parallel ranks")
                init_from_env(config.model.device.split(":")[0])
                self.leader = Leader(None, command_group())
            engine, tokenizer = load_engine(config, 0, self.world, bar)
            target = engine.target
            if self.leader is not None:
                self.leader.engine = engine
                engine = self.leader
            self.metrics.spec_budget.set(engine.budget)
            bar.update()
            self.phase = "capturing"
            if engine.device.type == "cuda" and config.kernels.graphs:
                bar.set_postfix_str(f"capturing CUDA graphs (batch buckets {self.graph_buckets})")
                # greedy and sampling rounds; shapes outside the buckets run eagerly (and count as fallbacks)
                engine.capture_graphs(batch_buckets=self.graph_buckets, sampling=(False, True), fallback=True)
            bar.update()
            self.phase = "smoke_test"
            bar.set_postfix_str(f"smoke test (batch sizes {self.smoke_sizes})")
            limit = max(1, max_seq_len - 9)
            prompts = [tokenizer.encode(t)[:limit] for t in SMOKE_TEXTS]
            extra = {"fault": self.smoke_fault} if self.smoke_fault else {}
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
        from .scheduler import Scheduler

        for slot in range(engine.max_batch_size):
            engine.release(slot)
        self.engine, self.tokenizer, self.report = engine, tokenizer, report
        self.stop_token_ids = stop_ids(tokenizer, target)
        # decoding happens on the engine thread: give it its own tokenizer instance
        self.scheduler = Scheduler(engine, copy.deepcopy(tokenizer), self.metrics, config.serving.waiting_limit)
        self.scheduler.start()
        self.metrics.smoke_test_passed.set(1)
        self.reason = report.reason
        self.phase = "ready"
        log.info(
            "%s; ready to serve %s (%s, budget %s, %d slots x %d tokens)",
            report.reason,
            self.name,
            config.speculation.method,
            engine.budget,
            engine.max_batch_size,
            engine.max_seq_len,
        )

    def _fail(self, reason: str) -> None:
        self.phase, self.reason, self.exit_code = "failed", reason, 1
        self.metrics.smoke_test_passed.set(0)
        log.error("%s", reason)
        from .smoke import write_termination_log

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
            from .parallel import RankFailure

            try:
                self.leader.stop()
                clean = True
            except RankFailure as exc:
                log.warning("could not stop the other ranks: %s", exc)
        leaving = None
        if clean:  # NCCL's teardown waits for every rank: leave together with the followers, then join them
            from .parallel import leave_group

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

        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
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
            try:
                resp = await handler(request)
            except APIError as exc:
                resp = exc.response()
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                resp = APIError(exc.status, f"{exc.reason}: {request.method} {request.path}").response()
            except asyncio.CancelledError:  # the client went away
                if counted:
                    self.metrics.request_finished(499)
                raise
            except Exception as exc:  # answer 500 and keep serving
                log.exception("internal error on %s", request.path)
                resp = APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
            if counted:
                self.metrics.request_finished(request.get("ddtree_status", resp.status))
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

    async def _body(self, request) -> dict:
        try:
            raw = await request.read()
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad(f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("'model' must be a string", "model")
        if model is not None and model != self.name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.name}'",
                param="model",
                code="model_not_found",
            )
        return body

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        tok = self.tokenizer
        if chat:
            msgs = _chat_messages(body)
            if not getattr(tok, "chat_template", None):
                raise _bad("this model's tokenizer has no chat template; use /v1/completions")
            try:
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
                raise _bad(f"chat template failed: {exc}", "messages") from None
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise _bad("'prompt' is empty", "prompt")
            return tok.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise _bad("batched prompts are not supported: send one prompt per request", "prompt")
        raise _bad("'prompt' must be a string or a list of token ids", "prompt")

    async def _generate(self, request, chat: bool):
        from .engine import SamplingParams
        from .scheduler import NotRunning, QueueFull, Request

        body = await self._body(request)
        if self.phase != "ready":
            raise APIError(503, f"the server is not ready ({self.phase}); poll /ready", code="not_ready")
        s = Sampling(body, chat, self.engine.budget)
        prompt = self._prompt_ids(body, chat)
        limit = self.config.serving.seq_len
        if len(prompt) >= limit:
            raise _bad(
                f"the prompt has {len(prompt)} tokens; this server's context is {limit} tokens (prompt + max_tokens)",
                "prompt" if not chat else "messages",
            )
        # defaults: OpenAI's 16 for completions, the rest of the context for chat
        max_tokens = s.max_tokens if s.max_tokens is not None else limit - len(prompt)
        if s.max_tokens is None and not chat:
            max_tokens = min(16, max_tokens)
        if len(prompt) + max_tokens > limit:
            raise _bad(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context of {limit} tokens",
                "max_tokens",
            )
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stop_token_ids=() if s.ignore_eos else self.stop_token_ids,
        )
        try:
            self.engine.check_request(prompt, params)
        except ValueError as exc:
            raise _bad(str(exc)) from None

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(ev) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, ev)
            except RuntimeError:  # the event loop is closed (shutting down): nobody is listening
                pass

        req = Request(prompt, params, s.stop, sink)
        try:
            self.scheduler.submit(req)
        except QueueFull as exc:
            raise APIError(429, str(exc), code="queue_full") from None
        except NotRunning as exc:
            raise APIError(503, str(exc), code="not_running") from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        try:
            if s.stream:
                return await self._stream(request, req, queue, rid, chat, s.include_usage)
            return await self._collect(req, queue, rid, chat)
        finally:
            if req.finish_reason is None:
                self.scheduler.cancel(req)

    def _usage(self, req, completion_tokens: int) -> dict:
        p = len(req.prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}

    async def _collect(self, req, queue, rid: str, chat: bool):
        from aiohttp import web

        parts = []
        while True:
            ev = await queue.get()
            if ev.error is not None:
                raise APIError(ev.error_status, ev.error)
            parts.append(ev.text)
            if ev.finish_reason is not None:
                break
        text = "".join(parts)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": ev.finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": ev.finish_reason}
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.name,
                "choices": [choice],
                "usage": self._usage(req, ev.completion_tokens),
            }
        )

    async def _stream(self, request, req, queue, rid: str, chat: bool, include_usage: bool):
        from aiohttp import web

        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out = {"id": rid, "object": obj, "created": created, "model": self.name, "choices": [choice]}
            if include_usage:
                out["usage"] = None
            return out

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)

            async def send(obj_: dict) -> None:
                await resp.write(b"data: " + json.dumps(obj_, ensure_ascii=False).encode() + b"\n\n")

            if chat:
                await send(chunk(None, role=True))
            while True:
                ev = await queue.get()
                if ev.error is not None:
                    request["ddtree_status"] = ev.error_status
                    await send(APIError(ev.error_status, ev.error).body())
                    break
                if ev.text:
                    await send(chunk(ev.text))
                if ev.finish_reason is not None:
                    await send(chunk(None, ev.finish_reason))
                    if include_usage:
                        await send(
                            {
                                "id": rid,
                                "object": obj,
                                "created": created,
                                "model": self.name,
                                "choices": [],
                                "usage": self._usage(req, ev.completion_tokens),
                            }
                        )
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:  # the client went away mid-stream; the caller frees the slot
            request["ddtree_status"] = 499
        return resp


async def _serve(server: EngineServer) -> int:
    from aiohttp import web

    host, port = server.config.serving.host, server.config.serving.port
    server.loop = asyncio.get_running_loop()
    server.stopped = asyncio.Event()
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, shutdown_timeout=5.0)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        server._fail(f"cannot listen on {host}:{port}: {exc}")
        return 1
    host, port = runner.addresses[0][:2]
    log.info("listening on http://%s:%s (model %s)", host if ":" not in host else f"[{host}]", port, server.name)
    for sig in (signal.SIGINT, signal.SIGTERM):
        server.loop.add_signal_handler(sig, server.stopped.set)
    server.start_loading()
    await server.stopped.wait()
    log.info("shutting down")
    server.closing = True
    if server.scheduler is not None:
        await asyncio.to_thread(server.scheduler.stop)
    await runner.cleanup()
    return server.exit_code


# ---- command line ----------------------------------------------------------------------------


def _int_list(text: str, flag: str) -> list[int]:
    from .config import parse_int_list

    return sorted(set(parse_int_list(text, flag)))


SERVE_FLAGS = FLAGS  # serve has a flag for every field


def serve_config(args) -> EngineConfig:
    """The `serve` settings (--config file and flags), validated (ConfigError on bad ones) and resolved:
    device, dtype and drafter filled in; the batch buckets are checked against max_batch_size."""
    config = EngineConfig.from_args(args, SERVE_FLAGS).resolve()
    config.serve_batch_sizes()
    return config


def _tensor_parallel(config: EngineConfig) -> tuple[int, int, bool]:
    """(rank, world, spawn_followers): started by torchrun (WORLD_SIZE set), or --tensor-parallel ranks that
    this process starts itself (as rank 0). A split that does not fit is refused before anything starts."""
    tp, flag = config.parallel.tensor_parallel, config.name("parallel.tensor_parallel")
    torchrun = "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else tp
    rank = int(os.environ.get("RANK", "0")) if torchrun else 0
    spawn_followers = world > 1 and not torchrun
    if torchrun and tp not in (1, world):
        raise UsageError(f"{flag} {tp} differs from torchrun's WORLD_SIZE {world}")
    if world == 1:
        return rank, world, spawn_followers
    if spawn_followers and config.model.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < world:
            raise UsageError(f"{flag} {world} needs {world} GPUs, this host has {torch.cuda.device_count()}")
    from .loading import RANDOM_PREFIX, peek_config, random_config
    from .model import ModelConfig
    from .parallel import check_divisible

    ref, revision = config.model.id, config.model.revision
    model_config = random_config(ref) if ref.startswith(RANDOM_PREFIX) else peek_config(ref, revision)
    if isinstance(model_config, dict):
        model_config = ModelConfig.from_hf(model_config)
    if model_config is not None:  # otherwise shard() refuses it at load time (a start-up failure)
        check_divisible(model_config, world)  # ValueError: one line, exit 2
    return rank, world, spawn_followers


def cmd_serve(args) -> int:
    config = serve_config(args)
    rank, world, spawn_followers = _tensor_parallel(config)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
        )
    if rank > 0:  # a torchrun process other than rank 0
        return serve_follower(rank, world, config)
    server = EngineServer(config, world, smoke_fault=args.smoke_fault)
    if spawn_followers:
        from .parallel import start_followers

        server.followers = start_followers(world, serve_follower, config, device_type=config.model.device.split(":")[0])
    try:
        code = asyncio.run(_serve(server))
    finally:
        clean = server.stop_followers()
    if not clean or (server.loader is not None and server.loader.is_alive()):
        # stopped while loading, or a thread is stuck in a collective: don't join torch
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def cmd_bench_serve(args) -> int:
    levels = _int_list(args.concurrency, "--concurrency")
    if args.requests_per_client < 1 or args.max_tokens < 1:
        raise UsageError("--requests-per-client and --max-tokens must be >= 1")
    prompts = None
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [
                json.loads(line) if line.lstrip().startswith('"') else line.rstrip("\n") for line in f if line.strip()
            ]
    results = asyncio.run(
        bench_serve(
            args.url,
            levels,
            args.requests_per_client,
            args.max_tokens,
            prompts,
            chat=not args.completions,
            temperature=args.temperature,
            ignore_eos=not args.no_ignore_eos,
        )
    )
    for r in results:
        print(json.dumps(r) if args.json else _bench_line(r))
    return 0 if all(r["errors"] == 0 for r in results) else 1


def register(subparsers, bench: bool = True) -> None:
    """Add `serve` (and `bench-serve`) to the `ddtree` command line's subparsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    add_model_flags(p)  # --config, --model, --drafter, --method, --budget
    p.add_argument("--host", default=UNSET, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=UNSET, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--max-batch-size", type=int, default=UNSET, help="engine slots = concurrently running requests (default 8)"
    )
    p.add_argument(
        "--max-seq-len", type=int, default=UNSET, help="per-request context: prompt + max_tokens (default 2048)"
    )
    p.add_argument(
        "--max-waiting", type=int, default=UNSET, help="queued requests beyond the slots before 429 (default 4 x slots)"
    )
    p.add_argument("--served-model-name", default=UNSET, help="model name in the API (default: the --model value)")
    add_device_flags(p)
    p.add_argument(
        "--batch-buckets",
        default=UNSET,
        help="batch sizes for CUDA graphs and the smoke test, e.g. "
        "1,2,4,8 (default: powers of two up to --max-batch-size)",
    )
    p.add_argument("--no-graphs", action="store_true", default=UNSET, help="run rounds eagerly (no CUDA graph capture)")
    p.add_argument(
        "--termination-log",
        default=UNSET,
        help="file for the start-up failure reason (default /dev/termination-log when it exists)",
    )
    p.add_argument("--revision", default=UNSET, help="hub revision of --model (branch, tag or commit)")
    p.add_argument("--drafter-revision", default=UNSET, help="hub revision of --drafter")
    p.add_argument(
        "--block-size", type=int, default=UNSET, help="expected drafter block size (checked against the drafter)"
    )
    add_parallel_flags(p)
    p.add_argument("--kernels", choices=KERNEL_CHOICES, default=UNSET, help=KERNELS_HELP)
    p.add_argument("--smoke-fault", choices=list(SMOKE_FAULTS), help=argparse.SUPPRESS)  # tests only
    p.set_defaults(func=cmd_serve)
    if not bench:
        return
    b = subparsers.add_parser("bench-serve", help="load generator for a running `ddtree serve`")
    b.add_argument("--url", default="http://127.0.0.1:8000")
    b.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client counts, run in turn")
    b.add_argument("--requests-per-client", type=int, default=4)
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--completions", action="store_true", help="raw prompts to /v1/completions (default: chat)")
    b.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (default: every request generates exactly --max-tokens)",
    )
    b.add_argument("--prompts-file", help="one prompt per line (or one JSON string per line)")
    b.add_argument("--json", action="store_true", help="one JSON object per concurrency level")
    b.set_defaults(func=cmd_bench_serve)


# ---- load generator ---------------------------------------------------------------------------

BENCH_PROMPTS = [
    "Explain in a few paragraphs how a hash table handles collisions.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests.",
    "Summarise the causes of the French Revolution.",
    "What is the difference between TCP and UDP? Give examples of when to use each.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List ten tips for writing clear technical documentation.",
    "Describe the water cycle to a ten-year-old.",
    'def quicksort(xs):\n    """Sort a list with quicksort."""\n',
    "Translate to French: The weather is nice today and we are going to the beach.",
    "Explain what a transformer neural network is and why attention matters.",
    "Give a step-by-step recipe for pancakes.",
    "import json\nimport sys\n\n\ndef main():\n",
    "What are the trade-offs between SQL and NoSQL databases?",
    "Write a haiku about autumn, then explain its imagery.",
    "How does public-key cryptography work?",
    "Compare Python lists, tuples and sets.",
]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


async def _bench_one(
    session, url: str, model: str, prompt: str, max_tokens: int, chat: bool, temperature: float, ignore_eos: bool
) -> dict:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    t0 = time.perf_counter()
    ttft, tokens, status = None, 0, 0
    try:
        async with session.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
            status = r.status
            if r.status == 200:
                async for line in r.content:
                    line = line.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        status = data["error"].get("code") or 500
                    if data.get("usage"):
                        tokens = data["usage"]["completion_tokens"]
                    for c in data.get("choices", []):
                        if ttft is None and (c.get("text") or (c.get("delta") or {}).get("content")):
                            ttft = time.perf_counter() - t0
            else:
                await r.read()
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        status = type(exc).__name__
    return {"status": status, "latency": time.perf_counter() - t0, "ttft": ttft, "tokens": tokens}


async def bench_serve(
    url: str,
    concurrencies=(1, 8, 32, 64),
    requests_per_client: int = 4,
    max_tokens: int = 128,
    prompts: list[str] | None = None,
    chat: bool = True,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    timeout: float = 3600.0,
) -> list[dict]:
    """Drive a running server with `c` closed-loop clients per level (each sends requests_per_client
    streaming requests back to back). Per level: throughput, latency percentiles, and, from /metrics
    deltas, the time per round inside engine.step versus the scheduler's wall time per round (the
    difference, prefills excluded, is the serving overhead)."""
    import aiohttp

    from .metrics import read_samples, total

    prompts = prompts or BENCH_PROMPTS
    url = url.rstrip("/")
    results = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        deadline = time.monotonic() + timeout
        while True:  # wait for the smoke test to pass
            try:
                async with session.get(url + "/ready") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientConnectionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not become ready")
            await asyncio.sleep(1.0)
        async with session.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def scrape():
            async with session.get(url + "/metrics") as r:
                return read_samples(await r.text())

        for c in concurrencies:
            before = await scrape()
            records: list[dict] = []

            async def client(i: int, records: list[dict] = records) -> None:
                for k in range(requests_per_client):
                    prompt = prompts[(i * requests_per_client + k) % len(prompts)]
                    records.append(
                        await _bench_one(session, url, model, prompt, max_tokens, chat, temperature, ignore_eos)
                    )

            t0 = time.perf_counter()
            await asyncio.gather(*(client(i) for i in range(c)))
            wall = time.perf_counter() - t0
            after = await scrape()
            while True:  # let the engine thread finish the bookkeeping of its last iteration
                await asyncio.sleep(0.2)
                again = await scrape()
                if again == after and total(after, "ddtree_requests_running") == 0:
                    break
                after = again

            def d(name: str, after: dict = after, before: dict = before) -> float:
                return total(after, name) - total(before, name)

            ok = [r for r in records if r["status"] == 200]
            tokens = sum(r["tokens"] for r in ok)
            rounds = d("ddtree_engine_step_seconds_count")
            step_ms = 1e3 * d("ddtree_engine_step_seconds_sum") / rounds if rounds else float("nan")
            iter_ms = 1e3 * d("ddtree_scheduler_iteration_seconds_sum") / rounds if rounds else float("nan")
            prefill_ms = 1e3 * d("ddtree_prefill_seconds_sum") / rounds if rounds else float("nan")
            drafts = d("ddtree_spec_decode_num_drafts_total")
            tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["ttft"] and r["tokens"] > 1]
            results.append(
                {
                    "concurrency": c,
                    "requests": len(records),
                    "errors": len(records) - len(ok),
                    "error_statuses": sorted({str(r["status"]) for r in records if r["status"] != 200}),
                    "duration_s": round(wall, 3),
                    "requests_per_s": round(len(ok) / wall, 3),
                    "output_tokens": tokens,
                    "output_tokens_per_s": round(tokens / wall, 2),
                    "latency_p50_s": round(_pct([r["latency"] for r in ok], 50), 4),
                    "latency_p90_s": round(_pct([r["latency"] for r in ok], 90), 4),
                    "latency_p99_s": round(_pct([r["latency"] for r in ok], 99), 4),
                    "ttft_p50_s": round(_pct([r["ttft"] for r in ok if r["ttft"]], 50), 4),
                    "ttft_p99_s": round(_pct([r["ttft"] for r in ok if r["ttft"]], 99), 4),
                    "tpot_mean_ms": round(1e3 * sum(tpot) / len(tpot), 3) if tpot else float("nan"),
                    "acceptance_length": round(1 + d("ddtree_spec_decode_num_accepted_tokens_total") / drafts, 3)
                    if drafts
                    else float("nan"),
                    "rounds": int(rounds),
                    "mean_batch": round(drafts / rounds, 2) if rounds else float("nan"),
                    "engine_step_ms_per_round": round(step_ms, 3),
                    "prefill_ms_per_round": round(prefill_ms, 3),
                    "wall_ms_per_round": round(iter_ms, 3),
                    "serving_overhead_ms_per_round": round(iter_ms - step_ms - prefill_ms, 3),
                }
            )
    return results


def _bench_line(r: dict) -> str:
    return (
        f"c={r['concurrency']:<3} req={r['requests']} err={r['errors']} {r['output_tokens_per_s']:.1f} tok/s "
        f"{r['requests_per_s']:.2f} req/s  latency p50/p99 {r['latency_p50_s']:.3f}/{r['latency_p99_s']:.3f}s  "
        f"ttft p50/p99 {r['ttft_p50_s']:.3f}/{r['ttft_p99_s']:.3f}s  tpot {r['tpot_mean_ms']:.1f}ms  "
        f"accept {r['acceptance_length']}  round: step {r['engine_step_ms_per_round']:.2f}ms + prefill "
        f"{r['prefill_ms_per_round']:.2f}ms + overhead {r['serving_overhead_ms_per_round']:.2f}ms = "
        f"{r['wall_ms_per_round']:.2f}ms (batch {r['mean_batch']})"
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m ddtree.server serve ...`: the same as `ddtree serve ...`."""
    from ddtree.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
