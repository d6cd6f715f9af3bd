"""DFlash2 drafter, compatible with the `DFlash2DraftModel` checkpoint layout.

DFlash2 is the DFlash drafter (drafter.py) with two additions:
- every layer wraps its attention and its MLP in a causal grouped dynamic convolution over the block's
  positions: before the sublayer its input is convolved, after it its output, each with taps that are a
  learned base (per channel) plus a per-position term (per channel group) projected from the sublayer's
  normed input. The convolution runs inside the block only (the block's first position sees zeros before
  it), so the context keys/values stay what DFlash caches.
- a candidate selector replaces the per-position argmax: each draft position keeps its top-k draft tokens
  and rescores them with the unary draft logit plus a rank-r term of the token chosen before it
  (<predecessor[prev] * P hidden, successor[candidate]>), choosing left to right from the bonus token.
  A position's draft therefore depends on its parent token, which the chain (`dflash`) follows and a
  DDTree (one fixed distribution per depth) cannot.

The config and checkpoint are read as the authors' reference reads them (PyPI `dflash` 0.1.0,
dflash/model.py: DFlash2DraftModel); tests/test_dflash2_parity.py checks the two against each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .drafter import DFlashDrafter, DrafterConfig, DrafterLayer, DrafterMismatchError

ARCHITECTURE_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DFlash2Config(DrafterConfig):
    architecture: ClassVar[str] = "DFlash2DraftModel"

    # defaults only because the base dataclass has defaulted fields; from_hf requires all four
    conv_kernel_size: int = 4  # taps of each convolution: a position sees itself and the K - 1 before it
    conv_group_size: int = 64  # channels sharing one dynamic tap (hidden_size / this groups)
    selector_rank: int = 64  # rank of the selector's predecessor-successor term
    selector_top_k: int = 8  # candidates per draft position

    def drafter_class(self) -> type[DFlashDrafter]:
        return DFlash2Drafter

    @classmethod
    def architecture_fields(cls, cfg: dict, value: Callable[..., Any]) -> dict:
        fields = {}
        for name in ARCHITECTURE_KEYS:
            v = value(name)
            if v is None:
                raise DrafterMismatchError(f"DFlash2 drafter config has no {name}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 1:
                raise DrafterMismatchError(f"DFlash2 drafter {name} {v!r} must be a positive integer")
            fields[name] = int(v)
        if cfg["hidden_size"] % fields["conv_group_size"]:
            raise DrafterMismatchError(
                f"DFlash2 drafter conv_group_size {fields['conv_group_size']} does not divide hidden_size "
                f"{cfg['hidden_size']}"
            )
        if fields["selector_top_k"] > cfg["vocab_size"]:
            raise DrafterMismatchError(
                f"DFlash2 drafter selector_top_k {fields['selector_top_k']} exceeds the vocabulary of "
                f"{cfg['vocab_size']}"
            )
        return fields

    def to_hf(self) -> dict:
        cfg = super().to_hf()
        for name in ARCHITECTURE_KEYS:
            cfg["dflash_config"][name] = cfg.pop(name)
        return cfg


class DynamicConv(nn.Module):
    """The pair of causal grouped dynamic convolutions around one sublayer. One projection of the sublayer's
    normed input gives the per-position taps of both (`before` uses the first half, `after` the second);
    base_kernel [2, K, H] holds their per-channel base taps. Tap o of position t weighs position t - o."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def convolve(self, x: Tensor, dynamic: Tensor, base: Tensor) -> Tensor:
        """x [bs, T, H] over the block's T positions; dynamic [bs, T, K, groups]; base [K, H]."""
        bs, t, h = x.shape
        xg = x.view(bs, t, self.groups, self.group_size)
        out = torch.zeros_like(xg)
        for o in range(min(self.kernel_size, t)):  # taps reaching before the block's start see zeros
            shifted = xg if o == 0 else F.pad(xg[:, : t - o], (0, 0, 0, 0, o, 0))
            # base and dynamic parts added in turn (not their sum once): the reference's rounding
            out = out + base[o].view(self.groups, self.group_size).to(x.dtype) * shifted
            out = out + dynamic[:, :, o, :, None] * shifted
        return out.view(bs, t, h)

    def before(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The sublayer's input x (normed) convolved, and the dynamic taps `after` uses."""
        dynamic = self.kernel_projection(x).view(*x.shape[:2], 2, self.kernel_size, self.groups)
        return self.convolve(x, dynamic[:, :, 0], self.base_kernel[0]), dynamic[:, :, 1]

    def after(self, y: Tensor, dynamic: Tensor) -> Tensor:
        return self.convolve(y, dynamic, self.base_kernel[1])


class DFlash2Layer(DrafterLayer):
    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        assert isinstance(cfg, DFlash2Config)
        self.attention_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, h, next_norm, ctx, rope_blk, rope_ctx, blk_slots, ctx_slots, mask, meta=None):
        h, taps = self.attention_conv.before(h)
        h = self.self_attn(h, ctx, rope_blk, rope_ctx, blk_slots, ctx_slots, mask, meta)
        x = x + self.attention_conv.after(h, taps)
        h, taps = self.mlp_conv.before(self.post_attention_layernorm(x))
        x = x + self.mlp_conv.after(self.mlp(h), taps)
        return x, next_norm(x)


