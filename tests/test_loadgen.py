"""`ddtree bench-serve`'s workloads (closed-loop clients, Poisson arrivals, generated system prompts and user
turns) against EngineServer over a real engine of the tiny random model, with a byte tokenizer: one token per
byte, so the token counts the load generator aims at are checked against exact ones."""

import asyncio
import json
import math
import random
import statistics

import pytest

from ddtree.cli import main
from ddtree.config import UsageError
from ddtree.models.random import ByteTokenizer
from ddtree.runtime.engine import Engine
from ddtree.runtime.smoke import default_prompts, run_smoke
from ddtree.serving.loadgen import (
    BENCH_PROMPTS,
    PromptLengths,
    bench_line,
    bench_serve,
    poisson_arrivals,
    turn_lengths,
)
from in_process_server import InProcessServer

# every key of a level's JSON line; benchmarks/report.py and benchmarks/gpu.sh read the closed-loop ones
KEYS = {
    "arrival",
    "response_format",
    "grammar_replaced_tokens",
    "prefix_cache_hit_tokens",
    "preemptions",
    "concurrency",
    "request_rate",
    "achieved_request_rate",
    "seed",
    "system_prompt_tokens",
    "prompt_lengths",
    "turns",
    "requests",
    "errors",
    "error_statuses",
    "duration_s",
    "requests_per_s",
    "output_tokens",
    "output_tokens_per_s",
    "prompt_tokens_mean",
    "latency_p50_s",
    "latency_p90_s",
    "latency_p99_s",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_mean_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "acceptance_length",
    "rounds",
    "mean_batch",
    "engine_step_ms_per_round",
    "prefill_ms_per_round",
    "wall_ms_per_round",
    "serving_overhead_ms_per_round",
}
NEWLINE = ByteTokenizer(64).encode("\n")[0]  # no generated word holds one: it ends the system part of a prompt


class ChatByteTokenizer(ByteTokenizer):
    """The byte tokenizer with a plain chat template: `<|role|>content` a line per message."""

    chat_template = "plain"

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"
        return self.encode(text) if tokenize else text


