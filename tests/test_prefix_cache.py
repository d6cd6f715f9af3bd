"""Prefix reuse through the KV cache's pages: a prompt that starts with whole pages the page index holds (a
running request's prompt, a finished request's prompt and reply) maps them into its row and prefills only
the rest, and generates what a fresh prefill does. Rounds leave pages no active row holds alone."""

import copy
import threading

import pytest
import torch

from ddtree.models.random import ByteTokenizer
from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.runtime.pages import PAGE_SIZE
from ddtree.serving.metrics import ServerMetrics, read_samples, total
from ddtree.serving.scheduler import Request, Scheduler
from ddtree.speculative.drafter import DrafterConfig, init_drafter
from test_deepseek_v3 import tiny_mla

G = torch.Generator().manual_seed(3)
SYSTEM = torch.randint(0, 60, (3 * PAGE_SIZE,), generator=G).tolist()  # a shared start of several prompts
USER_A = torch.randint(0, 60, (9,), generator=G).tolist()
USER_B = torch.randint(0, 60, (13,), generator=G).tolist()
OTHER = torch.randint(0, 60, (20,), generator=G).tolist()
SP = SamplingParams(max_new_tokens=20)
METHODS = [("ar", None), ("dflash", None), ("ddtree", 8)]


def make(target, drafter, method, budget, rows=3, **kw) -> Engine:
    return Engine(
        target, drafter if method != "ar" else None, method, budget, max_batch_size=rows, max_seq_len=160, **kw
    )


def alone(target, drafter, method, budget, prompt, sp=SP) -> list[int]:
    """The prompt's tokens from an engine of its own (on copies: an engine sets up its models' caches)."""
    eng = make(copy.deepcopy(target), copy.deepcopy(drafter), method, budget, rows=1)
    return eng.generate([prompt], sp)[0].token_ids


def start(eng: Engine, row: int, prompt: list[int], reuse: bool = True) -> tuple[int, list[int]]:
    """begin + prefill (whole); returns (tokens reused, [first token])."""
    reused = eng.begin(row, prompt, SP, reuse=reuse)
    first = eng.prefill(row, len(prompt))
    assert first is not None
    return reused, [first]


def run(eng: Engine, tokens: dict[int, list[int]], n: int, until: int = 20) -> None:
    """Rounds on rows [0, n) until every row in `tokens` has `until` tokens."""
    while min(len(t) for t in tokens.values()) < until:
        for row, emitted in enumerate(eng.step(n)):
            if row in tokens:
                tokens[row] += emitted


def serve_all(sched: Scheduler, prompts: list[list[int]], sp: SamplingParams = SP) -> list[tuple[Request, list]]:
    """Submit every prompt to a started scheduler at once, wait for all to end, stop it; returns each
    request with the events its sink got."""
    served, waits = [], []
    try:
        for prompt in prompts:
            done, events = threading.Event(), []
            req = Request(prompt, sp, None, lambda ev: None)
            req.sink = lambda ev, d=done, got=events: (got.append(ev), (ev.finish_reason or ev.error) and d.set())
            served.append((req, events))
            waits.append(done)
            sched.submit(req)
        assert all(done.wait(60) for done in waits)
    finally:
        sched.stop()
    return served


def cache_bytes(eng: Engine, row: int, n: int) -> torch.Tensor:
    """Logical slots [0, n) of row `row` in the target cache and every drafter layer's."""
    parts = [eng.target.slot_storage()[:, :, eng.target.slot_map[row, :n]].flatten()]
    if eng.drafter is not None:
        for layer in eng.drafter.layers:
            parts += [t.flatten() for t in layer.self_attn.kv_cache.row(row, n)]
    return torch.cat(parts).clone()


def assert_caches_as_fresh(eng: Engine, row: int, prompt: list[int]) -> None:
    """Row `row`'s target and drafter caches hold, for the whole prompt, what one prefill of it writes."""
    fresh = Engine(
        copy.deepcopy(eng.target), copy.deepcopy(eng.drafter), eng.method, eng.budget, max_batch_size=1, max_seq_len=160
    )
    start(fresh, 0, prompt, reuse=False)
    # keys written by decode rounds differ from a prefill's in the last bits (other GEMM shapes)
    torch.testing.assert_close(
        cache_bytes(eng, row, len(prompt)), cache_bytes(fresh, 0, len(prompt)), atol=1e-4, rtol=1e-3
    )


