"""One eviction setting as one object: :class:`EvictionSpec`, and the one rule for "does the prompt fit".

A spec holds what a cache is built from (policy, ``T``, ``r``, recent window, prompt protection, seed, policy
options, calibration statistics), checks it once when it is made, with the messages :class:`EvictingCache` gives,
and builds caches with :meth:`EvictionSpec.make_cache`. ``EvictionSpec.full()`` is full attention: no eviction.

The field checks (:mod:`randattn.rules`) are shared with :class:`~randattn.cache.EvictingCache`, so both refuse the same settings
with the same words.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

from .policies import Policy, make_policy_and_mode
from .rules import (Problem, SettingError, SpecError, _is_int, check_scope, check_sizes, min_budget,  # noqa: F401
                    prompt_fits_problem, resolve_protection, resolve_recent)
from .seeding import _check_seed

__all__ = ["EvictionSpec", "FULL", "SpecError", "SettingError", "Problem", "prompt_fits_problem", "min_budget",
           "SPEC_KEYS", "ALIASES", "read_settings", "spec_default", "key_lines"]

#: The policy name meaning "no eviction" (full attention).
FULL = "full"


#: The keys every source of eviction settings spells the same way (the :class:`EvictionSpec` fields).
SPEC_KEYS = ("policy", "budget", "buffer", "recent", "protect_prompt", "seed", "options", "stats")
#: Other spellings of a spec key (the paper's ``K``, the docs' ``T`` and ``r``): refused by every source, naming
#: the one key, so no setting is read under two names.
ALIASES = {"K": "budget", "k": "budget", "T": "budget", "r": "buffer", "R": "buffer"}


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_mapping(v) -> bool:
    return isinstance(v, Mapping)


#: What each key's value must be, as a source reads it: (check, words). ``None`` is each key's default.
_KINDS: dict = {
    "policy": (lambda v: isinstance(v, str) or callable(v), "a policy name (a string)"),
    "budget": (_is_int, "an integer"),
    "buffer": (_is_int, "an integer"),
    "recent": (_is_int, "an integer"),
    "protect_prompt": (_is_bool, "true or false"),
    "seed": (_is_int, "an integer"),
    "options": (_is_mapping, "a mapping of policy option names to values"),
}


def _listed(keys) -> str:
    return ", ".join(keys)


def read_settings(source: Mapping, *, where: str, accepted: Iterable[str] = SPEC_KEYS, lines=None,
                  spell: Callable[[str], str] = str, taker: str = "it", types: bool = True) -> dict:
    """The one reader of eviction settings from any source (flags, a TOML file, lm-eval ``model_args``, vLLM's
    ``additional_config``): ``source`` as a dict, each key checked against ``accepted`` (``spell`` writes a key the
    way the source does, e.g. ``--budget``; ``lines`` maps a key to its line in the file ``where`` names) and each
    spec key's value against its type (``types``). Refusals are a :class:`SettingError` naming the source, the key
    and the accepted keys: another spelling of a spec key (``K``: did you mean budget?), a key the source does not
    take, a value of the wrong type. ``None`` is every key's default."""
    accepted = tuple(accepted)
    shown = _listed(spell(k) for k in accepted)

    def at(key):
        line = (lines or {}).get(key)
        return f"{where}:{line}" if line else where

    if not isinstance(source, Mapping):
        raise SettingError("settings", f"must be a mapping of settings (keys: {shown}), got {type(source).__name__}",
                           where=where, accepted=accepted)
    for key in source:
        target = ALIASES.get(key)
        if target is not None and key not in accepted:
            raise SettingError(target, f"{spell(key)}: not a key here; did you mean {spell(target)}? (every source calls "
                               f"it {target}); the accepted keys are {shown}", where=at(key), key=key,
                               accepted=accepted)
    unknown = [k for k in source if k not in accepted]
    if unknown:
        import difflib

        close = {k: difflib.get_close_matches(str(k), accepted, n=1) for k in unknown}
        hint = "".join(f"; {spell(k)}: did you mean {spell(c[0])}?" for k, c in close.items() if c)
        raise SettingError(str(unknown[0]), f"unknown keys {sorted(map(str, unknown))}: it sets "
                           f"{_listed(map(spell, unknown))}, which {taker} does not take{hint}; the accepted keys are "
                           f"{shown}", where=at(unknown[0]), key=str(unknown[0]), accepted=accepted)
    if types:
        for key, value in source.items():
            kind = _KINDS.get(key)
            if kind is not None and value is not None and not kind[0](value):
                raise SettingError(key, f"{spell(key)}: must be {kind[1]}, got {value!r} ({type(value).__name__}); "
                                   f"the accepted keys are {shown}", where=at(key), key=key, accepted=accepted)
    return dict(source)


