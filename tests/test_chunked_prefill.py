"""Chunked prefill: prompts go into the caches a chunk at a time, between the running rows' rounds, at a
few fixed shapes that `Engine.warm_up` runs once at start-up."""

import threading

import pytest
import torch

from ddtree.config import ConfigError, EngineConfig
from ddtree.runtime.engine import Engine, SamplingParams, prefill_sizes
from ddtree.serving.metrics import ServerMetrics
from ddtree.serving.scheduler import Request, Scheduler

LONG = torch.randint(0, 60, (70,), generator=torch.Generator().manual_seed(1)).tolist()
SHORT = [7, 8, 9]


def caches(models, row, n):
    """Keys and values of the first n cache slots of batch row `row`, every layer of every model."""
    return torch.cat(
        [torch.stack(layer.self_attn.kv_cache.row(row, n)).flatten() for model in models for layer in model.layers]
    )


def test_prefill_sizes_are_powers_of_two_up_to_the_chunk():
    assert prefill_sizes(64) == (16, 32, 64)
    assert prefill_sizes(512) == (16, 32, 64, 128, 256, 384, 512)
    for bad in (8, 48, 100):
        with pytest.raises(ValueError, match="power of two >= 16"):
            prefill_sizes(bad)
    with pytest.raises(ConfigError, match="serving.prefill_chunk must be a power of two >= 16, got 100"):
        EngineConfig.from_dict({"model": {"id": "x"}, "serving": {"prefill_chunk": 100}})


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("method,budget", [("ar", None), ("ddtree", 8)])
def test_chunked_prefill_equals_one_forward(tiny_target, tiny_drafter, method, budget, padded):
    """A 70-token prompt in chunks of 16 (or 64, its last chunk padded) leaves the target and drafter
    caches of one 70-token forward (add_many's), and generates the same tokens."""
    drafter = tiny_drafter if method != "ar" else None
    models = [tiny_target.model] + ([tiny_drafter] if drafter else [])
    sp = SamplingParams(max_new_tokens=16)

    def run(chunk, whole):
        eng = Engine(tiny_target, drafter, method, budget, max_batch_size=2, max_seq_len=128, prefill_chunk=chunk)
        eng.fixed_prefill_shapes = padded  # as on CUDA: chunks padded to the prefill sizes
        first = eng.add_many([1], [LONG], sp)[0] if whole else eng.add(1, LONG, sp)
        prefilled = caches(models, 1, len(LONG)).clone()
        out = [first]
        while len(out) < 16:
            out += eng.step(2)[1]
        return prefilled, out[:16]

    want_cache, want = run(512, whole=True)
    got_cache, got = run(64 if padded else 16, whole=False)
    torch.testing.assert_close(got_cache, want_cache, atol=1e-5, rtol=1e-5)
    assert got == want


@pytest.mark.parametrize("method,budget", [("ar", None), ("dflash", None), ("ddtree", 8)])
@pytest.mark.parametrize("prefilling_row", [0, 1])
def test_prefill_between_rounds_leaves_running_rows_and_itself_as_alone(
    tiny_target, tiny_drafter, method, budget, prefilling_row
):
    """A row being prefilled takes part in the other row's rounds as an inactive row (below or above it):
    the running request emits what it emits alone, and so does the prefilled one once it starts."""
    drafter = tiny_drafter if method != "ar" else None
    sp = SamplingParams(max_new_tokens=24)

    def alone(prompt):
        eng = Engine(tiny_target, drafter, method, budget, max_batch_size=1, max_seq_len=128)
        return eng.generate([prompt], sp)[0].token_ids

    eng = Engine(tiny_target, drafter, method, budget, max_batch_size=2, max_seq_len=128, prefill_chunk=16)
    eng.fixed_prefill_shapes = prefilling_row == 0  # padded chunks (as on CUDA) in half the cases
    running = 1 - prefilling_row
    got = {running: [eng.add(running, SHORT, sp)], prefilling_row: []}
    eng.begin(prefilling_row, LONG, sp)
    chunks = 0
    while True:
        first = eng.prefill(prefilling_row, 16)
        chunks += 1
        if first is not None:
            got[prefilling_row].append(first)
            break
        got[running] += eng.step(2)[running]  # a round on both rows while the prompt goes in
    assert chunks == 5 and len(got[running]) >= 5
    while min(len(t) for t in got.values()) < 24:
        for row, toks in enumerate(eng.step(2)):
            got[row] += toks
    assert got[running][:24] == alone(SHORT)
    assert got[prefilling_row][:24] == alone(LONG)


