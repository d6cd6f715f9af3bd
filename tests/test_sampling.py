"""Sampling at T > 0 is lossless: DDTree emits the same distribution as plain sampling."""

import collections

import pytest
import torch

from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.speculative.drafter import DrafterConfig, init_drafter
from tiny_models import random_target


def chi_square_p_value(a: collections.Counter, b: collections.Counter) -> float:
    """Two-sample chi-square test of homogeneity; cells with few counts are pooled."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    rows, pooled = [], [0, 0]
    for k in keys:
        if a[k] + b[k] < 10:
            pooled[0] += a[k]
            pooled[1] += b[k]
        else:
            rows.append((a[k], b[k]))
    if sum(pooled):
        rows.append(tuple(pooled))
    stat = 0.0
    for x, y in rows:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    dof = len(rows) - 1
    half_dof, half_stat = (torch.tensor(v / 2, dtype=torch.float64) for v in (dof, stat))
    return torch.special.gammaincc(half_dof, half_stat).item()  # the chi-square survival function


# Rounds of 64 samples per side (1920): test_the_test_detects_a_biased_sampler shows that at this size the
# statistic rejects T=0.8 against T=1 (p ~ 1e-5; twice the samples only add margin, T=0.9 needs far more).
ROUNDS = 30


def emitted_pairs(engine, rounds, seed0, params_kw):
    counts = collections.Counter()
    for r in range(rounds):
        res = engine.generate([[1, 2, 3]] * 64, SamplingParams(max_new_tokens=3, seed=seed0 + r, **params_kw))
        counts.update(tuple(x.token_ids[1:3]) for x in res)  # tokens 2 and 3: produced by verify rounds
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("params_kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.8}])
def test_ddtree_sampling_matches_ar(params_kw):
    target = random_target(vocab=8, hidden=32, layers=2, seed=1, scale=0.25)
    drafter = init_drafter(DrafterConfig.for_target(target.config, block_size=4), seed=2)
    ar = Engine(target, None, "ar", max_batch_size=64, max_seq_len=16)
    tree = Engine(target, drafter, "ddtree", 12, max_batch_size=64, max_seq_len=32)
    a = emitted_pairs(ar, ROUNDS, 1000, params_kw)
    b = emitted_pairs(tree, ROUNDS, 5000, params_kw)
    assert len(a) > 10, "the test needs a spread-out distribution"
    assert chi_square_p_value(a, b) > 1e-3
    # with 8 tokens and budget 12 the tree always holds every depth-1 token: drafts are accepted
    accepted = tree.generate([[1, 2, 3]] * 64, SamplingParams(max_new_tokens=3, seed=7, **params_kw))
    assert sum(r.acceptance_length for r in accepted) / 64 > 1.5


@pytest.mark.slow
def test_the_test_detects_a_biased_sampler():
    """Guard: with the samples test_ddtree_sampling_matches_ar takes, the statistic rejects a distribution
    that differs (T=0.8 vs T=1)."""
    target = random_target(vocab=8, hidden=32, layers=2, seed=1, scale=0.25)
    ar = Engine(target, None, "ar", max_batch_size=64, max_seq_len=16)
    a = emitted_pairs(ar, ROUNDS, 1000, {"temperature": 1.0})
    b = emitted_pairs(ar, ROUNDS, 5000, {"temperature": 0.8})
    assert chi_square_p_value(a, b) < 1e-3


def test_same_seed_same_output():
    target = random_target(vocab=8, hidden=32, layers=2, seed=1, scale=0.25)
    drafter = init_drafter(DrafterConfig.for_target(target.config, block_size=4), seed=2)
    eng = Engine(target, drafter, "ddtree", 12, max_batch_size=4, max_seq_len=32)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=42)
    first = [r.token_ids for r in eng.generate([[1, 2]] * 4, sp)]
    assert [r.token_ids for r in eng.generate([[1, 2]] * 4, sp)] == first
