"""A policy is shown the cache's own tensors (views of its storage, no copies): one that writes into any of them must
stop with an error naming the policy, the field, the layer and the round, on every path that hands a policy a view
(issue 29 item 1): ``randattn.generate``, ``randattn.replay``, a ``Replay`` fork, keep-mask pins, a model-scope
``score_layers`` and a run under ``torch.inference_mode``."""

from __future__ import annotations

import pytest
import torch

import randattn
from randattn.testing import tiny_model

from conftest import random_ids

FIELDS = ("keys", "values", "positions", "pinned", "attention", "queries", "query_positions")


class Writer(randattn.Policy):
    """Random scores; once ``armed``, writes into ``view.<field>`` first."""

    def __init__(self, field: str, armed: bool = True):
        self.field, self.armed = field, armed
        self.name = f"writes-{field}"
        self.needs = frozenset({"attention"} if field == "attention" else {"queries"} if "quer" in field else ())
        self.window = 4

    def score(self, view):
        if self.armed:
            _write(getattr(view, self.field))
        return torch.rand(view.shape, generator=view.generator)


def _write(t: torch.Tensor) -> None:
    if t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.add_(1000)


def _message(policy: str, field: str, layer: int = 0, round_: int = 0) -> str:
    return f"policy {policy!r} wrote into view.{field} at layer {layer}, round {round_}"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("field", FIELDS)
def test_generate_stops_a_policy_that_writes_into_its_view(model, field):
    cache = randattn.EvictingCache(Writer(field), budget=16, buffer=4)  # protected prompt: pinned is a tensor
    with pytest.raises(RuntimeError, match=_message(f"writes-{field}", field)) as err:
        randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=24, do_sample=False)
    assert "must not modify the tensors it is shown" in str(err.value)


@pytest.mark.parametrize("field", ("keys", "positions"))
def test_replay_stops_it(model, field):
    cache = randattn.EvictingCache(Writer(field), budget=16, buffer=4)
    with pytest.raises(RuntimeError, match=_message(f"writes-{field}", field)):
        randattn.replay(model, random_ids(1, 40), cache, prompt_len=8)


@pytest.mark.parametrize("field", ("keys", "values", "positions"))
def test_a_replay_fork_stops_it_and_the_base_is_untouched(model, field):
    """A fork's cache is a deep copy, whose tensors no longer share a version counter with their buffers."""
    ids = random_ids(1, 60)
    base = randattn.Replay(model, ids, randattn.EvictingCache(Writer(field, armed=False), budget=16, buffer=4),
                           prompt_len=8).run(until=30)
    assert base.cache.total_events > 0
    stored = base.cache.positions(0).clone()
    branch = base.fork()
    branch.cache.policy.armed = True
    with pytest.raises(RuntimeError, match=_message(f"writes-{field}", field, round_=base.cache.layers[0].rounds)):
        branch.run()
    assert torch.equal(base.cache.positions(0), stored)


def test_keep_mask_pins_are_read_only(model):
    cache = randattn.EvictingCache(Writer("pinned"), budget=16, buffer=4, protect_prompt=False)
    cache.pin([9, 10])
    with pytest.raises(RuntimeError, match=_message("writes-pinned", "pinned")):
        randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=24, do_sample=False)


def test_inference_mode_refuses_the_write_too(model):
    """Inference tensors keep no version counter; the policy then runs outside inference mode, where torch refuses
    any in-place write into them."""
    cache = randattn.EvictingCache(Writer("keys"), budget=16, buffer=4)
    message = r"policy 'writes-keys' wrote into one of the tensors it is shown \(view.keys, .*\) at layer 0, round 0"
    with torch.inference_mode(), pytest.raises(RuntimeError, match=message):
        randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=24, do_sample=False)
    cache = randattn.EvictingCache("random", budget=16, buffer=4)  # and a policy that only reads still runs there
    with torch.inference_mode():
        randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=24, do_sample=False)
    assert cache.total_events > 0


class ModelScopeWriter(randattn.Policy):
    """A keep-set shared by all layers (as TriAttention's) that writes into the last layer's keys."""

    name = "model-scope-writer"
    scope = "model"

    def score(self, view):
        return torch.rand(view.shape, generator=view.generator)

    def score_layers(self, views):
        views[-1].keys.mul_(0)
        return [self.score(views[0])] * len(views)


def test_model_scope_score_layers_is_checked_on_every_layer(model):
    cache = randattn.EvictingCache(ModelScopeWriter(), budget=16, buffer=4)
    with pytest.raises(RuntimeError, match=_message("model-scope-writer", "keys", layer=1)):
        randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=24, do_sample=False)


@pytest.mark.parametrize("policy", ("random", "h2o", "snapkv", "vase", "streamingllm"))
def test_policies_that_only_read_run_unchanged(model, policy):
    """No false alarm: the shipped policies read their views (``.float()`` of a float32 tensor is the tensor itself)."""
    cache = randattn.EvictingCache(policy, budget=16, buffer=4)
    randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=24, do_sample=False)
    assert cache.total_events > 0
