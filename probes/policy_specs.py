"""Policy names as probes take them: checked once, asked what they need, bound to the model before a run.

A probe never keeps lists of which policy needs what: it asks the policy (``uses_seed``, ``calibration``,
``native_protection``, :meth:`randattn.Policy.bind`). A name is resolved once per process (:func:`resolved`); what
is built per run (options, a bound model) is an :class:`randattn.EvictionSpec`.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import randattn

from .config_errors import ConfigError

__all__ = ["resolved", "check_policy", "check_stats_used", "calibration_options", "bind_policies", "seed_free", "native_protection",
           "grid_protection"]


def resolved(name: str) -> randattn.Policy:
    """The policy ``name`` names, built once without options, to be asked what it declares (``calibration``,
    ``uses_seed``, ``native_protection``); never bound or run (a run's caches build their own). A ``MODULE:CALLABLE``
    is looked up from the working directory, so it is resolved once per directory."""
    return _resolved(name, os.getcwd() if ":" in name else "")


@functools.lru_cache(maxsize=None)
def _resolved(name: str, where: str) -> randattn.Policy:
    return randattn.make_policy(name)


def check_policy(field: str, spec: str, *, extra=()) -> None:
    """``spec`` is a registered policy, a paper mode name, a word in ``extra`` (e.g. ``full``) or a loadable
    ``MODULE:CALLABLE`` selector; else :class:`ConfigError` naming ``field``."""
    known = [*randattn.known_policies(), *randattn.PAPER_MODES]
    if spec in extra or spec in known:
        return
    if ":" not in spec:
        raise ConfigError(field, f"{spec!r} is unknown; choose from {', '.join([*extra, *known])}, or give your own "
                                 "selector as MODULE:CALLABLE (e.g. my_selector:score)")
    try:
        resolved(spec)
    except (ValueError, TypeError) as exc:
        raise ConfigError(field, str(exc)) from None


def check_stats_used(stats, specs, field: str = "stats") -> None:
    """A ``--stats`` file that no policy of the run would read is refused (it would be silently ignored)."""
    if stats is None:
        return
    specs = [s for s in specs if s not in ("full", None)]
    if not any(resolved(s).calibration for s in specs):
        raise ConfigError(field, f"no policy of this run reads calibration statistics ({', '.join(specs) or 'none'}); "
                                 "drop --stats, or run a policy that uses them (e.g. triattention)")


def calibration_options(spec: str, stats) -> dict:
    """``{option: stats}`` for a policy that takes per-model calibration data (``Policy.calibration``) when a
    probe's ``--stats`` is given; else ``{}`` (the policy's :meth:`~randattn.Policy.bind` then finds its own, e.g.
    the embedded model's shipped statistics, or refuses the model)."""
    option = resolved(spec).calibration
    return {option: stats} if stats is not None and option else {}


def bind_policies(field: str, specs, model, options_for=lambda spec: {}) -> None:
    """Build every policy with its options and bind it to ``model`` before a run starts, so a policy that cannot
    serve it (TriAttention without statistics for it, statistics of another model) stops the run with a
    :class:`ConfigError` naming ``field`` instead of failing at its first cache."""
    for spec in specs:
        try:
            randattn.make_policy(spec, **options_for(spec)).bind(model)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            raise ConfigError(field, f"{spec}: {exc}") from None


def seed_free(spec: str, options: Optional[dict] = None) -> bool:
    """Whether the policy's keep-sets ignore the seed (it then runs once per configuration)."""
    return not (randattn.make_policy(spec, **options) if options else resolved(spec)).uses_seed


def native_protection(spec: str) -> Optional[bool]:
    """The prompt protection a policy or paper mode is defined with (``None``: either)."""
    if spec in randattn.PAPER_MODES:
        return randattn.PAPER_MODES[spec][2]
    return resolved(spec).native_protection


def grid_protection(spec: str) -> Optional[bool]:
    """The prompt protection the paper's grid runs a policy with: its own mode where it is defined with one
    (:func:`native_protection`), else the policy's :attr:`randattn.Policy.paper_protection` (the one table: each
    policy's own attribute); ``None`` for a policy the grid does not know (a user's selector), which the grid
    protocol refuses, never defaults."""
    native = native_protection(spec)
    return native if native is not None else resolved(spec).paper_protection
