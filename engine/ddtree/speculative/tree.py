"""Draft trees: DDTree's top-B prefixes, the DFlash chain, and the root-only tree of plain decoding.

All three produce the same flat, static-shape batch layout so that verification and the walk are
shared: node 0 is the root (the last bonus token, already emitted), nodes are ordered so that
parent[i] < i, and `visible[i, j]` says whether node j is node i or one of its ancestors.

A DDTree lists its nodes best first (path score non-increasing), so its first b + 1 nodes are the tree of
budget b (`Tree.prefix`), and its path scores give the expected acceptance of every smaller budget
(`expected_accepted`): what `--budget auto` chooses from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Tree:
    tokens: Tensor  # [bs, N] long; N = budget + 1
    parents: Tensor  # [bs, N] long; -1 for the root
    depth: Tensor  # [bs, N] long; 0 for the root
    valid: Tensor  # [bs, N] bool; padded nodes (fewer prefixes than the budget) are False
    visible: Tensor  # [bs, N, N] bool; ancestor-or-self
    scores: Tensor | None = None  # [bs, N] float32 path log-probabilities under the draft (DDTree only)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def prefix(self, n: int) -> Tree:
        """The first n nodes: for a DDTree (nodes best first), the tree of budget n - 1."""
        if n == self.size:
            return self
        scores = self.scores[:, :n] if self.scores is not None else None
        return Tree(
            self.tokens[:, :n],
            self.parents[:, :n],
            self.depth[:, :n],
            self.valid[:, :n],
            self.visible[:, :n, :n],
            scores,
        )


def expected_accepted(scores: Tensor, budgets: Tensor) -> Tensor:
    """[bs, len(budgets)]: the drafted tokens a DDTree of each budget (>= 1) is expected to have accepted,
    if the target agreed with the draft: the sum of its nodes' path probabilities (paper, Prop. 1). scores
    [bs, N] are a best-first tree's path log-probabilities (root first; padding -inf), so the tree of budget
    b is its first b nodes after the root."""
    return torch.cumsum(scores[:, 1:].exp(), dim=1)[:, budgets - 1]


def ancestor_mask(parents: Tensor) -> Tensor:
    """visible[i] = visible[parent[i]] | {i}, by pointer doubling (log2(depth) steps, no host loop)."""
    bs, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(bs, n, n)
    # up[i] = the 2^k-th ancestor of i (root maps to itself); visible accumulates all of them
    up = torch.where(parents < 0, torch.arange(n, device=parents.device), parents)
    visible = eye | torch.nn.functional.one_hot(up, n).bool()
    steps = max(1, (n - 1).bit_length())
    for _ in range(steps):
        # visible[i] |= visible[up[i]]: everything reachable from the 2^k-th ancestor
        visible = visible | torch.gather(visible, 1, up[..., None].expand(bs, n, n))
        up = torch.gather(up, 1, up)
    return visible


def root_only(roots: Tensor) -> Tree:
    """Plain autoregressive decoding: verify just the bonus token."""
    bs = roots.shape[0]
    z = torch.zeros(bs, 1, dtype=torch.long, device=roots.device)
    return Tree(
        tokens=roots[:, None].clone(),
        parents=z - 1,
        depth=z,
        valid=torch.ones(bs, 1, dtype=torch.bool, device=roots.device),
        visible=torch.ones(bs, 1, 1, dtype=torch.bool, device=roots.device),
    )


def build_chain(roots: Tensor, draft_logits: Tensor) -> Tree:
    """DFlash: the argmax of every draft row as one chain of depth D."""
    return chain(roots, draft_logits.argmax(-1))


def chain(roots: Tensor, drafts: Tensor) -> Tree:
    """The chain root -> drafts[:, 0] -> ... -> drafts[:, D - 1] ([bs, D] tokens)."""
    bs, d = drafts.shape
    dev = roots.device
    tokens = torch.cat([roots[:, None], drafts], dim=1)
    idx = torch.arange(d + 1, device=dev)
    return Tree(
        tokens=tokens,
        parents=(idx - 1).expand(bs, -1).clone(),
        depth=idx.expand(bs, -1).clone(),
        valid=torch.ones(bs, d + 1, dtype=torch.bool, device=dev),
        visible=torch.tril(torch.ones(d + 1, d + 1, dtype=torch.bool, device=dev)).expand(bs, -1, -1).clone(),
    )


def top_candidates(draft_logits: Tensor, budget: int) -> tuple[Tensor, Tensor]:
    """Log-probabilities and ids of each draft row's top K = min(budget, V) tokens, [bs, D, K] each,
    sorted descending: all a DDTree of `budget` nodes can use."""
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    return logp.topk(min(budget, draft_logits.shape[-1]), dim=-1)


def build_ddtree(roots: Tensor, draft_logits: Tensor, budget: int) -> Tree:
    """The `budget` most probable prefixes under the factorised draft distribution (paper §4.2).

    Exact and tensorised: path scores never increase along a path, so the global top-B set is
    prefix-closed and holds at most B nodes per depth. Keeping the top-B candidates per depth
    (children of the previous depth's top-B, each limited to the row's top-K tokens, K = min(B, V))
    therefore keeps every node of the answer; a final top-B over all depths recovers it. A stable
    sort breaks score ties in favour of shallower nodes, so a parent always precedes its child.

    The Triton build (ddtree.runtime.fused.build_ddtree_triton) makes the same set in one launch.
    """
    bs, depth_max, vocab = draft_logits.shape
    dev = draft_logits.device
    b = budget
    k = min(b, vocab)
    top_lp, top_tok = top_candidates(draft_logits, budget)

    neg_inf = torch.full((bs, b), float("-inf"), device=dev)
    scores, parent_slot, tokens = [], [], []
    # depth 1: children of the root
    frontier = neg_inf.clone()
    frontier[:, :k] = top_lp[:, 0]
    first_tok = torch.zeros(bs, b, dtype=torch.long, device=dev)
    first_tok[:, :k] = top_tok[:, 0]
    scores.append(frontier)
    parent_slot.append(torch.full((bs, b), -1, dtype=torch.long, device=dev))
    tokens.append(first_tok)
    for d in range(1, depth_max):
        cand = frontier[:, :, None] + top_lp[:, d, None, :]  # [bs, B, K]
        frontier, flat = cand.reshape(bs, b * k).topk(b, dim=-1)
        scores.append(frontier)
        parent_slot.append(flat // k)
        tokens.append(torch.gather(top_tok[:, d], 1, flat % k))

    all_scores = torch.cat(scores, dim=1)  # [bs, D*B], depth-major, score-descending inside a depth
    # best first, padding (score -inf) last; a child never outscores its parent, and on a tie the stable
    # sort keeps the shallower (depth-major) one first, so a parent precedes its children
    chosen = torch.sort(all_scores, dim=1, descending=True, stable=True).indices[:, :b]
    node_scores = torch.gather(all_scores, 1, chosen)
    valid = torch.isfinite(node_scores)

    node_depth = chosen // b + 1
    all_parent = torch.cat(parent_slot, dim=1)
    all_tokens = torch.cat(tokens, dim=1)
    # parent's flat index = (depth-2)*B + parent_slot; map flat index -> node index (1-based, 0 = root)
    parent_flat = (node_depth - 2) * b + torch.gather(all_parent, 1, chosen)
    node_of_flat = torch.zeros(bs, depth_max * b, dtype=torch.long, device=dev)
    node_of_flat.scatter_(1, chosen, torch.arange(1, b + 1, device=dev).expand(bs, -1))
    node_parent = torch.where(
        node_depth == 1, torch.zeros_like(chosen), torch.gather(node_of_flat, 1, parent_flat.clamp(min=0))
    )
    node_parent = torch.where(valid, node_parent, torch.zeros_like(node_parent))

    zero = torch.zeros(bs, 1, dtype=torch.long, device=dev)
    parents = torch.cat([zero - 1, node_parent], dim=1)
    tree_tokens = torch.cat([roots[:, None], torch.gather(all_tokens, 1, chosen)], dim=1)
    tree_depth = torch.cat([zero, torch.where(valid, node_depth, torch.ones_like(node_depth))], dim=1)
    tree_valid = torch.cat([torch.ones(bs, 1, dtype=torch.bool, device=dev), valid], dim=1)
    visible = ancestor_mask(parents)
    # padded nodes see only themselves (never NaN rows), and nobody sees them
    eye = torch.eye(b + 1, dtype=torch.bool, device=dev)
    visible = torch.where(tree_valid[:, :, None] & tree_valid[:, None, :], visible, eye)
    tree_scores = torch.cat([torch.zeros(bs, 1, device=dev), node_scores], dim=1)
    return Tree(tree_tokens, parents, tree_depth, tree_valid, visible, tree_scores)
