"""The trained drafter's acceptance measured through the engine, and its model card (README.md)."""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..models.llama import Transformer
from ..speculative.drafter import (
    DFlashDrafter,
    DrafterConfig,
)
from .data import TokenData
from .recipe import TrainConfig, TrainResult


def relative_to(path: str | None, out: Path) -> str | None:
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


@torch.no_grad()
def measure_acceptance(
    target: Transformer, drafter: DFlashDrafter, data: TokenData, held_ids: list[int], cfg: TrainConfig
) -> dict:
    """Real acceptance lengths of Engine dflash and ddtree (budget cfg.final_eval_budget), greedy,
    on the prompts of the first held-out sequences, plus whether both emit the `ar` tokens."""
    from ..config import SpeculationConfig
    from ..runtime.build import make_engine
    from ..runtime.engine import SamplingParams

    dtype = target.lm_head.weight.dtype
    d = copy.deepcopy(drafter).to(dtype).eval()
    prompts = []
    for i in held_ids[: cfg.final_eval_prompts]:
        toks, p = data.sequence(i)
        prompts.append(toks[:p].tolist())
    stops = tuple(data.manifest.get("stop_token_ids", ()))
    sp = SamplingParams(max_new_tokens=cfg.final_eval_tokens, stop_token_ids=stops)
    max_seq = max(len(p) for p in prompts) + cfg.final_eval_tokens
    out: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": cfg.final_eval_tokens}
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