@pytest.mark.parametrize("method,budget", METHODS)
def test_a_released_requests_pages_survive_other_rows_rounds_and_are_reused(tiny_target, tiny_drafter, method, budget):
    """Request A runs in row 0 and is released; its full pages stay indexed. Row 1 then runs rounds over
    both rows (row 0 idle and inside them), which leave A's pages as they were. Request B, sharing A's
    system prompt, goes into row 0 reusing its 3 pages; request C, the next turn of B's conversation (B's
    prompt, its reply and a new message), reuses B's prompt and reply. Both generate what they generate
    alone."""
    eng = make(tiny_target, tiny_drafter, method, budget)
    prompt_a = SYSTEM + USER_A
    reused, got = start(eng, 0, prompt_a)
    assert reused == 0
    run(eng, {0: got}, 1)
    reply = got[:20]
    pages, held = list(eng.row_pages[0]), eng.cached_text(0)
    eng.release(0)
    indexed = eng.page_pool.match(held)
    assert held[: len(prompt_a)] == prompt_a and indexed == pages[: len(held) // PAGE_SIZE]
    storage = eng.target.slot_storage()
    slots = torch.tensor([p * PAGE_SIZE + i for p in indexed for i in range(PAGE_SIZE)])
    before = storage[:, :, slots].clone()
    _, other = start(eng, 1, OTHER)
    run(eng, {1: other}, 2)
    assert torch.equal(storage[:, :, slots], before)
    eng.release(1)

    reused, got_b = start(eng, 0, SYSTEM + USER_B)
    assert reused == len(SYSTEM) and eng.row_pages[0][:3] == pages[:3]
    assert_caches_as_fresh(eng, 0, SYSTEM + USER_B)
    run(eng, {0: got_b}, 1)
    assert got_b[:20] == alone(tiny_target, tiny_drafter, method, budget, SYSTEM + USER_B)
    eng.release(0)

    turn = SYSTEM + USER_B + got_b[:20] + USER_A
    reused, got_c = start(eng, 0, turn)
    # whole pages of the reply's tokens whose keys are in both caches (all but the last round's, for a drafter)
    assert len(SYSTEM + USER_B) < reused <= len(SYSTEM + USER_B) + 19 and reused % PAGE_SIZE == 0
    assert_caches_as_fresh(eng, 0, turn)
    run(eng, {0: got_c}, 1)
    assert got_c[:20] == alone(tiny_target, tiny_drafter, method, budget, turn)
    assert reply == alone(tiny_target, tiny_drafter, method, budget, prompt_a)


@pytest.mark.parametrize("method,budget", METHODS)
def test_a_running_requests_prompt_pages_are_shared(tiny_target, tiny_drafter, method, budget):
    """B starts while A, with the same system prompt, is generating in another row: B's row maps A's
    prompt pages (held by both, stored once), and both generate what they generate alone."""
    eng = make(tiny_target, tiny_drafter, method, budget)
    _, got_a = start(eng, 0, SYSTEM + USER_A)
    eng.step(1)
    got_a += eng.texts[0][len(SYSTEM + USER_A) + 1 :]
    used = eng.page_pool.used
    reused, got_b = start(eng, 2, SYSTEM + USER_B)
    assert reused == len(SYSTEM) and eng.row_pages[2][:3] == eng.row_pages[0][:3]
    assert eng.page_pool.used == used + eng.start_pages(SYSTEM + USER_B) - 3
    assert all(eng.page_pool.refs[p] == 2 for p in eng.row_pages[0][:3])
    assert_caches_as_fresh(eng, 2, SYSTEM + USER_B)
    run(eng, {0: got_a, 2: got_b}, 3)
    assert got_a[:20] == alone(tiny_target, tiny_drafter, method, budget, SYSTEM + USER_A)
    assert got_b[:20] == alone(tiny_target, tiny_drafter, method, budget, SYSTEM + USER_B)


def test_mla_latent_pages_are_shared():
    """The same on the DeepSeek-V3 family's latent cache: a shared prefix generates what a fresh one does."""
    mla = tiny_mla()
    drafter = init_drafter(DrafterConfig.for_target(mla.config, num_layers=1, block_size=8), seed=0)
    eng = make(mla, drafter, "ddtree", 8, rows=2)
    _, got_a = start(eng, 0, SYSTEM + USER_A)
    reused, got_b = start(eng, 1, SYSTEM + USER_B)
    assert reused == len(SYSTEM)
    assert_caches_as_fresh(eng, 1, SYSTEM + USER_B)
    run(eng, {0: got_a, 1: got_b}, 2)
    assert got_b[:20] == alone(mla, drafter, "ddtree", 8, SYSTEM + USER_B)


def test_a_whole_prompt_held_still_prefills_its_last_page(tiny_target, tiny_drafter):
    """A prompt the index holds whole reuses its pages short of the one with its last token, whose forward
    gives the first token; without reuse nothing is reused."""
    eng = make(tiny_target, tiny_drafter, "ddtree", 8)
    for row, prompt in ((0, OTHER), (1, SYSTEM), (2, USER_A)):
        start(eng, row, prompt)
    for row in (1, 0, 2):
        eng.release(row)
    assert eng.begin(2, SYSTEM, SP, reuse=False) == 0
    eng.release(2)
    reused, got = start(eng, 2, SYSTEM)
    assert reused == len(SYSTEM) - PAGE_SIZE
    run(eng, {2: got}, 3)
    assert got[:20] == alone(tiny_target, tiny_drafter, "ddtree", 8, SYSTEM)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_scheduler_counts_reused_prompt_tokens(tiny_target, tiny_drafter, prefix_cache):
    """Two requests one after the other with the same 48-token system prompt: the second prefills only its
    own part (ddtree_prefix_cache_hit_tokens), and both return what they return alone."""
    eng = make(tiny_target, tiny_drafter, "ddtree", 8, rows=2)
    metrics = ServerMetrics("test")
    sched = Scheduler(eng, ByteTokenizer(64), metrics, max_waiting=2, prefix_cache=prefix_cache)
    sched.start()
    reqs = []
    try:
        for user in (USER_A, USER_B):
            done = threading.Event()
            reqs.append(Request(SYSTEM + user, SP, None, lambda ev, d=done: (ev.finish_reason or ev.error) and d.set()))
            sched.submit(reqs[-1])
            assert done.wait(30)
    finally:
        sched.stop()
    samples = read_samples(metrics.render()[0].decode())
    assert total(samples, "ddtree_prefix_cache_hit_tokens_total") == (len(SYSTEM) if prefix_cache else 0)
    for req, user in zip(reqs, (USER_A, USER_B)):
        assert req.token_ids == alone(tiny_target, tiny_drafter, "ddtree", 8, SYSTEM + user)


@pytest.mark.parametrize("method,budget", METHODS)
def test_random_admissions_with_reuse_generate_what_each_prompt_generates_alone(
    tiny_target, tiny_drafter, method, budget
):
    """Twelve requests in three rows, admitted as rows free up, prefilled in chunks of 16 between rounds;
    their prompts share starts (a system prompt, earlier prompts, earlier prompts and their replies) and are
    reused from their own row, another released row or a running one. Each generates what it does alone."""
    rng = torch.Generator().manual_seed(7)

    def rand(n):
        return torch.randint(0, 60, (n,), generator=rng).tolist()

    eng = make(tiny_target, tiny_drafter, method, budget, prefill_chunk=16)
    done: list[tuple[list[int], int, list[int]]] = []  # (prompt, max new tokens, tokens)
    rows: dict[int, tuple[list[int], int, list[int]]] = {}
    reused = 0

    def round_and_release() -> None:
        """One round over every row; rows whose request has all its tokens are released."""
        for row, emitted in enumerate(eng.step(eng.max_batch_size)):
            if row in rows and emitted:
                rows[row][2].extend(emitted)
        for row in [r for r, (_, n, toks) in rows.items() if len(toks) >= n]:
            done.append(rows.pop(row))
            eng.release(row)

    for _ in range(12):
        choice = int(torch.randint(0, 3, (), generator=rng))
        if choice == 0 or not done:
            prompt = SYSTEM + rand(int(torch.randint(1, 20, (), generator=rng)))
        elif choice == 1:
            prompt = done[-1][0][: int(torch.randint(1, len(done[-1][0]) + 1, (), generator=rng))] + rand(5)
        else:
            prev = done[int(torch.randint(0, len(done), (), generator=rng))]
            prompt = prev[0] + prev[2] + rand(3)
        want = int(torch.randint(4, 17, (), generator=rng))
        while len(rows) == eng.max_batch_size or (rows and int(torch.randint(0, 2, (), generator=rng))):
            round_and_release()
        row = min(r for r in range(eng.max_batch_size) if r not in rows)  # the scheduler's choice
        reused += eng.begin(row, prompt, SamplingParams(max_new_tokens=want), reuse=True)
        while (first := eng.prefill(row, 16)) is None:
            for r, emitted in enumerate(eng.step(eng.max_batch_size)):
                if r in rows and emitted:
                    rows[r][2].extend(emitted)
        rows[row] = (prompt, want, [first])
    while rows:
        round_and_release()
    assert len(done) == 12 and reused >= 12 * PAGE_SIZE
    for prompt, want, tokens in done:
        assert tokens[:want] == alone(
            tiny_target, tiny_drafter, method, budget, prompt, SamplingParams(max_new_tokens=want)
        )


def test_a_prefix_last_held_by_a_higher_row_is_reused_in_the_lowest_free_row(tiny_target, tiny_drafter):
    """Rounds run rows [0, highest running + 1): a lone request whose prompt start only row 2 held goes into
    row 0 with those pages, and its rounds run on one row, not three."""

    class Rounds(Engine):
        def step(self, n, budget=None):
            self.sizes.append(n)
            return super().step(n, budget)

    eng = Rounds(tiny_target, tiny_drafter, "ddtree", 8, max_batch_size=3, max_seq_len=160)
    eng.sizes = []
    for row, prompt in ((0, OTHER), (1, USER_A), (2, SYSTEM + USER_A)):
        start(eng, row, prompt)
        eng.release(row)
    metrics = ServerMetrics("test")
    sched = Scheduler(eng, ByteTokenizer(64), metrics, max_waiting=2)
    req, done = None, threading.Event()
    sched.start()
    try:
        req = Request(SYSTEM + USER_B, SP, None, lambda ev: (ev.finish_reason or ev.error) and done.set())
        sched.submit(req)
        assert done.wait(30)
    finally:
        sched.stop()
    assert total(read_samples(metrics.render()[0].decode()), "ddtree_prefix_cache_hit_tokens_total") == len(SYSTEM)
    assert eng.sizes and set(eng.sizes) == {1}
    assert req.token_ids == alone(tiny_target, tiny_drafter, "ddtree", 8, SYSTEM + USER_B)


def test_a_small_pool_admits_by_pages_shares_prefixes_and_refuses_what_never_fits(tiny_target, tiny_drafter):
    """A pool of 10 pages under three rows: requests of up to 6 pages that share a 3-page system prompt are
    admitted with the pages of their prompt and first round and take more as they grow; the others wait for
    pages rather than rows, and finished requests' pages are evicted for new ones. All five return what they
    return alone, and a request within the context but larger than the whole pool gets a 400 without
    disturbing them."""
    eng = make(tiny_target, tiny_drafter, "ddtree", 8, kv_cache_tokens=10 * PAGE_SIZE)
    huge_prompt = (SYSTEM * 3)[:135]
    assert eng.page_pool.pages == 10 and eng.request_pages(SYSTEM + USER_B, SP) == 6
    assert eng.request_pages(huge_prompt, SP) > 10 and len(huge_prompt) + SP.max_new_tokens <= eng.max_seq_len
    metrics = ServerMetrics("test")
    sched = Scheduler(eng, ByteTokenizer(64), metrics, max_waiting=8)
    prompts = [SYSTEM + u for u in (USER_A, USER_B, OTHER[:11], OTHER[5:15], USER_A[:4])]
    peak, ratios = [0], []
    step = eng.step

    def gauges() -> tuple[float, float, float]:
        samples = read_samples(metrics.render()[0].decode())
        names = ("ddtree_kv_cache_usage_ratio", "ddtree_kv_pages_used", "ddtree_kv_pages_total")
        return tuple(total(samples, name) for name in names)

    def watched(n, budget=None):
        peak[0] = max(peak[0], eng.page_pool.used)
        ratios.append(gauges())  # as the scheduler's last iteration left them
        return step(n, budget)

    eng.step = watched
    sched.start()
    served = serve_all(sched, prompts[:2] + [huge_prompt] + prompts[2:])
    reqs = [req for req, _ in served]
    huge = reqs.pop(2)
    errors = [(r, events[-1]) for r, events in served if events[-1].error]
    assert [r for r, _ in errors] == [huge] and errors[0][1].error_status == 400
    assert "more than the whole KV cache (160 tokens)" in errors[0][1].error
    assert 9 <= peak[0] <= 10  # the pool used to its end, never past it
    assert all(ratio == used / 10 and pool == 10 for ratio, used, pool in ratios)
    assert max(used for _, used, _ in ratios) >= 9 and gauges() == (0, 0, 10)
    hits = total(read_samples(metrics.render()[0].decode()), "ddtree_prefix_cache_hit_tokens_total")
    assert hits == 4 * len(SYSTEM)  # every request after the first shares the system prompt's pages
    for req, prompt in zip(reqs, prompts):
        assert req.token_ids == alone(tiny_target, tiny_drafter, "ddtree", 8, prompt)


@pytest.mark.parametrize("method,budget", METHODS)
def test_requests_that_outgrow_the_pool_are_preempted_and_resume_where_they_were(
    tiny_target, tiny_drafter, method, budget
):
    """Three requests of 40 new tokens over 7 pages: each is admitted with the pages of its prompt and first
    round and takes more as its text grows, until the pool runs out; then the request admitted last gives
    its row and pages back, waits at the head of the queue and resumes from its prompt and the tokens it
    had. Each streams exactly what it generates alone, every token once."""
    sp = SamplingParams(max_new_tokens=40)
    eng = make(tiny_target, tiny_drafter, method, budget, kv_cache_tokens=7 * PAGE_SIZE)
    prompts = [OTHER, USER_B, USER_A]
    assert all(eng.request_pages(p, sp) <= 7 for p in prompts) and sum(eng.request_pages(p, sp) for p in prompts) > 7
    tokenizer = ByteTokenizer(64)
    metrics = ServerMetrics("test")
    sched = Scheduler(eng, tokenizer, metrics, max_waiting=8)
    sched.start()
    served = serve_all(sched, prompts, sp)
    samples = read_samples(metrics.render()[0].decode())
    assert total(samples, "ddtree_preemptions_total") >= 1
    assert total(samples, "ddtree_kv_pages_used") == 0
    for (req, events), prompt in zip(served, prompts):
        assert [ev.error for ev in events] == [None] * len(events) and events[-1].finish_reason == "length"
        counts = [ev.completion_tokens for ev in events]
        assert counts == sorted(counts) and counts[-1] == 40
        assert "".join(ev.text for ev in events) == tokenizer.decode(req.token_ids)
        assert req.token_ids == alone(tiny_target, tiny_drafter, method, budget, prompt, sp)


@pytest.mark.parametrize("method,budget", METHODS)
def test_a_row_takes_pages_as_its_text_grows(tiny_target, tiny_drafter, method, budget):
    """Admission takes the pages of the prompt and one round past it; before each round the row takes the
    pages its text has grown into, and what it generates is what an engine with every page up front does."""
    eng = make(tiny_target, tiny_drafter, method, budget)
    prompt = OTHER + USER_A  # 29 tokens
    _, got = start(eng, 0, prompt, reuse=False)
    assert len(eng.row_pages[0]) == eng.start_pages(prompt) == -(-(len(prompt) + eng.room) // PAGE_SIZE)
    held = [len(eng.row_pages[0])]
    while len(got) < SP.max_new_tokens:
        length = eng.host_lengths[0]
        got += eng.step(1)[0]
        held.append(len(eng.row_pages[0]))
        assert held[-1] == -(-(length + eng.room) // PAGE_SIZE)  # what this round could fill, no more
    assert held[-1] > held[0] and eng.page_pool.used == held[-1]
    assert got[: SP.max_new_tokens] == alone(tiny_target, tiny_drafter, method, budget, prompt)
