"""Verification: the tree attention mask, the target's decision at every node, and the walk.

The walk follows the target's own decoding rule: at T = 0 the argmax, at T > 0 one independent
sample per node from the target's processed distribution. Each emitted token is then a fresh draw
from p(. | accepted prefix), so speculative sampling is lossless without draft probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .tree import Tree


def tree_mask(lengths: Tensor, visible: Tensor, span: int) -> Tensor:
    """[bs, 1, N, span] bool: committed slots [0, L) for every node, tree slots L + j for j in visible[i]."""
    bs, n, _ = visible.shape
    cols = torch.arange(span, device=lengths.device)
    mask = (cols < lengths[:, None]).view(bs, 1, 1, span).expand(bs, 1, n, span).clone()
    tree_cols = (lengths[:, None] + torch.arange(n, device=lengths.device)).view(bs, 1, 1, n).expand(bs, 1, n, n)
    mask.scatter_(3, tree_cols, visible[:, None])
    return mask


@dataclass
class RowSampling:
    """Each row's sampling settings on the device, [rows] each: temperature (0: greedy), top_p, top_k (0:
    every token) and min_p. The engine keeps one for all its rows and writes a request's into its row."""

    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    min_p: Tensor

    @classmethod
    def greedy(cls, rows: int, device) -> RowSampling:
        zeros = torch.zeros(rows, device=device)
        return cls(
            zeros, torch.ones(rows, device=device), torch.zeros(rows, dtype=torch.long, device=device), zeros.clone()
        )

    def __getitem__(self, index) -> RowSampling:
        return RowSampling(self.temperature[index], self.top_p[index], self.top_k[index], self.min_p[index])


def processed_probs(logits: Tensor, rows: RowSampling) -> Tensor:
    """softmax(logits / T) [bs, ..., V] restricted, row by row, to its top_k most probable tokens, then to
    the top-p nucleus of those (renormalized, as transformers' and vLLM's samplers do), then to the tokens
    with at least min_p times the most probable one's probability. Each keeps the most probable token."""
    shape = (-1, *([1] * (logits.dim() - 1)))
    scores = logits.float() / rows.temperature.clamp(min=1e-6).view(shape)
    probs = torch.softmax(scores, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    top_k = torch.where(rows.top_k > 0, rows.top_k, vocab).view(shape)
    sorted_probs = sorted_probs * (torch.arange(vocab, device=logits.device) < top_k)
    total = sorted_probs.sum(-1, keepdim=True)
    sorted_probs = sorted_probs * ((sorted_probs.cumsum(-1) - sorted_probs) < rows.top_p.view(shape) * total)
    sorted_probs = sorted_probs * (sorted_probs >= rows.min_p.view(shape) * sorted_probs[..., :1])
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(-1, keepdim=True)


def decide(
    logits: Tensor,
    rows: RowSampling,
    generator: torch.Generator | None,
    sampling: bool,
    greedy: Tensor | None = None,
) -> Tensor:
    """The target's token at every node [bs, N]: argmax where T == 0 (`greedy` when the caller has it
    already), else a sample.

    `sampling` (known on the host) says whether any sequence has T > 0. Sampling uses the
    exponential race (argmax of p / E with E ~ Exp(1)), which needs no host sync.
    """
    if greedy is None:
        greedy = logits.argmax(-1)
    if not sampling:
        return greedy
    probs = processed_probs(logits, rows)
    race = torch.empty_like(probs).exponential_(generator=generator)
    sampled = (probs / race).argmax(-1)
    return torch.where((rows.temperature > 0)[:, None], sampled, greedy)


@dataclass
class Walk:
    path: Tensor  # [bs, D + 1] node indices of the accepted path (root first), padded with the last node
    accepted: Tensor  # [bs] nodes on the path, root included (the acceptance length of the round)
    bonus: Tensor  # [bs] the target's token after the path
    emitted: Tensor  # [bs, D + 1] tokens emitted this round: path tokens after the root, then the bonus


def walk(tree: Tree, decisions: Tensor, max_depth: int) -> Walk:
    """Follow the target's decisions down the tree, vectorised over depth (no host sync, ~20 kernels
    whatever the depth: a per-depth loop cost ~9 kernels a level inside every round's graph).

    A node agrees when its token is the target's decision at its parent; it is accepted when it and
    all its ancestors agree. Siblings carry distinct tokens, so at most one node per depth is
    accepted, and the deepest accepted node ends the path the sequential walk would follow."""
    bs, n = tree.tokens.shape
    dev = tree.tokens.device
    rows = torch.arange(bs, device=dev)
    parent_decision = torch.gather(decisions, 1, tree.parents.clamp(min=0))
    agree = ((tree.tokens == parent_decision) & tree.valid) | (torch.arange(n, device=dev) == 0)
    accepted_node = ~(tree.visible & ~agree[:, None, :]).any(-1)
    cur = torch.where(accepted_node, tree.depth, -1).argmax(-1)  # the deepest accepted node
    accepted = tree.depth[rows, cur] + 1
    # path[d] = the path's node at depth d (its ancestors are exactly visible[cur]); then cur repeated
    steps = torch.arange(max_depth + 1, device=dev)
    at_depth = torch.where(tree.visible[rows, cur], tree.depth, max_depth + 1)
    path = torch.zeros(bs, max_depth + 2, dtype=torch.long, device=dev)
    path.scatter_(1, at_depth, torch.arange(n, device=dev).expand(bs, n))
    path = torch.where(steps[None] < accepted[:, None], path[:, :-1], cur[:, None])
    bonus = decisions[rows, cur]
    # emitted[j] = token of path[j + 1] for j < accepted - 1, then the bonus at j = accepted - 1
    path_tokens = torch.gather(tree.tokens, 1, path)
    nxt = torch.cat([path_tokens[:, 1:], path_tokens[:, -1:]], dim=1)
    emitted = torch.where(steps[None] == (accepted - 1)[:, None], bonus[:, None], nxt)
    return Walk(path=path, accepted=accepted, bonus=bonus, emitted=emitted)
