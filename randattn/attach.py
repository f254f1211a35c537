"""Guards for the length of a ``with`` block: ``with randattn.attach(model): ...``.

:func:`randattn.install_guards` changes a model for good (what :func:`randattn.load_model` wants). A model someone
else owns (a serving stack's, a test's) may want randattn's guards only while randattn's caches run on it:
:func:`attach` installs what the model lacks and, on exit, removes exactly that, so the model is as it was.
"""

from __future__ import annotations

from contextlib import contextmanager

from .capture import attention_modules
from .models import install_guards

__all__ = ["attach"]

_PREFIX = "_randattn_"  # every attribute the guards keep on a model or module is named so
_HANDLES = ("_randattn_guard_handle", "_randattn_checks_handle")
_CAPTURE = "_randattn_capture_handle"


@contextmanager
def attach(model):
    """Install randattn's guards on ``model`` (as :func:`randattn.install_guards`) for the ``with`` block; on exit
    remove what this call installed: the forward pre-hooks, the ``generate`` wrapper, the query-capture hooks and
    the ``_randattn_*`` attributes the guards set (during the block too). A model that already had the guards (an
    outer ``attach``, ``install_guards``, :func:`randattn.load_model`) is left as it is, so nested use works.
    Yields ``model``."""
    before = set(model.__dict__)
    unhooked = [m for _, m in attention_modules(model) if m.__dict__.get(_CAPTURE) is None]
    owns = any(model.__dict__.get(key) is None for key in _HANDLES)
    try:
        if owns:
            install_guards(model)
        yield model
    finally:
        if owns:
            _detach(model, before, unhooked)


def _detach(model, before: set, unhooked: list) -> None:
    for module in unhooked:
        handle = module.__dict__.pop(_CAPTURE, None)
        if handle is not None:
            handle.remove()
    for key in _HANDLES:
        if key not in before and model.__dict__.get(key) is not None:
            model.__dict__.pop(key).remove()
    inner = model.__dict__.get("_randattn_inner_generate")
    if "generate" not in before:
        model.__dict__.pop("generate", None)
    elif inner is not None and "_randattn_inner_generate" not in before:
        model.__dict__["generate"] = inner  # someone else's instance-level wrapper, as it was
    for key in [k for k in model.__dict__ if k.startswith(_PREFIX) and k not in before]:
        del model.__dict__[key]
