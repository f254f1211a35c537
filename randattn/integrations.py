"""Using EvictingCache from nnsight and TransformerLens.

Both pass a caller's cache straight to the HF attention modules, so nothing here patches them;
these helpers only set the wrappers up the way that works and drive a decode loop.

- nnsight (0.8): ``TransformersModel(model, tokenizer=tok)``, then
  ``with nn_model.generate(ids, max_new_tokens=n, **{randattn.cache_argument_name(model): cache}) as tracer:``.
  The keyword is ``past_key_values`` up to transformers 5.23 (``cache=`` is rejected there as an
  unused kwarg) and ``cache`` from 5.24 on (the old name still works there, with a FutureWarning).
- TransformerLens (4.3): ``TransformerBridge.boot_transformers(label, hf_model=model, tokenizer=tok)``
  rewires ``model`` in place (eager attention, bridge modules) and reloads the tokenizer from
  its directory; the bridge's attention calls ``cache.update(post_rope_k, v, layer)`` itself.
  transformer-lens 4.3 needs transformers < 5.24: from 5.24 on HF hands the cache to the attention
  modules as ``cache=``, which the 4.3 bridge does not read, so its KV cache stays empty.
  :func:`bridge_decode` checks that the cache grows at every step and raises
  :class:`CacheNotUsedError` instead of decoding uncached.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import tempfile
import warnings

import torch

from .cache import EvictingCache

__all__ = ["nnsight_model", "transformer_lens_bridge", "bridge_decode", "CacheNotUsedError"]

# transformers renamed the cache argument of forward / attention modules here (the old name warns).
CACHE_RENAMED_IN = (5, 24)
# The newest transformer-lens checked against that rename: its bridge attention reads only
# `past_key_values` (and `layer_past`), so on transformers >= 5.24 it never sees the cache.
_TL_KNOWN_BROKEN_THROUGH = (4, 3)


class CacheNotUsedError(RuntimeError):
    """A forward pass was handed a cache but did not write the new tokens into it."""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _release(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _known_broken_pair() -> bool:
    """The installed transformers / transformer-lens pair is one whose bridge ignores a passed cache."""
    return (_release(_version("transformers")) >= CACHE_RENAMED_IN
            and _release(_version("transformer-lens")) <= _TL_KNOWN_BROKEN_THROUGH)


def _tl_fix_hint() -> str:
    tf, tl = _version("transformers"), _version("transformer-lens")
    cause = ("This is" if _known_broken_pair() else "A known cause (not this pair, by version) is")
    return (
        f"Installed: transformers {tf}, transformer-lens {tl}. {cause} the transformers 5.24 rename of the cache "
        f"argument `past_key_values` -> `cache`: transformer-lens <= 4.3's bridge attention reads only the old name, "
        f"so the bridge's KV cache stays empty and every step attends to its own tokens alone. Fix: install "
        f"transformers below 5.24 (`pip install 'transformers>=5.9,<5.24'`; `pip install \"randattn[transformer-lens]\"` "
        f"pins it), or a transformer-lens release that reads `cache`."
    )


def _require(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{module} is not installed; it is an optional extra: pip install \"randattn[{extra}]\""
                          + (" (which pins transformers < 5.24, the range transformer-lens 4.3 works in)"
                             if extra == "transformer-lens" else "")) from exc


def nnsight_model(model, tokenizer):
    """Wrap an already-loaded HF model for nnsight tracing (no reload, weights shared)."""
    TransformersModel = _require("nnsight", "nnsight").TransformersModel

    return TransformersModel(model, tokenizer=tokenizer)


def transformer_lens_bridge(model, tokenizer, *, label: str | None = None):
    """Boot a TransformerLens ``TransformerBridge`` around ``model``.

    The bridge modifies ``model`` in place (attention switched to eager, layers replaced by bridge
    components): keep a separate instance for plain HF or nnsight work. A tokenizer without a
    local path is saved to a temporary directory first, because the bridge reloads it by path.

    Warns (``RuntimeWarning``) when the installed transformers / transformer-lens pair is one whose
    bridge ignores a passed cache; :func:`bridge_decode` refuses to decode with it.
    """
    from transformers import AutoTokenizer

    TransformerBridge = _require("transformer_lens.model_bridge", "transformer-lens").TransformerBridge
    if _known_broken_pair():
        warnings.warn("cached decoding through this bridge will not work: " + _tl_fix_hint(), RuntimeWarning,
                      stacklevel=2)
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


def _bridge_cache_argument(bridge) -> str:
    """``cache`` if the bridge's forward names it, else ``past_key_values`` (transformer-lens 4.3)."""
    try:
        params = inspect.signature(getattr(bridge, "forward", bridge)).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def bridge_decode(bridge, input_ids: torch.Tensor, cache: EvictingCache, max_new_tokens: int):
    """Greedy manual decode loop through a TransformerLens bridge with ``cache``.

    Returns ``(ids[B, T + n], step_logits)`` where ``step_logits[i]`` are the last-position logits
    that chose token ``i``. Hooks added with ``bridge.hooks(...)`` fire at every step;
    attention patterns span the cache's physical slots, whose absolute positions are
    ``cache.positions(layer)``.

    Raises :class:`CacheNotUsedError` after the first step whose forward did not write its tokens
    into ``cache`` (``cache.get_seq_length()`` must rise by the number of tokens fed), naming the
    transformers / transformer-lens versions and the fix: decoding on would silently be uncached.
    """
    if cache.get_seq_length() != 0:
        raise ValueError("this EvictingCache has already been used; create a fresh one per sequence")
    name = _bridge_cache_argument(bridge)
    ids, logits_per_step = input_ids, []
    step_input = input_ids
    for step in range(max_new_tokens):
        before = cache.get_seq_length()
        logits = bridge(step_input, return_type="logits", **{name: cache})
        after = cache.get_seq_length()
        if after != before + step_input.shape[1]:
            raise CacheNotUsedError(
                f"step {step}: the bridge was given an EvictingCache as `{name}` and fed {step_input.shape[1]} "
                f"token(s), but the cache's length went {before} -> {after} (expected {before + step_input.shape[1]}), "
                f"so the model did not use it. " + _tl_fix_hint()
            )
        last = logits[:, -1]
        logits_per_step.append(last)
        step_input = last.argmax(-1, keepdim=True)
        ids = torch.cat([ids, step_input], dim=1)
    return ids, logits_per_step
