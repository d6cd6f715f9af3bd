"""Tiny random models for fast tests (a module, not conftest: tests/operator has its own conftest)."""

import torch

from ddtree.models.llama import ModelConfig, Transformer


def random_target(vocab=64, hidden=64, layers=4, heads=4, kv_heads=2, seed=0, scale=0.3) -> Transformer:
    """A tiny random Llama-shaped target with peaked enough logits to make greedy choices stable."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        tie_word_embeddings=True,
    )
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, scale)
    return model.eval()


def byte_level_chars() -> list[str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies: space is "Ġ"),
    indexed by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def reference_log_probs(model, text: list[int]) -> torch.Tensor:
    """log_softmax of a plain causal forward over `text`: row i is the distribution of token i + 1."""
    n = len(text)
    j = torch.arange(n)
    model.setup_caches(max_batch=1, max_slots=n + 1)
    with torch.no_grad():
        logits, _ = model(torch.tensor([text]), j[None], j[None], (j[:, None] >= j[None, :])[None, None])
    return logits[0].float().log_softmax(-1)
