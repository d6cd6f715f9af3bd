"""The shared round: tree attention, walk, KV compaction, termination, and greedy losslessness."""

import pytest
import torch

from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.speculative.drafter import DrafterConfig, init_drafter
from ddtree.speculative.tree import build_ddtree
from ddtree.speculative.verify import tree_mask, walk

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def causal(n):
    j = torch.arange(n)
    return (j[:, None] >= j[None, :])[None, None]


def test_tree_mask_and_depth_positions_equal_causal_paths(tiny_target):
    """Every node's logits equal those of its ancestor path run as a plain causal sequence."""
    m, vocab = tiny_target, tiny_target.config.vocab_size
    prefix = torch.randint(0, vocab, (1, 9))
    g = torch.Generator().manual_seed(0)
    tree = build_ddtree(torch.tensor([4]), torch.randn(1, 5, vocab, generator=g), 24)
    m.setup_caches(max_batch=1, max_slots=64)
    L = prefix.shape[1]
    j = torch.arange(L)
    with torch.no_grad():
        m(prefix, j[None], j[None], causal(L))
        n = tree.size
        logits, _ = m(
            tree.tokens, L + tree.depth, L + torch.arange(n)[None], tree_mask(torch.tensor([L]), tree.visible, L + n)
        )
        for i in range(n):
            path, k = [], i
            while k >= 0:
                path.append(tree.tokens[0, k].item())
                k = tree.parents[0, k].item()
            seq = torch.cat([prefix, torch.tensor([path[::-1]])], dim=1)
            m.setup_caches(max_batch=1, max_slots=64)
            t = seq.shape[1]
            ref, _ = m(seq, torch.arange(t)[None], torch.arange(t)[None], causal(t))
            torch.testing.assert_close(logits[0, i], ref[0, -1], atol=1e-4, rtol=1e-4)


def test_walk_follows_target_decisions():
    # root 0 -> {1: tok 5, 2: tok 6}; 1 -> {3: tok 7}; 3 -> {4: tok 8}
    from ddtree.speculative.tree import Tree, ancestor_mask

    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    tree = Tree(
        torch.tensor([[9, 5, 6, 7, 8]]),
        parents,
        torch.tensor([[0, 1, 1, 2, 3]]),
        torch.ones(1, 5, dtype=torch.bool),
        ancestor_mask(parents),
    )
    w = walk(tree, torch.tensor([[5, 7, 0, 1, 0]]), max_depth=4)  # accept 5, 7, then target says 1
    assert w.path[0].tolist() == [0, 1, 3, 3, 3]
    assert w.accepted.tolist() == [3] and w.bonus.tolist() == [1]
    assert w.emitted[0, :3].tolist() == [5, 7, 1]
    w = walk(tree, torch.tensor([[2, 0, 0, 0, 0]]), max_depth=4)  # nothing accepted
    assert w.accepted.tolist() == [1] and w.emitted[0, 0].item() == 2


def sequential_walk(tree, decisions, row):
    """The walk as the paper states it: from the root, step to the child the target chose."""
    path, cur = [0], 0
    while True:
        want = decisions[row, cur].item()
        kids = [
            i
            for i in range(tree.size)
            if tree.valid[row, i] and tree.parents[row, i] == cur and tree.tokens[row, i] == want
        ]
        if not kids:
            return path, want
        cur = kids[0]
        path.append(cur)


@pytest.mark.parametrize("seed", range(8))
def test_vectorised_walk_equals_sequential_walk(seed):
    """Random top-B trees (with padding) and target decisions that often follow the tree."""
    from ddtree.speculative.tree import build_ddtree

    g = torch.Generator().manual_seed(seed)
    vocab, depth, budget = 3 + seed % 3, 6, 4 + 5 * seed
    tree = build_ddtree(torch.zeros(4, dtype=torch.long), torch.randn(4, depth, vocab, generator=g) * 3, budget)
    # the target's decision at a node: usually its most probable child in the tree, sometimes random
    decisions = torch.randint(0, vocab, (4, tree.size), generator=g)
    follow = torch.rand(4, tree.size, generator=g) < 0.8
    for r in range(4):
        for i in range(tree.size):
            kids = [j for j in range(tree.size) if tree.valid[r, j] and tree.parents[r, j] == i]
            if kids and follow[r, i]:
                decisions[r, i] = tree.tokens[r, kids[0]]
    w = walk(tree, decisions, max_depth=depth)
    for r in range(4):
        path, bonus = sequential_walk(tree, decisions, r)
        assert w.accepted[r].item() == len(path) and w.bonus[r].item() == bonus
        assert w.path[r].tolist() == path + [path[-1]] * (depth + 1 - len(path))
        assert w.emitted[r, : len(path)].tolist() == [tree.tokens[r, i].item() for i in path[1:]] + [bonus]


