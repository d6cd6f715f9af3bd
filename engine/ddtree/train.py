"""Train a DFlash drafter against a frozen target (self-distillation), and the CLI commands for it.

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

import copy
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .data import TokenData
from .drafter import (
    DFlashDrafter,
    DrafterConfig,
    default_target_layer_ids,
    init_drafter,
    load_drafter,
    save_drafter,
)
from .model import Transformer, apply_rope, rope_cos_sin, rope_inv_freq

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
    cache = target.model.layers[0].self_attn.kv_cache
    # caches made under inference_mode (data generation, Engine) cannot be written outside it
    if cache is None or cache.k.is_inference() or target.max_batch < batch or target.max_slots < slots:
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


@torch.no_grad()
def evaluate(
    drafter: DFlashDrafter, target: Transformer, batches: list[Batch], gamma: float, device, autocast: bool
) -> dict:
    was_training = drafter.training
    drafter.eval()
    ce = w = acc = n = 0.0
    for b in batches:
        with _autocast(device, autocast):
            out = block_loss(drafter, target, b.to(device), gamma)
        ce += float(out["ce_sum"])
        w += float(out["w_sum"])
        acc += float(out["acc_sum"])
        n += out["anchors"]
    drafter.train(was_training)
    return {"loss": ce / max(w, 1e-9), "acc_len": acc / max(n, 1)}


def _autocast(device, enabled: bool):
    dev = torch.device(device)
    if enabled and dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(dev.type, enabled=False)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup * steps, then cosine from lr down to lr * min_lr_ratio (step is 0-based)."""
    warm = max(1, round(cfg.warmup * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, cfg.steps - warm))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ---- checkpoints ----------------------------------------------------------------------------------


