"""`--budget auto`: forecasts from the best-first tree, the controller's choice, and lossless rounds at
whatever budget it picks."""

import math

import pytest
import torch

from ddtree.runtime.budget import BudgetController
from ddtree.runtime.engine import SamplingParams
from ddtree.runtime.plan import auto_budgets, check_budget, round_plans
from ddtree.speculative.tree import build_ddtree, expected_accepted
from test_engine import PROMPTS, OracleEngine, reference
from test_tree import tree_paths


def test_a_best_first_tree_holds_every_smaller_budget_and_forecasts_it():
    """The first b + 1 nodes of a budget-64 tree are the budget-b tree, and expected_accepted is the sum of
    that tree's path probabilities (the paper's Prop. 1 surrogate)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 40, generator=g) * 2
    logits[1, ::2, 5] = 200.0  # probability 1: a child ties its parent's score
    big = build_ddtree(torch.tensor([1, 2, 3]), logits, 64)
    budgets = torch.tensor([1, 8, 16, 32, 64])
    forecast = expected_accepted(big.scores, budgets)
    logp = torch.log_softmax(logits.double(), -1)
    for b_i, b in enumerate(budgets.tolist()):
        small = build_ddtree(torch.tensor([1, 2, 3]), logits, b)
        prefix = big.prefix(b + 1)
        for row in range(3):
            assert set(tree_paths(prefix, row)) == set(tree_paths(small, row)), (b, row)
            probability = sum(
                math.exp(sum(logp[row, d, t].item() for d, t in enumerate(path))) for path in tree_paths(small, row)
            )
            assert forecast[row, b_i].item() == pytest.approx(probability, rel=1e-4)
    assert torch.all(forecast[:, 1:] >= forecast[:, :-1]), "a larger tree never forecasts less"


def test_auto_candidates_and_refusals():
    assert auto_budgets(1) == auto_budgets(16) == (0, 8, 16, 32, 64)
    assert auto_budgets(32) == (0, 8, 16, 32)  # 32 x 65 verified tokens would pass 2048
    assert auto_budgets(33) == auto_budgets(64) == (0, 8, 16)
    assert auto_budgets(256) == (0, 8)
    plans = round_plans("ddtree", "auto", 16, True, 20)
    assert [p.budget for p in plans] == [64] * 16 + [32] * 4, "the static plan is the largest candidate"
    assert {p.batch for p in plans} == {1, 2, 4, 8, 16, 20}, "plans cover power-of-two buckets"
    with pytest.raises(ValueError, match="needs method 'ddtree'"):
        check_budget("dflash", "auto")
    with pytest.raises(ValueError, match="got 'often'"):
        check_budget("ddtree", "often")


def controller(costs: dict[int, float]) -> BudgetController:
    c = BudgetController((8, 16, 32, 64), rows=2, explore_every=4)
    c.costs = {(2, 512): dict(costs)}
    return c


def test_controller_weighs_calibrated_forecasts_against_round_times():
    flat = {0: 1.0, 8: 1.2, 16: 1.3, 32: 1.4, 64: 2.0}
    c = controller(flat)
    assert c.choose(2, 100, [0, 1]) == 64, "nothing known yet: the largest tree tells the most"
    # a confident draft whose forecasts come true: a large tree pays
    for _ in range(3):
        c.observe(64, [0, 1], [9, 9], [[6.0, 7.0, 7.8, 8.0]] * 2)
    # per row: 7 tokens / 1.2, 8 / 1.3, 8.8 / 1.4, 9 / 2.0
    assert c.choose(2, 100, [0, 1]) == 32
    # the target accepts little of what the draft forecasts: calibration brings the forecasts down, until
    # drafting no longer pays for its time
    c = controller({0: 1.0, 8: 1.5, 16: 1.6, 32: 1.8, 64: 2.4})
    for _ in range(12):
        c.observe(16, [0, 1], [1, 2], [[4.0, 5.0, 6.0, 6.5]] * 2)
    assert c.estimates[0].calibration < 0.05 and 0.1 < c.estimates[1].calibration < 0.3
    assert c.choose(2, 100, [0, 1]) == 0
    # budget 0 learns nothing: every explore_every-th such round drafts with the smallest budget
    choices = [c.choose(2, 100, [0, 1]) for _ in range(8)]
    assert choices == [0, 0, 8, 0, 0, 0, 8, 0]
    # a new request in row 1 takes the other rows' mean forecast; span and batch pick the table
    c.reset(1)
    assert c.estimates[1] is None and c.expected_tokens([0, 1], 8) > 2.0
    c.costs[(4, 1024)] = {0: 1.0, 8: 100.0}
    assert c.table(3, 600) == {0: 1.0, 8: 100.0} and c.table(1, 5000) == c.costs[(2, 512)]


def test_auto_is_lossless_and_switches_budgets(tiny_target, tiny_drafter):
    """Rounds at whatever budget the controller picks (the oracle drafter makes long paths likely) give
    plain decoding's tokens; measured round times steer the choice."""
    ref = reference(tiny_target)
    full = [p + r.token_ids for p, r in zip(PROMPTS, ref)]
    eng = OracleEngine(tiny_target, tiny_drafter, "ddtree", "auto", max_batch_size=3, max_seq_len=160, continuations=[])
    assert eng.budget == 64 and eng.budgets is not None
    eng.measure_budgets()  # what serve does at start-up (generate would too), before the oracle knows the rows
    eng.continuations = full
    budgets = []
    step = eng._step
    eng._step = lambda n: budgets.append(eng.plan(n).budget) or step(n)
    res = eng.generate(PROMPTS, SamplingParams(max_new_tokens=40))
    assert [r.token_ids for r in res] == [r.token_ids for r in ref]
    # every round builds the largest tree (its first nodes forecast the smaller budgets): all draft rows
    assert all(eng.draft_depth(n) == eng.max_depth == tiny_drafter.block_size - 1 for n in (1, 2, 3))
    assert set(eng.budgets.costs) == {(1, eng.max_slots), (2, eng.max_slots), (3, eng.max_slots)}
    assert set(eng.budgets.costs[(3, eng.max_slots)]) == {0, 8, 16, 32, 64}
    # rounds that cost the same whatever the budget: the largest tree; drafting made expensive: no draft
    for table in eng.budgets.costs.values():
        table.update({b: 1.0 for b in table})
    budgets.clear()
    res = eng.generate(PROMPTS, SamplingParams(max_new_tokens=40))
    assert [r.token_ids for r in res] == [r.token_ids for r in ref] and set(budgets) == {64}
    assert min(r.acceptance_length for r in res) > 2.0
    for table in eng.budgets.costs.values():
        table.update({b: 1.0 + 100.0 * (b > 0) for b in table})
    budgets.clear()
    res = eng.generate(PROMPTS, SamplingParams(max_new_tokens=40))
    assert [r.token_ids for r in res] == [r.token_ids for r in ref]
    assert budgets[0] == 64 and budgets.count(0) > 0.8 * len(budgets), budgets


