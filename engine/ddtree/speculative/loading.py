"""Drafter checkpoints of either kind: which config a config.json describes (DFlash or DFlash2, by its
architecture) and loading one. Apart from drafter.py because DFlash2 builds on DFlash's modules."""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.llama import ModelConfig
from .dflash2 import DFlash2Config
from .drafter import DFlashDrafter, DrafterConfig, DrafterMismatchError


def drafter_config(cfg: dict) -> DrafterConfig:
    """The config of a drafter config.json, by its architecture: DFlash (DFlashDraftModel, the default) or
    DFlash2 (DFlash2DraftModel)."""
    arch = (cfg.get("architectures") or [DrafterConfig.architecture])[0]
    kinds = {c.architecture: c for c in (DrafterConfig, DFlash2Config)}
    if arch not in kinds:
        raise DrafterMismatchError(f"unsupported drafter architecture {arch} (expected {' or '.join(kinds)})")
    return kinds[arch].from_hf(cfg)


def load_drafter(folder: str | Path, target: ModelConfig | None = None, dtype=None, device="cpu") -> DFlashDrafter:
    """Load a z-lab-format drafter folder (DFlash or DFlash2); with `target`, refuse one that does not fit it."""
    from ..models.checkpoint import load_config, load_state_dict

    cfg = drafter_config(load_config(folder))
    if target is not None:
        cfg.check_target(target)
    cls = cfg.drafter_class()
    state = cls.checkpoint_names(load_state_dict(folder, dtype=dtype))
    with torch.device("meta"):
        drafter = cls(cfg)
    missing, unexpected = drafter.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise DrafterMismatchError(
            f"drafter checkpoint {folder} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    drafter.inv_freq = torch.empty(0)  # set by setup_caches
    return drafter.to(device=device, dtype=dtype or state["fc.weight"].dtype)
