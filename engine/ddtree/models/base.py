"""What every family's target shares: the embedding and LM head (vocabulary-parallel under tensor
parallelism), the forward over the (residual, normed) pair-form layers with the drafter's taps, loading
from a Hugging Face-layout folder, and the fused-module backend reset on moves.

A family's `Transformer` subclasses `CausalLM` and brings its `config_class`, its layers (under
`self.model`: `embed_tokens`, `layers`, `norm`), `setup_caches`, `cache_storage`, `compact`,
`shard_layers`, and, where it differs, `rope` and `checkpoint_state`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .layers import Collectives, rope_cos_sin


class CausalLM(nn.Module):
    config_class: ClassVar[Any]  # the family's ModelConfig: from_hf(config_dict)
    model: Any  # the family's decoder: embed_tokens, layers, norm (Hugging Face's `model.*` names)
    lm_head: nn.Linear
    inv_freq: Tensor

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.config = cfg
        self.max_batch = self.max_slots = 0
        self.tp: Collectives | None = None  # set once sharded
        # the modules' implementation: "reference" as built; ddtree.runtime.fused swaps in "torch" (fused
        # GEMMs) or "triton" (fused GEMMs and Triton kernels) for inference, once, at load
        self.backend = "reference"

    def _apply(self, fn, recurse=True):
        # moving or casting re-creates the weights, so the fused modules revert to the reference ones
        # (ddtree.runtime.fused); the next Engine swaps them in again
        self.backend = "reference"
        return super()._apply(fn, recurse)

    @property
    def trash_slot(self) -> int:
        return self.max_slots

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of the RoPE positions, shared by the layers."""
        return rope_cos_sin(self.inv_freq, positions, self.lm_head.weight.dtype)

    def embed(self, tokens: Tensor) -> Tensor:
        if self.tp is None:
            return self.model.embed_tokens(tokens)
        # vocabulary-parallel: each rank looks up the ids in its slice, the all-reduce fills in the rest
        local = self.model.embed_tokens.weight.shape[0]
        ids = tokens - self.tp.rank * local
        mine = (ids >= 0) & (ids < local)
        x = self.model.embed_tokens(ids.clamp(0, local - 1)) * mine[..., None].to(self.lm_head.weight.dtype)
        return self.tp.all_reduce(x)

    def logits(self, hidden: Tensor) -> Tensor:
        out = self.lm_head(hidden)
        return self.tp.all_gather_last(out) if self.tp else out

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        slots: Tensor,
        mask: Tensor,
        tap_layers: tuple[int, ...] = (),
        logits: bool = True,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """tokens, positions, slots: [bs, T]; mask: [bs, 1, T, span] bool over cache slots;
        rows: the cache rows of the batch entries (default 0..bs-1).

        Returns (logits [bs, T, V] or the final normed hidden states, taps [bs, T, len(taps)*H] or None),
        where tap l is the output of decoder layer l (0-based).
        """
        cos, sin = self.rope(positions)
        x = self.embed(tokens)
        layers, taps = self.model.layers, {}
        if not layers:
            return (self.logits(self.model.norm(x)) if logits else self.model.norm(x)), None
        bs, T = tokens.shape
        meta = layers[0].self_attn.metadata(mask.expand(bs, 1, T, mask.shape[-1]))
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = layer(x, h, next_norm, cos, sin, slots, mask, rows, meta)
            if i in tap_layers:
                taps[i] = x
        tapped = torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers else None
        return (self.logits(h) if logits else h), tapped

    @classmethod
    def checkpoint_state(cls, folder, cfg, dtype: torch.dtype) -> dict[str, Tensor]:
        """The tensors of a folder under this family's parameter names, floating ones in `dtype`."""
        from .checkpoint import load_state_dict

        return load_state_dict(folder, dtype=dtype)

    @classmethod
    def from_pretrained(cls, folder, dtype: torch.dtype = torch.float32, device="cpu"):
        """Load an HF-layout folder (config.json + safetensors, sharded or not)."""
        from .checkpoint import load_config

        cfg = cls.config_class.from_hf(load_config(folder))
        state = cls.checkpoint_state(folder, cfg, dtype)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        with torch.device("meta"):
            model = cls(cfg)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {folder} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = torch.empty(0)  # set by setup_caches
        return model.to(device=device, dtype=dtype).eval()
