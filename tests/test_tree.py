"""Tree construction: the tensorised top-B equals brute force and the paper's best-first heap."""

import heapq
import itertools
import math

import pytest
import torch

from ddtree.speculative.tree import ancestor_mask, build_chain, build_ddtree, root_only


def brute_force_top_b(logp: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    """Enumerate every prefix (depth 1..D) and keep the `budget` most probable."""
    depth, vocab = logp.shape
    scored = []
    for d in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=d):
            scored.append((sum(logp[i, t].item() for i, t in enumerate(path)), path))
    scored.sort(key=lambda x: -x[0])
    return {p for _, p in scored[:budget]}


def reference_heap(logp: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """The paper's best-first heap over rank tuples (ddtree reference, paraphrased): pop order."""
    depth, vocab = logp.shape
    k = min(budget, vocab)
    top_lp, top_tok = logp.double().topk(k, dim=-1)
    heap = [(-top_lp[0, 0].item(), (0,), ())]
    nodes = []
    while heap and len(nodes) < budget:
        neg, ranks, parent_path = heapq.heappop(heap)
        d, r = len(ranks), ranks[-1]
        path = parent_path + (top_tok[d - 1, r].item(),)
        nodes.append(path)
        if r + 1 < k:
            s = -neg - top_lp[d - 1, r].item() + top_lp[d - 1, r + 1].item()
            heapq.heappush(heap, (-s, ranks[:-1] + (r + 1,), parent_path))
        if d < depth:
            heapq.heappush(heap, (-(-neg + top_lp[d, 0].item()), ranks + (0,), path))
    return nodes


def tree_paths(tree, row: int) -> list[tuple[int, ...]]:
    """Token path (root excluded) of every valid node, in node order."""
    parents, tokens, valid = tree.parents[row].tolist(), tree.tokens[row].tolist(), tree.valid[row].tolist()
    paths = [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (tokens[i],) if valid[i] else None)
    return [p for p in paths[1:] if p is not None]


def check_structure(tree, row: int) -> None:
    parents, depth, valid = tree.parents[row], tree.depth[row], tree.valid[row]
    n = parents.shape[0]
    assert parents[0] == -1 and depth[0] == 0
    for i in range(1, n):
        if not valid[i]:
            continue
        p = parents[i].item()
        assert 0 <= p < i, "parent must precede child"
        assert valid[p] and depth[i] == depth[p] + 1
    children = {}
    for i in range(1, n):
        if valid[i]:
            children.setdefault(parents[i].item(), []).append(tree.tokens[row, i].item())
    for toks in children.values():
        assert len(toks) == len(set(toks)), "sibling tokens must be distinct"


@pytest.mark.parametrize("case", range(60))
def test_matches_brute_force_and_heap(case):
    g = torch.Generator().manual_seed(case)
    depth = 1 + case % 4
    vocab = 2 + case % 4
    budget = 1 + (case * 7) % 20
    logits = torch.randn(2, depth, vocab, generator=g) * 2
    tree = build_ddtree(torch.tensor([5, 6]), logits, budget)
    logp = torch.log_softmax(logits.double(), -1)
    for row in range(2):
        check_structure(tree, row)
        got = tree_paths(tree, row)
        n_prefixes = sum(vocab**d for d in range(1, depth + 1))
        assert len(got) == min(budget, n_prefixes)
        assert set(got) == brute_force_top_b(logp[row], budget)
        assert set(got) == set(reference_heap(logp[row], budget))
        assert set(got) == {p[:k] for p in got for k in range(1, len(p) + 1)}, "prefix-closed"
        assert tree.tokens[row, 0] == 5 + row


def test_large_vocab_budget_and_probability_one_rows():
    """Realistic sizes, including rows whose top token has log-probability exactly 0 (score ties
    between a parent and its child): the tree must stay prefix-closed."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 15, 1000, generator=g)
    logits[:, ::2, 7] = 200.0  # probability 1 in fp32 at every other depth
    tree = build_ddtree(torch.tensor([1, 2, 3]), logits, 64)
    for row in range(3):
        check_structure(tree, row)
        got = tree_paths(tree, row)
        assert len(got) == 64
        assert set(got) == {p[:k] for p in got for k in range(1, len(p) + 1)}
        heap = reference_heap(torch.log_softmax(logits[row].double(), -1), 64)
        assert set(got) == set(heap)


@pytest.mark.parametrize("budget", [1, 3, 8])
def test_a_tree_of_b_nodes_needs_only_the_first_b_rows(budget):
    """A tree of B nodes is at most B deep: built from the first B of 15 draft rows it is the same tree,
    probability-one rows (a child tying its parent's score) included. Engine.draft_depth relies on it."""
    g = torch.Generator().manual_seed(budget)
    logits = torch.randn(3, 15, 40, generator=g)
    logits[1, :, 7] = 200.0  # the best path runs through every row
    logits[2, ::2, 3] = 200.0
    roots = torch.tensor([1, 2, 3])
    whole, shallow = build_ddtree(roots, logits, budget), build_ddtree(roots, logits[:, :budget], budget)
    assert int(whole.depth[1].max()) == budget, "the probability-one chain reaches depth B"
    for field in ("tokens", "parents", "depth", "valid", "visible", "scores"):
        assert torch.equal(getattr(whole, field), getattr(shallow, field)), field


def test_ancestor_mask_matches_parent_walk():
    g = torch.Generator().manual_seed(3)
    tree = build_ddtree(torch.tensor([0]), torch.randn(1, 6, 5, generator=g), 40)
    vis = ancestor_mask(tree.parents)[0]
    parents = tree.parents[0].tolist()
    for i in range(len(parents)):
        expect, j = {i}, i
        while parents[j] >= 0:
            j = parents[j]
            expect.add(j)
        assert set(torch.nonzero(vis[i]).flatten().tolist()) == expect
    assert torch.equal(tree.visible[0], vis)


def test_chain_and_root_only():
    logits = torch.randn(2, 4, 10)
    chain = build_chain(torch.tensor([3, 4]), logits)
    assert chain.tokens[:, 1:].tolist() == logits.argmax(-1).tolist()
    assert chain.parents[0].tolist() == [-1, 0, 1, 2, 3]
    assert torch.equal(chain.visible[1], torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    root = root_only(torch.tensor([9, 8]))
    assert root.tokens.tolist() == [[9], [8]] and root.size == 1


def test_padding_when_fewer_prefixes_than_budget():
    tree = build_ddtree(torch.tensor([0]), torch.randn(1, 2, 2), 10)  # only 6 prefixes exist
    assert tree.valid[0].tolist() == [True] * 7 + [False] * 4
    assert torch.equal(tree.visible[0, 7:], torch.eye(11, dtype=torch.bool)[7:]), "padding sees only itself"
    assert not tree.visible[0, :7, 7:].any(), "nobody sees padding"


def test_surrogate_expected_acceptance_matches_monte_carlo():
    """Prop. 1: E[accepted drafts] under Q = sum of the tree's node probabilities."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 3, 4, generator=g) * 1.5
    tree = build_ddtree(torch.tensor([0]), logits, 8)
    probs = torch.softmax(logits[0].double(), -1)
    paths = tree_paths(tree, 0)
    expected = sum(math.prod(probs[i, t].item() for i, t in enumerate(p)) for p in paths)
    samples = torch.multinomial(probs, 20000, replacement=True, generator=g).T  # [n, depth]
    in_tree = set(paths)
    accepted = [next((d for d in range(3) if tuple(s[: d + 1]) not in in_tree), 3) for s in samples.tolist()]
    assert abs(sum(accepted) / len(accepted) - expected) < 0.03
