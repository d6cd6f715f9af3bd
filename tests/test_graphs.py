"""CUDA graphs of whole rounds: replay equals eager, shapes are checked, and the smoke test gates on it.
GPU tests are skipped on CPU; the shape checks and the smoke logic run everywhere."""

import pytest

from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.runtime.graphs import GraphShapeError, RoundGraphs, plan_buckets
from ddtree.runtime.smoke import run_smoke
from ddtree.speculative.drafter import DrafterConfig, init_drafter
from tiny_models import random_target

gpu = pytest.mark.gpu  # CUDA graphs; conftest.py skips it without a CUDA device


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [5, 4]]


def make(device="cpu", method="ddtree", budget=8, batch=4):
    target = random_target().to(device)
    drafter = init_drafter(DrafterConfig.for_target(target.config, block_size=8), seed=1).to(device)
    return Engine(target, drafter, method, budget, max_batch_size=batch, max_seq_len=96)


def test_uncaptured_shape_is_a_clear_error_naming_both_shapes():
    engine = make()
    engine.graphs = RoundGraphs(engine, [1, 2], span_buckets=[128])  # clamped to the 105-slot cache
    engine.add(0, PROMPTS[0], SamplingParams(max_new_tokens=8))
    with pytest.raises(GraphShapeError) as err:
        engine.step(1)
    msg = str(err.value)
    assert "no CUDA graph captured for batch 1 x span 105, draft 8 / verify 9 tokens per sequence, greedy" in msg
    assert "captured: none" in msg
    with pytest.raises(GraphShapeError, match="need a CUDA device"):
        engine.graphs.capture()
    with pytest.raises(GraphShapeError, match=r"batch buckets \[8\] outside"):
        RoundGraphs(engine, [8])


def test_budget_per_batch_size_changes_only_at_graph_buckets():
    engine = make(budget={1: 16, 3: 8})
    with pytest.raises(GraphShapeError, match=r"changes at batch sizes \[3\], which are not graph batch buckets"):
        RoundGraphs(engine, [1, 2, 4])
    graphs = RoundGraphs(make(budget={1: 16, 2: 8}), [1, 2, 4])
    # `bench --policy` captures these for its rounds on 4 rows
    assert plan_buckets(engine, 4) == [1, 3, 4] and plan_buckets(make(), 4) == [4]
    RoundGraphs(engine, plan_buckets(engine, 4))
    assert [graphs.shape(b, 128, False).verify_tokens for b in (1, 2, 4)] == [17, 9, 9]


def test_fallback_runs_eagerly_and_the_smoke_test_reports_it():
    engine = make()
    engine.graphs = RoundGraphs(engine, [1], span_buckets=[128], fallback=True)
    report = run_smoke(engine, [1, 2], PROMPTS, max_new_tokens=4)
    assert not report.passed and "fell back to eager" in report.reason
    assert report.fallbacks > 0 and report.mismatches == []


def test_smoke_on_cpu_compares_batched_with_alone_and_catches_a_corrupted_input():
    engine = make()
    good = run_smoke(engine, [1, 2, 4], PROMPTS, max_new_tokens=6)
    assert good.passed and good.mode == "eager" and good.acceptance_length >= 1.0, good.reason
    bad = run_smoke(engine, [1, 2], PROMPTS, max_new_tokens=6, fault="corrupt-graph-input")
    assert not bad.passed and bad.mismatches
    assert run_smoke(engine, [2], PROMPTS, max_new_tokens=6).passed, "the fault must be undone afterwards"
    assert not run_smoke(engine, [1], PROMPTS, max_new_tokens=6, min_acceptance=17.0).passed


def test_smoke_reference_runs_under_the_budget_of_the_batch_size_it_checks():
    # in bf16 a 129-row verify and a 9-row one round differently, so a reference drafted with another
    # budget can flip a near-tie and fail a correct graph (seen with --budget 1:128,4:8 on an H200)
    engine = make(budget={1: 16, 2: 8})
    before = engine.plans
    plans = []
    build_tree = engine.build_tree

    def recording(n, span):
        plans.append((n, engine.plan(n).budget))
        return build_tree(n, span)

    engine.build_tree = recording
    assert run_smoke(engine, [2], PROMPTS, max_new_tokens=6).passed
    assert {budget for n, budget in plans if n == 1} == {8}, "the alone runs use batch 2's budget"
    plans.clear()
    assert run_smoke(engine, [1, 2, 4], PROMPTS, max_new_tokens=6).passed
    assert {budget for n, budget in plans if n == 1} == {16, 8}
    assert engine.plans == before and engine.plan(1).budget == 16, "the plans are restored"