class Recording(Engine):
    """Records the (batch rows, chunk size, attention span) of every prefill forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shapes: set[tuple[int, int, int]] = set()

    def _prefill_forward(self, part, size, rows, span):
        self.shapes.add((rows, size, span))
        return super()._prefill_forward(part, size, rows, span)


def test_warm_up_runs_every_prefill_shape_a_request_meets(tiny_target, tiny_drafter):
    """Prompts of every length, prefilled with any per-call budget, meet only (rows, chunk size, attention
    span) shapes that warm_up ran; warm_up leaves no row in use."""
    eng = Recording(tiny_target, tiny_drafter, "ddtree", 8, max_batch_size=1, max_seq_len=600, prefill_chunk=64)
    eng.fixed_prefill_shapes = True  # as on CUDA
    eng.warm_up()
    warmed, eng.shapes = eng.shapes, set()
    assert eng.host_active == [False] and eng.host_lengths == [0] and not eng.prefills
    g = torch.Generator().manual_seed(0)
    for length in list(range(1, 600, 37)) + [599]:
        prompt = torch.randint(0, 60, (length,), generator=g).tolist()
        eng.begin(0, prompt, SamplingParams(max_new_tokens=1))
        budget = int(torch.randint(1, 100, (), generator=g))
        while eng.prefill(0, budget) is None:
            pass
    assert eng.shapes and eng.shapes <= warmed, sorted(eng.shapes - warmed)
    assert {size for _, size, _ in warmed} == {16, 32, 64}


def test_warm_up_runs_every_shape_of_prefills_shared_by_rows(tiny_target):
    """Several rows' chunks in one forward meet only shapes warm_up ran: rows padded to a power of two, and
    never more than the largest chunk's tokens in one forward."""
    eng = Recording(tiny_target, None, "ar", max_batch_size=6, max_seq_len=300, prefill_chunk=64)
    eng.fixed_prefill_shapes = True  # as on CUDA
    eng.warm_up()
    warmed, eng.shapes = eng.shapes, set()
    assert {(rows, size) for rows, size, _ in warmed} == {(1, 16), (2, 16), (4, 16), (1, 32), (2, 32), (1, 64)}
    g = torch.Generator().manual_seed(3)
    sp = SamplingParams(max_new_tokens=1)
    for _ in range(12):
        for row in range(6):
            length = int(torch.randint(1, 300, (), generator=g))
            eng.begin(row, torch.randint(0, 60, (length,), generator=g).tolist(), sp)
        while eng.prefills:  # the scheduler's way: up to one chunk of tokens per call, oldest row first
            budget, takes = 64, []
            for row, job in eng.prefills.items():
                take = min(len(job.prompt) - job.done, budget, int(torch.randint(1, 64, (), generator=g)))
                if take > 0:
                    takes.append((row, take))
                    budget -= take
            eng.prefill_many(takes)
    assert eng.shapes and eng.shapes <= warmed, sorted(eng.shapes - warmed)
    assert {rows for rows, _, _ in eng.shapes} >= {1, 2, 4}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("method,budget", [("ar", None), ("ddtree", 8)])
def test_prefill_many_leaves_each_row_as_alone(tiny_target, tiny_drafter, method, budget, padded):
    """Chunks of three rows at different positions in shared forwards (on CUDA's fixed shapes: padded to a
    prefill size, rows padded to a power of two by copies that write nowhere) leave each row's target and
    drafter caches as one forward of its prompt does, and each row then generates what it does alone."""
    drafter = tiny_drafter if method != "ar" else None
    models = [tiny_target.model] + ([tiny_drafter] if drafter else [])
    sp = SamplingParams(max_new_tokens=12)
    prompts = {0: LONG, 1: SHORT, 2: LONG[5:45]}

    def alone(prompt):
        eng = Engine(tiny_target, drafter, method, budget, max_batch_size=1, max_seq_len=128)
        first = eng.add_many([0], [prompt], sp)[0]
        cache = caches(models, 0, len(prompt)).clone()
        out = [first]
        while len(out) < 12:
            out += eng.step(1)[0]
        return cache, out[:12]

    eng = Engine(tiny_target, drafter, method, budget, max_batch_size=3, max_seq_len=128, prefill_chunk=64)
    eng.fixed_prefill_shapes = padded
    for row, prompt in prompts.items():
        eng.begin(row, prompt, sp)
    got: dict[int, list[int]] = {}
    # three chunks of one padded size (four rows on CUDA), then two of different sizes at other positions
    for takes in ([(0, 16), (1, 3), (2, 10)], [(0, 54), (2, 30)]):
        for (row, _), first in zip(takes, eng.prefill_many(takes)):
            if first is not None:
                got[row] = [first]
    assert sorted(got) == [0, 1, 2] and not eng.prefills
    cache = {row: caches(models, row, len(prompt)).clone() for row, prompt in prompts.items()}
    while min(len(t) for t in got.values()) < 12:
        for row, toks in enumerate(eng.step(3)):
            got[row] += toks
    for row, prompt in prompts.items():
        want_cache, want = alone(prompt)
        torch.testing.assert_close(cache[row], want_cache, atol=1e-5, rtol=1e-5)
        assert got[row][:12] == want, row


