import pytest
import torch

from ddtree.drafter import DrafterConfig, init_drafter
from ddtree.model import Transformer
from tiny_models import random_target


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
