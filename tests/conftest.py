import pytest
import torch

from ddtree.drafter import DrafterConfig, init_drafter
from ddtree.model import ModelConfig, Transformer


def random_target(vocab=64, hidden=64, layers=4, heads=4, kv_heads=2, seed=0, scale=0.3) -> Transformer:
    """A tiny random Llama-shaped target with peaked enough logits to make greedy choices stable."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        tie_word_embeddings=True,
    )
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, scale)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_target() -> Transformer:
    return random_target()


@pytest.fixture(scope="session")
def tiny_drafter(tiny_target):
    cfg = DrafterConfig.for_target(tiny_target.config, num_layers=1, block_size=8)
    return init_drafter(cfg, seed=0)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (built-in id), fp32 on CPU, with its tokenizer."""
    from transformers import AutoTokenizer

    from ddtree.loading import resolve_model

    folder = resolve_model("smollm2-135m-instruct")
    return Transformer.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder), folder