@pytest.mark.parametrize(
    "method,budget",
    [("dflash", None), ("ddtree", 0), ("ddtree", 1), ("ddtree", 4), ("ddtree", 15), ("ddtree", 32), ("ddtree", 64)],
)
def test_greedy_equals_ar_random_drafter(tiny_target, tiny_drafter, method, budget):
    sp = SamplingParams(max_new_tokens=24)
    ref = Engine(tiny_target, None, "ar", max_batch_size=3, max_seq_len=64).generate(PROMPTS, sp)
    eng = Engine(tiny_target, tiny_drafter, method, budget, max_batch_size=3, max_seq_len=64)
    assert [r.token_ids for r in eng.generate(PROMPTS, sp)] == [r.token_ids for r in ref]
    assert [eng.generate([p], sp)[0].token_ids for p in PROMPTS] == [r.token_ids for r in ref]


class OracleEngine(Engine):
    """Draft rows that put the true continuation on top most of the time (second otherwise), so
    rounds accept long paths: exercises compaction, context staging and termination inside a path."""

    def __init__(self, *args, continuations, **kw):
        super().__init__(*args, **kw)
        self.continuations = continuations

    def propose(self, n, span):
        real = super().propose(n, span)  # keep the drafter cache path running
        g = torch.Generator().manual_seed(sum(self.host_lengths))
        logits = torch.randn(real.shape, generator=g)
        for i, full in enumerate(self.continuations):
            L = self.host_lengths[i]
            for d in range(real.shape[1]):
                if L + 1 + d < len(full):
                    logits[i, d, full[L + 1 + d]] += 6.0 if torch.rand((), generator=g) < 0.75 else 1.5
        return logits


def reference(tiny_target, n=40):
    return Engine(tiny_target, None, "ar", max_batch_size=3, max_seq_len=96).generate(
        PROMPTS, SamplingParams(max_new_tokens=n)
    )


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 4), ("ddtree", 32)])
def test_greedy_equals_ar_with_long_accepted_paths(tiny_target, tiny_drafter, method, budget):
    ref = reference(tiny_target)
    full = [p + r.token_ids for p, r in zip(PROMPTS, ref)]
    eng = OracleEngine(tiny_target, tiny_drafter, method, budget, max_batch_size=3, max_seq_len=96, continuations=full)
    res = eng.generate(PROMPTS, SamplingParams(max_new_tokens=40))
    assert [r.token_ids for r in res] == [r.token_ids for r in ref]
    assert min(r.acceptance_length for r in res) > 2.0, "the oracle must make rounds accept several tokens"


def test_kv_compaction_over_many_rounds_equals_fresh_prefill(tiny_target, tiny_drafter):
    ref = reference(tiny_target, n=80)
    full = [p + r.token_ids for p, r in zip(PROMPTS, ref)]
    eng = OracleEngine(tiny_target, tiny_drafter, "ddtree", 16, max_batch_size=3, max_seq_len=128, continuations=full)
    emitted = [[eng.add(i, p, SamplingParams(max_new_tokens=80))] for i, p in enumerate(PROMPTS)]
    for _ in range(12):
        for i, toks in enumerate(eng.step(3)):
            emitted[i] += toks
    assert min(len(e) for e in emitted) > 12 + 12, "rounds must have accepted several tokens"
    caches = [
        [layer.self_attn.kv_cache.row(i, eng.host_lengths[i]) for i in range(len(PROMPTS))]
        for layer in tiny_target.model.layers
    ]
    # committed text in the cache = prompt + all emitted tokens but the last (the pending bonus)
    for i, p in enumerate(PROMPTS):
        text = p + emitted[i][:-1]
        assert eng.host_lengths[i] == len(text)
        fresh = Engine(tiny_target, None, "ar", max_batch_size=1, max_seq_len=128)
        fresh.add(0, text, SamplingParams(max_new_tokens=1))
        for rows, layer in zip(caches, tiny_target.model.layers):
            k, v = rows[i]
            fresh_k, fresh_v = layer.self_attn.kv_cache.row(0, len(text))
            torch.testing.assert_close(k, fresh_k, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, fresh_v, atol=1e-4, rtol=1e-4)