class RecordingEngine(Engine):
    """The engine, keeping the token ids of every prompt it admits, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts: list[list[int]] = []

    def begin(self, row, prompt, params, reuse=False):
        self.prompts.append(list(prompt))
        return super().begin(row, prompt, params, reuse)


@pytest.fixture(scope="module")
def server(tiny_target):
    """The server over a real ar engine of the tiny model; yields (url, engine)."""
    engine = RecordingEngine(tiny_target, None, "ar", max_batch_size=8, max_seq_len=4096)
    report = run_smoke(engine, [1, 8], default_prompts(tiny_target.config.vocab_size), max_new_tokens=4)
    assert report.passed, report.reason  # bench-serve waits for /ready, which shows this report
    for row in range(engine.max_batch_size):
        engine.release(row)
    tokenizer = ChatByteTokenizer(tiny_target.config.vocab_size)
    served = InProcessServer(engine, tokenizer, {"max_seq_len": 4096}, report=report)
    yield served.url, engine
    served.close()


def system_and_user(prompt: list[int]) -> tuple[list[int], list[int]]:
    cut = prompt.index(NEWLINE)
    return prompt[:cut], prompt[cut:]


def test_poisson_arrivals_are_exponential_gaps_from_the_seeded_rng():
    rng = random.Random(7)
    expected, t = [], 0.0
    for _ in range(5):
        t += rng.expovariate(4.0)
        expected.append(t)
    assert poisson_arrivals(4.0, 5, seed=7) == expected
    assert poisson_arrivals(4.0, 5, seed=8) != expected
    # the same pattern at every rate, scaled
    assert poisson_arrivals(2.0, 5, seed=7) == pytest.approx([2 * x for x in expected])
    gaps = [b - a for a, b in zip([0.0, *poisson_arrivals(5.0, 20000, 0)], poisson_arrivals(5.0, 20000, 0))]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.03)  # exponential: the deviation is the mean


def test_prompt_lengths_parse_and_draw():
    fixed = PromptLengths.parse("fixed:128")
    assert (fixed.low, fixed.high) == (128, 128) and fixed.draw(random.Random(0)) == 128
    uniform = PromptLengths.parse("uniform:50:500")
    assert (uniform.low, uniform.high, uniform.spec) == (50, 500, "uniform:50:500")
    draws = [uniform.draw(random.Random(k)) for k in range(2000)]
    assert min(draws) >= 50 and max(draws) <= 500 and statistics.mean(draws) == pytest.approx(275, rel=0.05)
    for bad in ("uniform:500:50", "fixed:0", "fixed:x", "normal:1:2", "uniform:5", "128"):
        with pytest.raises(UsageError, match="--prompt-lengths takes fixed:N or uniform:LO:HI"):
            PromptLengths.parse(bad)


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--request-rate", "2", "--concurrency", "4"],
            "--request-rate (open loop: Poisson arrivals) and --concurrency",
        ),
        (["--request-rate", "2", "--requests-per-client", "4"], "and --requests-per-client (closed loop"),
        (["--num-requests", "10"], "--num-requests goes with --request-rate"),
        (["--request-rate", "2,-1"], "--request-rate takes comma-separated positive numbers"),
        (["--request-rate", "nan"], "--request-rate takes comma-separated positive numbers"),
        (["--prompt-lengths", "uniform:9:1"], "--prompt-lengths takes fixed:N or uniform:LO:HI"),
        (["--prompt-lengths", "fixed:9", "--prompts-file", "p.txt"], "--prompts-file gives them: give one"),
        (["--system-prompt-tokens", "-5"], "--system-prompt-tokens must be >= 0"),
        (["--request-rate", "2", "--turns", "2"], "--turns goes with the closed loop"),
        (["--turns", "0"], "--turns must be >= 1"),
        (["--response-format", "json"], "'json' is neither json_object nor a readable JSON Schema file"),
    ],
)
def test_bench_serve_refuses_bad_flags_in_one_line(argv, message, capsys):
    # refused before any connection: the URL has no server
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddtree: error: ") and message in err and err.count("\n") == 1, err


def test_response_format_is_json_object_or_a_schema_file_and_never_goes_with_ignore_eos(tmp_path):
    from ddtree.serving.loadgen import response_format_arg

    assert response_format_arg("json_object") == {"type": "json_object"}
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    (tmp_path / "person.json").write_text(json.dumps(schema))
    assert response_format_arg(str(tmp_path / "person.json")) == {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema},
    }
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(UsageError, match="holds a JSON list, not a JSON Schema object"):
        response_format_arg(str(tmp_path / "list.json"))
    with pytest.raises(UsageError, match="cannot go with ignore_eos"):  # before any connection
        asyncio.run(bench_serve("http://127.0.0.1:9", (1,), response_format={"type": "json_object"}))


def test_poisson_arrivals_with_a_shared_system_prompt_and_uniform_user_turns(server):
    url, engine = server
    count, rate, lengths = 40, 40.0, PromptLengths.parse("uniform:20:80")
    first = len(engine.prompts)
    (r,) = asyncio.run(
        bench_serve(
            url,
            max_tokens=4,
            chat=False,
            request_rates=[rate],
            num_requests=count,
            system_prompt_tokens=200,
            prompt_lengths=lengths,
            seed=3,
        )
    )
    assert set(r) == KEYS
    assert (r["arrival"], r["concurrency"], r["request_rate"], r["seed"]) == ("poisson", None, rate, 3)
    assert (r["system_prompt_tokens"], r["prompt_lengths"]) == (200, "uniform:20:80")
    assert r["requests"] == count and r["errors"] == 0 and r["output_tokens"] == 4 * count, r
    # the requests went out at the seeded schedule's rate, close to the one asked for
    scheduled = count / poisson_arrivals(rate, count, 3)[-1]
    assert r["achieved_request_rate"] == pytest.approx(scheduled, rel=0.1)
    assert r["achieved_request_rate"] == pytest.approx(rate, rel=0.25)

    _, *prompts = engine.prompts[first:]  # the first is the completion that measures tokens per word
    assert len(prompts) == count
    systems, users = zip(*(system_and_user(p) for p in prompts))
    assert all(s == systems[0] for s in systems), "every request has the same system prompt"
    assert len(systems[0]) == pytest.approx(200, rel=0.1)
    # once in the rows' caches, the shared system prompt is not prefilled again (8 rows: 8 first requests at most)
    assert r["prefix_cache_hit_tokens"] >= (count - engine.max_batch_size) * len(systems[0])
    user_tokens = [len(u) - 2 for u in users]  # less the "\n\n" after the system prompt
    drawn = turn_lengths(lengths, count, 3)
    assert drawn == turn_lengths(lengths, count, 3) != turn_lengths(lengths, count, 4)
    assert (
        min(drawn) >= 20 and max(drawn) <= 80 and statistics.stdev(drawn) == pytest.approx(60 / math.sqrt(12), rel=0.2)
    )
    # request k's turn has about drawn[k] tokens: a whole number of words, of 2 to 8 bytes each here
    assert all(abs(n - want) <= 0.2 * want + 5 for n, want in zip(user_tokens, drawn)), list(zip(user_tokens, drawn))
    assert statistics.mean(user_tokens) == pytest.approx(statistics.mean(drawn), rel=0.05)
    assert r["prompt_tokens_mean"] == pytest.approx(statistics.mean(len(p) for p in prompts), abs=0.05)
    assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["tpot_p50_ms"] <= r["tpot_p99_ms"]
    assert 0 < r["ttft_mean_s"] <= r["ttft_p99_s"] and r["tpot_mean_ms"] > 0


def test_closed_loop_chat_with_a_system_message_over_the_built_in_prompts(server):
    url, engine = server
    first = len(engine.prompts)
    results = asyncio.run(bench_serve(url, (1, 3), requests_per_client=2, max_tokens=3, system_prompt_tokens=60))
    assert [(r["arrival"], r["concurrency"], r["request_rate"]) for r in results] == [
        ("closed", 1, None),
        ("closed", 3, None),
    ]
    for r in results:
        assert set(r) == KEYS and r["achieved_request_rate"] is None and r["prompt_lengths"] is None
        assert r["errors"] == 0 and r["output_tokens"] == 3 * r["requests"], r
    _, *prompts = engine.prompts[first:]
    assert len(prompts) == 2 + 6
    system = ChatByteTokenizer(64).encode("<|system|>")
    systems, users = zip(*(system_and_user(p) for p in prompts))
    assert all(s == systems[0] for s in systems) and systems[0][: len(system)] == system
    assert len(systems[0]) - len(system) == pytest.approx(60, rel=0.15)
    # the user turns are the built-in prompts, as without --system-prompt-tokens
    expected = [ChatByteTokenizer(64).encode(f"<|user|>{BENCH_PROMPTS[k]}\n<|assistant|>") for k in range(6)]
    assert sorted(u[1:] for u in users[2:]) == sorted(expected)
    assert not math.isnan(results[-1]["prompt_tokens_mean"])


def test_the_command_line_runs_rate_levels_and_prints_a_json_line_each(server, capsys):
    url, engine = server
    argv = ["bench-serve", "--url", url, "--completions", "--max-tokens", "2", "--json", "--seed", "5"]
    workload = ["--system-prompt-tokens", "40", "--prompt-lengths", "fixed:16"]
    assert main([*argv, *workload, "--request-rate", "50,25", "--num-requests", "6"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["arrival"], r["request_rate"], r["requests"], r["errors"]) for r in lines] == [
        ("poisson", 25.0, 6, 0),
        ("poisson", 50.0, 6, 0),
    ]
    assert all(set(r) == KEYS and (r["seed"], r["prompt_lengths"]) == (5, "fixed:16") for r in lines)
    assert bench_line(lines[0]).startswith("rate=25/s (sent at ")
    # closed loop stays the default, its lines as before plus the new keys
    assert main([*argv, "--concurrency", "2", "--requests-per-client", "1"]) == 0
    (closed,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (closed["arrival"], closed["concurrency"], closed["requests"], closed["errors"]) == ("closed", 2, 2, 0)
    assert bench_line(closed).startswith("c=2   req=2 err=0 ")


def test_sizes_over_the_servers_context_are_refused_before_any_request(server):
    url, engine = server
    first = len(engine.prompts)
    with pytest.raises(UsageError, match="add up to 4100 tokens, over the server's max_model_len 4096"):
        asyncio.run(
            bench_serve(
                url, (1,), max_tokens=64, system_prompt_tokens=4000, prompt_lengths=PromptLengths.parse("fixed:36")
            )
        )
    assert len(engine.prompts) == first


def test_conversations_send_their_earlier_turns_and_replies_and_reuse_them(server):
    """--turns 2: each client's second request is its first prompt, the reply, and a new user turn; the
    server takes the first prompt from its caches instead of prefilling it again."""
    url, engine = server
    first = len(engine.prompts)
    (r,) = asyncio.run(bench_serve(url, (2,), requests_per_client=4, max_tokens=3, system_prompt_tokens=30, turns=2))
    assert set(r) == KEYS and r["turns"] == 2 and r["errors"] == 0 and r["requests"] == 8, r
    _, *prompts = engine.prompts[first:]
    openers = [p for p in prompts if not any(q is not p and p[: len(q)] == q for q in prompts)]
    followers = [p for p in prompts if p not in openers]
    assert len(openers) == len(followers) == 4
    for p in followers:  # a second turn holds the first: chat template, user turn, the reply, then more
        (opener,) = [q for q in openers if p[: len(q)] == q]
        assert len(p) > len(opener) + 3
    hits = r["prefix_cache_hit_tokens"]
    assert hits >= sum(max(len(q) for q in openers if p[: len(q)] == q) for p in followers)
