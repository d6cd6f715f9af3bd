"""Reading a config.json: the fields a family cannot do without, refused by name when absent or not a
number, before anything indexes them (a KeyError deep in a loader says nothing to the person who wrote the
file)."""

from __future__ import annotations

from collections.abc import Iterable


def require_fields(cfg: dict, names: Iterable[str], what: str = "config", nullable: Iterable[str] = ()) -> None:
    """ValueError naming the first of `names` that `cfg` lacks (and the others), or the first that is not an
    integer (every required size and count is one); those in `nullable` must be there but may be null."""
    names, nullable = list(names), set(nullable)
    missing = [k for k in names if k not in cfg or (cfg[k] is None and k not in nullable)]
    if missing:
        also = f" (and {', '.join(missing[1:])})" if missing[1:] else ""
        raise ValueError(f"{what} lacks '{missing[0]}'{also}")
    for k in names:
        if cfg[k] is not None and (isinstance(cfg[k], bool) or not isinstance(cfg[k], int)):
            raise ValueError(f"{what} field '{k}' must be an integer, got {cfg[k]!r}")


def attention_window(cfg: dict) -> int | None:
    """The sliding attention window a dense config asks for, as transformers reads it: Mistral's
    `sliding_window` on every layer; Qwen2's and Qwen3's only with `use_sliding_window`, on the layers from
    `max_window_layers` on (none when that is past the last), or where `layer_types` names sliding layers.
    The targets do not implement sliding windows, so their context stops at it (context_limit)."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    if cfg.get("model_type", "llama") == "mistral":
        return int(window)
    if not cfg.get("use_sliding_window"):
        return None
    if cfg.get("layer_types") is not None:
        return int(window) if "sliding_attention" in cfg["layer_types"] else None
    layers = cfg.get("num_hidden_layers") or 0
    return int(window) if cfg.get("max_window_layers", 28) < layers else None


def context_limit(max_position_embeddings: int, window: int | None) -> tuple[int, str]:
    """The most tokens a sequence may hold here, and why: the model's max_position_embeddings, or a
    sliding window (attention_window) short of it."""
    if window is not None and window < max_position_embeddings:
        return window, "its sliding window: sliding-window attention is not implemented, so a request stops at it"
    return max_position_embeddings, "max_position_embeddings in its config"