def test_stop_token_and_max_new_tokens_inside_an_accepted_path(tiny_target, tiny_drafter):
    ref = reference(tiny_target)
    full = [p + r.token_ids for p, r in zip(PROMPTS, ref)]
    stop = ref[0].token_ids[12]
    first = ref[0].token_ids.index(stop)
    eng = OracleEngine(tiny_target, tiny_drafter, "ddtree", 32, max_batch_size=3, max_seq_len=96, continuations=full)
    res = eng.generate(
        PROMPTS,
        [
            SamplingParams(max_new_tokens=40, stop_token_ids=(stop,)),
            SamplingParams(max_new_tokens=7),
            SamplingParams(max_new_tokens=40),
        ],
    )
    assert res[0].token_ids == ref[0].token_ids[: first + 1] and res[0].finish_reason == "stop"
    assert res[1].token_ids == ref[1].token_ids[:7] and res[1].finish_reason == "length"
    assert res[2].token_ids == ref[2].token_ids, "a finished neighbour must not disturb the others"
    assert max(res[1].accepted_per_round) > 1


def test_ar_acceptance_is_one_and_budget_zero_is_ar(tiny_target, tiny_drafter):
    sp = SamplingParams(max_new_tokens=10)
    ar = Engine(tiny_target, None, "ar").generate([PROMPTS[0]], sp)[0]
    assert ar.acceptance_length == 1.0 and ar.rounds == 9  # the first token comes from the prefill
    zero = Engine(tiny_target, tiny_drafter, "ddtree", 0).generate([PROMPTS[0]], sp)[0]
    assert zero.token_ids == ar.token_ids and zero.acceptance_length == 1.0


def test_bad_requests_are_refused(tiny_target, tiny_drafter):
    eng = Engine(tiny_target, tiny_drafter, "ddtree", 8, max_batch_size=2, max_seq_len=32)
    with pytest.raises(ValueError, match="exceeds the context"):
        eng.generate([[1] * 30], SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="batch of 3"):
        eng.generate([[1], [2], [3]])
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(tiny_target, None, "dflash")
    with pytest.raises(ValueError, match="unknown method"):
        Engine(tiny_target, None, "beam")
    with pytest.raises(ValueError, match="budget must be >= 0"):
        Engine(tiny_target, tiny_drafter, "ddtree", -1)


def test_budget_per_batch_size(tiny_target, tiny_drafter):
    """A {batch size: budget} policy: each round builds the tree of its batch size's budget, and output
    stays plain decoding's, with long accepted paths (the oracle drafter)."""
    ref = reference(tiny_target)
    full = [p + r.token_ids for p, r in zip(PROMPTS, ref)]
    eng = OracleEngine(
        tiny_target, tiny_drafter, "ddtree", {1: 4, 2: 32, 3: 12}, max_batch_size=3, max_seq_len=96, continuations=full
    )
    assert (eng.budget, eng.tree_size) == (32, 33), "buffers fit the largest budget"
    assert [eng.plan(n).budget for n in (1, 2, 3)] == [4, 32, 12]
    assert [eng.plan(n).tree_size for n in (1, 2, 3)] == [5, 33, 13]
    with pytest.raises(ValueError, match="no round on 4 rows"):
        eng.plan(4)
    assert eng.max_depth == tiny_drafter.block_size - 1 == 7
    assert [eng.draft_depth(n) for n in (1, 2, 3)] == [4, 7, 7], "a tree of B nodes is B deep at most"
    sizes, rows = [], []
    build, propose = eng.build_tree, eng.propose
    eng.build_tree = lambda n, span: sizes.append((n, (tree := build(n, span)).size)) or tree
    eng.propose = lambda n, span: rows.append((n, (logits := propose(n, span)).shape[1])) or logits
    res = eng.generate(PROMPTS, SamplingParams(max_new_tokens=40))
    assert [r.token_ids for r in res] == [r.token_ids for r in ref]
    eng.continuations = full[1:2]
    alone = eng.generate(PROMPTS[1:2], SamplingParams(max_new_tokens=40))[0]
    assert alone.token_ids == ref[1].token_ids and alone.acceptance_length > 2.0
    assert (3, 13) in sizes and (1, 5) in sizes and all(size == eng.plan(n).tree_size for n, size in sizes)
    assert (1, 4) in rows and all(depth == eng.draft_depth(n) for n, depth in rows)
    with pytest.raises(ValueError, match="needs method 'ddtree'"):
        Engine(tiny_target, tiny_drafter, "dflash", {1: 8})
    with pytest.raises(ValueError, match="batch sizes >= 1 and budgets >= 0"):
        Engine(tiny_target, tiny_drafter, "ddtree", {1: -1})
    with pytest.raises(ValueError, match="batch sizes >= 1 and budgets >= 0"):
        Engine(tiny_target, tiny_drafter, "ddtree", {0: 8})
    assert Engine(tiny_target, tiny_drafter, "ddtree", {1: 0, 4: 0}).drafter is None, "never drafts: plain decoding"


