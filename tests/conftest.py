import importlib.util
import os

import pytest
import torch

from ddtree.models.llama import Transformer
from ddtree.speculative.drafter import DrafterConfig, init_drafter
from tiny_models import random_target

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRETED and importlib.util.find_spec("triton") is not None:
    import triton.runtime.interpreter as _interpreter

    _patch_lang_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor_numpy_2_4(tensor, scope) -> None:
        """Triton 3.6's interpreter turns a scalar (a one-element array) into a Python int with int(), which
        NumPy 2.4 refuses: a loop over runtime bounds (`range(lo, hi, step)`) fails. Fixed upstream
        (triton-lang/triton#9171); until the Triton that torch pins has it, take the element first."""
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_lang_tensor_numpy_2_4


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        # the real model: seconds to load, and the tests that use it run it for many more
        if "smollm2" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
        # the gpu mark (benchmarks/gpu.sh runs `-m gpu`) is also the skip on a host without CUDA
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        # TRITON_INTERPRET must be set before triton is imported, so only a process started with it runs these
        if item.get_closest_marker("triton_interpreter"):
            if not INTERPRETED:
                item.add_marker(pytest.mark.skip(reason="needs TRITON_INTERPRET=1: make test-triton-interpreter"))
            elif importlib.util.find_spec("triton") is None:
                item.add_marker(pytest.mark.skip(reason="triton is not installed"))


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

    from ddtree.models.checkpoint import resolve_model

    folder = resolve_model("smollm2-135m-instruct")
    return Transformer.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder), folder
