"""Using EvictingCache from nnsight and TransformerLens.

Both pass a caller's cache straight to the HF attention modules, so nothing here patches them;
these helpers only set the wrappers up the way that works and drive a decode loop.

- nnsight (0.8): ``TransformersModel(model, tokenizer=tok)``, then
  ``with nn_model.generate(ids, max_new_tokens=n, past_key_values=cache) as tracer: ...``.
  The keyword is ``past_key_values`` (``cache=`` is rejected by HF 5.23 as an unused kwarg).
- TransformerLens (4.3): ``TransformerBridge.boot_transformers(label, hf_model=model, tokenizer=tok)``
  rewires ``model`` in place (eager attention, bridge modules) and reloads the tokenizer from
  its directory; the bridge's attention calls ``cache.update(post_rope_k, v, layer)`` itself.
"""

from __future__ import annotations

import tempfile

import torch

from .cache import EvictingCache

__all__ = ["nnsight_model", "transformer_lens_bridge", "bridge_decode"]


def nnsight_model(model, tokenizer):
    """Wrap an already-loaded HF model for nnsight tracing (no reload, weights shared)."""
    from nnsight import TransformersModel

    return TransformersModel(model, tokenizer=tokenizer)


def transformer_lens_bridge(model, tokenizer, *, label: str | None = None):
    """Boot a TransformerLens ``TransformerBridge`` around ``model``.

    The bridge modifies ``model`` in place (attention switched to eager, layers replaced by bridge
    components): keep a separate instance for plain HF or nnsight work. A tokenizer without a
    local path is saved to a temporary directory first, because the bridge reloads it by path.
    """
    from transformers import AutoTokenizer
    from transformer_lens.model_bridge import TransformerBridge

    path = tokenizer.init_kwargs.get("name_or_path") or getattr(tokenizer, "name_or_path", "")
    if not path:
        tmp = tempfile.mkdtemp(prefix="randattn-tok-")
        tokenizer.save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    device = next(model.parameters()).device
    return TransformerBridge.boot_transformers(
        label or getattr(model.config, "_name_or_path", None) or model.config.model_type,
        hf_model=model,
        tokenizer=tokenizer,
        device=str(device),
    )


@torch.no_grad()
def bridge_decode(bridge, input_ids: torch.Tensor, cache: EvictingCache, max_new_tokens: int):
    """Greedy manual decode loop through a TransformerLens bridge with ``cache``.

    Returns ``(ids[B, T + n], step_logits)`` where ``step_logits[i]`` are the last-position logits
    that chose token ``i``. Hooks added with ``bridge.hooks(...)`` fire at every step;
    attention patterns span the cache's physical slots, whose absolute positions are
    ``cache.positions(layer)``.
    """
    if cache.get_seq_length() != 0:
        raise ValueError("this EvictingCache has already been used; create a fresh one per sequence")
    ids, logits_per_step = input_ids, []
    step_input = input_ids
    for _ in range(max_new_tokens):
        logits = bridge(step_input, return_type="logits", past_key_values=cache)
        last = logits[:, -1]
        logits_per_step.append(last)
        step_input = last.argmax(-1, keepdim=True)
        ids = torch.cat([ids, step_input], dim=1)
    return ids, logits_per_step
