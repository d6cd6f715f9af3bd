"""What a DFlash drafter is trained on: the recipe (TrainConfig), batches of anchored blocks from
self-distilled sequences, the target features and the block loss.

Training forward (no KV cache). For a batch of self-distilled sequences (prompt + the target's own
continuation):
  1. one no-grad target forward over every token (causal) gives the tapped hidden states;
  2. per sequence, random anchors among continuation tokens (the anchor and the next token are
     both continuation); anchor a plays the bonus token of a draft round at position a;
  3. each anchor forms a block [token a, MASK x (BS-1)] at positions a..a+BS-1, embedded with the
     target's embedding. Block queries attend to the context keys at positions < a (the fused
     features hidden_norm(fc(taps)), projected by the layer's own k/v) and to all keys of their own
     block, never to other blocks: one SDPA call over [context keys ; all block keys] with a
     boolean mask. This is exactly what inference computes with the drafter cache (a test checks it);
  4. the target's LM head on block slots 1..BS-1; cross-entropy against the target's tokens at
     a+1..a+BS-1 (the continuation IS the target's decoding), slot k weighted by exp(-(k-1)/gamma).
The target (embedding and LM head included) is frozen; only the drafter's own weights train.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.layers import apply_rope, rope_cos_sin, rope_inv_freq
from ..models.llama import Transformer
from ..speculative.drafter import (
    DFlashDrafter,
    DrafterConfig,
    default_target_layer_ids,
)
from .data import TokenData

CHECKPOINT = "checkpoint"
# TrainConfig fields that a resumed run may change (the rest is the recipe, fixed by the checkpoint)
RESUMABLE = (
    "steps",
    "max_minutes",
    "eval_every",
    "eval_batches",
    "save_every",
    "log_every",
    "final_eval_prompts",
    "final_eval_tokens",
    "final_eval_budget",
    "save_dtype",
)


@dataclass
class TrainConfig:
    layers: int = 2
    block_size: int = 16
    taps: list[int] | None = None  # target layer ids; default: default_taps()
    intermediate_size: int | None = None  # default: the target's
    mask_token_id: int | None = None  # default: the last vocabulary row
    steps: int = 2000
    batch_size: int = 32  # sequences per step
    anchors_per_seq: int = 32
    max_len: int = 1024  # longer sequences are cut
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of the steps
    min_lr_ratio: float = 0.0  # cosine decays to lr * this
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    gamma: float = 7.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 250
    eval_batches: int = 4
    save_every: int = 500
    max_minutes: float | None = None
    final_eval_prompts: int = 8
    final_eval_tokens: int = 128
    final_eval_budget: int = 32
    save_dtype: str = "bfloat16"
    init_from_target: list[int] | None = None  # target layers copied into the drafter layers at step 0

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


def default_taps(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """At least 3 evenly spread taps on deep targets (a thin drafter gains from low, middle and high
    target features at the small cost of `fc`), the published DFlash rule otherwise; deduplicated.
    SmolLM2 (30 layers), 1-3 draft layers: [1, 14, 27]."""
    k = max(num_draft_layers, 3) if num_target_layers >= 12 else num_draft_layers
    ids = default_target_layer_ids(num_target_layers, k)
    return sorted({min(max(i, 0), num_target_layers - 1) for i in ids})


def copy_target_layers(drafter: DFlashDrafter, target: Transformer, layer_ids: list[int]) -> None:
    """Start drafter layer i as a copy of target layer layer_ids[i] (attention, MLP, norms), and `fc` as
    the identity on the deepest tap. A warm start: the drafter's output feeds the target's final norm
    and LM head, so copies of late target layers begin in the space that head reads."""
    if len(layer_ids) != len(drafter.layers):
        raise ValueError(
            f"--init-from-target names {len(layer_ids)} target layers for {len(drafter.layers)} drafter layers"
        )
    bad = [i for i in layer_ids if not 0 <= i < len(target.model.layers)]
    if bad:
        raise ValueError(f"--init-from-target {bad} outside the target's {len(target.model.layers)} layers")
    with torch.no_grad():
        for d_layer, i in zip(drafter.layers, layer_ids):
            t_state = target.model.layers[i].state_dict()
            for name, p in d_layer.state_dict(keep_vars=True).items():
                if name in t_state and t_state[name].shape == p.shape:
                    p.copy_(t_state[name].to(p.dtype))
        h = drafter.config.hidden_size
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -h:].copy_(torch.eye(h, dtype=drafter.fc.weight.dtype))


def make_drafter_config(target_cfg, cfg: TrainConfig) -> DrafterConfig:
    taps = cfg.taps or default_taps(target_cfg.num_hidden_layers, cfg.layers)
    dcfg = DrafterConfig.for_target(
        target_cfg,
        num_layers=cfg.layers,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=list(taps),
        intermediate_size=cfg.intermediate_size,
    )
    dcfg.check_target(target_cfg)
    return dcfg


# ---- batches --------------------------------------------------------------------------------------


@dataclass
class Batch:
    tokens: Tensor  # [B, T] long, right-padded with 0
    lengths: Tensor  # [B]
    anchors: Tensor  # [B, A] long (padding anchors point at a valid position but carry no loss)
    anchor_valid: Tensor  # [B, A] bool
    labels: Tensor  # [B, A, BS-1]: the token at anchor + k, k = 1..BS-1
    label_mask: Tensor  # [B, A, BS-1] bool

    def to(self, device) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))


def _gen(*keys: int) -> torch.Generator:
    h = 0x9E3779B97F4A7C15
    for k in keys:
        h = (h * 6364136223846793005 + (k & 0xFFFFFFFFFFFF) + 1442695040888963407) & ((1 << 63) - 1)
    return torch.Generator().manual_seed(h)


def build_batch(
    data: TokenData, seq_ids: list[int], anchors_per_seq: int, block_size: int, max_len: int, gen: torch.Generator
) -> Batch:
    """Sequences seq_ids, each cut to max_len, with up to anchors_per_seq random anchors among
    positions a where a and a+1 are continuation tokens (prompt_len <= a <= len-2)."""
    seqs, plens = [], []
    for i in seq_ids:
        toks, p = data.sequence(int(i))
        seqs.append(toks[:max_len])
        plens.append(p)
    B, A, D = len(seqs), anchors_per_seq, block_size - 1
    T = max(s.shape[0] for s in seqs)
    tokens = torch.zeros(B, T, dtype=torch.long)
    lengths = torch.tensor([s.shape[0] for s in seqs])
    anchors = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    for b, (s, p) in enumerate(zip(seqs, plens)):
        n = s.shape[0]
        tokens[b, :n] = s
        lo, hi = p, n - 2  # inclusive range of anchors
        count = hi - lo + 1
        if count <= 0:  # no supervised pair left after the cut: a dummy anchor without loss
            anchors[b] = max(0, n - 1)
            continue
        pick = torch.randperm(count, generator=gen)[:A] + lo
        pick = pick.sort().values
        anchors[b, : pick.shape[0]] = pick
        anchors[b, pick.shape[0] :] = lo
        valid[b, : pick.shape[0]] = True
    k = torch.arange(1, block_size)
    pos = anchors[..., None] + k  # [B, A, D]
    label_mask = (pos < lengths[:, None, None]) & valid[..., None]
    labels = torch.gather(tokens, 1, pos.clamp(max=T - 1).view(B, -1)).view(B, A, D)
    labels = torch.where(label_mask, labels, 0)
    return Batch(tokens, lengths, anchors, valid, labels, label_mask)


class Sampler:
    """Stateless: the sequences and anchors of step s depend only on (seed, s), so a resumed run
    draws exactly the batches of an uninterrupted one. Sequences are visited epoch by epoch in a
    per-epoch permutation."""

    def __init__(self, data: TokenData, cfg: TrainConfig):
        self.data, self.cfg = data, cfg
        self.train_ids = data.indices(held_out=False).tolist()
        self.held_ids = data.indices(held_out=True).tolist()
        if not self.train_ids:
            raise ValueError("the training data has no training sequences")
        self._perm: tuple[int, list[int]] | None = None

    def _epoch(self, e: int) -> list[int]:
        if self._perm is None or self._perm[0] != e:
            order = torch.randperm(len(self.train_ids), generator=_gen(self.cfg.seed, 1, e)).tolist()
            self._perm = (e, [self.train_ids[i] for i in order])
        return self._perm[1]

    def train_batch(self, step: int) -> Batch:
        n, B = len(self.train_ids), self.cfg.batch_size
        ids = []
        for j in range(step * B, (step + 1) * B):
            ids.append(self._epoch(j // n)[j % n])
        return build_batch(
            self.data,
            ids,
            self.cfg.anchors_per_seq,
            self.cfg.block_size,
            self.cfg.max_len,
            _gen(self.cfg.seed, 2, step),
        )

    def eval_batches(self) -> list[Batch]:
        """Fixed held-out batches (the same at every evaluation, and across resumes)."""
        ids = self.held_ids or self.train_ids[: self.cfg.batch_size]
        out = []
        for e in range(self.cfg.eval_batches):
            chunk = ids[e * self.cfg.batch_size : (e + 1) * self.cfg.batch_size]
            if not chunk:
                break
            out.append(
                build_batch(
                    self.data,
                    chunk,
                    self.cfg.anchors_per_seq,
                    self.cfg.block_size,
                    self.cfg.max_len,
                    _gen(self.cfg.seed, 3, e),
                )
            )
        return out


# ---- the training forward -------------------------------------------------------------------------


def _ensure_target_cache(target: Transformer, batch: int, slots: int) -> None:
    cache = target.cache_storage
    # caches made under inference_mode (data generation, Engine) cannot be written outside it
    if cache is None or cache.is_inference() or target.max_batch < batch or target.max_slots < slots:
        target.setup_caches(max(batch, target.max_batch), max(slots, target.max_slots))


@torch.no_grad()
def target_features(target: Transformer, tokens: Tensor, taps: list[int]) -> Tensor:
    """Tapped hidden states [B, T, len(taps)*H] of every token, one causal no-grad forward
    (as Engine.add does for a prompt). Right padding never influences real tokens."""
    B, T = tokens.shape
    _ensure_target_cache(target, B, T)
    j = torch.arange(T, device=tokens.device)
    causal = (j[:, None] >= j[None, :]).view(1, 1, T, T).expand(B, 1, T, T)
    pos = j.expand(B, T)
    _, feats = target(tokens, pos, pos, causal, tuple(taps), logits=False)
    return feats


def block_hidden(
    drafter: DFlashDrafter, target: Transformer, features: Tensor, tokens: Tensor, anchors: Tensor
) -> Tensor:
    """Drafter output (final-normed) [B, A, BS, H] for blocks [tokens[a], MASK...] at positions
    a..a+BS-1; block queries see context positions < a and their own block only."""
    cfg = drafter.config
    B, T = tokens.shape
    A, BS, H = anchors.shape[1], cfg.block_size, cfg.hidden_size
    N = A * BS
    dev = tokens.device
    block_tok = torch.full((B, A, BS), cfg.mask_token_id, dtype=torch.long, device=dev)
    block_tok[..., 0] = torch.gather(tokens, 1, anchors)
    with torch.no_grad():
        x = target.embed(block_tok.view(B, N))
    blk_pos = (anchors[..., None] + torch.arange(BS, device=dev)).view(B, N)
    ctx_pos = torch.arange(T, device=dev).expand(B, T)
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(dev)
    # RoPE tables in the target's dtype, as at inference (DFlashDrafter.forward uses the block's dtype)
    rope_blk = rope_cos_sin(inv_freq, blk_pos, x.dtype)
    rope_ctx = rope_cos_sin(inv_freq, ctx_pos, x.dtype)
    ctx = drafter.hidden_norm(drafter.fc(features))
    # mask over [T context keys ; N block keys]: context j < anchor, block keys of the same anchor
    see_ctx = ctx_pos[:, None, :] < anchors[..., None]  # [B, A, T]
    see_ctx = see_ctx[:, :, None, :].expand(B, A, BS, T).reshape(B, N, T)
    blk_id = torch.arange(N, device=dev) // BS
    see_blk = (blk_id[:, None] == blk_id[None, :]).expand(B, N, N)
    mask = torch.cat([see_ctx, see_blk], dim=-1)[:, None]  # [B, 1, N, T + N]
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        k_ctx, v_ctx = attn._kv(ctx, *rope_ctx)
        k_blk, v_blk = attn._kv(h, *rope_blk)
        q = attn.q_norm(attn.q_proj(h).view(B, N, attn.n_heads, attn.head_dim)).transpose(1, 2)
        q = apply_rope(q, *rope_blk)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        if attn.n_heads != attn.n_kv:
            rep = attn.n_heads // attn.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(B, N, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).view(B, A, BS, H)


def position_weights(block_size: int, gamma: float, device=None) -> Tensor:
    """exp(-(k-1)/gamma) for block slots k = 1..block_size-1."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_loss(
    drafter: DFlashDrafter, target: Transformer, batch: Batch, gamma: float, features: Tensor | None = None
) -> dict:
    """Weighted cross-entropy of the block slots 1..BS-1, plus the greedy-chain acceptance estimate
    (leading slots whose argmax equals the target's token, +1) per valid anchor."""
    cfg = drafter.config
    if features is None:
        features = target_features(target, batch.tokens, cfg.target_layer_ids)
    hidden = block_hidden(drafter, target, features, batch.tokens, batch.anchors)[:, :, 1:]  # [B, A, D, H]
    sel = batch.label_mask
    logits = target.lm_head(hidden[sel])  # only supervised rows: [M, V]
    labels = batch.labels[sel]
    w = position_weights(cfg.block_size, gamma, hidden.device).expand_as(sel)[sel]
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    loss = (ce * w).sum() / w.sum().clamp(min=1e-9)
    with torch.no_grad():
        correct = torch.zeros_like(sel)
        correct[sel] = logits.argmax(-1) == labels
        accepted = correct.long().cumprod(-1).sum(-1) + 1  # [B, A]
        valid = batch.anchor_valid
        acc_len = accepted[valid].float().mean() if valid.any() else torch.tensor(1.0)
        top1 = (correct.sum() / sel.sum().clamp(min=1)).float()
    return {
        "loss": loss,
        "acc_len": acc_len,
        "top1": top1,
        "rows": int(sel.sum()),
        "ce_sum": (ce * w).sum().detach(),
        "w_sum": w.sum().detach(),
        "acc_sum": accepted[valid].sum().detach(),
        "anchors": int(valid.sum()),
    }


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    losses: list[float] = field(default_factory=list)  # per step of this run
    acc_lens: list[float] = field(default_factory=list)
    eval: dict = field(default_factory=dict)  # last held-out evaluation
    final_eval: dict = field(default_factory=dict)  # real Engine acceptance lengths
    stopped: str = "steps"  # steps / time / interrupted / until