def test_overhead_outside_the_graph_counts_against_plain_decoding():
    """Rounds whose graphs take 1 ms (budget 0) and 2 ms (budget 8) but which start 5 ms apart: the 3 ms of
    host and prefill time per round make a draft that adds 0.6 tokens worth its extra millisecond."""
    c = BudgetController((8, 16, 32, 64), rows=1)
    c.costs = {(1, 512): {0: 0.001, 8: 0.002}}
    c.observe(8, [0], [2], [[0.6, 0.7, 0.8, 0.9]])
    assert c.estimates[0].calibration == pytest.approx(1 / 0.6)  # one accepted where 0.6 was forecast
    c.estimates[0].accepted = 0.6  # calibrated: 1.6 tokens per drafting round
    assert c.choose(1, 100, [0]) == 0, "graphs alone: 1 token / 1 ms beats 1.6 / 2 ms"
    for k in range(40):
        c.round_started(k * 0.005, 1, 100, 8)
    assert c.overhead == pytest.approx(0.003, rel=1e-3)
    assert c.choose(1, 100, [0]) == 8, "1.6 / 5 ms beats 1 / 4 ms"
    c.round_started(10.0, 1, 100, 8)  # an idle gap is not a round's overhead
    assert c.overhead == pytest.approx(0.003, rel=1e-3)


def test_a_per_request_budget_is_refused_by_a_server_that_chooses_its_own():
    from ddtree.serving.protocol import APIError, Sampling

    with pytest.raises(APIError, match="this server runs budget auto"):
        Sampling({"prompt": "hi", "budget": 64}, False, "auto")
    Sampling({"prompt": "hi", "budget": 8}, False, 8)  # equal to a fixed budget: accepted
