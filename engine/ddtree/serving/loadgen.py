"""`ddtree bench-serve`: a load generator for a running server (OpenAI API plus /metrics)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import UsageError

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

# Generated prompts (--system-prompt-tokens, --prompt-lengths) are words drawn from this list with a seeded
# RNG: common English words that most BPE tokenizers keep whole, so a word is about one token there.
WORDS = """the of and to in is it you that he was for on are with as his they be at one have this from or had by
word but what some we can out other were all there when up use your how said an each she which do their time if
will way about many then them write would like so these her long make thing see him two has look more day could go
come did number sound no most people my over know water than call first who may down side been now find any new
work part take get place made live where after back little only round man year came show every good me give our
under name very through just form great think say help low line differ turn cause much mean before move right boy
old too same tell does set three want air well also play small end put home read hand port large spell add even land
here must big high such follow act why ask men change went light kind off need house picture try us again animal
point mother world near build self earth father head stand own page should country found answer school grow study
still learn plant cover food sun four between state keep eye never last let thought city tree cross farm hard start
might story saw far sea draw left late run while press close night real life few north""".split()
CALIBRATION_WORDS = 512  # the sample whose token count gives tokens per word (fewer if the server's context is short)


@dataclass(frozen=True)
class PromptLengths:
    """User-turn lengths in tokens, drawn per request: `fixed:N`, or `uniform:LO:HI` (integers, both ends
    included, each equally likely)."""

    low: int
    high: int
    spec: str

    @classmethod
    def parse(cls, text: str) -> PromptLengths:
        kind, _, rest = text.partition(":")
        try:
            bounds = [int(x) for x in rest.split(":")]
        except ValueError:
            bounds = []
        if kind == "fixed" and len(bounds) == 1 and bounds[0] >= 1:
            return cls(bounds[0], bounds[0], text)
        if kind == "uniform" and len(bounds) == 2 and 1 <= bounds[0] <= bounds[1]:
            return cls(bounds[0], bounds[1], text)
        raise UsageError(f"--prompt-lengths takes fixed:N or uniform:LO:HI (1 <= LO <= HI), got '{text}'")

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


def word_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words))


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """Send times (seconds from the start) of `count` requests arriving as a Poisson process of `rate` per
    second: exponential gaps from random.Random(seed), the same gaps (scaled by 1/rate) at every rate."""
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        times.append(t)
    return times


@dataclass(frozen=True)
class Workload:
    """What each request sends: an optional system prompt shared by every request, and user turns (request k
    sends user_turns[k % len(user_turns)])."""

    system_prompt: str | None
    user_turns: list[str]

    def fields(self, k: int, chat: bool, earlier: Sequence[tuple[int, str]] = ()) -> dict:
        """Request k's `messages` (chat: the system prompt as a system message) or `prompt` (completions: the
        system prompt as its prefix). `earlier`: the conversation so far, (request, reply) per turn before
        this one (bench-serve --turns): their user turns and replies come first, as messages or text."""
        turns = [(self.user_turns[j % len(self.user_turns)], reply) for j, reply in earlier]
        turn = self.user_turns[k % len(self.user_turns)]
        if chat:
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            history = [
                m
                for user, reply in turns
                for m in ({"role": "user", "content": user}, {"role": "assistant", "content": reply})
            ]
            return {"messages": [*system, *history, {"role": "user", "content": turn}]}
        # completions: the text goes on from where each reply stopped, then the next turn after a blank line
        text = f"{self.system_prompt}\n\n" if self.system_prompt else ""
        for user, reply in turns:
            text += f"{user}{reply}\n\n"
        return {"prompt": text + turn}


def turn_lengths(lengths: PromptLengths, count: int, seed: int) -> list[int]:
    """The user-turn lengths in tokens of requests 0..count-1: draws from random.Random(seed)."""
    rng = random.Random(seed)
    return [lengths.draw(rng) for _ in range(count)]


def build_workload(
    count: int,
    seed: int,
    tokens_per_word: float,
    system_prompt_tokens: int = 0,
    prompt_lengths: PromptLengths | None = None,
    prompts: list[str] | None = None,
) -> Workload:
    """The system prompt (about system_prompt_tokens tokens) and `count` user turns of turn_lengths tokens,
    words from WORDS drawn with a RNG seeded from `seed`; without prompt_lengths the turns are `prompts`
    (default BENCH_PROMPTS). A length of L tokens is round(L / tokens_per_word) words, at least one."""
    rng = random.Random(f"words {seed}")

    def text(tokens: int) -> str:
        return word_text(rng, max(1, round(tokens / tokens_per_word)))

    system = text(system_prompt_tokens) if system_prompt_tokens else None
    if prompt_lengths is None:
        return Workload(system, list(prompts or BENCH_PROMPTS))
    return Workload(system, [text(n) for n in turn_lengths(prompt_lengths, count, seed)])


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


async def _bench_one(session, url: str, body: dict, chat: bool) -> dict:
    t0 = time.perf_counter()
    ttft, tokens, prompt_tokens, text = None, 0, None, []
    status: int | str = 0  # the HTTP status, or the exception's name
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
                    if data.get("usage"):  # the final chunk (stream_options.include_usage)
                        tokens = data["usage"]["completion_tokens"]
                        prompt_tokens = data["usage"]["prompt_tokens"]
                    for c in data.get("choices", []):
                        piece = c.get("text") or (c.get("delta") or {}).get("content")
                        if piece:
                            text.append(piece)
                            if ttft is None:
                                ttft = time.perf_counter() - t0
            else:
                await r.read()
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        status = type(exc).__name__
    return {
        "status": status,
        "latency": time.perf_counter() - t0,
        "ttft": ttft,
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "text": "".join(text),
    }


async def _tokens_per_word(session, url: str, model: str, max_model_len: int | None) -> float:
    """Prompt tokens per word of WORDS text on this server's tokenizer: the usage of one completion (max_tokens
    1) of a sample of words. The sample's UTF-8 bytes fit max_model_len, so it fits with any tokenizer that
    takes at most one token per byte (byte-level BPE, byte tokenizers, SentencePiece with byte fallback). Its
    words are not the system prompt's (another seed), so it warms no prefix cache for the requests."""
    bytes_per_word = max(len(w) for w in WORDS) + 1
    words = min(CALIBRATION_WORDS, (max_model_len - 8) // bytes_per_word) if max_model_len else CALIBRATION_WORDS
    if words < 1:
        raise UsageError(f"the server's max_model_len {max_model_len} leaves no room for generated prompts")
    sample = word_text(random.Random("tokens per word"), words)
    body = {"model": model, "prompt": sample, "max_tokens": 1, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise UsageError(
                f"measuring tokens per word for --system-prompt-tokens/--prompt-lengths: {url}/v1/completions "
                f"answered {r.status}: {(await r.text())[:200]}"
            )
        return (await r.json())["usage"]["prompt_tokens"] / words


async def bench_serve(
    url: str,
    concurrencies: Sequence[int] = (1, 8, 32, 64),
    requests_per_client: int = 4,
    max_tokens: int = 128,
    prompts: list[str] | None = None,
    chat: bool = True,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    timeout: float = 3600.0,
    api_key: str | None = None,
    request_rates: Sequence[float] | None = None,
    num_requests: int = 100,
    system_prompt_tokens: int = 0,
    prompt_lengths: PromptLengths | None = None,
    seed: int = 0,
    response_format: dict | None = None,
    turns: int = 1,
) -> list[dict]:
    """Drive a running server, one level at a time: `c` closed-loop clients per level of `concurrencies` (each
    sends requests_per_client streaming requests back to back), or, with request_rates, num_requests requests
    per rate sent at Poisson arrival times (open loop: a request is sent at its time whether or not earlier ones
    have finished). Prompts: `prompts` (default BENCH_PROMPTS) as user turns, or generated ones (see
    build_workload) when system_prompt_tokens or prompt_lengths are set; their sizes in tokens are converted
    to words with the server's tokens per word (_tokens_per_word). Per level: throughput, latency percentiles,
    and, from /metrics deltas, the time per round inside engine.step versus the scheduler's wall time per
    round (the difference, prefills excluded, is the serving overhead). With response_format, every request
    asks for it (the grammar ends the text, so EOS ends requests: ignore_eos must be off) and each level
    reports the tokens the grammar replaced. With turns > 1 (closed loop only) each client holds
    conversations of `turns` requests: every request after a conversation's first sends its earlier user
    turns and the replies it got, then a new user turn, as an agent or a chat user does."""
    import aiohttp

    from .metrics import read_samples, total

    if response_format and ignore_eos:
        raise UsageError("a response_format ends the text with the grammar: it cannot go with ignore_eos")
    if turns < 1:
        raise UsageError(f"--turns must be >= 1, got {turns}")
    if turns > 1 and request_rates:
        raise UsageError("--turns goes with the closed loop (a turn waits for the reply before it): not --request-rate")
    url = url.rstrip("/")
    results = []
    conn = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeouts = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=conn, timeout=timeouts, headers=headers) as session:
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
            served = (await r.json())["data"][0]
        model = served["id"]
        tokens_per_word = 1.0
        if system_prompt_tokens or prompt_lengths:
            max_model_len = served.get("max_model_len")
            longest = system_prompt_tokens + turns * ((prompt_lengths.high if prompt_lengths else 0) + max_tokens)
            if max_model_len and longest > max_model_len:
                raise UsageError(
                    f"--system-prompt-tokens and --turns x (the longest --prompt-lengths + --max-tokens) add up to "
                    f"{longest} tokens, over the server's max_model_len {max_model_len}"
                )
            tokens_per_word = await _tokens_per_word(session, url, model, max_model_len)
        count = num_requests if request_rates else max(concurrencies) * requests_per_client
        workload = build_workload(count, seed, tokens_per_word, system_prompt_tokens, prompt_lengths, prompts)
        common = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos,
        }
        if response_format:
            common["response_format"] = response_format

        async def request(k: int, earlier: Sequence[tuple[int, str]] = ()) -> dict:
            return await _bench_one(session, url, {**common, **workload.fields(k, chat, earlier)}, chat)

        async def scrape():  # the server's own samples: process_cpu_seconds_total and the like never settle
            async with session.get(url + "/metrics") as r:
                return {k: v for k, v in read_samples(await r.text()).items() if k[0].startswith("ddtree_")}

        async def closed_loop(c: int) -> tuple[list[dict], None]:
            records: list[dict] = []

            async def client(i: int) -> None:
                earlier: list[tuple[int, str]] = []  # this conversation's turns so far
                for k in range(requests_per_client):
                    if k % turns == 0:
                        earlier = []
                    record = await request(i * requests_per_client + k, earlier)
                    records.append(record)
                    earlier = [*earlier, (i * requests_per_client + k, record["text"])]

            await asyncio.gather(*(client(i) for i in range(c)))
            return records, None

        async def open_loop(rate: float) -> tuple[list[dict], float]:
            start, tasks = time.perf_counter(), []
            for k, at in enumerate(poisson_arrivals(rate, num_requests, seed)):
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                tasks.append(asyncio.create_task(request(k)))
            achieved_rate = num_requests / (time.perf_counter() - start)  # the rate the requests went out at
            return list(await asyncio.gather(*tasks)), achieved_rate

        levels = [("poisson", r) for r in request_rates] if request_rates else [("closed", c) for c in concurrencies]
        for arrival, level in levels:
            before = await scrape()
            t0 = time.perf_counter()
            records, achieved_rate = await (open_loop(level) if arrival == "poisson" else closed_loop(int(level)))
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
            ttft = [r["ttft"] for r in ok if r["ttft"]]
            tpot = [1e3 * (r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["ttft"] and r["tokens"] > 1]
            prompt_tokens = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]
            results.append(
                {
                    "arrival": arrival,
                    "concurrency": level if arrival == "closed" else None,
                    "request_rate": level if arrival == "poisson" else None,
                    "achieved_request_rate": round(achieved_rate, 3) if achieved_rate else None,
                    "seed": seed,
                    "system_prompt_tokens": system_prompt_tokens or None,
                    "prompt_lengths": prompt_lengths.spec if prompt_lengths else None,
                    "turns": turns,
                    "requests": len(records),
                    "errors": len(records) - len(ok),
                    "error_statuses": sorted({str(r["status"]) for r in records if r["status"] != 200}),
                    "duration_s": round(wall, 3),
                    "requests_per_s": round(len(ok) / wall, 3),
                    "output_tokens": tokens,
                    "output_tokens_per_s": round(tokens / wall, 2),
                    "prompt_tokens_mean": round(sum(prompt_tokens) / len(prompt_tokens), 1)
                    if prompt_tokens
                    else float("nan"),
                    "latency_p50_s": round(_pct([r["latency"] for r in ok], 50), 4),
                    "latency_p90_s": round(_pct([r["latency"] for r in ok], 90), 4),
                    "latency_p99_s": round(_pct([r["latency"] for r in ok], 99), 4),
                    "ttft_mean_s": round(sum(ttft) / len(ttft), 4) if ttft else float("nan"),
                    "ttft_p50_s": round(_pct(ttft, 50), 4),
                    "ttft_p99_s": round(_pct(ttft, 99), 4),
                    "tpot_mean_ms": round(sum(tpot) / len(tpot), 3) if tpot else float("nan"),
                    "tpot_p50_ms": round(_pct(tpot, 50), 3),
                    "tpot_p99_ms": round(_pct(tpot, 99), 3),
                    "acceptance_length": round(1 + d("ddtree_spec_decode_num_accepted_tokens_total") / drafts, 3)
                    if drafts
                    else float("nan"),
                    "response_format": _format_name(response_format),
                    "grammar_replaced_tokens": int(d("ddtree_grammar_replaced_tokens_total")),
                    "prefix_cache_hit_tokens": int(d("ddtree_prefix_cache_hit_tokens_total")),
                    "preemptions": int(d("ddtree_preemptions_total")),
                    "rounds": int(rounds),
                    "mean_batch": round(drafts / rounds, 2) if rounds else float("nan"),
                    "engine_step_ms_per_round": round(step_ms, 3),
                    "prefill_ms_per_round": round(prefill_ms, 3),
                    "wall_ms_per_round": round(iter_ms, 3),
                    "serving_overhead_ms_per_round": round(iter_ms - step_ms - prefill_ms, 3),
                }
            )
    return results


