"""`ddtree soak`: a bounded soak of a running server. Clients send a mix of streaming and non-streaming,
chat and completion requests back to back for a fixed time, and some of them hang up mid-request. At the
end the server must have settled (no request running or waiting), its memory and open file descriptors
must be where they were after the warm-up (within stated margins), every request the clients saw to the
end must have ended cleanly (a finish reason, or an error body), and the server's request counters must
add up to what the clients did.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

from .loadgen import BENCH_PROMPTS

RSS_MARGIN_BYTES = 64 * 1024 * 1024  # growth of resident memory tolerated from the warm-up's end
FD_MARGIN = 8  # open file descriptors: the same, a few for whatever the runtime keeps open lazily


async def _one(session, url: str, model: str, rng: random.Random, max_tokens: int, hang_up: float) -> str:
    """One request: 'completed', 'cancelled' (this client hung up), an HTTP status (an error body), or
    'broken:WHY' when the server ended it without a finish reason or an error."""
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    body: dict = {"model": model, "max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0, 0.8])}
    prompt = rng.choice(BENCH_PROMPTS)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
    path = "/v1/chat/completions" if chat else "/v1/completions"
    hang_up_after = rng.uniform(0.0, 0.5) if rng.random() < hang_up else None

    async def run() -> str:
        async with session.post(url + path, json=body) as r:
            if r.status != 200:
                error = await r.json()
                return str(r.status) if "error" in error else f"broken:{r.status} without an error body"
            if not stream:
                out = await r.json()
                return "completed" if out["choices"][0]["finish_reason"] else "broken:no finish reason"
            finished = done = False
            async for line in r.content:
                line = line.strip()
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    data = json.loads(line[6:])
                    if "error" in data:
                        return str(data["error"].get("code") or "stream error")
                    finished |= any(c.get("finish_reason") for c in data.get("choices", []))
            return "completed" if finished and done else "broken:stream ended without finish reason and [DONE]"

    task = asyncio.ensure_future(run())
    if hang_up_after is None:
        return await task
    done, _ = await asyncio.wait({task}, timeout=hang_up_after)
    if done:
        return task.result()
    task.cancel()  # closes the connection under the request
    try:
        await task
    except asyncio.CancelledError:
        pass
    return "cancelled"


async def soak(
    url: str,
    duration: float,
    clients: int = 8,
    max_tokens: int = 48,
    hang_up: float = 0.2,
    warmup: float | None = None,
    seed: int = 0,
    api_key: str | None = None,
) -> dict:
    """Run the soak for `duration` seconds (the first `warmup` seconds, default 10% of it, set the
    baseline of memory and descriptors) and return its report; `report["ok"]` says whether it held."""
    import aiohttp

    from .metrics import read_samples, total

    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    warmup = duration / 10 if warmup is None else warmup
    outcomes: dict[str, int] = {}
    samples: list[tuple[float, float, float]] = []  # (seconds, rss bytes, open fds)
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def scrape() -> dict:
            async with session.get(url + "/metrics") as r:
                return read_samples(await r.text())

        async with session.get(url + "/v1/models") as r:
            if r.status != 200:
                raise RuntimeError(f"GET /v1/models answered {r.status}: {await r.text()}")
            model = (await r.json())["data"][0]["id"]
        before = await scrape()
        start = time.monotonic()
        end = start + duration

        async def client(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < end:
                outcome = await _one(session, url, model, rng, max_tokens, hang_up)
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                if outcome in ("429", "503"):  # as clients do on Retry-After
                    await asyncio.sleep(rng.uniform(0.1, 0.5))

        async def sampler() -> None:
            while time.monotonic() < end:
                m = await scrape()
                samples.append(
                    (time.monotonic() - start, total(m, "process_resident_memory_bytes"), total(m, "process_open_fds"))
                )
                await asyncio.sleep(max(0.5, duration / 40))

        await asyncio.gather(sampler(), *(client(i) for i in range(clients)))
        settle_deadline = time.monotonic() + 60
        while True:  # hung-up requests leave between rounds; closed connections are reaped by the loop
            await asyncio.sleep(0.5)
            after = await scrape()
            idle = total(after, "ddtree_requests_running") == 0 and total(after, "ddtree_requests_waiting") == 0
            if idle or time.monotonic() > settle_deadline:
                break
    statuses = sorted({dict(labels)["status"] for name, labels in after if name == "ddtree_requests_total"})
    server = {}
    for status in statuses:
        n = total(after, "ddtree_requests_total", status=status) - total(before, "ddtree_requests_total", status=status)
        if n:
            server[status] = int(n)
    sent = sum(outcomes.values())
    completed, cancelled = outcomes.get("completed", 0), outcomes.get("cancelled", 0)
    broken = {k: v for k, v in outcomes.items() if k.startswith("broken:")}
    errors = {k: v for k, v in outcomes.items() if k not in ("completed", "cancelled") and k not in broken}
    baseline = [s for s in samples if s[0] >= warmup][:1] or samples[-1:]
    rss0, fds0 = baseline[0][1:] if baseline else (0.0, 0.0)
    rss1, fds1 = total(after, "process_resident_memory_bytes"), total(after, "process_open_fds")
    checks = {
        "settled": idle,
        "no_broken_requests": not broken,
        # every request that ended counted once, under the status its client saw; a hung-up one under 499,
        # under the status it got before the server noticed its client had gone, or not at all when it left
        # before the server had read its headers
        "counters_add_up": sent - cancelled <= sum(server.values()) <= sent
        and server.get("499", 0) <= cancelled
        and server.get("200", 0) >= completed
        and all(server.get(status, 0) >= n for status, n in errors.items()),
        "rss_flat": rss1 - rss0 <= RSS_MARGIN_BYTES,
        "fds_flat": fds1 - fds0 <= FD_MARGIN,
    }
    return {
        "duration_s": duration,
        "clients": clients,
        "requests": sent,
        "completed": completed,
        "cancelled": cancelled,
        "errors": errors,
        "broken": broken,
        "server_requests_by_status": server,
        "rss_mib": {"baseline": round(rss0 / 2**20, 1), "end": round(rss1 / 2**20, 1)},
        "rss_max_mib": round(max((s[1] for s in samples), default=0) / 2**20, 1),
        "open_fds": {"baseline": int(fds0), "end": int(fds1), "max": int(max((s[2] for s in samples), default=0))},
        "checks": checks,
        "ok": all(checks.values()),
    }


def soak_lines(report: dict) -> str:
    c, fds = report["checks"], report["open_fds"]
    return "\n".join(
        [
            f"{report['requests']} requests from {report['clients']} clients in {report['duration_s']:g} s: "
            f"{report['completed']} completed, {report['cancelled']} hung up, errors {report['errors'] or 'none'}, "
            f"broken {report['broken'] or 'none'}",
            f"server counted {report['server_requests_by_status']}",
            f"rss {report['rss_mib']['baseline']} -> {report['rss_mib']['end']} MiB (max {report['rss_max_mib']}), "
            f"open fds {fds['baseline']} -> {fds['end']} (max {fds['max']})",
            "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in c.items()),
        ]
    )
