"""The one build path: an `EngineConfig` in, a loaded (split, fused) target and drafter and an `Engine` out.

`build_engine(config, rank, world)` is what `generate`, `serve` (every rank), `smoke` and `bench` run;
`load_models` and `make_engine` are its two halves, for callers that need the tokenizer before sizing the
engine (`generate`) or build many engines over one load (`bench`'s sweep, training's acceptance check).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import DTYPE_NAMES, ConfigError, EngineConfig, SpeculationConfig


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

    from ..models.checkpoint import resolve_model
    from ..models.random import RANDOM_PREFIX, random_model
    from ..models.registry import load_pretrained
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
    given here."""
    loaded = load_models(config, rank, world, note)
    engine = make_engine(
        loaded.target,
        loaded.drafter,
        config.speculation,
        max_batch_size=max_batch_size or config.serving.max_batch_size,
        max_seq_len=max_seq_len or config.serving.seq_len,
        prefill_chunk=config.serving.prefill_chunk,
        logprobs=config.serving.max_logprobs > 0,
        kv_cache_tokens=config.serving.kv_cache_tokens,
    )
    return engine, loaded.tokenizer
