"""Prefix reuse: a prompt that starts like text an engine row's caches hold (a released request's, or the
committed text of a running or prefilling one) prefills only the rest, and generates what a fresh prefill
does. Rounds leave inactive rows' caches alone, so that a released row keeps its text."""

import copy
import threading

import pytest
import torch

from ddtree.models.random import ByteTokenizer
from ddtree.runtime.engine import Engine, SamplingParams, shared_prefix
from ddtree.serving.metrics import ServerMetrics, read_samples, total
from ddtree.serving.scheduler import Request, Scheduler
from ddtree.speculative.drafter import DrafterConfig, init_drafter
from test_deepseek_v3 import tiny_mla

G = torch.Generator().manual_seed(3)
SYSTEM = torch.randint(0, 60, (45,), generator=G).tolist()  # a shared start of several prompts
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


def cache_bytes(eng: Engine, row: int, n: int) -> torch.Tensor:
    """Slots [0, n) of row `row` in the target cache and every drafter layer's."""
    parts = [eng.target.slot_storage()[:, row, :, :n].flatten()]
    if eng.drafter is not None:
        for layer in eng.drafter.layers:
            parts += [
                layer.self_attn.kv_cache.k[row, :, :n].flatten(),
                layer.self_attn.kv_cache.v[row, :, :n].flatten(),
            ]
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
def test_a_released_row_keeps_its_text_through_other_rows_rounds_and_reuses_it(
    tiny_target, tiny_drafter, method, budget
):
    """Request A runs in row 0 and is released; row 1 then runs rounds over both rows (row 0 idle and
    inside them), which leave row 0's cached text as it was. Request B, sharing A's system prompt, goes
    into row 0 reusing those 45 tokens; request C, the next turn of A's conversation (A's prompt, its reply
    and a new message), reuses A's prompt and reply. Both generate what they generate alone."""
    eng = make(tiny_target, tiny_drafter, method, budget)
    prompt_a = SYSTEM + USER_A
    reused, got = start(eng, 0, prompt_a)
    assert reused == 0
    run(eng, {0: got}, 1)
    reply = got[:20]
    eng.release(0)
    held = eng.retained[0]
    assert held[: len(prompt_a)] == prompt_a and len(held) >= len(prompt_a)
    before = cache_bytes(eng, 0, len(held))
    _, other = start(eng, 1, OTHER)
    run(eng, {1: other}, 2)
    assert torch.equal(cache_bytes(eng, 0, len(held)), before)
    eng.release(1)

    reused, got_b = start(eng, 0, SYSTEM + USER_B)
    assert reused == len(SYSTEM)
    assert_caches_as_fresh(eng, 0, SYSTEM + USER_B)
    run(eng, {0: got_b}, 1)
    assert got_b[:20] == alone(tiny_target, tiny_drafter, method, budget, SYSTEM + USER_B)
    eng.release(0)

    turn = SYSTEM + USER_B + got_b[:20] + USER_A
    reused, got_c = start(eng, 0, turn)
    # the reply's tokens whose keys are in both caches (all but the last round's, for a drafter)
    assert len(SYSTEM + USER_B) < reused <= len(SYSTEM + USER_B) + 19
    assert_caches_as_fresh(eng, 0, turn)
    run(eng, {0: got_c}, 1)
    assert got_c[:20] == alone(tiny_target, tiny_drafter, method, budget, turn)
    assert reply == alone(tiny_target, tiny_drafter, method, budget, prompt_a)


@pytest.mark.parametrize("method,budget", METHODS)
def test_a_prefix_is_copied_from_a_running_row(tiny_target, tiny_drafter, method, budget):
    """B starts while A, with the same system prompt, is generating in another row: B's row gets the
    shared slots copied from A's, and both generate what they generate alone."""
    eng = make(tiny_target, tiny_drafter, method, budget)
    _, got_a = start(eng, 0, SYSTEM + USER_A)
    eng.step(1)
    got_a += eng.texts[0][len(SYSTEM + USER_A) + 1 :]
    reused, got_b = start(eng, 2, SYSTEM + USER_B)
    assert reused == len(SYSTEM)
    assert_caches_as_fresh(eng, 2, SYSTEM + USER_B)
    run(eng, {0: got_a, 2: got_b}, 3)
    assert got_a[:20] == alone(tiny_target, tiny_drafter, method, budget, SYSTEM + USER_A)
    assert got_b[:20] == alone(tiny_target, tiny_drafter, method, budget, SYSTEM + USER_B)


def test_mla_latents_are_copied_and_reused():
    """The same on the DeepSeek-V3 family's latent cache: a copied prefix generates what a fresh one does."""
    mla = tiny_mla()
    drafter = init_drafter(DrafterConfig.for_target(mla.config, num_layers=1, block_size=8), seed=0)
    eng = make(mla, drafter, "ddtree", 8, rows=2)
    _, got_a = start(eng, 0, SYSTEM + USER_A)
    reused, got_b = start(eng, 1, SYSTEM + USER_B)
    assert reused == len(SYSTEM)
    assert_caches_as_fresh(eng, 1, SYSTEM + USER_B)
    run(eng, {0: got_a, 1: got_b}, 2)
    assert got_b[:20] == alone(mla, drafter, "ddtree", 8, SYSTEM + USER_B)


def test_whole_prompt_held_still_prefills_its_last_token(tiny_target, tiny_drafter):
    """A prompt the caches hold whole reuses all but its last token, whose forward gives the first token;
    without reuse nothing is reused."""
    eng = make(tiny_target, tiny_drafter, "ddtree", 8)
    for row, prompt in ((0, OTHER), (1, SYSTEM), (2, USER_A)):
        start(eng, row, prompt)
    for row in (1, 0, 2):
        eng.release(row)
    assert eng.begin(2, SYSTEM, SP, reuse=False) == 0 and eng.retained[2] == []
    eng.release(2)
    reused, got = start(eng, 2, SYSTEM)
    assert reused == len(SYSTEM) - 1
    run(eng, {2: got}, 3)
    assert got[:20] == alone(tiny_target, tiny_drafter, "ddtree", 8, SYSTEM)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_scheduler_counts_reused_prompt_tokens(tiny_target, tiny_drafter, prefix_cache):
    """Two requests one after the other with the same 45-token system prompt: the second prefills only its
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


def test_shared_prefix_counts_the_leading_tokens_two_texts_share():
    rng = torch.Generator().manual_seed(0)
    for _ in range(300):
        a = torch.randint(0, 3, (int(torch.randint(0, 700, (), generator=rng)),), generator=rng).tolist()
        cut = int(torch.randint(0, len(a) + 1, (), generator=rng))
        b = a[:cut] + torch.randint(0, 3, (int(torch.randint(0, 300, (), generator=rng)),), generator=rng).tolist()
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert shared_prefix(a, b) == shared_prefix(b, a) == want


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
    assert len(done) == 12 and reused > 12 * 10
    for prompt, want, tokens in done:
        assert tokens[:want] == alone(
            tiny_target, tiny_drafter, method, budget, prompt, SamplingParams(max_new_tokens=want)
        )


def test_a_prefix_held_by_a_higher_row_is_copied_into_the_lowest_free_row(tiny_target, tiny_drafter):
    """Rounds run rows [0, highest running + 1): a lone request whose prompt start only row 2 holds goes into
    row 0 with that start copied, and its rounds run on one row, not three."""

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
