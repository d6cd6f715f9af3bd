"""The one build path: an `EngineConfig` in, a loaded (split, fused) target and drafter and an `Engine` out.

`build_engine(config, rank, world)` is what `generate`, `serve` (every rank), `smoke` and `bench` run;
`load_models` and `make_engine` are its two halves, for callers that need the tokenizer before sizing the
engine (`generate`) or build many engines over one load (`bench`'s sweep, training's acceptance check).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import DEFAULT_MAX_SEQ_LEN, DTYPE_NAMES, ConfigError, EngineConfig, SpeculationConfig

log = logging.getLogger("ddtree.build")


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[DTYPE_NAMES[name]]


def device_and_dtype(device: str | None, dtype: str | None):
    """(device, torch dtype) of --device/--dtype as the engine commands resolve them (EngineConfig.resolve)."""
    config = EngineConfig.from_dict(
        {"model": {"id": "-", "device": device, "dtype": dtype}},
        names={"model.device": "--device", "model.dtype": "--dtype"},
    )
    model = config.resolve(default_drafter=False).model
    return model.device, torch_dtype(model.dtype)


def inference_backend(choice: str, device: str) -> str:
    """The fused-module backend (ddtree.runtime.fused) of a --kernels choice: auto, torch or triton."""
    from .kernels import available

    if choice == "triton" and not available(device):
        raise ConfigError("--kernels triton needs triton and a CUDA device")
    triton = choice == "triton" or (choice == "auto" and str(device).startswith("cuda") and available(device))
    return "triton" if triton else "torch"


def load_target(
    ref: str,
    device: str,
    dtype,
    revision: str | None = None,
    kernels: str = "torch",
    shard: Callable[[Any], Any] | None = None,
    trust_remote_code: bool = False,
    label: str = "",
):
    """(model, tokenizer) for a built-in id, local folder, .gguf file or hub id; `kernels` picks the
    element-wise path (auto, torch or triton); `shard` (runtime.parallel.shard for one rank) cuts the
    model before its weights are read, so a rank reads only its slices."""
    from transformers import AutoTokenizer

    from ..models.checkpoint import load_config, resolve_model
    from ..models.random import RANDOM_PREFIX, random_model
    from ..models.registry import config_from_hf, load_pretrained
    from .fused import use_backend

    backend = inference_backend(kernels, device)  # refuse before the (slow) load
    if ref.startswith(RANDOM_PREFIX):  # cost runs: random weights and a byte-level stand-in tokenizer
        from ..models.random import ByteTokenizer

        target = random_model(ref.removeprefix(RANDOM_PREFIX), device, dtype)
        if shard is not None:
            shard(target)
        use_backend(target, backend)
        return target, ByteTokenizer(target.config.vocab_size)
    folder = resolve_model(ref, revision)
    if not trust_remote_code and tokenizer_is_code(folder):
        # refused here: transformers would fall back to a generic tokenizer, which may split text otherwise
        raise ConfigError(
            f"the tokenizer of {ref} is Python code shipped with the checkpoint: run it with "
            "--trust-remote-code (model.trust_remote_code) if you trust its source"
        )
    config_from_hf(load_config(folder))  # a bad config.json refused by name, before transformers reads it too
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    target = load_pretrained(folder, dtype=dtype, device=device, shard=shard, label=label)
    use_backend(target, backend)  # the Engine keeps the backend a target has
    return target, tokenizer


def tokenizer_is_code(folder) -> bool:
    """Whether a checkpoint's tokenizer_config.json maps AutoTokenizer to code in the checkpoint (Kimi's)."""
    import json
    from pathlib import Path

    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return False
    auto_map = json.loads(path.read_text(encoding="utf-8")).get("auto_map") or {}
    return "AutoTokenizer" in auto_map


def target_config(ref: str, revision: str | None = None):
    """The target's ModelConfig without loading weights (a GGUF file is converted first)."""
    from ..models.checkpoint import load_config, resolve_model
    from ..models.random import RANDOM_PREFIX, random_config
    from ..models.registry import config_from_hf

    if ref.startswith(RANDOM_PREFIX):
        return random_config(ref)
    return config_from_hf(load_config(resolve_model(ref, revision)))


