"""`ddtree plan`: the per-GPU memory plan of a model (and drafter) from their config files, never their weights.

The counting is models/memory.py (torch-free, shared with the operator); this module turns references into
config.json dicts: a local folder, a config.json file, a built-in id, a hub id (config.json alone is
downloaded), or random:SHAPE; a drafter may also be random:LAYERS (DrafterConfig.for_target's shape).
Exit 0 when the plan fits, 2 with one line on stderr when it does not (the table or JSON still printed).
"""

from __future__ import annotations

import json
import pathlib
import sys

from ..config import AUTO, UsageError
from ..models.memory import parse_size, plan_memory
from .plan import AUTO_BUDGETS


def read_config(ref: str, revision: str | None = None) -> dict:
    """The config.json dict of a model reference, without reading weights."""
    from ..models.checkpoint import ModelNotFoundError, _not_found, peek_config
    from ..models.random import RANDOM_PREFIX, random_hf_config

    if ref.startswith(RANDOM_PREFIX):
        return random_hf_config(ref)
    path = pathlib.Path(ref).expanduser()
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                raise UsageError(f"'{ref}' is a GGUF file: `ddtree plan` reads config.json (a folder or the file)")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise UsageError(f"'{ref}' is not a config.json: {str(exc).splitlines()[0]}") from None
        if not isinstance(config, dict):
            raise UsageError(f"'{ref}' is not a config.json: a JSON object is expected")
        return config
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model folder '{ref}' has no config.json")
    config = peek_config(ref, revision)
    if config is None:
        raise ModelNotFoundError(_not_found(ref))
    return config


def read_drafter_config(ref: str, target: dict, revision: str | None = None) -> dict:
    """The drafter's config.json dict; random:LAYERS is the random drafter `generate` / `bench` build."""
    from ..models.random import RANDOM_PREFIX

    if not ref.startswith(RANDOM_PREFIX):
        return read_config(ref, revision)
    layers = ref.removeprefix(RANDOM_PREFIX)
    if not layers.isdigit() or int(layers) < 1:
        raise UsageError(f"a random drafter is random:LAYERS with LAYERS >= 1, got '{ref}'")
    from ..models.registry import config_from_hf
    from ..speculative.drafter import DrafterConfig

    return DrafterConfig.for_target(config_from_hf(target), num_layers=int(layers)).to_hf()


def largest_budget(budget):
    """The budget the buffers fit: a policy's largest, or the largest that auto chooses from."""
    if isinstance(budget, dict):
        return max(budget.values())
    return max(AUTO_BUDGETS) if budget == AUTO else budget


def visible_gpu_memory() -> int:
    """The first visible GPU's total memory (--gpu-memory's default)."""
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--gpu-memory is required where no GPU is visible (e.g. --gpu-memory 141GiB)")
    return torch.cuda.get_device_properties(0).total_memory


def cmd_plan(args) -> int:
    try:
        gpu_memory = parse_size(args.gpu_memory) if args.gpu_memory is not None else visible_gpu_memory()
    except ValueError as exc:
        raise UsageError(f"--gpu-memory: {exc}") from None
    for flag, value in (
        ("--gpus", args.gpus),
        ("--max-batch", args.max_batch),
        ("--max-context", args.max_context),
        ("--kv-cache-tokens", args.kv_cache_tokens),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.gpu_memory_utilization is not None:
        if args.kv_cache_tokens is not None:
            raise UsageError("give --kv-cache-tokens or --gpu-memory-utilization, not both")
        if not 0 < args.gpu_memory_utilization <= 1:
            raise UsageError(
                f"--gpu-memory-utilization must be more than 0 and at most 1, got {args.gpu_memory_utilization}"
            )
    config = read_config(args.model, args.revision)
    drafter = read_drafter_config(args.drafter, config, args.drafter_revision) if args.drafter else None
    plan = plan_memory(
        config,
        gpus=args.gpus,
        gpu_memory=gpu_memory,
        max_context=args.max_context,  # default: the model's max_position_embeddings
        max_batch=args.max_batch,
        kv_cache_tokens=args.kv_cache_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        drafter_config=drafter,
        budget=largest_budget(args.budget),
        expert_parallel=args.expert_parallel,
        replicate_drafter=args.replicate_drafter,
    )
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.render())
    if not plan.fits:
        print(f"ddtree: does not fit: {plan.reason}", file=sys.stderr)
        return 2
    return 0