def _format_name(response_format: dict | None) -> str | None:
    """ "json_object", "json_schema:NAME" or None, for the report."""
    if not response_format:
        return None
    kind = response_format.get("type")
    name = (response_format.get("json_schema") or {}).get("name")
    return f"{kind}:{name}" if kind == "json_schema" and name else kind


def response_format_arg(value: str) -> dict:
    """--response-format: json_object, or the path of a JSON Schema file (sent as a json_schema named after
    the file); UsageError for a file that is not a JSON object."""
    if value == "json_object":
        return {"type": "json_object"}
    path = Path(value)
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"--response-format: '{value}' is neither json_object nor a readable JSON Schema file ({exc})"
        ) from None
    if not isinstance(schema, dict):
        raise UsageError(f"--response-format: '{value}' holds a JSON {type(schema).__name__}, not a JSON Schema object")
    return {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema}}


def bench_line(r: dict) -> str:
    level = (
        f"c={r['concurrency']:<3}"
        if r["arrival"] == "closed"
        else f"rate={r['request_rate']:g}/s (sent at {r['achieved_request_rate']:.2f}/s)"
    )
    return (
        f"{level} req={r['requests']} err={r['errors']} {r['output_tokens_per_s']:.1f} tok/s "
        f"{r['requests_per_s']:.2f} req/s  prompt {r['prompt_tokens_mean']:.0f} tok  latency p50/p99 "
        f"{r['latency_p50_s']:.3f}/{r['latency_p99_s']:.3f}s  ttft mean/p50/p99 {r['ttft_mean_s']:.3f}/"
        f"{r['ttft_p50_s']:.3f}/{r['ttft_p99_s']:.3f}s  tpot mean/p50/p99 {r['tpot_mean_ms']:.1f}/"
        f"{r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f}ms  accept {r['acceptance_length']}  round: step "
        f"{r['engine_step_ms_per_round']:.2f}ms + prefill {r['prefill_ms_per_round']:.2f}ms + overhead "
        f"{r['serving_overhead_ms_per_round']:.2f}ms = {r['wall_ms_per_round']:.2f}ms (batch {r['mean_batch']})"
        + (
            f"  {r['response_format']}: {r['grammar_replaced_tokens']} tokens replaced"
            if r.get("response_format")
            else ""
        )
        + (
            f"  prefix cache: {r['prefix_cache_hit_tokens']} prompt tokens reused"
            if r["prefix_cache_hit_tokens"]
            else ""
        )
        + (f"  {r['preemptions']} preempted" if r["preemptions"] else "")
    )
