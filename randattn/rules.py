"""The rules every eviction setting obeys, in one place: the sizes, the recent window, the prompt protection a policy
implies, and whether a protected prompt fits. Shared by :class:`randattn.EvictionSpec` and
:class:`randattn.EvictingCache` (neither imports the other for them)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .policies import Policy, paper_mode_twin

__all__ = ["SpecError", "SettingError", "Problem", "check_sizes", "resolve_recent", "resolve_protection", "check_scope", "min_budget",
           "longest_prompt", "prompt_fits_problem", "fits_wording"]


class SpecError(ValueError):
    """A setting is refused; ``field`` names it (``budget``, ``buffer``, ``recent``, ``policy``, ``options``,
    ``protect_prompt``, ``seed``, ``stats``), so a command line can name its flag without reading the message."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class SettingError(SpecError):
    """A setting refused where it was read: ``where`` names the source (``--budget``, ``grid.toml:3``,
    ``--model_args``, ``additional_config['randattn']``), ``key`` the key as that source spells it, ``accepted`` the
    keys the source takes. The message starts with ``where``; ``field`` is the spec field, as for :class:`SpecError`."""

    def __init__(self, field: str, message: str, *, where: Optional[str] = None, key: Optional[str] = None,
                 accepted=()):
        super().__init__(field, f"{where}: {message}" if where else message)
        self.where, self.key, self.accepted, self.message = where, key or field, tuple(accepted), message


class Problem(str):
    """What :func:`prompt_fits_problem` (and :meth:`randattn.EvictionSpec.validate`) return for a prompt that does
    not fit: the message, a plain ``str``, with ``field`` naming the setting that fixes it (``budget``) and ``need``
    the smallest value that does (so a command line can word the fix with its own flags)."""

    field: str
    need: int

    def __new__(cls, message: str, field: str, need: int, *, prompt_len: Optional[int] = None,
                budget: Optional[int] = None, recent: Optional[int] = None):
        obj = super().__new__(cls, message)
        obj.field, obj.need = field, need
        obj.prompt_len, obj.budget, obj.recent = prompt_len, budget, recent
        return obj

    def worded(self, **words) -> str:
        """The same problem in a source's own words (:func:`fits_wording`: ``budget_text``, ``what``, ``use``,
        ``fix``), e.g. a command line's ``--budget`` and ``--no-protect-prompt``."""
        return fits_wording(self.prompt_len, budget=self.budget, recent=self.recent, need=self.need, **words)


def fits_wording(prompt_len: int, *, budget: int, recent: int, need: int, budget_text: Optional[str] = None,
                 what: str = "prompt", use: str = "budget", fix: Optional[str] = "protect_prompt=False") -> str:
    """The one wording of the prompt-fits rule; a source names its own ``budget_text`` (default ``budget T=...``),
    whose prompt (``what``), the setting to raise (``use``) and the other way out (``fix``)."""
    text = budget_text if budget_text is not None else f"budget T={budget}"
    return (f"{text} cannot hold the protected {what} of {prompt_len} tokens plus one free slot beside the recent "
            f"window of {recent}; use {use} >= {need}" + (f" or {fix}" if fix else ""))


def _is_int(val) -> bool:
    return not isinstance(val, bool) and isinstance(val, (int, np.integer))


# -- the field checks (EvictingCache calls these too) --------------------------------------------------------------
def check_sizes(budget, buffer) -> None:
    for name, val in (("budget", budget), ("buffer", buffer)):
        if not _is_int(val) or val <= 0:
            raise SpecError(name, f"{name} must be a positive integer (T pairs per head after a round, r buffer), "
                             f"got {val!r}")


def resolve_recent(budget: int, buffer: int, recent) -> int:
    """The recent window: ``recent``, or the buffer ``r`` by default (the paper's engine)."""
    if recent is None:
        if buffer >= budget:
            raise SpecError("budget",
                f"budget T={budget} must exceed the recent window, which is the buffer r={buffer} by default (the "
                f"newest r pairs are kept untouched, as in the paper's engine, where T - r of the older ones are "
                f"selected); use budget > {buffer}, a smaller buffer, or recent=0 to let all T + r pairs compete")
        recent = buffer
    if not _is_int(recent) or not 0 <= recent < budget:
        raise SpecError("recent", f"recent must be an integer in [0, budget) (the newest pairs kept outside the "
                         f"competition; default buffer={buffer}), got {recent!r} with budget={budget}")
    return int(recent)


def resolve_protection(policy, resolved: Policy, native: Optional[bool], protect_prompt) -> bool:
    """Whether the prompt is pinned: the mode a paper alias or policy is defined with, else ``protect_prompt``
    (default True); a ``protect_prompt`` contradicting a policy's own mode is refused."""
    if protect_prompt is not None and native is not None and bool(protect_prompt) != native:
        name = policy if isinstance(policy, str) else resolved.name
        raise SpecError("protect_prompt",
            f"policy {name!r} runs with the prompt {'protected' if native else 'unprotected'} by definition (a "
            f"paper mode names its protection), but protect_prompt={protect_prompt!r}; drop protect_prompt, or "
            f"use the other mode's name ({paper_mode_twin(name) or 'the plain policy name'})")
    if protect_prompt is None:
        return True if native is None else bool(native)
    return bool(protect_prompt)


def check_scope(resolved: Policy, recent: int) -> None:
    if getattr(resolved, "scope", "layer") == "model" and recent < 1:
        raise SpecError("recent", f"policy {resolved.name!r} scores every layer's candidates at once, which needs "
                         "recent >= 1 (the newest pairs stay out of the round); use recent >= 1")


# -- the prompt-fits rule ------------------------------------------------------------------------------------------
def min_budget(prompt_len: int, recent: int) -> int:
    """The smallest ``T`` that holds a protected ``prompt_len``-token prompt: the prompt, one free slot to select
    into (a round with no free slot would keep the same pairs forever), and the recent window."""
    return prompt_len + 1 + recent


def longest_prompt(budget: int, recent: int) -> int:
    """The longest protected prompt a budget ``T`` holds (the inverse of :func:`min_budget`): ``T - 1 - recent``."""
    return budget - 1 - recent


def prompt_fits_problem(prompt_len: int, *, budget: int, recent: int, protect: bool) -> Optional[Problem]:
    """The one prompt-fits rule: ``None`` when a ``prompt_len``-token prompt fits, else the :class:`Problem` (a
    ``str``, its ``field`` ``budget``), naming the fields that fix it (``budget``, ``protect_prompt``). An
    unprotected prompt always fits (it competes)."""
    # The paper's engine silently protects only the first T - r - 1 prompt tokens of a longer prompt
    # (pl = min(prompt_len, K - 1)); a clamp changes the policy, so it is a problem here instead.
    need = min_budget(prompt_len, recent)
    if protect and need > budget:
        return Problem(fits_wording(prompt_len, budget=budget, recent=recent, need=need), "budget", need,
                       prompt_len=prompt_len, budget=budget, recent=recent)
    return None

