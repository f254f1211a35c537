"""What the cache refuses about the model it serves, found at its forwards: a padded batch or a 4D mask on a model
randattn does not guard (HF would map the mask onto cache slots by position, wrong once heads evict different
positions), and, at the first forward, what :func:`randattn.check_model` refuses (ALiBi biases over slots)."""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

__all__ = ["set_model_check", "check_model", "layers_and_kv_heads", "refuse_unseen_padding"]

# randattn.check_model, handed over by randattn.decoding (randattn.models imports the cache, so the cache cannot
# import it): the cache runs it on a model it finds serving it without randattn's guards.
_model_check: Optional[Callable] = None


def set_model_check(check: Callable) -> None:
    """The check the cache runs at its first forward on a model randattn does not guard (:func:`randattn.check_model`,
    set when randattn is imported)."""
    global _model_check
    _model_check = check


def check_model(model) -> None:
    if _model_check is not None:  # an ALiBi model handed to its own model.generate is refused as load_model does
        _model_check(model)


def layers_and_kv_heads(config) -> "tuple[Optional[int], Optional[int]]":
    """``(layers, KV heads)`` of a decoder config, each ``None`` when the config does not say it as one int."""
    text = config.get_text_config(decoder=True)
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    as_int = lambda v: int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None  # noqa: E731
    return as_int(layers), as_int(heads)


def refuse_unseen_padding(first: bool = False) -> None:
    """A model randattn does not guard builds its mask from the 2D padding mask by slot, which is wrong after a
    round in a padded batch: find the mask the model was given (its forward's ``attention_mask``) and refuse
    padding or a 4D mask before anything is stored. At the first forward (``first``) the model found is also
    checked as the guarded paths check it (:func:`check_model`: e.g. ALiBi biases over slots). Call it straight from
    ``EvictingCache.update``: the walk starts at that method's caller."""
    from transformers import PreTrainedModel

    # The whole stack is walked: any depth of wrappers around the attention modules stays in sight. A model
    # seen only where its mask is not (a call frame without it, a compiled forward) is refused, not trusted.
    fix = ("Call randattn.install_guards(model) once (randattn.load_model does), or use randattn.generate / "
           "randattn.decode_step(attention_mask=...); then left-padded batches are exact")
    hidden = None
    frame = sys._getframe(2)  # past this function and EvictingCache.update
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("forward", "_call_impl", "_wrapped_call_impl"):
            local = frame.f_locals
            model = local.get("self")
            if isinstance(model, PreTrainedModel):
                kwargs = local.get("kwargs")  # a module call's **kwargs, where the mask may travel
                if "attention_mask" in code.co_varnames or (isinstance(kwargs, dict) and "attention_mask" in kwargs):
                    if first:
                        check_model(model)
                    mask = (local.get("attention_mask") if "attention_mask" in code.co_varnames
                            else kwargs["attention_mask"])
                    if torch.is_tensor(mask) and (mask.dim() != 2 or not bool(mask.all())):
                        what = "a padded batch" if mask.dim() == 2 else f"a {mask.dim()}D attention mask"
                        raise ValueError(
                            f"EvictingCache got {what} on a model randattn does not guard, where HF would map the "
                            f"mask onto cache slots by position (wrong once heads evict different positions). "
                            f"{fix}")
                    return
                hidden = model
        frame = frame.f_back
    if hidden is not None:
        if first:
            check_model(hidden)
        raise ValueError(
            f"EvictingCache cannot see the attention mask of the model it serves ({type(hidden).__name__}, which "
            f"randattn does not guard), so it cannot tell whether a padded batch would be mapped onto cache slots "
            f"by position (wrong once heads evict different positions). {fix}")