@gpu
@pytest.mark.parametrize("method,budget", [("ar", None), ("dflash", None), ("ddtree", 8), ("ddtree", 32)])
def test_graph_replay_equals_eager_for_every_bucket(method, budget):
    engine = make("cuda", method, budget, batch=4)
    sp = SamplingParams(max_new_tokens=24)
    eager = engine.generate(PROMPTS, sp)
    capture = engine.capture_graphs([1, 2, 4], [128])
    assert capture > 0 and len(engine.graphs.graphs) == 3
    for n in (1, 3, 4):  # 3 runs padded in the bucket of 4
        rounds = engine.eager_rounds
        got = engine.generate(PROMPTS[:n], sp)
        assert [r.token_ids for r in got] == [r.token_ids for r in eager[:n]]
        assert engine.eager_rounds == rounds, "no eager fallback"
    report = run_smoke(engine, [1, 2, 4], PROMPTS, max_new_tokens=6)
    assert report.passed and report.mode == "cuda-graphs", report.reason
    bad = run_smoke(engine, [1, 2], PROMPTS, max_new_tokens=6, fault="corrupt-graph-input")
    assert not bad.passed


@gpu
def test_triton_backend_rounds_replay_losslessly():
    """The Triton backend's rounds (tree, walk, commit and greedy read as kernels) replayed from graphs
    emit plain decoding's tokens (fp32), for ddtree and dflash, at a batch with an idle row padded in."""
    from ddtree.runtime.fused import use_backend

    sp = SamplingParams(max_new_tokens=24)
    reference = make("cuda", "ar", None).generate(PROMPTS, sp)
    for method, budget in (("ddtree", 8), ("dflash", None)):
        engine = make("cuda", method, budget, batch=4)
        use_backend(engine.target, "triton")
        engine = Engine(engine.target, engine.drafter, method, budget, max_batch_size=4, max_seq_len=96)
        engine.capture_graphs([1, 2, 4], [128])
        rounds = engine.eager_rounds
        for n in (3, 4):
            got = engine.generate(PROMPTS[:n], sp)
            assert [r.token_ids for r in got] == [r.token_ids for r in reference[:n]], (method, n)
        assert engine.eager_rounds == rounds, "no eager fallback"
        report = run_smoke(engine, [1, 2, 4], PROMPTS, max_new_tokens=6)
        assert report.passed and report.mode == "cuda-graphs", report.reason


@gpu
def test_sampling_graph_is_seeded_and_replays():
    engine = make("cuda", "ddtree", 8, batch=2)
    engine.capture_graphs([2], [128], sampling=(False, True))
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)
    a = engine.generate(PROMPTS[:2], sp)
    b = engine.generate(PROMPTS[:2], sp)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


@gpu
def test_budget_auto_captures_every_candidate_times_it_and_stays_lossless():
    sp = SamplingParams(max_new_tokens=24)
    reference = make("cuda", "ar", None).generate(PROMPTS, sp)  # the same seeded target
    engine = make("cuda", "ddtree", "auto", batch=4)
    engine.capture_graphs([1, 2, 4], [128])
    assert len(engine.graphs.graphs) == 3 * 5, "one graph per bucket and candidate budget"
    costs = engine.measure_budgets()
    assert set(costs) == {(1, 128), (2, 128), (4, 128)} and all(set(t) == {0, 8, 16, 32, 64} for t in costs.values())
    assert all(s > 0 for t in costs.values() for s in t.values())
    chosen = []
    step = engine._step
    engine._step = lambda n: chosen.append(engine.plan(n).budget) or step(n)
    rounds = engine.eager_rounds
    got = engine.generate(PROMPTS, sp)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference]
    assert engine.eager_rounds == rounds, "every chosen budget replays a graph"
    assert chosen[0] == 64 and len(set(chosen)) > 1, chosen  # a random drafter: drafting stops paying
    engine._step = step
    report = run_smoke(engine, [1, 2, 4], PROMPTS, max_new_tokens=6)
    assert report.passed and report.mode == "cuda-graphs", report.reason


@gpu
def test_bench_runs_a_budget_per_batch_size_from_graphs():
    from ddtree.runtime.bench import run_config

    engine = make("cuda")  # its target and drafter, on the GPU
    row = run_config(engine.target, engine.drafter, "ddtree", {1: 16, 4: 4}, 4, PROMPTS, True, 2, False)
    assert (row["budget"], row["policy"], row["eager_fallbacks"]) == (4, "1:16,4:4", 0), row


@gpu
def test_rounds_that_map_new_pages_sync_the_host_once_each():
    """The one host sync of a round is its readout: the slot map of a row's new page is copied without one
    (each row commits at least 20 tokens over the 20 rounds counted, so it crosses a 16-slot page)."""
    from ddtree.runtime.bench import count_host_syncs

    target = random_target().to("cuda")
    drafter = init_drafter(DrafterConfig.for_target(target.config, block_size=8), seed=1).to("cuda")
    engine = Engine(target, drafter, "ddtree", 8, max_batch_size=4, max_seq_len=512)
    engine.capture_graphs([4], [512])
    for row, prompt in enumerate(PROMPTS):
        engine.add(row, prompt, SamplingParams(max_new_tokens=400))
    engine.step(4)
    pages = [len(p) for p in engine.row_pages[:4]]
    assert count_host_syncs(engine, 4, rounds=(23, 3)) == 1.0
    assert all(len(p) > n for p, n in zip(engine.row_pages[:4], pages)), "every row took a new page"
