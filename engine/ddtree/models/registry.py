"""From a checkpoint's `model_type` to its model family.

A family is one module of this package that defines `ModelConfig` (with `from_hf(config_dict)`) and
`Transformer` (with `from_pretrained(folder, dtype, device)`), and whose target has the interface the
engine uses: `forward(tokens, positions, slots, mask, tap_layers, logits, rows)`, `embed`, `logits`,
`setup_caches`, `compact`, `config`. Families are imported when first asked for, so that reading the
registry imports no model code. docs/engine.md, "Model families", says how to add one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Family:
    name: str
    module: str  # the family's module, under ddtree.models
    model_types: tuple[str, ...]  # config.json's model_type values it loads

    def load(self) -> ModuleType:
        return importlib.import_module(f"ddtree.models.{self.module}")


FAMILIES = (
    Family("llama", "llama", ("llama", "mistral", "qwen2", "qwen3")),
    Family("deepseek_v3", "deepseek_v3", ("deepseek_v3", "kimi_k2", "kimi_k25")),
    Family("qwen3_moe", "qwen3_moe", ("qwen3_moe",)),
)


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in f.model_types)


def family_for(hf_config: dict) -> Family:
    """The family of a Hugging Face config.json dict (ValueError naming the supported types otherwise)."""
    model_type = hf_config.get("model_type", "llama")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ValueError(f"unsupported model_type '{model_type}' (supported: {', '.join(supported_model_types())})")


def config_from_hf(hf_config: dict):
    """The family's ModelConfig of a config.json dict."""
    return family_for(hf_config).load().ModelConfig.from_hf(hf_config)


def load_pretrained(folder, dtype, device, shard=None, label: str = ""):
    """The target of a Hugging Face-layout folder (config.json and safetensors), in its family's class;
    `shard` cuts it before its weights are read (base.CausalLM.from_pretrained)."""
    from .checkpoint import load_config

    family = family_for(load_config(folder)).load()
    return family.Transformer.from_pretrained(folder, dtype=dtype, device=device, shard=shard, label=label)
