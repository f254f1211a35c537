import functools
import os

# Nothing in the suite may reach a model hub: CI has no network beyond package registries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from randattn.testing import tiny_model


@functools.lru_cache(maxsize=None)
def _tiny(arch: str):
    return tiny_model(arch, seed=0)


@pytest.fixture
def tiny():
    """tiny(arch) -> a cached tiny random-weight model of that architecture."""
    return _tiny


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct on CPU, loaded once per session."""
    import randattn

    model, tok = randattn.load_model(device="cpu")
    return model, tok


def random_ids(batch: int, length: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)