def load_drafter_ref(ref: str, target, device: str, dtype, revision: str | None = None):
    from ..models.checkpoint import resolve_model
    from ..models.random import RANDOM_PREFIX
    from ..speculative.drafter import random_drafter
    from ..speculative.loading import load_drafter

    if ref.startswith(RANDOM_PREFIX):  # random:LAYERS, a random-init drafter (cost runs)
        layers = ref.removeprefix(RANDOM_PREFIX)
        if not layers.isdigit() or int(layers) < 1:
            raise ConfigError(f"a random drafter is random:LAYERS with LAYERS >= 1, got '{ref}'")
        return random_drafter(target, int(layers))
    return load_drafter(resolve_model(ref, revision), target.config, dtype=dtype, device=device)


def stop_ids(tokenizer, target) -> tuple[int, ...]:
    ids = set(target.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


@dataclass
class Loaded:
    target: Any
    drafter: Any  # None for `ar` (or a bench run without a drafter)
    tokenizer: Any
    drafter_split: str  # how the drafter runs under tensor parallelism: "split", "replicated" or "none"


def rank_device(device: str, rank: int, world: int) -> str:
    if world > 1 and device == "cuda":
        return f"cuda:{os.environ.get('LOCAL_RANK', rank)}"
    return device


def _no_note(text: str | None = None) -> None:
    pass


def load_models(
    config: EngineConfig, rank: int = 0, world: int = 1, note: Callable[[str | None], None] | None = None
) -> Loaded:
    """Target (+ drafter unless the method is `ar`) of a resolved config; with world > 1, this rank's
    shard (call it on every rank, after joining the group), fused again on the shards."""
    if note is None:
        note = _no_note
    m, spec = config.model, config.speculation
    device, dtype = rank_device(m.device, rank, world), torch_dtype(m.dtype)
    note(f"loading {m.id}")
    shard, whole_experts = None, config.parallel.expert_parallel != 1
    if world > 1:
        from .parallel import shard as shard_model

        def shard(model):
            return shard_model(model, rank, world, whole_experts)

    target, tokenizer = load_target(
        m.id,
        device,
        dtype,
        m.revision,
        kernels=config.kernels.backend,
        shard=shard,
        trust_remote_code=m.trust_remote_code,
        label=f"rank {rank}" if world > 1 else "",
    )
    note(None)
    drafter = None
    if spec.method != "ar" and m.drafter:
        note(f"loading drafter {m.drafter}")
        drafter = load_drafter_ref(m.drafter, target, device, dtype, m.drafter_revision)
        if spec.block_size is not None and spec.block_size != drafter.block_size:
            raise ValueError(
                f"{config.name('speculation.block_size')} {spec.block_size} differs from the "
                f"drafter's block size {drafter.block_size} (a DFlash drafter is trained for one "
                "block size)"
            )
    note(None)
    how = "none"
    if world > 1:
        from .parallel import split_drafter

        how = split_drafter(target, drafter, config.parallel.replicate_drafter)
    return Loaded(target, drafter, tokenizer, how)


def make_engine(
    target,
    drafter,
    speculation: SpeculationConfig,
    *,
    max_batch_size: int,
    max_seq_len: int,
    prefill_chunk: int | None = None,
    logprobs: bool = False,
    kv_cache_tokens: int | None = None,
):
    """The Engine of loaded models: the one place engines are constructed from settings."""
    from .engine import PREFILL_CHUNK, Engine

    return Engine(
        target,
        drafter,
        speculation.method,
        speculation.budget,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        prefill_chunk=prefill_chunk or PREFILL_CHUNK,
        logprobs=logprobs,
        kv_cache_tokens=kv_cache_tokens,
    )


def build_engine(
    config: EngineConfig,
    rank: int = 0,
    world: int = 1,
    *,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
    note=None,
):
    """(engine, tokenizer) of a resolved config (EngineConfig.resolve()): load, apply the kernels, split
    over `world` ranks when > 1, and size the engine by serving.max_batch_size / max_seq_len unless
    given here (max_seq_len: default 2048 tokens, or the model's context where that is shorter; more than
    the model's context is refused)."""
    loaded = load_models(config, rank, world, note)
    max_batch_size = max_batch_size or config.serving.max_batch_size
    max_seq_len = max_seq_len or config.serving.max_seq_len
    context, why = model_context(loaded.target.config)
    if max_seq_len is None:
        max_seq_len = min(DEFAULT_MAX_SEQ_LEN, context)
    elif max_seq_len > context:
        raise ConfigError(
            f"{config.name('serving.max_seq_len')} {max_seq_len:,} is more than {config.model.id}'s context of "
            f"{context:,} tokens ({why})"
        )
    kv_cache_tokens = config.serving.kv_cache_tokens
    if config.serving.gpu_memory_utilization is not None:
        device = loaded.target.lm_head.weight.device
        kv_cache_tokens = pool_within_memory(config, device, world, max_batch_size, max_seq_len)
    engine = make_engine(
        loaded.target,
        loaded.drafter,
        config.speculation,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        prefill_chunk=config.serving.prefill_chunk,
        logprobs=config.serving.max_logprobs > 0,
        kv_cache_tokens=kv_cache_tokens,
    )
    return engine, loaded.tokenizer


def pool_within_memory(config: EngineConfig, device, world: int, max_batch_size: int, max_seq_len: int) -> int:
    """serving.gpu_memory_utilization, on a rank whose weights are loaded: the KV page pool in tokens that
    keeps the memory plan (`ddtree plan`: models/memory.py) of an engine of max_batch_size rows and
    max_seq_len within that share of the GPU's memory, and the pool, workspace and reserve within what the
    GPU has free now; the smallest over the ranks. Raises ConfigError when one request does not fit."""
    import torch

    from ..models.memory import gib, plan_memory, pool_tokens_within
    from .memory_command import largest_budget, read_config, read_drafter_config

    n = config.name
    if torch.device(device).type != "cuda":
        raise ConfigError(
            f"{n('serving.gpu_memory_utilization')} sizes the KV cache from GPU memory: it needs a CUDA device "
            f"(give {n('serving.kv_cache_tokens')} instead)"
        )
    m, spec, serving = config.model, config.speculation, config.serving
    try:
        target = read_config(m.id, m.revision)
        drafter = (
            read_drafter_config(m.drafter, target, m.drafter_revision) if spec.method != "ar" and m.drafter else None
        )
    except Exception as exc:  # a GGUF file, say: no config.json to plan from
        raise ConfigError(
            f"{n('serving.gpu_memory_utilization')} plans from the models' config.json, which could not be read "
            f"({str(exc).splitlines()[0]}): give {n('serving.kv_cache_tokens')} instead"
        ) from None
    total = torch.cuda.get_device_properties(device).total_memory
    plan = plan_memory(
        target,
        gpus=world,
        gpu_memory=total,
        max_context=max_seq_len,
        max_batch=max_batch_size,
        gpu_memory_utilization=serving.gpu_memory_utilization,
        dtype=m.dtype,
        drafter_config=drafter,
        budget=largest_budget(spec.budget),
        expert_parallel=config.parallel.expert_parallel,
        replicate_drafter=config.parallel.replicate_drafter,
    )
    if not plan.fits:
        raise ConfigError(f"{n('serving.gpu_memory_utilization')} {serving.gpu_memory_utilization:g}: {plan.reason}")
    free = torch.cuda.mem_get_info(device)[0]  # the weights are in already
    per_token = plan.kv_bytes_per_token + plan.drafter_kv_bytes_per_token
    rest = plan.per_rank_bytes["workspace"] + plan.per_rank_bytes["reserve"]
    pool = min(plan.pool_slots, pool_tokens_within(free - rest, per_token))
    if world > 1:  # every rank maps the same pages: the smallest pool holds on all
        import torch.distributed as dist

        smallest = torch.tensor([pool], device=device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        pool = int(smallest.item())
    if pool < max_seq_len:
        raise ConfigError(
            f"{n('serving.gpu_memory_utilization')} {serving.gpu_memory_utilization:g} leaves a KV cache of "
            f"{pool:,} tokens, less than one request of {n('serving.max_seq_len')} ({max_seq_len:,}): "
            f"{gib(free)} of {gib(total)} free after the weights, a round's workspace and reserve "
            f"{gib(rest)}, {per_token:,} bytes per token"
        )
    log.info(
        "KV cache: %s tokens (%s) within %g of %s and %s free",
        f"{pool:,}",
        gib(pool * per_token),
        serving.gpu_memory_utilization,
        gib(total),
        gib(free),
    )
    return pool


def model_context(model_config) -> tuple[int, str]:
    """The most tokens of a request for a target of this config, and why (models.config_fields.context_limit)."""
    from ..models.config_fields import context_limit

    return context_limit(model_config.max_position_embeddings, getattr(model_config, "attention_window", None))
