"""What every family's target shares: the embedding and LM head (vocabulary-parallel under tensor
parallelism), the forward over the (residual, normed) pair-form layers with the drafter's taps, loading
from a Hugging Face-layout folder, and the fused-module backend reset on moves.

A family's `Transformer` subclasses `CausalLM` and brings its `config_class`, its layers (under
`self.model`: `embed_tokens`, `layers`, `norm`), `setup_caches`, `cache_storage`, `compact`,
`shard_layers`, and, where it differs, `rope`, `checkpoint_names` and `keep_dtype`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .layers import Collectives, physical_slots, rope_cos_sin, slot_map_for


class CausalLM(nn.Module):
    config_class: ClassVar[Any]  # the family's ModelConfig: from_hf(config_dict)
    model: Any  # the family's decoder: embed_tokens, layers, norm (Hugging Face's `model.*` names)
    lm_head: nn.Linear
    inv_freq: Tensor

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.config = cfg
        self.max_batch = self.max_slots = self.pool_slots = 0
        # [max_batch, max_slots + 1] int32: the physical cache slot of each row's logical slot (setup_caches)
        self.slot_map = torch.zeros(0, 0, dtype=torch.int32)
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
        """The logical slot padded tokens write to (every row's maps to the physical trash slot)."""
        return self.max_slots

    def setup_slot_map(self, max_batch: int, max_slots: int, pool_slots: int | None, slot_map: Tensor | None) -> int:
        """Record the cache's sizes and slot map for setup_caches (layers.slot_map_for); returns the
        physical slots to allocate."""
        self.slot_map, pool_slots = slot_map_for(max_batch, max_slots, pool_slots, slot_map, self.lm_head.weight.device)
        self.max_batch, self.max_slots, self.pool_slots = max_batch, max_slots, pool_slots
        return pool_slots

    def physical_slots(self, slots: Tensor, rows: Tensor | None = None) -> Tensor:
        """The physical cache slots [bs, T] of logical slots [bs, T] of rows `rows` (default 0..bs-1)."""
        return physical_slots(self.slot_map, slots, rows)

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
        rows: the cache rows of the batch entries (default 0..bs-1). Slots are logical (a row's own
        numbering, slot = position for committed text); the layers write at the physical slots they map to.

        Returns (logits [bs, T, V] or the final normed hidden states, taps [bs, T, len(taps)*H] or None),
        where tap l is the output of decoder layer l (0-based), of the last layer after the final norm:
        transformers' hidden_states[l + 1].
        """
        cos, sin = self.rope(positions)
        x = self.embed(tokens)
        slots = self.physical_slots(slots, rows)
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
                # the last layer's tap is after the final norm: transformers' hidden_states[-1], what DFlash
                # drafters are trained on
                taps[i] = h if i == len(layers) - 1 else x
        tapped = torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers else None
        return (self.logits(h) if logits else h), tapped

    # floating tensors that keep their checkpoint dtype (name suffixes): FP8 block scales are fp32
    keep_dtype: ClassVar[tuple[str, ...]] = ("weight_scale_inv",)

    @classmethod
    def checkpoint_names(cls, keys, cfg) -> dict[str, str]:
        """{our parameter name: checkpoint tensor name} of the checkpoint tensors this family loads
        (families with other names, or tensors they do not run, override this)."""
        return {k: k for k in keys}

    @classmethod
    def from_pretrained(
        cls,
        folder,
        dtype: torch.dtype = torch.float32,
        device="cpu",
        shard: Callable[[CausalLM], Any] | None = None,
        label: str = "",
    ):
        """Load an HF-layout folder (config.json + safetensors, sharded or not). The model is built on the
        meta device, `shard` (runtime.parallel.shard for this rank) then cuts it, and only then are the
        tensors read: each one, or the slice this rank keeps, straight to `device`. Quantized weights
        (models/quant.py) load as published."""
        from .checkpoint import SafetensorsFolder, load_config
        from .quant import parse_quantization, quantize_modules

        hf = load_config(folder)
        cfg = cls.config_class.from_hf(hf)
        stored = SafetensorsFolder(folder)
        names = cls.checkpoint_names(stored.tensors, cfg)
        if cfg.tie_word_embeddings:
            names.pop("lm_head.weight", None)
        with torch.device("meta"):
            model = cls(cfg)
        quantization = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
        quantize_modules(model, parse_quantization(quantization), names)
        expected = set(model.state_dict())
        if cfg.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing, unexpected = sorted(expected - set(names)), sorted(set(names) - expected)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {folder} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        for name, t in model.state_dict(keep_vars=True).items():
            if name in names:  # a tied weight keeps the name it is stored under
                t.checkpoint_name = name  # type: ignore[attr-defined]
        if shard is not None:
            shard(model)
        read_weights(model, stored, names, dtype, device, cls.keep_dtype, label)
        model.inv_freq = torch.empty(0)  # set by setup_caches
        return model.to(device=device, dtype=dtype).eval()


READ_AHEAD = 4  # tensors read by threads while the main thread moves earlier ones to the device


@torch.no_grad()
def read_weights(model: nn.Module, stored, names: dict[str, str], dtype, device, keep_dtype, label: str = "") -> None:
    """Replace every meta tensor of `model` that has a checkpoint name by the stored tensor, or by the
    slice keep_rows / keep_cols recorded on it, read straight to `device`; floating tensors in `dtype`
    but FP8 and the `keep_dtype` suffixes. READ_AHEAD threads read the next tensors (file reads release
    the GIL) while this one is converted and copied. Shows progress (tensors, bytes, rate) when slow."""
    from concurrent.futures import Future, ThreadPoolExecutor

    slots: list[tuple[dict, str, Tensor]] = []  # (the module's table, the name in it, the meta tensor)
    first: dict[int, Tensor] = {}  # each tensor once (tied weights share one)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for local, t in table.items():
                if t is not None and t.device.type == "meta" and hasattr(t, "checkpoint_name"):
                    slots.append((table, local, t))
                    first.setdefault(id(t), t)
    todo = list(first.values())
    progress = LoadProgress(label, sum(stored.tensors[names[_source(t)]].nbytes for t in todo))

    def read(t: Tensor) -> Tensor:
        return stored.read(names[_source(t)], getattr(t, "checkpoint_slice", None))

    loaded: dict[int, Tensor] = {}
    with ThreadPoolExecutor(READ_AHEAD) as pool:
        pending: list[Future | None] = [pool.submit(read, t) for t in todo[:READ_AHEAD]]
        for i, t in enumerate(todo):
            future = pending[i]
            assert future is not None
            data = future.result()
            if i + READ_AHEAD < len(todo):  # keep READ_AHEAD reads in flight, no more (host memory)
                pending.append(pool.submit(read, todo[i + READ_AHEAD]))
            pending[i] = None  # its buffer is freed once copied
            loaded[id(t)] = _placed(t, data, names, dtype, device, keep_dtype)
            progress.add(loaded[id(t)].nbytes)
    for table, local, t in slots:
        table[local] = loaded[id(t)]  # type: ignore[assignment]  # a Parameter where t was one
    progress.done()


def _placed(t: Tensor, data: Tensor, names: dict[str, str], dtype, device, keep_dtype) -> Tensor:
    """The checkpoint tensor `data` for the meta tensor `t`: checked, in its run dtype, on `device`."""
    name = _source(t)
    if _exact(t) and data.dtype != t.dtype:  # quantized weights are taken as published
        if data.is_floating_point() or t.is_floating_point():
            raise ValueError(f"checkpoint tensor {names[name]} is {data.dtype}, expected {t.dtype}")
        data = data.to(t.dtype)  # an integer shape or index tensor
    if data.is_floating_point() and not _exact(t) and not name.endswith(keep_dtype):
        data = data.to(dtype)
    data = data.to(device)
    if getattr(t, "zeroed", False):
        data.zero_()
    if data.shape != t.shape:
        raise ValueError(f"checkpoint tensor {names[name]} has shape {tuple(data.shape)}, expected {tuple(t.shape)}")
    return nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data


def _source(t: Tensor) -> str:
    """The checkpoint name from_pretrained gave a meta tensor."""
    return t.checkpoint_name  # type: ignore[attr-defined]


def _exact(t: Tensor) -> bool:
    """Whether a tensor keeps the checkpoint's dtype exactly: integers (packed INT4, shapes) and FP8."""
    return not t.is_floating_point() or t.dtype.itemsize == 1


class LoadProgress:
    """One stderr line every few seconds while weights load (and a summary), when loading is slow enough
    to wonder about."""

    EVERY = 5.0

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label or "loading", total
        self.bytes = self.tensors = 0
        self.start = self.last = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.tensors += 1
        now = time.monotonic()
        if now - self.last >= self.EVERY:
            self.last = now
            print(f"{self.label}: {self._line(now)}", file=sys.stderr, flush=True)

    def done(self) -> None:
        now = time.monotonic()
        if now - self.start >= self.EVERY:
            print(f"{self.label}: loaded {self._line(now)}", file=sys.stderr, flush=True)

    def _line(self, now: float) -> str:
        rate = self.bytes / max(now - self.start, 1e-9) / 1e9
        return f"{self.tensors} tensors, {self.bytes / 1e9:.2f} of {self.total / 1e9:.2f} GB ({rate:.2f} GB/s)"
