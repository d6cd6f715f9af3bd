"""The training loop: optimizer, schedule, held-out evaluation, checkpoints and resumption."""

from __future__ import annotations

import copy
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..models.llama import Transformer
from ..speculative.drafter import DFlashDrafter, init_drafter, save_drafter
from ..speculative.loading import load_drafter
from .card import measure_acceptance, relative_to, write_model_card
from .data import TokenData
from .recipe import (
    CHECKPOINT,
    RESUMABLE,
    Batch,
    Sampler,
    TrainConfig,
    TrainResult,
    block_loss,
    copy_target_layers,
    make_drafter_config,
)


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
            from ..models.checkpoint import resolve_model

            drafter = load_drafter(resolve_model(str(init)), target.config, dtype=torch.float32, device=dev)
        else:
            drafter = init_drafter(make_drafter_config(target.config, cfg), seed=cfg.seed).to(dev)
            if cfg.init_from_target:
                copy_target_layers(drafter, target, cfg.init_from_target)
    dcfg = drafter.config
    if dcfg.architecture != "DFlashDraftModel":  # the recipe has no loss for a DFlash2 selector or convolutions
        raise ValueError(f"train-drafter trains DFlash drafters (DFlashDraftModel), not {dcfg.architecture}")
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
                "data_path": relative_to(data_path, out),
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
        out, cfg, dcfg, n_params, data, result, history, elapsed, command, target_name, relative_to(data_path, out)
    )
    return result


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