@dataclass
class Selection:
    tokens: Tensor  # [bs, D] the chosen token of each draft position, left to right
    candidates: Tensor  # [bs, D, k] each position's top-k draft tokens, by descending draft logit
    scores: Tensor  # [bs, D, k] the candidates' scores given the token chosen before them

    def probs(self, temperature: float) -> Tensor:
        """The selector's distribution over each position's candidates at `temperature` > 0, given the chosen
        predecessors: what a sampling selector draws a candidate from."""
        return torch.softmax(self.scores.float() / temperature, dim=-1)


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.successor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def forward(self, hidden: Tensor, logits: Tensor, anchors: Tensor) -> Selection:
        """hidden [bs, D, H] and logits [bs, D, V]: the drafter's states and draft logits at the D positions
        after the anchor; anchors [bs]: the token before the first (the bonus). Greedy, left to right: a
        position's pick is its best-scoring candidate given the previous pick. D static steps of a few small
        kernels each, with no host sync."""
        unary, candidates = logits.topk(self.top_k, dim=-1)
        # <pred[prev] * P h, succ[c]> = <pred[prev], P h * succ[c]>: the part without prev once for all positions
        right = self.successor_codebook(candidates) * self.hidden_projection(hidden)[:, :, None]  # [bs, D, k, r]
        prev = anchors
        tokens, scores = [], []
        for d in range(hidden.shape[1]):
            pred = self.predecessor_codebook(prev)  # [bs, r]
            s = unary[:, d] + (right[:, d] @ pred[:, :, None])[..., 0]
            prev = torch.gather(candidates[:, d], 1, s.argmax(-1, keepdim=True))[:, 0]
            tokens.append(prev)
            scores.append(s)
        return Selection(torch.stack(tokens, 1), candidates, torch.stack(scores, 1))


class DFlash2Drafter(DFlashDrafter):
    layer_class = DFlash2Layer

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg)

    @staticmethod
    def checkpoint_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
        # checkpoints may store the codebooks as bare tensors (the reference's from_pretrained maps them too)
        bare = {f"candidate_selector.{n}" for n in ("predecessor_codebook", "successor_codebook")}
        return {f"{k}.weight" if k in bare else k: v for k, v in state.items()}

    def select(self, hidden: Tensor, logits: Tensor, anchors: Tensor) -> Selection:
        """The chain's tokens from forward()'s hidden states after the bonus and their draft_logits."""
        return self.candidate_selector(hidden, logits, anchors)
