"""Does a drafter fit its target? The comparison, and the drafter config keys it reads, without torch.

The engine refuses a drafter that does not fit at load (DrafterConfig.check_target); the operator runs the same
comparison on the two config.json files when a SpeculativeDeployment is applied, before any GPU is scheduled
(its image has no torch, so nothing here may import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class DrafterMismatchError(ValueError):
    """The drafter does not fit the target (vocabulary, hidden size, tapped layers)."""


class DrafterShape(Protocol):
    vocab_size: int
    hidden_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int


class TargetShape(Protocol):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread taps, as in the published DFlash configs ([1, 9, 17, 25, 33] for 36 and 5)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def dflash_value(cfg: dict, name: str, default: Any = None) -> Any:
    """A DFlash key of a drafter config.json: from `dflash_config` first, then from the top level."""
    return (cfg.get("dflash_config") or {}).get(name, cfg.get(name, default))


def target_layer_ids(cfg: dict) -> list[int]:
    """The target layers a drafter config.json taps: given, or spread over `num_target_layers`."""
    layer_ids = dflash_value(cfg, "target_layer_ids")
    if layer_ids is not None:
        return list(layer_ids)
    if cfg.get("num_target_layers") is None:
        raise DrafterMismatchError("drafter config gives neither target_layer_ids nor num_target_layers")
    return default_target_layer_ids(cfg["num_target_layers"], cfg["num_hidden_layers"])


def mask_token_id(cfg: dict) -> int:
    value = dflash_value(cfg, "mask_token_id")
    if value is None:
        raise DrafterMismatchError("drafter config has no mask_token_id")
    return int(value)


def mismatches(drafter: DrafterShape, target: TargetShape) -> list[str]:
    """What keeps the drafter from running on the target (empty when it fits)."""
    problems = []
    if drafter.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {drafter.vocab_size} != target's {target.vocab_size}")
    if drafter.hidden_size != target.hidden_size:
        problems.append(f"hidden size {drafter.hidden_size} != target's {target.hidden_size}")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {target.num_hidden_layers} layers")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {drafter.mask_token_id} outside the vocabulary")
    if drafter.block_size < 2:
        problems.append(f"block_size {drafter.block_size} < 2")
    return problems


# drafters whose draft distribution at a position depends on the token chosen before it: DDTree's tree takes one
# distribution per depth from a single forward, so they run as chains (method dflash) only
CHAIN_ONLY_DRAFTERS = ("DFlash2DraftModel",)


def method_problem(method: str, architecture: str) -> str | None:
    """Why `method` cannot run a drafter of `architecture` (its config.json's architectures[0]), or None."""
    if method == "ddtree" and architecture in CHAIN_ONLY_DRAFTERS:
        return (
            f"method 'ddtree' cannot run a {architecture} drafter: the tree builder takes one draft distribution "
            "per depth and this drafter's depends on the parent token (use method dflash)"
        )
    return None


def check_fits(drafter: DrafterShape, target: TargetShape) -> None:
    problems = mismatches(drafter, target)
    if problems:
        raise DrafterMismatchError("drafter does not fit the target: " + "; ".join(problems))


@dataclass
class _Drafter:
    vocab_size: int
    hidden_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int


@dataclass
class _Target:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int


def _field(cfg: dict, name: str, whose: str) -> int:
    value = cfg.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"the {whose} config.json has no integer {name}")
    return value


def config_mismatches(drafter_config: dict, target_config: dict) -> list[str]:
    """`mismatches` of two config.json dicts, read as the engine reads them (a kimi_k25 target's language
    model is its text_config). A drafter config that lacks a DFlash key raises DrafterMismatchError, as at
    load; one the comparison cannot read at all, ValueError."""
    if target_config.get("model_type") == "kimi_k25":
        target_config = target_config.get("text_config") or {}
    target = _Target(*(_field(target_config, k, "target") for k in ("vocab_size", "hidden_size", "num_hidden_layers")))
    _field(drafter_config, "num_hidden_layers", "drafter")  # target_layer_ids may spread the taps over them
    drafter = _Drafter(
        vocab_size=_field(drafter_config, "vocab_size", "drafter"),
        hidden_size=_field(drafter_config, "hidden_size", "drafter"),
        target_layer_ids=target_layer_ids(drafter_config),
        mask_token_id=mask_token_id(drafter_config),
        block_size=int(dflash_value(drafter_config, "block_size", 16)),
    )
    return mismatches(drafter, target)