def save_checkpoint(folder: Path, drafter: DFlashDrafter, opt: torch.optim.Optimizer, state: dict) -> None:
    """drafter (fp32, z-lab layout) + optimizer + trainer state + RNG, written to a temp folder and
    swapped in, so an interrupted save never leaves a half checkpoint."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        for f in tmp.iterdir():
            f.unlink()
    save_drafter(drafter, tmp)
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        if old.exists():
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        folder.rename(old)
    tmp.rename(folder)
    if old.exists():
        for f in old.iterdir():
            f.unlink()
        old.rmdir()


def find_checkpoint(path: str | Path) -> Path:
    p = Path(path)
    if (p / CHECKPOINT / "trainer_state.json").is_file():
        return p / CHECKPOINT
    if (p / "trainer_state.json").is_file():
        return p
    raise FileNotFoundError(f"no training checkpoint in {path} (expected {p / CHECKPOINT}/trainer_state.json)")


# ---- the training loop ----------------------------------------------------------------------------


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    losses: list[float] = field(default_factory=list)  # per step of this run
    acc_lens: list[float] = field(default_factory=list)
    eval: dict = field(default_factory=dict)  # last held-out evaluation
    final_eval: dict = field(default_factory=dict)  # real Engine acceptance lengths
    stopped: str = "steps"  # steps / time / interrupted / until


def train_drafter(
    target: Transformer,
    data: TokenData,
    out_dir: str | Path,
    cfg: TrainConfig | None = None,
    *,
    device: str | None = None,
    init: str | Path | None = None,
    resume: str | Path | None = None,
    until_step: int | None = None,
    progress: bool = True,
    final_eval: bool = True,
    command: str | None = None,
    target_name: str | None = None,
    data_path: str | None = None,
    overrides: dict | None = None,
) -> TrainResult:
    """Train (or resume training) a drafter for the frozen `target` on `data`; write the drafter in
    the z-lab layout to out_dir, plus checkpoint/, training_log.jsonl and a README.md model card.

    `until_step` stops early (as if interrupted) after that many total steps; `resume` continues a
    checkpoint: its TrainConfig wins, except the RESUMABLE fields, taken from `cfg` when given, or from
    the `overrides` dict (field -> value) when only some of them should change."""
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = device or str(target.lm_head.weight.device)
    dev = torch.device(device)
    target.requires_grad_(False).eval()
    autocast = dev.type == "cuda"

    start_step, elapsed_before, state = 0, 0.0, {}
    if resume is not None:
        ckpt = find_checkpoint(resume)
        state = json.loads((ckpt / "trainer_state.json").read_text())
        saved = TrainConfig.from_dict(state["config"])
        # a resumed run may extend or re-pace training, not change the recipe
        for name in RESUMABLE:
            if cfg is not None:
                setattr(saved, name, getattr(cfg, name))
            if overrides and overrides.get(name) is not None:
                setattr(saved, name, overrides[name])
        cfg = saved
        drafter = load_drafter(ckpt, target.config, dtype=torch.float32, device=dev)
        start_step, elapsed_before = int(state["step"]), float(state.get("elapsed", 0.0))
    else:
        cfg = copy.deepcopy(cfg) if cfg is not None else TrainConfig()
        if init is not None:
            from .loading import resolve_model

            drafter = load_drafter(resolve_model(str(init)), target.config, dtype=torch.float32, device=dev)
        else:
            drafter = init_drafter(make_drafter_config(target.config, cfg), seed=cfg.seed).to(dev)
            if cfg.init_from_target:
                copy_target_layers(drafter, target, cfg.init_from_target)
    dcfg = drafter.config
    dcfg.check_target(target.config)
    cfg.block_size, cfg.layers, cfg.taps = dcfg.block_size, dcfg.num_hidden_layers, list(dcfg.target_layer_ids)
    check_data(data, target)
    drafter.train()

    decay = [p for n, p in drafter.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in drafter.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
        fused=dev.type == "cuda",
    )
    if resume is not None:
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=dev, weights_only=True))
        rng = torch.load(ckpt / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    sampler = Sampler(data, cfg)
    eval_set = sampler.eval_batches()
    log_path = out / "training_log.jsonl"
    if resume is None and log_path.exists():
        log_path.unlink()

    def write(rec: dict) -> None:
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(json.dumps(rec) + "\n")

    n_params = sum(p.numel() for p in drafter.parameters())
    if resume is None:
        manifest = {k: v for k, v in data.manifest.items() if k not in ("files", "held_out_files")}
        write(
            {
                "event": "start",
                "config": asdict(cfg),
                "drafter": dcfg.to_hf(),
                "params": n_params,
                "data": manifest,
                "data_path": _relative_to(data_path, out),
                "target": target_name,
                "device": device,
                "command": command,
            }
        )
    else:
        write({"event": "resume", "step": start_step, "command": command})

    result = TrainResult(out, start_step)
    history = state.get("history", [])
    best = state.get("eval", {})
    ema = state.get("ema_acc")
    end_step = cfg.steps if until_step is None else min(cfg.steps, until_step)
    t_start = time.perf_counter()
    toks = 0
    bar = tqdm(
        total=cfg.steps, initial=start_step, desc="train-drafter", unit="step", disable=not progress, dynamic_ncols=True
    )
    step = start_step
    stopped = "steps"

    def checkpoint(step: int) -> None:
        save_checkpoint(
            out / CHECKPOINT,
            drafter,
            opt,
            {
                "step": step,
                "config": asdict(cfg),
                "elapsed": elapsed_before + time.perf_counter() - t_start,
                "ema_acc": ema,
                "eval": best,
                "history": history[-200:],
                "target": target_name,
                "data": data_path,
            },
        )

    try:
        while step < end_step:
            if cfg.max_minutes is not None and time.perf_counter() - t_start > 60 * cfg.max_minutes:  # per run
                stopped = "time"
                break
            batch = sampler.train_batch(step).to(dev)
            lr = lr_at(step, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            with _autocast(dev, autocast):
                outd = block_loss(drafter, target, batch, cfg.gamma)
            opt.zero_grad(set_to_none=True)
            outd["loss"].backward()
            gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            loss, acc = float(outd["loss"].detach()), float(outd["acc_len"])
            result.losses.append(loss)
            result.acc_lens.append(acc)
            ema = acc if ema is None else 0.98 * ema + 0.02 * acc
            toks += int(batch.lengths.sum())
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{ema:.2f}", lr=f"{lr:.1e}")
            if step % cfg.log_every == 0 or step == end_step:
                el = time.perf_counter() - t_start
                rec = {
                    "step": step,
                    "loss": round(loss, 5),
                    "acc_len": round(acc, 4),
                    "acc_len_ema": round(ema, 4),
                    "top1": round(float(outd["top1"]), 4),
                    "lr": lr,
                    "grad_norm": round(float(gnorm), 4),
                    "tokens_per_s": round(toks / max(el, 1e-9)),
                    "elapsed": round(elapsed_before + el, 2),
                }
                history.append({"step": step, "loss": rec["loss"], "acc_len": rec["acc_len"]})
                write(rec)
            if cfg.eval_every and step % cfg.eval_every == 0 and eval_set:
                best = {"step": step, **evaluate(drafter, target, eval_set, cfg.gamma, dev, autocast)}
                write({"event": "eval", **best})
                bar.write(f"step {step}: held-out loss {best['loss']:.4f}, acceptance estimate {best['acc_len']:.3f}")
            if cfg.save_every and step % cfg.save_every == 0 and step < end_step:
                checkpoint(step)
        if until_step is not None and step >= until_step and step < cfg.steps:
            stopped = "until"
    except KeyboardInterrupt:
        stopped = "interrupted"
        bar.close()
        checkpoint(step)
        write({"event": "interrupted", "step": step})
        raise
    bar.close()
    result.step, result.stopped = step, stopped
    if eval_set and (not best or best.get("step") != step):
        best = {"step": step, **evaluate(drafter, target, eval_set, cfg.gamma, dev, autocast)}
        write({"event": "eval", **best})
    result.eval = best
    checkpoint(step)
    final = copy.deepcopy(drafter).to(_dtype(cfg.save_dtype))
    save_drafter(final, out)
    if final_eval and stopped != "until" and sampler.held_ids and cfg.final_eval_prompts > 0:
        result.final_eval = measure_acceptance(target, drafter, data, sampler.held_ids, cfg)
        write({"event": "final_eval", **result.final_eval})
    elapsed = elapsed_before + time.perf_counter() - t_start
    write({"event": "end", "step": step, "stopped": stopped, "elapsed": round(elapsed, 2)})
    write_model_card(
        out, cfg, dcfg, n_params, data, result, history, elapsed, command, target_name, _relative_to(data_path, out)
    )
    return result


def _relative_to(path: str | None, out: Path) -> str | None:
    """A data path as the log and the model card give it: relative to the output folder, so that a
    drafter's files name no folder of the machine it was trained on. The checkpoint keeps the path
    as given (--resume reads the data from there)."""
    if path is None:
        return None
    return Path(os.path.relpath(Path(path).resolve(), out.resolve())).as_posix()


def _short(items) -> str:
    if isinstance(items, list) and len(items) > 4:
        return f"{items[:3]} and {len(items) - 3} more"
    return str(items)


def _dtype(name: str) -> torch.dtype:
    return {
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
    }[name]


def check_data(data: TokenData, target: Transformer) -> None:
    vocab = target.config.vocab_size
    mx = int(data.tokens.max()) if data.tokens.numel() else 0
    if mx >= vocab or data.manifest.get("vocab_size", vocab) != vocab:
        raise ValueError(
            f"the training data was made for a vocabulary of {data.manifest.get('vocab_size', '?')} "
            f"tokens (max id {mx}), the target has {vocab}: regenerate it with `ddtree make-data "
            f"--target` for this target"
        )


@torch.no_grad()
def measure_acceptance(
    target: Transformer, drafter: DFlashDrafter, data: TokenData, held_ids: list[int], cfg: TrainConfig
) -> dict:
    """Real acceptance lengths of Engine dflash and ddtree (budget cfg.final_eval_budget), greedy,
    on the prompts of the first held-out sequences, plus whether both emit the `ar` tokens."""
    from .build import make_engine
    from .config import SpeculationConfig
    from .engine import SamplingParams

    dtype = target.lm_head.weight.dtype
    d = copy.deepcopy(drafter).to(dtype).eval()
    prompts = []
    for i in held_ids[: cfg.final_eval_prompts]:
        toks, p = data.sequence(i)
        prompts.append(toks[:p].tolist())
    stops = tuple(data.manifest.get("stop_token_ids", ()))
    sp = SamplingParams(max_new_tokens=cfg.final_eval_tokens, stop_token_ids=stops)
    max_seq = max(len(p) for p in prompts) + cfg.final_eval_tokens
    out = {"prompts": len(prompts), "max_new_tokens": cfg.final_eval_tokens}
    ref = None
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", cfg.final_eval_budget)):
        eng = make_engine(
            target,
            None if method == "ar" else d,
            SpeculationConfig(method, budget),
            max_batch_size=len(prompts),
            max_seq_len=max_seq,
        )
        t0 = time.perf_counter()
        res = eng.generate(prompts, sp)
        secs = time.perf_counter() - t0
        key = method if method != "ddtree" else f"ddtree_b{budget}"
        ntok = sum(len(r.token_ids) for r in res)
        out[key] = {
            "acceptance_length": round(sum(r.acceptance_length for r in res) / len(res), 4),
            "tokens_per_second": round(ntok / secs, 1),
        }
        if ref is None:
            ref = [r.token_ids for r in res]
        else:
            out[key]["same_as_ar"] = sum(r.token_ids == t for r, t in zip(res, ref)) / len(res)
    return out


def write_model_card(
    out: Path,
    cfg: TrainConfig,
    dcfg: DrafterConfig,
    n_params: int,
    data: TokenData,
    result: TrainResult,
    history: list,
    elapsed: float,
    command: str | None,
    target_name: str | None,
    data_path: str | None,
) -> None:
    m = data.manifest
    recent = [h["loss"] for h in history[-10:]]
    loss_line = (
        f"- final training loss (mean of the last logged steps): {sum(recent) / len(recent):.4f}"
        if recent
        else "- no logged steps"
    )
    lines = [
        f"# DFlash drafter for {target_name or m.get('target', 'the target')}",
        "",
        (
            "A block-diffusion drafter in the z-lab `DFlashDraftModel` layout (`config.json` + `model.safetensors`), "
            "trained by `ddtree train-drafter` on the target's own continuations (self-distillation)."
        ),
        "",
        "## Drafter",
        "",
        (
            f"- layers: {dcfg.num_hidden_layers}, hidden {dcfg.hidden_size}, intermediate {dcfg.intermediate_size}, "
            f"heads {dcfg.num_attention_heads}/{dcfg.num_key_value_heads}"
        ),
        (
            f"- block size: {dcfg.block_size}, mask token id: {dcfg.mask_token_id}, "
            f"target layer ids: {dcfg.target_layer_ids}"
        ),
        f"- parameters: {n_params / 1e6:.2f} M ({cfg.save_dtype})",
        "",
        "## Data",
        "",
        f"- file: `{data_path}`" if data_path else "- in-memory data",
        (
            f"- sequences: {m.get('num_train', '?')} train, {m.get('num_held_out', '?')} held out "
            f"(held-out prompts come from held-out source files); kinds {m.get('kinds', {})}"
        ),
        (
            f"- tokens: {m.get('tokens', int(data.tokens.numel()))} "
            f"({m.get('continuation_tokens', '?')} continuation), "
            f"sources {_short(m.get('sources', '?'))}, {m.get('num_files', '?')} files, "
            f"temperature {m.get('temperature', '?')}, seed {m.get('seed', '?')}"
        ),
        "",
        "## Training",
        "",
        f"- steps: {result.step} of {cfg.steps} (stopped by: {result.stopped}), {elapsed / 60:.1f} min",
        (
            f"- batch {cfg.batch_size} sequences x {cfg.anchors_per_seq} anchors, lr {cfg.lr} (warmup {cfg.warmup}, "
            f"cosine), AdamW betas {list(cfg.betas)}, weight decay {cfg.weight_decay}, grad clip {cfg.grad_clip}, "
            f"gamma {cfg.gamma}, seed {cfg.seed}"
        ),
        loss_line,
    ]
    if cfg.init_from_target:
        lines.insert(
            -1, f"- drafter layers initialised from target layers {cfg.init_from_target} (`--init-from-target`)"
        )
    if result.eval:
        lines.append(
            f"- held-out loss {result.eval['loss']:.4f}, held-out acceptance estimate (greedy chain, "
            f"bonus included) {result.eval['acc_len']:.3f} at step {result.eval['step']}"
        )
    if result.final_eval:
        fe = result.final_eval
        lines += [
            "",
            "## Held-out acceptance length (Engine, greedy)",
            "",
            (
                f"{fe['prompts']} held-out prompts, up to {fe['max_new_tokens']} new tokens; acceptance length = "
                'committed tokens per verify round, bonus included. "output == ar" is the share of prompts '
                "whose tokens equal plain greedy decoding: 1.00 in fp32; in bf16 the differently shaped verify "
                "forward can flip near-tie argmaxes."
            ),
            "",
            "| method | acceptance length | tokens/s | output == ar |",
            "|---|---|---|---|",
        ]
        for key, v in fe.items():
            if isinstance(v, dict):
                lines.append(
                    f"| {key} | {v['acceptance_length']:.3f} | {v['tokens_per_second']} | "
                    f"{v.get('same_as_ar', 1.0):.2f} |"
                )
    lines += ["", "## Command", "", "```", command or "(python API)", "```", ""]
    (out / "README.md").write_text("\n".join(lines))


# ---- command line -----------------------------------------------------------------------------------


def _usage(msg: str):
    from .cli import UsageError

    return UsageError(msg)


def _parse_ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise _usage(f"{flag} takes comma-separated integers, got '{text}'") from None


def _data_path(p: str) -> Path:
    path = Path(p)
    return path / "data.safetensors" if path.suffix != ".safetensors" else path


def _file_errors_as_usage(handler):
    """Missing data / corpus / checkpoint paths are user errors: one line, exit code 2."""
    import functools

    @functools.wraps(handler)
    def run(args) -> int:
        try:
            return handler(args)
        except FileNotFoundError as exc:
            raise _usage(str(exc)) from None

    return run


@_file_errors_as_usage
def cmd_make_data(args) -> int:
    from .build import device_and_dtype, load_target
    from .data import make_data

    for name in ("num_prompts", "prompt_tokens", "continuation_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise _usage(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.held_out < 1:
        raise _usage(f"--held-out must be in [0, 1), got {args.held_out}")
    mix = _parse_mix(args.mix)
    device, dtype = device_and_dtype(args.device, args.dtype)
    target, tok = load_target(args.target, device, dtype)
    out = _data_path(args.out)
    data = make_data(
        target,
        out,
        tokenizer=tok,
        num_prompts=args.num_prompts,
        prompt_tokens=args.prompt_tokens,
        continuation_tokens=args.continuation_tokens,
        held_out_fraction=args.held_out,
        seed=args.seed,
        batch_size=args.batch_size,
        temperature=args.temperature,
        top_p=args.top_p,
        sources=args.source or ["stdlib"],
        mix=mix,
        target_name=args.target,
    )
    m = data.manifest
    print(
        f"wrote {m['num_sequences']} sequences ({m['num_train']} train, {m['num_held_out']} held out), "
        f"{m['tokens']} tokens ({m['continuation_tokens']} generated) in {m['seconds_total']:.0f} s to {out}"
    )
    return 0


def _parse_mix(text: str) -> tuple[float, float, float]:
    try:
        mix = tuple(float(x) for x in text.split(","))
    except ValueError:
        mix = ()
    if len(mix) != 3 or min(mix) < 0 or sum(mix) <= 0:
        raise _usage(f"--mix takes three non-negative weights code,prose,chat; got '{text}'")
    return mix  # type: ignore[return-value]


@_file_errors_as_usage
def cmd_train_drafter(args) -> int:
    from .build import device_and_dtype, load_target
    from .data import make_data

    if args.resume and args.init:
        raise _usage("--resume and --init exclude each other")
    if args.init_from_target and (args.init or args.resume):
        raise _usage("--init-from-target excludes --init and --resume")
    for name in ("layers", "steps", "batch_size", "anchors_per_seq"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise _usage(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.block_size < 2:
        raise _usage(f"--block-size must be >= 2, got {args.block_size}")
    if args.gamma <= 0 or args.lr <= 0 or not 0 <= args.warmup < 1:
        raise _usage("--gamma and --lr must be > 0 and --warmup in [0, 1)")
    device, dtype = device_and_dtype(args.device, args.dtype)
    torch.manual_seed(args.seed)
    target, tok = load_target(args.target, device, dtype)
    if args.resume and not args.data:  # the data the checkpoint was trained on
        saved = json.loads((find_checkpoint(args.resume) / "trainer_state.json").read_text()).get("data")
        args.data = saved or None
    data_path = _data_path(args.data) if args.data else Path(args.out) / "data.safetensors"
    if not data_path.is_file():
        if args.data and not args.make_data:
            raise _usage(f"no training data at {data_path}: run `ddtree make-data` or pass --make-data")
        print(f"making training data at {data_path} ({args.data_prompts} prompts)", file=sys.stderr)
        make_data(
            target,
            data_path,
            tokenizer=tok,
            num_prompts=args.data_prompts,
            seed=args.seed,
            batch_size=args.data_batch_size,
            continuation_tokens=args.data_continuation_tokens,
            target_name=args.target,
        )
    data = TokenData.load(data_path)
    if data.manifest.get("target") not in (None, args.target, "<in-memory model>"):
        print(
            f"note: the data was generated by '{data.manifest['target']}', training against '{args.target}'",
            file=sys.stderr,
        )
    given = {name: getattr(args, name) for name in RESUMABLE}
    cfg = TrainConfig(
        layers=args.layers,
        block_size=args.block_size,
        taps=_parse_ints(args.taps, "--taps"),
        intermediate_size=args.intermediate_size,
        mask_token_id=args.mask_token_id,
        batch_size=args.batch_size,
        anchors_per_seq=args.anchors_per_seq,
        max_len=args.max_len,
        lr=args.lr,
        warmup=args.warmup,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        gamma=args.gamma,
        seed=args.seed,
        **{k: v for k, v in given.items() if v is not None},
    )
    if args.init_from_target:
        n = target.config.num_hidden_layers
        ids = (
            list(range(n - cfg.layers, n))
            if args.init_from_target == "last"
            else _parse_ints(args.init_from_target, "--init-from-target")
        )
        if len(ids) != cfg.layers or not all(0 <= i < n for i in ids):
            raise _usage(f"--init-from-target needs {cfg.layers} target layer ids in [0, {n}), got {ids}")
        cfg.init_from_target = ids
    if cfg.taps is not None:
        bad = [t for t in cfg.taps if not 0 <= t < target.config.num_hidden_layers]
        if bad:
            raise _usage(f"--taps {bad} outside the target's {target.config.num_hidden_layers} layers")
    command = "ddtree " + " ".join(shlex.quote(a) for a in (args.argv or sys.argv[1:]))
    res = train_drafter(
        target,
        data,
        args.out,
        None if args.resume else cfg,
        device=device,
        init=args.init,
        resume=args.resume,
        progress=not args.no_progress,
        command=command,
        target_name=args.target,
        data_path=str(data_path),
        overrides=given,
    )
    summary = {
        "out": str(res.out_dir),
        "step": res.step,
        "stopped": res.stopped,
        "held_out": res.eval,
        "acceptance": res.final_eval,
    }
    print(json.dumps(summary))
    return 0


def register(subparsers) -> None:
    """Add `train-drafter` and `make-data` to the `ddtree` command line."""
    m = subparsers.add_parser(
        "make-data", help="self-distillation data: the target continues prompts cut from offline corpora"
    )
    m.add_argument("--target", required=True, help="target: built-in id, local folder or .gguf")
    m.add_argument("--out", required=True, help="output .safetensors file (or folder: FOLDER/data.safetensors)")
    m.add_argument("--num-prompts", type=int, default=4096)
    m.add_argument("--prompt-tokens", type=int, default=128, help="longest prompt (prompts are 1/4..1x this)")
    m.add_argument("--continuation-tokens", type=int, default=256, help="tokens the target generates per prompt")
    m.add_argument("--held-out", type=float, default=0.05, help="held-out fraction (split by source file)")
    m.add_argument(
        "--source",
        action="append",
        help="corpus: stdlib (default), site-packages, or a file/folder of .py/.txt/.md/.rst/.html (repeatable)",
    )
    m.add_argument("--mix", default="0.4,0.2,0.4", help="prompt kinds code,prose,chat (weights)")
    m.add_argument("--batch-size", type=int, default=128)
    m.add_argument("--temperature", type=float, default=0.0, help="0 = greedy continuations")
    m.add_argument("--top-p", type=float, default=1.0)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--device")
    m.add_argument("--dtype")
    m.set_defaults(func=cmd_make_data)

    t = subparsers.add_parser("train-drafter", help="train a DFlash drafter against a frozen target")
    t.add_argument("--target", required=True, help="target: built-in id, local folder or .gguf")
    t.add_argument("--out", required=True, help="output folder (drafter, checkpoint/, README.md, training_log.jsonl)")
    t.add_argument("--data", help="data from `ddtree make-data` (default: OUT/data.safetensors, made if missing)")
    t.add_argument("--make-data", action="store_true", help="make --data first when it does not exist")
    t.add_argument("--data-prompts", type=int, default=2048, help="prompts when making data here")
    t.add_argument("--data-batch-size", type=int, default=128)
    t.add_argument("--data-continuation-tokens", type=int, default=256)
    t.add_argument("--layers", type=int, default=2, help="drafter layers")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--taps", help="target layer ids, comma separated (default: >= 3 evenly spread layers)")
    t.add_argument("--intermediate-size", type=int, help="drafter MLP width (default: the target's)")
    t.add_argument("--mask-token-id", type=int, help="MASK vocabulary row (default: the last)")
    t.add_argument("--steps", type=int, help="optimizer steps (default 2000)")
    t.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    t.add_argument("--anchors-per-seq", type=int, default=32)
    t.add_argument("--max-len", type=int, default=1024)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of the steps")
    t.add_argument("--min-lr-ratio", type=float, default=0.0)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) of block slot k")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log-every", type=int, help="log every N steps (default 10)")
    t.add_argument("--eval-every", type=int, help="held-out evaluation every N steps (default 250; 0: only at the end)")
    t.add_argument("--eval-batches", type=int, help="held-out batches per evaluation (default 4)")
    t.add_argument("--save-every", type=int, help="checkpoint every N steps (default 500; 0: only at the end)")
    t.add_argument(
        "--max-minutes",
        type=float,
        help="stop cleanly after this many minutes of this run's training loop (then evaluates and saves)",
    )
    t.add_argument(
        "--final-eval-prompts",
        type=int,
        help="held-out prompts for the Engine acceptance measurement (default 8; 0: skip)",
    )
    t.add_argument("--final-eval-tokens", type=int, help="default 128")
    t.add_argument("--final-eval-budget", type=int, help="DDTree budget of the final measurement (default 32)")
    t.add_argument(
        "--save-dtype", choices=["bfloat16", "float32"], help="dtype of the saved drafter (default bfloat16)"
    )
    t.add_argument("--init", help="start from this drafter folder instead of random weights")
    t.add_argument(
        "--init-from-target",
        nargs="?",
        const="last",
        metavar="LAYERS",
        help="start the drafter layers as copies of target layers: comma-separated ids, or 'last' "
        "(the default when the flag has no value) for the target's last --layers layers",
    )
    t.add_argument("--resume", help="continue from OUT (or its checkpoint/ folder)")
    t.add_argument("--device")
    t.add_argument("--dtype", help="target dtype (default: bfloat16 on cuda, float32 on cpu)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train_drafter, argv=None)