class Timeline(Engine):
    """Records the order of prefill chunks and rounds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, int]] = []

    def _prefill_forward(self, part, size, rows, span):
        self.events.append(("prefill", len(part)))
        return super()._prefill_forward(part, size, rows, span)

    def step(self, n):
        self.events.append(("round", n))
        return super().step(n)


def test_scheduler_runs_rounds_between_the_chunks_of_a_long_prompt(tiny_target, tiny_drafter):
    """While a 200-token prompt is admitted in chunks of 16, the running request gets a round after every
    chunk (never more than prefill_chunk prompt tokens between two rounds), and both requests produce what
    they produce alone."""
    from ddtree.models.random import ByteTokenizer

    long_prompt = torch.randint(0, 60, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    sp = SamplingParams(max_new_tokens=60)
    eng = Timeline(tiny_target, tiny_drafter, "ddtree", 8, max_batch_size=2, max_seq_len=300, prefill_chunk=16)
    sched = Scheduler(eng, ByteTokenizer(64), ServerMetrics("test"), max_waiting=2)
    sched.start()
    done = [threading.Event(), threading.Event()]
    started = threading.Event()
    reqs = []

    def sink(i):
        def put(ev):
            started.set()
            if ev.finish_reason or ev.error:
                done[i].set()

        return put

    try:
        reqs.append(Request(SHORT, sp, None, sink(0)))
        sched.submit(reqs[0])
        assert started.wait(10)
        reqs.append(Request(long_prompt, SamplingParams(max_new_tokens=4), None, sink(1)))
        sched.submit(reqs[1])
        assert done[0].wait(30) and done[1].wait(30)
    finally:
        sched.stop()
    chunks = [i for i, (kind, _) in enumerate(eng.events) if kind == "prefill"][1:]  # the long prompt's
    assert len(chunks) == 13
    between = [eng.events[a + 1 : b] for a, b in zip(chunks, chunks[1:])]
    assert all([kind for kind, _ in gap] == ["round"] for gap in between), between
    alone = Engine(tiny_target, tiny_drafter, "ddtree", 8, max_batch_size=1, max_seq_len=300)
    assert reqs[0].token_ids == alone.generate([SHORT], sp)[0].token_ids
    assert reqs[1].token_ids == alone.generate([long_prompt], SamplingParams(max_new_tokens=4))[0].token_ids


def test_a_request_being_admitted_when_the_engine_fails_gets_an_error(tiny_target):
    """An engine that fails while a request goes into its row (not a refusal of the request: that is a
    ValueError and a 400) stops the engine thread; the request it was admitting is answered 503 too."""
    from ddtree.models.random import ByteTokenizer

    class Failing(Engine):
        def begin(self, row, prompt, params, reuse=False):
            raise RuntimeError("device lost")

    eng = Failing(tiny_target, None, "ar", max_batch_size=1, max_seq_len=64)
    sched = Scheduler(eng, ByteTokenizer(64), ServerMetrics("test"), max_waiting=1)
    events = []
    done = threading.Event()
    sched.start()
    try:
        sched.submit(Request(SHORT, SamplingParams(max_new_tokens=4), None, lambda ev: (events.append(ev), done.set())))
        assert done.wait(10)
    finally:
        sched.stop()
    assert events[-1].error_status == 503 and "device lost" in events[-1].error


def test_scheduler_prefills_the_requests_it_admits_together_in_one_forward(tiny_target, tiny_drafter):
    """Requests admitted in one iteration go into the caches in one prefill forward (their prompt tokens
    within prefill_chunk), and each produces what it produces alone."""
    from ddtree.models.random import ByteTokenizer

    prompts = [SHORT, LONG[:40], LONG[10:60]]
    sp = SamplingParams(max_new_tokens=10)
    eng = Timeline(tiny_target, tiny_drafter, "ddtree", 8, max_batch_size=3, max_seq_len=128, prefill_chunk=128)
    sched = Scheduler(eng, ByteTokenizer(64), ServerMetrics("test"), max_waiting=3)
    done = [threading.Event() for _ in prompts]
    reqs = [
        Request(p, sp, None, lambda ev, d=d: (ev.finish_reason or ev.error) and d.set()) for p, d in zip(prompts, done)
    ]
    sched.start()
    try:
        with sched._cv:  # the engine thread waits for this lock: its first iteration admits all three
            for req in reqs:
                sched.submit(req)
        assert all(d.wait(30) for d in done)
    finally:
        sched.stop()
    assert eng.events[0] == ("prefill", 3) and [kind for kind, _ in eng.events].count("prefill") == 1
    alone = Engine(tiny_target, tiny_drafter, "ddtree", 8, max_batch_size=1, max_seq_len=128)
    for req, prompt in zip(reqs, prompts):
        assert req.token_ids == alone.generate([prompt], sp)[0].token_ids
