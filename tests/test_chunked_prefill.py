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


def test_warm_up_runs_every_prefill_shape_a_request_meets(tiny_target, tiny_drafter):
    """Prompts of every length, prefilled with any per-call budget, meet only (chunk size, attention span)
    shapes that warm_up ran; warm_up leaves no row in use."""

    class Recording(Engine):
        def _prefill_chunk(self, row, chunk, start):
            self.shapes.add((self._padded(len(chunk)), self.prefill_span(start, self._padded(len(chunk)))))
            return super()._prefill_chunk(row, chunk, start)

    eng = Recording(tiny_target, tiny_drafter, "ddtree", 8, max_batch_size=1, max_seq_len=600, prefill_chunk=64)
    eng.fixed_prefill_shapes = True  # as on CUDA
    eng.shapes = set()
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
    assert {size for size, _ in warmed} == {16, 32, 64}


class Timeline(Engine):
    """Records the order of prefill chunks and rounds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, int]] = []

    def _prefill_chunk(self, row, chunk, start):
        self.events.append(("prefill", len(chunk)))
        return super()._prefill_chunk(row, chunk, start)

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