def key_lines(text: str) -> dict:
    """``{key: line}`` of a TOML text's top-level keys (tomllib keeps no positions), so an error names the line."""
    import re

    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("["):
            break  # the top-level keys come before the first table
        m = re.match(r"""\s*(["']?)([A-Za-z0-9_-]+)\1\s*=""", line)
        if m:
            out.setdefault(m.group(2), n)
    return out


def spec_default(name: str):
    """The default of one :class:`EvictionSpec` field, declared once (the dataclass field)."""
    f = EvictionSpec.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@dataclass(frozen=True)
class EvictionSpec:
    """One eviction setting, checked when made; :meth:`make_cache` builds its caches.

    Args:
        policy: a policy name, paper mode name, ``"MODULE:CALLABLE"``, :class:`Policy` or score function, as
            :class:`EvictingCache` takes; or ``"full"`` (see :meth:`full`): no eviction.
        budget: ``T``; buffer: ``r``; recent: the recent window (default ``r``); protect_prompt: default the mode
            the policy or paper alias names, else True; seed: the draws' seed (as :class:`EvictingCache`).
        options: the policy's constructor options (e.g. ``{"n_sink": 4}``).
        stats: a run's calibration statistics (a file, a shipped name, or the data): handed to the policy's
            calibration option (``Policy.calibration``, TriAttention's ``stats``) when it has one, unused by a
            policy without one (a run passes one file to all its policies). An explicit option of the same name in
            ``options`` wins.

    Every refusal is a :class:`SpecError` (a ``ValueError``) whose ``field`` names the setting to change; the
    message is the one :class:`EvictingCache` gives.

    The policy is resolved once, here, for its declared needs (:attr:`policy_object`); each cache still builds its
    own instance from ``policy``, since a policy may keep state per model (TriAttention binds statistics) or per
    layer. Not hashable (``options`` is a mapping).
    """

    policy: "str | Policy | Callable" = "random"
    budget: Optional[int] = None
    buffer: int = 64
    recent: Optional[int] = None
    protect_prompt: Optional[bool] = None
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    stats: Any = None
    _policy: Optional[Policy] = field(default=None, init=False, repr=False, compare=False)
    _recent: int = field(default=0, init=False, repr=False, compare=False)
    _protect: bool = field(default=False, init=False, repr=False, compare=False)
    _options: Mapping[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def from_mapping(cls, source: Mapping, *, where: str, keys: Iterable[str] = SPEC_KEYS, extra: Iterable[str] = (),
                     defaults: Optional[Mapping] = None, lines=None, spell: Callable[[str], str] = str,
                     taker: str = "it") -> "EvictionSpec":
        """The spec a source of settings gives (:func:`read_settings`): the spec ``keys`` the source takes (default
        all of :data:`SPEC_KEYS`) plus its own ``extra``, which are left for the caller; over ``defaults`` (the
        source's own, different ones). Every refusal, the spec's own checks included, is a :class:`SettingError`
        naming ``where`` and the key."""
        keys = tuple(keys)
        assert set(keys) <= set(SPEC_KEYS), keys
        accepted = (*keys, *extra)
        values = read_settings(source, where=where, accepted=accepted, lines=lines, spell=spell, taker=taker)
        given = {k: v for k, v in values.items() if k in SPEC_KEYS and v is not None}
        kw = {**(defaults or {}), **given}
        try:
            return cls(**kw)
        except SettingError:
            raise
        except SpecError as exc:
            key = exc.field if exc.field in SPEC_KEYS else "policy"
            line = (lines or {}).get(key)
            text = str(exc) if str(exc).startswith(key) else f"{spell(key)}: {exc}"
            raise SettingError(exc.field, text, where=f"{where}:{line}" if line else where,
                               key=key, accepted=accepted) from None

    def __reduce__(self):
        """Pickled as its given fields (``options`` a plain dict): unpickling checks and resolves it again, so a spec
        crosses into another process (``probes.unit_pool``) as the same setting."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        given["options"] = dict(given["options"])
        return (_rebuild, (type(self), given))

    @classmethod
    def full(cls) -> "EvictionSpec":
        """Full attention: a cache that never evicts (what a probe's ``full`` arm runs)."""
        return cls(FULL)

    def __post_init__(self):
        if not isinstance(self.options, Mapping) or not all(isinstance(k, str) for k in self.options):
            raise SpecError("options", f"options must be a mapping of policy option names to values, e.g. {{'n_sink': 4}}, "
                             f"got {self.options!r}")
        set_ = lambda name, val: object.__setattr__(self, name, val)  # noqa: E731  (a frozen dataclass)
        set_("options", types.MappingProxyType(dict(self.options)))
        if self.is_full:
            given = [f"{name}={getattr(self, name)!r}" for name in ("budget", "recent")
                     if getattr(self, name) is not None]
            given += ["protect_prompt=True"] if self.protect_prompt else []
            given += ["options"] if self.options else []
            if given:
                raise SpecError(given[0].split("=")[0], f"policy='full' is full attention (no eviction), but {', '.join(given)} was given; "
                                 "drop it, or name an evicting policy")
            set_("seed", _seed(self.seed))
            return
        # The same order as EvictingCache: sizes, then the policy (a wrong name is the error a user wants first).
        check_sizes(self.budget, self.buffer)
        set_("_options", types.MappingProxyType(self._with_stats()))
        from_stats = self._stats_option() if self.stats is not None else None
        from_stats = None if from_stats in self.options else from_stats
        resolved, native = _resolve(self.policy, self._options, from_stats)
        recent = resolve_recent(self.budget, self.buffer, self.recent)
        set_("seed", _seed(self.seed))
        protect = resolve_protection(self.policy, resolved, native, self.protect_prompt)
        check_scope(resolved, recent)
        set_("_policy", resolved)
        set_("_recent", recent)
        set_("_protect", protect)

    def _with_stats(self) -> dict:
        """``options``, with ``stats`` under the policy's calibration option when it has one (options win)."""
        opts = dict(self.options)
        if self.stats is None:
            return opts
        option = self._stats_option()
        return {option: self.stats, **opts} if option else opts

    def _stats_option(self) -> Optional[str]:
        """The policy option ``stats`` goes to (``Policy.calibration``), or None."""
        if isinstance(self.policy, str):
            return _resolve(self.policy, {})[0].calibration  # a class attribute: read before the options
        if getattr(self.policy, "calibration", None):
            raise SpecError("stats", f"stats given with a built policy ({self.policy!r}); pass its calibration data to "
                            "the policy itself, or name the policy (e.g. 'triattention') so the spec can")
        return None

    # -- what it resolved to ---------------------------------------------------------------------------------------
    @property
    def is_full(self) -> bool:
        return isinstance(self.policy, str) and self.policy == FULL

    @property
    def policy_object(self) -> Optional[Policy]:
        """The policy resolved once (its ``name``, ``needs``, ``uses_seed``, ``calibration``); None for full."""
        return self._policy

    @property
    def recent_window(self) -> Optional[int]:
        """The recent window the caches use (``recent``, or ``r``); None for full."""
        return None if self.is_full else self._recent

    @property
    def protects_prompt(self) -> bool:
        """Whether the caches pin the prompt (resolved from ``protect_prompt`` and the policy's own mode)."""
        return False if self.is_full else self._protect

    @property
    def cache_options(self) -> dict:
        """The policy options a cache gets: ``stats`` under the policy's calibration option, then ``options``."""
        return dict(self._options)

    def bind(self, model) -> "EvictionSpec":
        """Ask the resolved policy whether it can serve ``model`` (:meth:`Policy.bind`: TriAttention without
        statistics for it refuses), before any cache is built; a full spec binds to anything. Returns ``self``."""
        if self._policy is not None:
            self._policy.bind(model)
        return self

    # -- the rule and the caches -----------------------------------------------------------------------------------
    def validate(self, prompt_len: int) -> Optional[Problem]:
        """The prompt-fits rule for this spec: ``None`` when a ``prompt_len``-token prompt fits, else the
        :class:`Problem` (a ``str`` whose ``field`` is ``budget``), naming the fields that fix it (``budget``,
        ``protect_prompt``). Full attention always fits."""
        if not _is_int(prompt_len) or prompt_len < 0:
            raise ValueError(f"prompt_len must be a non-negative integer, got {prompt_len!r}")
        if self.is_full:
            return None
        return prompt_fits_problem(int(prompt_len), budget=self.budget, recent=self._recent, protect=self._protect)

    def make_cache(self, *, keep_log: bool = False, row_keys: Optional[Iterable] = None,
                   prompt_len: Optional[int] = None, max_tokens: Optional[int] = None):
        """A fresh :class:`~randattn.EvictingCache` for one batch. ``prompt_len``, ``keep_log`` and ``row_keys`` go
        to the cache. ``max_tokens`` (the most tokens a row reaches: prompt + new tokens) sizes a full spec's
        cache, which is a cache too large ever to run a round; an evicting spec needs none."""
        from .cache import EvictingCache

        kw = dict(keep_log=keep_log, row_keys=row_keys, prompt_len=prompt_len)
        if self.is_full:
            if not _is_int(max_tokens) or max_tokens < 1:
                raise ValueError(f"max_tokens must be a positive integer for policy='full' (prompt + new tokens: the "
                                 f"cache is sized never to evict), got {max_tokens!r}")
            # A round runs at T + r = max_tokens + 2 pairs, one more than a row ever holds.
            return EvictingCache("random", budget=int(max_tokens) + 1, buffer=1, protect_prompt=False, **kw)
        return EvictingCache(self.policy, budget=self.budget, buffer=self.buffer, recent=self.recent,
                             protect_prompt=self.protect_prompt, seed=self.seed, **kw, **self.cache_options)


def _resolve(policy, options: Mapping[str, Any], from_stats: Optional[str] = None):
    """``make_policy_and_mode``, its refusal a :class:`SpecError` naming what is wrong: ``policy`` when the name
    alone does not resolve, ``stats`` when the option ``stats`` filled (``from_stats``) is what fails, else
    ``options``."""
    try:
        return make_policy_and_mode(policy, **options)
    except ValueError as exc:
        field_ = "policy"
        if options:
            try:
                make_policy_and_mode(policy)
                field_ = "options"
                if from_stats in options:
                    make_policy_and_mode(policy, **{k: v for k, v in options.items() if k != from_stats})
                    field_ = "stats"
            except (ValueError, TypeError, FileNotFoundError):
                pass
        raise SpecError(field_, str(exc)) from exc


def _seed(seed):
    try:
        return _check_seed(seed)
    except ValueError as exc:
        raise SpecError("seed", str(exc)) from exc


def _rebuild(cls, given: dict) -> "EvictionSpec":
    """An :class:`EvictionSpec` from its pickled fields (:meth:`EvictionSpec.__reduce__`)."""
    return cls(**given)