def test_round_plans_cover_every_batch_size():
    """One plan per batch size: a budget per batch size takes the smallest listed size at or above n (the
    last entry beyond), a plan covers the row counts up to its `batch`, and budget 0 plans no draft."""
    from ddtree.runtime.plan import round_plans

    def fields(plans):
        return [(p.batch, p.drafts, p.budget, p.tree_size, p.block) for p in plans]

    assert (
        fields(round_plans("ddtree", {1: 4, 3: 12}, 16, True, 5))
        == [(1, True, 4, 5, 16)] + [(3, True, 12, 13, 16)] * 2 + [(5, True, 12, 13, 16)] * 2
    )
    assert fields(round_plans("ddtree", {2: 8, 4: 0, 64: 16}, 16, True, 5)) == [(2, True, 8, 9, 16)] * 2 + [
        (4, False, 0, 1, 0)
    ] * 2 + [(5, True, 16, 17, 16)]
    assert fields(round_plans("ddtree", None, 16, True, 2)) == [(2, True, 15, 16, 16)] * 2
    assert fields(round_plans("ddtree", 0, 1, False, 2)) == [(2, False, 0, 1, 0)] * 2
    assert fields(round_plans("dflash", None, 8, True, 1)) == [(1, True, 7, 8, 8)]
    assert fields(round_plans("ar", None, 1, False, 3)) == [(3, False, 0, 1, 0)] * 3


def drafter_cache(drafter, row, n):
    """Keys and values of the first n drafter cache slots of batch row `row`, every layer."""
    return torch.stack([torch.stack(layer.self_attn.kv_cache.row(row, n)) for layer in drafter.layers])


def test_budget_zero_decodes_without_drafting_and_keeps_the_drafter_context(tiny_target, tiny_drafter):
    """Budget 0 at a batch size switches speculation off there: rounds on 2 rows verify the bonus
    token alone and run no draft, yet still write each committed token's context into the drafter
    cache, so that rounds on 1 row draft with the whole text. Output stays plain decoding's, and the
    drafter cache equals that of an engine that drafted in every round."""
    ref = reference(tiny_target, n=80)[0].token_ids
    params = SamplingParams(max_new_tokens=80)
    # the oracle drafter accepts long paths: a drafting round stages several tokens of context
    eng = OracleEngine(
        tiny_target,
        tiny_drafter,
        "ddtree",
        {1: 8, 2: 0},
        max_batch_size=2,
        max_seq_len=96,
        continuations=[PROMPTS[0] + ref],
    )
    assert (eng.budget, eng.plan(1).tree_size, eng.plan(2).tree_size) == (8, 9, 1)
    assert (eng.plan(1).drafts, eng.plan(2).drafts, eng.plan(2).block) == (True, False, 0)
    drafts = []
    propose = eng.propose
    eng.propose = lambda n, span: drafts.append(n) or propose(n, span)
    out, accepted = [eng.add(0, PROMPTS[0], params)], []
    for n in [2] * 6 + [1] * 4 + [2] * 3 + [1] * 3 + [2] * 2:  # row 1 idle: rounds on 2 rows decode plainly
        toks = eng.step(n)[0]
        accepted.append(len(toks))
        out += toks
    assert out == ref[: len(out)] and set(drafts) == {1} and len(drafts) == 7
    assert set(accepted[:6] + accepted[10:13] + accepted[16:]) == {1} and max(accepted) > 2
    # the drafter cache of the committed text, but for the last round's path (staged, not yet written)
    written = eng.host_lengths[0] - int(eng.ctx_count[0])
    switched = drafter_cache(tiny_drafter, 0, written).clone()
    always = Engine(tiny_target, tiny_drafter, "ddtree", 8, max_batch_size=1, max_seq_len=96)
    always.add(0, PROMPTS[0], params)
    while always.host_lengths[0] - int(always.ctx_count[0]) < written:
        always.step(1)
    torch.testing.assert_close(drafter_cache(tiny_drafter, 0, written), switched, atol=1e-4, rtol=1e-4)


