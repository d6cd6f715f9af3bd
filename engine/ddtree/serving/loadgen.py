"""`ddtree bench-serve`: a load generator for a running server (OpenAI API plus /metrics)."""

from __future__ import annotations

import asyncio
import json
import math
import time

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
    ttft, tokens = None, 0
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
    api_key: str | None = None,
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


def bench_line(r: dict) -> str:
    return (
        f"c={r['concurrency']:<3} req={r['requests']} err={r['errors']} {r['output_tokens_per_s']:.1f} tok/s "
        f"{r['requests_per_s']:.2f} req/s  latency p50/p99 {r['latency_p50_s']:.3f}/{r['latency_p99_s']:.3f}s  "
        f"ttft p50/p99 {r['ttft_p50_s']:.3f}/{r['ttft_p99_s']:.3f}s  tpot {r['tpot_mean_ms']:.1f}ms  "
        f"accept {r['acceptance_length']}  round: step {r['engine_step_ms_per_round']:.2f}ms + prefill "
        f"{r['prefill_ms_per_round']:.2f}ms + overhead {r['serving_overhead_ms_per_round']:.2f}ms = "
        f"{r['wall_ms_per_round']:.2f}ms (batch {r['mean_batch']})"
    )
