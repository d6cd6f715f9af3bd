"""The OpenAI protocol: error bodies, request fields and their validation, sampling settings, chat messages."""

from __future__ import annotations

import json
import math

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
# OpenAI's message roles; any other role string would be rendered by the chat template as a turn of its own
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 128  # `n`: OpenAI's limit
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
# the refusals that say more than "not supported"
REFUSALS = {
    "functions": "'functions' (the legacy form of 'tools') is not supported: send 'tools'",
    "tools": "'tools' is only taken by /v1/chat/completions, whose chat template renders them",
    **{
        f"guided_{kind}": f"'guided_{kind}' is not supported: send 'response_format' (json_object or json_schema)"
        for kind in ("json", "regex", "choice", "grammar")
    },
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


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ---- request parsing ------------------------------------------------------------------------


def get_int(body: dict, key: str, default=None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{key}' must be an integer, got {type(v).__name__}", key)
    return v


def get_float(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    try:
        value = float(v) if not isinstance(v, bool) and isinstance(v, (int, float)) else math.nan
    except OverflowError:  # an integer beyond float's range
        value = math.nan
    if not math.isfinite(value):
        raise bad_request(f"'{key}' must be a finite number", key)
    return value


def get_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean", key)
    return v


def refuse_unsupported(body: dict, chat: bool) -> None:
    """Fields we cannot honour are refused rather than silently ignored (their neutral values pass)."""
    neutral: dict[str, tuple] = {
        "echo": (None, False),
        "best_of": (None, 1),
        "presence_penalty": (None, 0, 0.0),
        "frequency_penalty": (None, 0, 0.0),
        "suffix": (None, ""),
        "functions": (None, []),
        "logit_bias": (None, {}),
        # vLLM's extensions that change the output
        "repetition_penalty": (None, 1, 1.0),
        "bad_words": (None, []),
        "use_beam_search": (None, False),
        "guided_json": (None,),
        "guided_regex": (None,),
        "guided_choice": (None,),
        "guided_grammar": (None,),
    }
    if not chat:
        neutral["tools"] = (None, [])
    for key, ok in neutral.items():
        v = body.get(key)
        if isinstance(v, (list, dict)):
            if v:
                raise bad_request(REFUSALS.get(key, f"'{key}' is not supported by this server"), key)
        elif not any(v is o or (type(v) is type(o) and v == o) for o in ok):
            raise bad_request(REFUSALS.get(key, f"'{key}' is not supported by this server"), key)


class Sampling:
    """The validated generation fields of a request (prompt and max_tokens default aside)."""

    def __init__(self, body: dict, chat: bool, engine_budget: int | str, max_logprobs: int = 0):
        limit = "max_completion_tokens" if chat and body.get("max_tokens") is None else "max_tokens"
        self.max_tokens = get_int(body, limit)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad_request(f"'{limit}' must be >= 1, got {self.max_tokens}", limit)
        self.temperature = get_float(body, "temperature", 1.0)
        if not 0 <= self.temperature <= 2:
            raise bad_request(f"'temperature' must be in [0, 2], got {self.temperature}", "temperature")
        self.top_p = get_float(body, "top_p", 1.0)
        if not 0 < self.top_p <= 1:
            raise bad_request(f"'top_p' must be in (0, 1], got {self.top_p}", "top_p")
        self.top_k = get_int(body, "top_k", 0)  # extension (as in vLLM): 0 or -1 is every token
        if self.top_k < -1:
            raise bad_request(f"'top_k' must be -1, 0 (every token) or positive, got {self.top_k}", "top_k")
        self.top_k = max(self.top_k, 0)
        self.min_p = get_float(body, "min_p", 0.0)  # extension (as in vLLM)
        if not 0 <= self.min_p <= 1:
            raise bad_request(f"'min_p' must be in [0, 1], got {self.min_p}", "min_p")
        self.seed = get_int(body, "seed")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise bad_request(f"'seed' must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]", "seed")
        self.n = get_int(body, "n", 1)
        if not 1 <= self.n <= MAX_CHOICES:
            raise bad_request(f"'n' must be in 1..{MAX_CHOICES}, got {self.n}", "n")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if (
            not isinstance(stop, list)
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
            or len(stop) > 16
        ):
            raise bad_request(
                f"'stop' must be a string or a list of up to 16 strings, each of 1 to {MAX_STOP_CHARS} characters",
                "stop",
            )
        self.stop = stop
        # extensions (as in vLLM): more tokens that end the completion, their text kept unless they are
        # special tokens; the stop string that ended it kept in the text
        ids = body.get("stop_token_ids")
        if ids is not None and (
            not isinstance(ids, list)
            or len(ids) > MAX_STOP_TOKEN_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            raise bad_request(
                f"'stop_token_ids' must be a list of up to {MAX_STOP_TOKEN_IDS} token ids (integers >= 0)",
                "stop_token_ids",
            )
        self.stop_token_ids = tuple(ids or ())
        allowed = body.get("allowed_token_ids")  # extension (as in vLLM): every token from this set
        if allowed is not None and (
            not isinstance(allowed, list)
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in allowed)
        ):
            raise bad_request("'allowed_token_ids' must be a list of token ids (integers >= 0)", "allowed_token_ids")
        self.allowed_token_ids = tuple(allowed or ())
        self.include_stop_str_in_output = get_bool(body, "include_stop_str_in_output")
        self.min_tokens = get_int(body, "min_tokens", 0)  # extension (as in vLLM): no stop before that many
        if self.min_tokens < 0:
            raise bad_request(f"'min_tokens' must be >= 0, got {self.min_tokens}", "min_tokens")
        self.stream = get_bool(body, "stream")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        if opts is not None and not self.stream:  # as OpenAI's API answers
            raise bad_request("'stream_options' is only allowed with \"stream\": true", "stream_options")
        self.include_usage = get_bool(opts or {}, "include_usage")
        self.ignore_eos = get_bool(body, "ignore_eos")  # extension (as in vLLM): for benchmarks
        self.logprobs = requested_logprobs(body, chat, max_logprobs)
        budget = get_int(body, "budget")
        if budget is not None and (budget != engine_budget or isinstance(engine_budget, str)):
            raise bad_request(
                f"per-request 'budget' is not supported: this server runs budget {engine_budget}", "budget"
            )
        refuse_unsupported(body, chat)


def requested_logprobs(body: dict, chat: bool, max_logprobs: int) -> int | None:
    """How many top tokens to return with each completion token's log-probability, or None for no
    log-probabilities: chat's `logprobs: true` with `top_logprobs`, completions' `logprobs: N`."""
    if chat:
        wanted = get_bool(body, "logprobs")
        top = get_int(body, "top_logprobs")
        if top is not None and not wanted:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        key, top = "top_logprobs", (top or 0) if wanted else None
    else:
        key, top = "logprobs", get_int(body, "logprobs")
    if top is None:
        return None
    if max_logprobs == 0:
        raise bad_request("this server returns no log-probabilities (it was started with --max-logprobs 0)", key)
    if not 0 <= top <= max_logprobs:
        raise bad_request(f"'{key}' must be in 0..{max_logprobs}, got {top}", key)
    return top


def chat_logprobs(entries) -> dict:
    """OpenAI's chat `logprobs` object of scheduler TokenLogprob entries."""

    def one(token: str, data: bytes, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(data)}

    return {
        "content": [
            {**one(e.token, e.raw_bytes, e.logprob), "top_logprobs": [one(*alternative) for alternative in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(entries, offset: int) -> dict:
    """OpenAI's (legacy) completions `logprobs` object of TokenLogprob entries, whose text starts at
    character `offset` of the completion."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += e.chars
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token: v for token, _, v in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_messages(body: dict) -> list[dict]:
    """The messages as the chat template takes them: text content; an assistant's `tool_calls` with their
    arguments as JSON objects (chat templates write them with `tojson`); a tool result's `tool_call_id`
    (required, as in OpenAI's API) and `name`."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", "messages")
        if m["role"] not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}", "messages")
        content = m.get("content")
        if content is None and m["role"] != "assistant":  # as in OpenAI's API: only an assistant's may be absent
            raise bad_request(f"messages[{i}].content is required for a {m['role']} message", "messages")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad_request(f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(p["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
        message = {"role": m["role"], "content": content}
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise bad_request(f"messages[{i}].tool_call_id must be the id of the tool call it answers", "messages")
            message["tool_call_id"] = m["tool_call_id"]
            if m.get("name") is not None:
                if not isinstance(m["name"], str):
                    raise bad_request(f"messages[{i}].name must be a string", "messages")
                message["name"] = m["name"]
        out.append(message)
    return out


def _tool_calls(calls, i: int) -> list[dict]:
    shape = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}'
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list of {shape}", "messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type", "function") != "function"
            or not isinstance(call.get("id"), str)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise bad_request(f"messages[{i}].tool_calls[{j}] must be {shape}", "messages")
        try:
            arguments = json.loads(function["arguments"])
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            raise bad_request(
                f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object, as text", "messages"
            )
        out.append(
            {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        )
    return out