def test_add_many_prefills_like_one_add_per_prompt(tiny_target, tiny_drafter):
    """Prompts of different lengths prefilled into rows in one right-padded forward: the same first
    tokens and target and drafter caches as one add per prompt, and the same greedy continuations."""
    sp, rows = SamplingParams(max_new_tokens=20), [2, 0, 1]

    def prefilled(many):
        eng = Engine(tiny_target, tiny_drafter, "ddtree", 8, max_batch_size=3, max_seq_len=96)
        firsts = eng.add_many(rows, PROMPTS, sp) if many else [eng.add(r, p, sp) for r, p in zip(rows, PROMPTS)]
        caches = [
            torch.cat([drafter_cache(model, r, len(p)).flatten() for model in (tiny_target.model, tiny_drafter)])
            for r, p in zip(rows, PROMPTS)
        ]
        return eng, firsts, caches

    _, firsts, caches = prefilled(many=False)
    eng, got_firsts, got_caches = prefilled(many=True)
    assert got_firsts == firsts and eng.host_lengths == [len(PROMPTS[1]), len(PROMPTS[2]), len(PROMPTS[0])]
    for got, want in zip(got_caches, caches):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    out = {r: [f] for r, f in zip(rows, got_firsts)}
    while min(map(len, out.values())) < 20:
        for r, toks in enumerate(eng.step(3)):
            out[r] += toks
    assert [out[r][:20] for r in rows] == [r.token_ids for r in reference(tiny_target, n=20)]


def test_drafter_for_another_target_is_refused(tiny_target):
    from ddtree.models.llama import ModelConfig
    from ddtree.speculative.drafter import DrafterMismatchError

    other = ModelConfig(
        vocab_size=99,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    drafter = init_drafter(DrafterConfig.for_target(other, block_size=8))
    with pytest.raises(DrafterMismatchError, match="vocabulary 99 != target's 64"):
        Engine(tiny_target, drafter, "ddtree", 8)


@pytest.mark.parametrize("method,budget", [("ar", None), ("ddtree", 8)])
def test_requests_join_and_leave_between_rounds(tiny_target, tiny_drafter, method, budget):
    """Continuous batching: a request that joins a running batch, into a row another request left,
    emits exactly what it emits alone."""
    ref = reference(tiny_target, n=20)
    drafter = tiny_drafter if method != "ar" else None
    eng = Engine(tiny_target, drafter, method, budget, max_batch_size=2, max_seq_len=96)
    sp = SamplingParams(max_new_tokens=20)
    got = {0: [eng.add(0, PROMPTS[0], sp)]}
    for _ in range(3):
        got[0] += eng.step(1)[0]
    got[1] = [eng.add(1, PROMPTS[1], sp)]
    owner = 0  # which request row 0 serves
    while len(got[1]) < 20 or len(got[2] if owner == 2 else []) < 20:
        toks = eng.step(2)
        got[owner] += toks[0]
        got[1] += toks[1]
        if owner == 0 and len(got[0]) >= 20:
            eng.release(0)  # row 0 leaves; a new request takes it while row 1 keeps running
            owner, got[2] = 2, [eng.add(0, PROMPTS[2], sp)]
    assert len(got[1]) > 20 + 5, "row 1 must have kept running while row 0 changed hands"
    for i in range(3):
        assert got[i][:20] == ref[i].token_ids, i
