"""`ddtree serve`: OpenAI-compatible endpoints, continuous batching, readiness gated on the smoke test,
Prometheus metrics, bad input and load.

The scheduler's token handling (stop strings across tokens, UTF-8, max_tokens and stop tokens inside an
accepted path, queue bound, cancellation) runs against a scripted fake engine; everything else runs
real `python -m ddtree serve` processes with SmolLM2-135M on CPU, bound to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from ddtree.serving.metrics import ServerMetrics, read_samples, total
from server_process import MODEL, Server, assert_openai_error, http, metrics
from unlimited_pages import UnlimitedPages


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    from ddtree.models.checkpoint import load_config, resolve_model
    from ddtree.models.llama import ModelConfig
    from ddtree.speculative.drafter import DrafterConfig, init_drafter, save_drafter

    target = ModelConfig.from_hf(load_config(resolve_model(MODEL)))
    out = tmp_path_factory.mktemp("drafter") / "drafter"
    save_drafter(init_drafter(DrafterConfig.for_target(target, num_layers=1, block_size=8), seed=0), out)
    return out


@pytest.fixture(scope="module")
def ddtree_server(drafter_dir, tmp_path_factory):
    """DDTree (budget 8) with 8 engine rows sharing a KV page pool of 1024 tokens (less than 8 rows of 192);
    the readiness sequence it went through is kept on it."""
    log = tmp_path_factory.mktemp("ddtree-server") / "server.log"
    server = Server(
        [
            "--drafter",
            str(drafter_dir),
            "--method",
            "ddtree",
            "--budget",
            "8",
            "--max-batch-size",
            "8",
            "--max-seq-len",
            "192",
            "--kv-cache-tokens",
            "1024",
            "--batch-buckets",
            "1,2",
            "--served-model-name",
            "smol-ddtree",
        ],
        log,
    )
    try:
        server.readiness = server.wait_ready()
        server.ready_after = time.monotonic() - server.started
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ar_server(tmp_path_factory):
    """Plain decoding with 2 engine rows and a waiting queue of 1: for disconnects and 429."""
    log = tmp_path_factory.mktemp("ar-server") / "server.log"
    server = Server(
        [
            "--method",
            "ar",
            "--max-batch-size",
            "2",
            "--max-waiting",
            "1",
            "--max-seq-len",
            "512",
            "--batch-buckets",
            "1",
        ],
        log,
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


# ---- the scheduler against a scripted engine (no model) -----------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from ddtree.models.checkpoint import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(MODEL))


class ScriptedEngine(UnlimitedPages):
    """Engine stand-in: each request's token stream comes from a script keyed by its first prompt token,
    cut into rounds of the given sizes; step() can be paused to hold requests in their rows."""

    def __init__(self, scripts: dict[int, tuple[list[int], list[int]]], max_batch_size=2, tree_size=5):
        self.scripts, self.max_batch_size, self.max_seq_len = scripts, max_batch_size, 256
        self.tree_size, self.budget = tree_size, tree_size - 1
        self.host_lengths = [0] * max_batch_size
        self.host_active = [False] * max_batch_size
        self.streams: dict[int, list[list[int]]] = {}
        self.released: list[int] = []
        self.prefill_sizes = (512,)
        self.pending: dict[int, tuple] = {}
        self.gate = threading.Event()
        self.gate.set()

    budgets = None  # a fixed budget, not auto

    def plan(self, n):
        from ddtree.runtime.plan import RoundPlan

        return RoundPlan(self.max_batch_size, True, self.budget, self.tree_size, 8)

    @property
    def last_plan(self):
        return self.plan(1)

    def add(self, row, prompt, params):
        tokens, sizes = self.scripts[prompt[0]]
        rounds, i = [], 1
        for s in sizes:
            rounds.append(tokens[i : i + s])
            i += s
        self.streams[row] = rounds
        self.host_active[row], self.host_lengths[row] = True, len(prompt)
        return tokens[0]

    def begin(self, row, prompt, params, reuse=False):
        self.pending[row] = (prompt, params)
        return 0  # nothing reused

    def prefill(self, row, budget):
        return self.add(row, *self.pending.pop(row))

    def prefill_many(self, takes):
        return [self.prefill(row, take) for row, take in takes]

    def step(self, n):
        self.gate.wait(10)
        out = []
        for row in range(n):
            if not self.host_active[row]:
                out.append([])
                continue
            toks = self.streams[row].pop(0)
            self.host_lengths[row] += len(toks)
            out.append(toks)
        return out

    def release(self, row):
        self.host_active[row] = False
        self.released.append(row)


def run_requests(engine, tokenizer, reqs, max_waiting=4):
    """Run (prompt, SamplingParams, stop[, Request options]) requests through a Scheduler; returns per request
    its events. A
    request is done when its last event has been flushed (as the server's sinks, which keep events until
    the scheduler's flush)."""
    from ddtree.serving.scheduler import Request, Scheduler

    done = [threading.Event() for _ in reqs]
    events = [[] for _ in reqs]
    unflushed: list[tuple[int, object]] = []

    def flush():
        for i, ev in unflushed:
            if ev.finish_reason or ev.error:
                done[i].set()
        unflushed.clear()

    m = ServerMetrics("test")
    sched = Scheduler(engine, tokenizer, m, max_waiting, flush=flush)
    sched.start()

    def sink(i):
        def put(ev):
            events[i].append(ev)
            unflushed.append((i, ev))

        return put

    for i, (prompt, params, stop, *options) in enumerate(reqs):
        sched.submit(Request(prompt, params, stop, sink(i), **(options[0] if options else {})))
    for d in done:
        assert d.wait(10)
    sched.stop()
    return events, read_samples(m.render()[0].decode())


def test_scheduler_stop_strings_utf8_and_truncation_inside_rounds(tokenizer):
    from ddtree.runtime.engine import SamplingParams

    text = "Héllo wörld 😀 — 世界! The END is near, but not yet."
    ids = tokenizer.encode(text)
    eos = tokenizer.eos_token_id
    n = len(ids)
    scripts = {
        100: (ids + [7] * 8, [3, 1, 5, 2, 4] + [1] * n),  # stop string "END" spans several tokens
        101: (ids + [7] * 8, [4, 4, 4] + [1] * n),  # no stop: max_tokens cuts inside a 4-token round
        102: (ids[:6] + [eos] + ids[6:], [3, 4, 4] + [1] * n),  # stop token in the middle of a round
        103: (ids + [7] * 8, [2] * n),  # whole text, then max_tokens
    }
    eng = ScriptedEngine(scripts, max_batch_size=2)
    reqs = [
        ([100, 5], SamplingParams(max_new_tokens=64, stop_token_ids=(eos,)), ["END", "never"]),
        ([101, 5], SamplingParams(max_new_tokens=10, stop_token_ids=(eos,)), []),
        ([102, 5], SamplingParams(max_new_tokens=64, stop_token_ids=(eos,)), []),
        ([103, 5], SamplingParams(max_new_tokens=n, stop_token_ids=(eos,)), ["xyz"]),
    ]
    events, samples = run_requests(eng, tokenizer, reqs)
    texts = ["".join(e.text for e in evs) for evs in events]
    for evs in events:  # text arrives in pieces, every piece valid UTF-8 text, the last one finishes
        assert all("\ufffd" not in e.text for e in evs)
        assert [e.finish_reason is not None for e in evs] == [False] * (len(evs) - 1) + [True]
    assert texts[0] == text[: text.index("END")] and events[0][-1].finish_reason == "stop"
    assert all("E" not in e.text for e in events[0]), "a partial stop string must be held back"
    assert texts[1] == tokenizer.decode(ids[:10]) and events[1][-1].completion_tokens == 10
    assert events[1][-1].finish_reason == "length"
    assert texts[2] == tokenizer.decode(ids[:6]) and events[2][-1].finish_reason == "stop"
    assert events[2][-1].completion_tokens == 7, "the stop token counts, the tokens after it do not"
    assert texts[3] == text and events[3][-1].finish_reason == "length" and len(events[3]) > 3
    # counters: drafts per sequence-round, accepted = emitted - bonus, generation = completion tokens
    drafts = total(samples, "ddtree_spec_decode_num_drafts_total")
    assert drafts == total(samples, "ddtree_acceptance_length_count") > 0
    assert total(samples, "ddtree_spec_decode_num_draft_tokens_total") == 4 * drafts
    assert total(samples, "ddtree_acceptance_length_sum") == drafts + total(
        samples, "ddtree_spec_decode_num_accepted_tokens_total"
    )
    assert total(samples, "ddtree_generation_tokens_total") == sum(evs[-1].completion_tokens for evs in events)
    assert total(samples, "ddtree_prompt_tokens_total") == 8
    assert len(eng.released) == 4


def test_scheduler_keeps_the_text_of_a_requests_own_stop_tokens_and_stop_strings_when_asked(tokenizer):
    """vLLM's semantics: a request's own stop_token_ids end the completion with their text, unless they are
    special tokens (the EOS here); include_stop_str keeps the stop string that ended it; a stop string that
    completes before min_tokens tokens does not count."""
    from ddtree.runtime.engine import SamplingParams

    text = "Héllo wörld 😀 — 世界! The END is near, but not yet."
    ids = tokenizer.encode(text)
    eos = tokenizer.eos_token_id
    scripts = {
        100: (ids + [7] * 8, [3, 1, 5, 2, 4] + [1] * len(ids)),
        101: (ids + [7] * 8, [2, 3, 2] + [1] * len(ids)),
        102: (ids[:6] + [eos] + ids[6:], [3, 4, 4] + [1] * len(ids)),
        103: (ids + [7] * 8, [2] * len(ids)),
    }
    eng = ScriptedEngine(scripts, max_batch_size=4)
    word = ids[3]  # an ordinary token, inside the second round
    reqs = [
        ([100, 5], SamplingParams(max_new_tokens=64, stop_token_ids=(eos,)), ["END"], {"include_stop_str": True}),
        ([101, 5], SamplingParams(max_new_tokens=64, stop_token_ids=(eos, word)), [], {"shown_stop_ids": [word]}),
        ([102, 5], SamplingParams(max_new_tokens=64, stop_token_ids=(eos,)), [], {"shown_stop_ids": [eos]}),
        ([103, 5], SamplingParams(max_new_tokens=len(ids)), ["END"], {"min_tokens": len(ids)}),
    ]
    events, _ = run_requests(eng, tokenizer, reqs)
    texts = ["".join(e.text for e in evs) for evs in events]
    assert texts[0] == text[: text.index("END") + 3] and events[0][-1].finish_reason == "stop"
    first = ids.index(word)
    assert texts[1] == tokenizer.decode(ids[: first + 1]) and events[1][-1].completion_tokens == first + 1
    assert texts[2] == tokenizer.decode(ids[:6]) and events[2][-1].completion_tokens == 7  # EOS: special, no text
    assert [evs[-1].finish_reason for evs in events] == ["stop", "stop", "stop", "length"]
    assert texts[3] == text  # "END" completed before min_tokens


def test_scheduler_queue_bound_and_cancellation_free_rows(tokenizer):
    from ddtree.runtime.engine import SamplingParams
    from ddtree.serving.scheduler import QueueFull, Request, Scheduler

    scripts = {i: (list(range(1000, 1100)), [1] * 99) for i in range(200, 206)}
    eng = ScriptedEngine(scripts, max_batch_size=2)
    eng.gate.clear()  # rounds block: admitted requests stay in their rows
    m = ServerMetrics("test")
    sched = Scheduler(eng, tokenizer, m, max_waiting=1)
    sched.start()
    got = {i: [] for i in range(4)}
    reqs = [Request([200 + i], SamplingParams(max_new_tokens=50), None, got[i].append) for i in range(4)]
    sched.submit(reqs[0])
    sched.submit(reqs[1])
    deadline = time.monotonic() + 5
    while sched.running < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sched.running == 2
    sched.submit(reqs[2])  # waits
    with pytest.raises(QueueFull):
        sched.submit(reqs[3])
    sched.cancel(reqs[2])  # a waiting request just leaves the queue
    assert sched.waiting == 0
    sched.cancel(reqs[0])  # a running one frees its row before the next round
    eng.gate.set()
    deadline = time.monotonic() + 5
    while 0 not in eng.released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 0 in eng.released
    deadline = time.monotonic() + 5
    while not (got[1] and got[1][-1].finish_reason) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got[1][-1].finish_reason == "length" and got[1][-1].completion_tokens == 50
    assert got[2] == [] and got[3] == [] and not any(e.finish_reason or e.error for e in got[0])
    # stopping the scheduler fails what is still running with 503
    got[4] = []
    eng.gate.clear()
    sched.submit(Request([204], SamplingParams(max_new_tokens=50), None, got[4].append))
    while sched.running < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    stopper = threading.Thread(target=sched.stop)
    stopper.start()
    time.sleep(0.1)
    eng.gate.set()
    stopper.join(10)
    assert got[4][-1].error_status == 503 and "shutting down" in got[4][-1].error
    assert sched._free == 2, "every claimed row was given back"


def test_load_is_running_plus_waiting_over_the_batch_size(tokenizer):
    """ddtree_load, the autoscaling metric: 1.0 with every row busy, above 1 once requests queue, 0 when idle."""
    from ddtree.runtime.engine import SamplingParams
    from ddtree.serving.scheduler import Request, Scheduler

    scripts = {i: (list(range(1000, 1020)), [1] * 19) for i in range(300, 304)}
    eng = ScriptedEngine(scripts, max_batch_size=2)
    eng.gate.clear()  # rounds block: admitted requests stay in their rows
    m = ServerMetrics("test")
    sched = Scheduler(eng, tokenizer, m, max_waiting=2)

    def load():
        return total(read_samples(m.render()[0].decode()), "ddtree_load")

    def wait_load(expected):
        deadline = time.monotonic() + 5
        while load() != expected and time.monotonic() < deadline:
            time.sleep(0.01)
        return load()

    sched.start()
    assert load() == 0
    got = {i: [] for i in range(4)}
    reqs = [Request([300 + i], SamplingParams(max_new_tokens=19), None, got[i].append) for i in range(4)]
    sched.submit(reqs[0])
    sched.submit(reqs[1])
    deadline = time.monotonic() + 5
    while sched.running < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sched.running == 2 and load() == 1.0  # both rows busy, nothing waits
    sched.submit(reqs[2])
    assert load() == 1.5
    sched.submit(reqs[3])
    assert sched.waiting == 2 and load() == 2.0  # two running, two waiting
    eng.gate.set()  # rounds run: everything finishes
    assert wait_load(0.0) == 0.0
    assert all(got[i] and got[i][-1].finish_reason == "length" for i in range(4))
    sched.stop()


def test_scheduler_survives_a_failed_round_and_reports_a_dead_engine(tokenizer):
    from ddtree.runtime.engine import SamplingParams
    from ddtree.serving.scheduler import NotRunning, Request, Scheduler

    class Failing(ScriptedEngine):
        error: type = RuntimeError

        def step(self, n):
            raise self.error("boom")

    eng = Failing({300: (list(range(1000, 1010)), [1] * 9)}, max_batch_size=2)
    sched = Scheduler(eng, tokenizer, ServerMetrics("test"), max_waiting=2)
    sched.start()

    def run_one():
        got, done = [], threading.Event()
        sched.submit(
            Request(
                [300],
                SamplingParams(max_new_tokens=5),
                None,
                lambda ev: (got.append(ev), (ev.error or ev.finish_reason) and done.set()),
            )
        )
        assert done.wait(10)
        return got[-1]

    ev = run_one()  # a failed round fails its requests with 500; the scheduler keeps going
    assert ev.error_status == 500 and "boom" in ev.error and sched.error is None
    assert sched._free == 2
    eng.error = KeyError  # anything else kills the engine thread: requests get 503, new ones are refused
    ev = run_one()
    assert ev.error_status == 503 and "engine failure" in ev.error
    assert isinstance(sched.error, KeyError)
    with pytest.raises(NotRunning):
        sched.submit(Request([300], SamplingParams(max_new_tokens=5), None, lambda ev: None))


# ---- start-up, readiness, smoke failure -----------------------------------------------------------


@pytest.mark.slow
def test_ready_is_503_until_the_smoke_test_passed_then_200_with_the_report(ddtree_server):
    seen = ddtree_server.readiness
    assert seen[0] == (200, 503), f"health must answer while loading, ready must not: {seen[:5]}"
    assert all(h == 200 for h, _ in seen) and seen[-1] == (200, 200)
    status, report = http("GET", ddtree_server.url + "/ready")
    assert status == 200 and report["passed"] is True and "smoke test passed" in report["reason"]
    assert {"captured", "capture_seconds", "mismatches", "fallbacks"} <= set(report)
    samples = metrics(ddtree_server.url)
    assert total(samples, "ddtree_smoke_test_passed", model="smol-ddtree") == 1
    assert total(samples, "ddtree_spec_budget", model="smol-ddtree") == 8
    assert ("ddtree_graph_capture_seconds", (("model", "smol-ddtree"),)) in samples
    assert total(samples, "ddtree_kv_pages_total", model="smol-ddtree") == 1024 // 16  # --kv-cache-tokens


@pytest.mark.slow
def test_forced_smoke_failure_exits_nonzero_with_the_reason_in_the_termination_log(tmp_path):
    term = tmp_path / "termination-log"
    server = Server(
        [
            "--method",
            "ar",
            "--max-batch-size",
            "2",
            "--max-seq-len",
            "128",
            "--batch-buckets",
            "1",
            "--smoke-fault",
            "corrupt-graph-input",
            "--termination-log",
            str(term),
        ],
        tmp_path / "log",
    )
    try:
        seen = []
        while server.proc.poll() is None and len(seen) < 3:
            try:
                seen.append(
                    (
                        http("GET", server.url + "/health", timeout=5)[0],
                        http("GET", server.url + "/ready", timeout=5)[0],
                    )
                )
            except (urllib.error.URLError, ConnectionError):
                break
        code = server.proc.wait(300)
    finally:
        server.stop()
    assert code != 0, server.output()
    assert seen and seen[0] == (200, 503), seen
    reason = term.read_text()
    assert reason.startswith("smoke test failed") and "mismatch" in reason, reason
    assert reason.strip() in server.output()


def test_bad_flags_are_usage_errors(capsys):
    from ddtree.cli import main

    for argv, needle in [
        (["serve", "--model", "/local/model", "--method", "ddtree"], "needs --drafter"),
        (["serve", "--model", MODEL, "--method", "ar", "--max-batch-size", "0"], "--max-batch-size"),
        (["serve", "--model", MODEL, "--method", "ar", "--batch-buckets", "1,16"], "exceed --max-batch-size"),
        (["serve", "--model", MODEL, "--method", "ar", "--batch-buckets", "a,b"], "comma-separated"),
        (["serve", "--model", MODEL, "--method", "ar", "--budget", "-1"], "--budget"),
        (
            ["serve", "--model", MODEL, "--method", "ar", "--budget", "1:32,16:8"],
            "a budget per batch size needs --method ddtree",
        ),
        (["serve", "--model", MODEL, "--method", "ddtree", "--budget", "16:"], "BATCH:BUDGET pairs"),
        (["serve", "--model", MODEL, "--method", "beam"], "invalid choice"),
        (["serve", "--model", MODEL, "--method", "ar", "--smoke-fault", "nope"], "invalid choice"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (argv, err)


# ---- API surface -----------------------------------------------------------------------------------


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, "malformed json"),
    ("/v1/completions", b"[1, 2]", 400, "json object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "nope"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, 400, "exceeds the context"),
    ("/v1/completions", {"prompt": "hi " * 400, "max_tokens": 4}, 400, "context"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "batched"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, 400, "integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4.5}, 400, "integer"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "must be in 1..128"),
    ("/v1/completions", {"prompt": "hi", "n": "2"}, 400, "integer"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "budget": 3}, 400, "budget"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "must be in 0..20"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "not supported"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
]


@pytest.mark.slow
def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(ddtree_server):
    url = ddtree_server.url
    before = metrics(url)
    for path, body, code, needle in BAD_REQUESTS:
        status, resp = http("POST", url + path, body)
        assert_openai_error(status, resp, code, needle)
    assert_openai_error(*http("GET", url + "/v1/nothing"), 404, "not found")
    assert_openai_error(*http("GET", url + "/v1/completions"), 405)
    status, resp = http(
        "POST", url + "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "budget": 8, "temperature": 0}
    )
    assert status == 200 and resp["usage"]["completion_tokens"] == 2
    after = metrics(url)
    for code in (400, 404):
        want = sum(1 for p, _, c, _ in BAD_REQUESTS if c == code)
        got = total(after, "ddtree_requests_total", status=str(code)) - total(
            before, "ddtree_requests_total", status=str(code)
        )
        assert got == want, code


@pytest.mark.slow
def test_models_endpoint(ddtree_server):
    status, body = http("GET", ddtree_server.url + "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["smol-ddtree"] and body["data"][0]["max_model_len"] == 192


@pytest.mark.slow
def test_official_openai_client_completions_chat_and_streaming(ddtree_server):
    import openai

    client = openai.OpenAI(base_url=ddtree_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    models = [m.id for m in client.models.list()]
    assert models == ["smol-ddtree"]

    c = client.completions.create(model="smol-ddtree", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert c.choices[0].finish_reason == "length" and "Paris" in c.choices[0].text
    assert c.usage.completion_tokens == 6 and c.usage.prompt_tokens > 0
    streamed = list(
        client.completions.create(
            model="smol-ddtree", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in streamed) == c.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "What is 2+2? Answer briefly."}]
    chat = client.chat.completions.create(model="smol-ddtree", messages=messages, max_tokens=12, temperature=0)
    answer = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and "4" in answer
    chunks = list(
        client.chat.completions.create(
            model="smol-ddtree",
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [chat.choices[0].finish_reason]

    # stop strings cut the text (the stop string itself excluded); "seed" and sampling are accepted
    full = c.choices[0].text
    cut = client.completions.create(
        model="smol-ddtree", prompt="The capital of France is", max_tokens=6, temperature=0, stop=["aris"]
    )
    assert cut.choices[0].text == full[: full.index("aris")] and cut.choices[0].finish_reason == "stop"
    sampled = client.completions.create(
        model="smol-ddtree", prompt="Once upon a time", max_tokens=4, temperature=0.8, top_p=0.9, seed=1
    )
    again = client.completions.create(
        model="smol-ddtree", prompt="Once upon a time", max_tokens=4, temperature=0.8, top_p=0.9, seed=1
    )
    assert sampled.choices[0].text == again.choices[0].text, "a seeded request alone is reproducible"

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smol-ddtree", prompt="hi", max_tokens=-1)


PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Here is a short list of three colours:\n1.",
    "Once upon a time, in a small village by the sea, there lived",
    "import numpy as np\n\nx = np.",
    "The three primary colours are",
    "Water boils at",
    "Q: What is the largest planet in the solar system?\nA:",
    "To make a cup of tea, first",
    "The quick brown fox",
    "SELECT name FROM users WHERE",
    "In 1969, the first humans",
    "My favourite programming language is",
    "1, 2, 3, 4, 5,",
    "The mitochondria is the",
    "Dear Sir or Madam,\n\nI am writing to",
]


@pytest.mark.slow
def test_32_concurrent_clients_match_sequential_greedy_and_counters_add_up(ddtree_server):
    import aiohttp

    url, max_tokens = ddtree_server.url, 8
    # the same prompts one at a time
    reference = {}
    for p in PROMPTS:
        status, body = http("POST", url + "/v1/completions", {"prompt": p, "max_tokens": max_tokens, "temperature": 0})
        assert status == 200, body
        reference[p] = body["choices"][0]["text"]
    before = metrics(url)

    async def load():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

            async def client(i):
                out = []
                for k in range(4):
                    p = PROMPTS[(i + 5 * k) % len(PROMPTS)]
                    body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "model": "smol-ddtree"}
                    if k % 2:  # half of them streamed
                        body.update(stream=True, stream_options={"include_usage": True})
                    async with session.post(url + "/v1/completions", json=body) as r:
                        if k % 2:
                            text, usage = "", None
                            async for line in r.content:
                                line = line.strip()
                                if line.startswith(b"data: {"):
                                    chunk = json.loads(line[6:])
                                    text += "".join(c["text"] for c in chunk["choices"])
                                    usage = chunk.get("usage") or usage
                            out.append((p, r.status, text, usage))
                        else:
                            data = await r.json()
                            out.append((p, r.status, data["choices"][0]["text"], data["usage"]))
                return out

            return [x for xs in await asyncio.gather(*(client(i) for i in range(32))) for x in xs]

    t0 = time.monotonic()
    results = asyncio.run(load())
    elapsed = time.monotonic() - t0
    assert len(results) == 128 and all(status == 200 for _, status, _, _ in results)
    mismatched = [(p, text, reference[p]) for p, _, text, _ in results if text != reference[p]]
    assert not mismatched, mismatched[:3]

    after = metrics(url)

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("ddtree_generation_tokens_total") == sum(u["completion_tokens"] for *_, u in results)
    assert delta("ddtree_prompt_tokens_total") == sum(u["prompt_tokens"] for *_, u in results)
    assert delta("ddtree_requests_total", status="200") == 128
    drafts = delta("ddtree_spec_decode_num_drafts_total")
    assert drafts == delta("ddtree_acceptance_length_count") > 0
    assert delta("ddtree_spec_decode_num_draft_tokens_total") == 8 * drafts
    assert delta("ddtree_acceptance_length_sum") == drafts + delta("ddtree_spec_decode_num_accepted_tokens_total")
    assert delta("ddtree_time_to_first_token_seconds_count") == 128
    assert delta("ddtree_request_latency_seconds_count") == 128
    rounds = delta("ddtree_engine_step_seconds_count")
    assert drafts / rounds > 2, "requests must have shared rounds (continuous batching)"
    # the gauges are set at the end of the engine thread's iteration, after the last response went out
    deadline = time.monotonic() + 10
    while total(after, "ddtree_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
        after = metrics(url)
    assert total(after, "ddtree_requests_running") == 0 and total(after, "ddtree_requests_waiting") == 0
    print(f"\n32x4 requests: {elapsed:.1f}s, {rounds:.0f} rounds, mean batch {drafts / rounds:.1f}")


@pytest.mark.slow
def test_budget_zero_above_one_request_keeps_greedy_output(drafter_dir, tmp_path):
    """`--budget 1:8,2:0`: a request running alone is drafted for, several at once decode plainly
    (budget 0), and each request's text is the one it gets alone, whichever rounds it went through."""
    server = Server(
        [
            "--drafter",
            str(drafter_dir),
            "--method",
            "ddtree",
            "--budget",
            "1:8,2:0",
            "--max-batch-size",
            "4",
            "--max-seq-len",
            "192",
            "--batch-buckets",
            "1,2,4",
        ],
        tmp_path / "server.log",
    )
    try:
        server.wait_ready()
        prompts = PROMPTS[:4]

        def complete(p):
            status, body = http(
                "POST", server.url + "/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0}
            )
            assert status == 200, body
            return body["choices"][0]["text"]

        alone = {p: complete(p) for p in prompts}
        before = metrics(server.url)
        together = {}
        threads = [threading.Thread(target=lambda p=p: together.__setitem__(p, complete(p))) for p in prompts * 2]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = metrics(server.url)
        assert together == alone

        def delta(name):
            return total(after, name) - total(before, name)

        # rounds on one request draft 8 tokens a sequence, rounds on more draft none
        drafts = delta("ddtree_spec_decode_num_drafts_total")
        assert drafts > 0 and delta("ddtree_spec_decode_num_draft_tokens_total") < 8 * drafts
    finally:
        server.stop()


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_response_format_json_schema_is_lossless_through_the_openai_client(ddtree_server, ar_server):
    """A JSON schema through the real client, streamed and not: the text parses and fits the schema, and
    DDTree's constrained output equals plain decoding's constrained output token for token."""
    import openai

    messages = [{"role": "user", "content": "Which is the largest city of France, and how many people live there?"}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
    texts = {}
    for server in (ddtree_server, ar_server):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        before = metrics(server.url)
        ask = dict(model=model, messages=messages, max_tokens=48, temperature=0, response_format=schema_format)
        reply = client.chat.completions.create(**ask)
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", text
        value = json.loads(text)
        assert set(value) == {"city", "population"}, value
        assert isinstance(value["city"], str) and isinstance(value["population"], int), value
        streamed = list(client.chat.completions.create(**ask, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
        assert streamed[-1].choices[0].finish_reason == "stop"
        # JSON mode: one JSON object, whatever its keys
        plain = client.chat.completions.create(**{**ask, "response_format": {"type": "json_object"}})
        assert isinstance(json.loads(plain.choices[0].message.content), dict)
        after = metrics(server.url)
        assert total(after, "ddtree_grammar_replaced_tokens_total") > total(
            before, "ddtree_grammar_replaced_tokens_total"
        )
        texts[model] = text
    assert texts["smol-ddtree"] == texts[MODEL]

    for body, needle in [
        ({"response_format": {"type": "xml"}}, "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "compile"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ]:
        status, resp = http("POST", ddtree_server.url + "/v1/chat/completions", {"messages": messages, **body})
        assert_openai_error(status, resp, 400, needle)


@pytest.mark.slow
def test_bench_serve_load_generator(ddtree_server):
    from ddtree.serving.loadgen import bench_serve

    results = asyncio.run(bench_serve(ddtree_server.url, (1, 4), requests_per_client=1, max_tokens=4))
    assert [r["concurrency"] for r in results] == [1, 4]
    for r in results:
        assert r["errors"] == 0 and r["output_tokens"] == 4 * r["requests"], r  # ignore_eos: exactly max_tokens
        assert r["rounds"] >= 3 and r["acceptance_length"] >= 1.0
        assert r["engine_step_ms_per_round"] > 0 and r["serving_overhead_ms_per_round"] > -1e-6
        parts = r["engine_step_ms_per_round"] + r["prefill_ms_per_round"] + r["serving_overhead_ms_per_round"]
        assert abs(r["wall_ms_per_round"] - parts) < 0.01
        assert r["response_format"] is None and r["grammar_replaced_tokens"] == 0
    # structured output: every request under a JSON schema, ended by the grammar (so by EOS), still speculative
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    (r,) = asyncio.run(
        bench_serve(
            ddtree_server.url, (2,), requests_per_client=1, max_tokens=24, ignore_eos=False, response_format=fmt
        )
    )
    assert r["errors"] == 0 and r["response_format"] == "json_schema:answer", r
    assert 0 < r["output_tokens"] <= 2 * 24 and r["rounds"] >= 1 and r["acceptance_length"] >= 1.0
    assert r["grammar_replaced_tokens"] >= 0


# ---- admission control and disconnects (2 engine rows, 1 waiting) ---------------------------------


def _open_stream(url: str, max_tokens: int = 400, stream: bool = True) -> socket.socket:
    """Start a long completion on a raw socket; for a stream, wait for its first token. Returns the socket."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(
        {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    ).encode()
    s = socket.create_connection((host, int(port)), timeout=120)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    if not stream:
        return s
    buf = b""
    while b"data: {" not in buf:
        chunk = s.recv(65536)
        assert chunk, buf
        buf += chunk
    assert buf.startswith(b"HTTP/1.1 200"), buf[:200]
    return s


def _wait_metric(url: str, name: str, value: float, timeout: float = 60.0, **labels) -> None:
    deadline = time.monotonic() + timeout
    while True:
        got = total(metrics(url), name, **labels)
        if got == value:
            return
        assert time.monotonic() < deadline, f"{name}{labels} is {got}, expected {value}"
        time.sleep(0.1)


@pytest.mark.slow
def test_queue_bound_gives_429_and_disconnected_clients_free_their_rows(ar_server):
    url = ar_server.url
    base_499 = total(metrics(url), "ddtree_requests_total", status="499")
    a, b = _open_stream(url), _open_stream(url)  # both rows busy
    _wait_metric(url, "ddtree_requests_running", 2)
    result = {}
    waiter = threading.Thread(
        target=lambda: result.update(
            r=http("POST", url + "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "temperature": 0})
        )
    )
    waiter.start()
    _wait_metric(url, "ddtree_requests_waiting", 1)
    status, body = http("POST", url + "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert_openai_error(status, body, 429, "waiting")
    # the clients of both long streams go away: their rows free up and the waiting request runs
    a.close()
    b.close()
    waiter.join(120)
    assert result["r"][0] == 200 and result["r"][1]["usage"]["completion_tokens"] == 3
    _wait_metric(url, "ddtree_requests_running", 0)
    _wait_metric(url, "ddtree_requests_total", base_499 + 2, status="499")
    samples = metrics(url)
    assert total(samples, "ddtree_requests_total", status="429") >= 1
    # a non-streaming client that goes away frees its row too
    c = _open_stream(url, stream=False)
    _wait_metric(url, "ddtree_requests_running", 1)
    c.close()
    _wait_metric(url, "ddtree_requests_running", 0)
    _wait_metric(url, "ddtree_requests_total", base_499 + 3, status="499")
    assert total(metrics(url), "ddtree_kv_cache_usage_ratio") == 0
    # the freed rows really are free: a full-length request completes normally
    status, body = http(
        "POST",
        url + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0},
    )
    assert status == 200 and body["object"] == "chat.completion"


@pytest.mark.slow
def test_requests_before_ready_get_503(tmp_path):
    """While loading, /v1 endpoints answer 503 with an OpenAI error body (and /health 200)."""
    server = Server(
        ["--method", "ar", "--max-batch-size", "1", "--max-seq-len", "64", "--batch-buckets", "1"], tmp_path / "log"
    )
    try:
        status, body = http("POST", server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        if http("GET", server.url + "/ready")[0] == 503:  # still loading after the call (it always is on CPU)
            assert_openai_error(status, body, 503, "not ready")
        assert http("GET", server.url + "/health")[0] == 200
    finally:
        server.stop()
    assert server.proc.returncode in (0, -15)
