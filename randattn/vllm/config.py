"""The plugin's user config, and the round arithmetic every vLLM-side piece shares.

How the config is read
----------------------
The user passes one mapping under the key ``"randattn"`` of vLLM's ``additional_config``::

    LLM(model, additional_config={"randattn": {"policy": "random", "budget": 1024, "buffer": 64}})
    vllm serve MODEL --additional-config '{"randattn": {"policy": "snapkv", "budget": 512, "buffer": 32}}'

Keys (the :class:`randattn.EvictionSpec` fields, checked by it with the HF engine's messages):
``policy`` (a registered name or paper mode alias; default ``"random"``), ``budget`` (T, required), ``buffer``
(r, default 64), ``recent`` (default r), ``protect_prompt`` (default: the policy's own mode, else True), ``seed``
(default 0), ``options`` (the policy's constructor options). Plugin-only keys: ``keep_log_dir`` (a folder: each
finished request's keep-log is written there as ``<request key>.npz``, a second request of the same key in one
engine as ``<request key>+1.npz`` and so on (:func:`randattn.vllm.keys.log_file_name`), :class:`randattn.KeepLog`
format; for conformance checks). Any other key is refused by name.

:func:`read_config` turns ``VllmConfig.additional_config`` (a dict, or vLLM's own wrapper of one) into an
:class:`EngineConfig`, or ``None`` when there is no ``"randattn"`` key (the plugin then changes nothing).
Every process (front end, engine core, worker) reads the same ``additional_config``, so each can call it.

The arithmetic (what the KV-cache manager and scheduler need)
-------------------------------------------------------------
A request's layer stores its prompt whole (no round inside a prompt: the HF engine runs at most one round, right
at the end of the prefill, and only when the prompt is unprotected and at least ``T + r`` long), then one pair
per token; a round runs in the forward that brings the stored count to ``T + r`` and leaves ``T``. So the rounds
run at the absolute lengths ``first, first + r, first + 2r, ...`` with ``first = max(prompt_len, T + r)``
(:func:`round_lengths`), a layer holds :func:`held_pairs` after ``n`` tokens, and never more than
:func:`max_held_pairs` (the slots a request needs: ``ceil(max_held_pairs / block_size)`` blocks). These read the
round engine's schedule (:mod:`randattn.rounds`, the HF cache's too) with the config's ``T`` and ``r``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .. import rounds
from ..spec import SPEC_KEYS, EvictionSpec, SettingError, read_settings

__all__ = ["EngineConfig", "read_config", "parse_config", "max_held_pairs", "held_pairs", "round_lengths",
           "next_round_length", "SECTION"]

#: The key of ``additional_config`` the plugin reads.
SECTION = "randattn"

#: The spec's keys (randattn.spec.SPEC_KEYS), less ``stats``: the plugin takes no calibration statistics file.
_SPEC_KEYS = tuple(k for k in SPEC_KEYS if k != "stats")
_PLUGIN_KEYS = ("keep_log_dir",)


@dataclass(frozen=True)
class EngineConfig:
    """The checked plugin config: the eviction :attr:`spec` and the plugin-only settings."""

    spec: EvictionSpec
    keep_log_dir: Optional[str] = None

    @property
    def budget(self) -> int:
        return self.spec.budget

    @property
    def buffer(self) -> int:
        return self.spec.buffer

    @property
    def recent(self) -> int:
        return self.spec.recent_window


def parse_config(section: Mapping[str, Any]) -> EngineConfig:
    """Check one ``additional_config["randattn"]`` mapping; errors name the bad key and the fix."""
    where = f"additional_config['{SECTION}']"
    if not isinstance(section, Mapping):
        raise SettingError("settings", f"must be a mapping such as {{'policy': 'random', 'budget': 1024, 'buffer': "
                           f"64}}, got {type(section).__name__}", where=where, accepted=_SPEC_KEYS + _PLUGIN_KEYS)
    # the keys, their spellings and types first (one reader, EvictionSpec.from_mapping), then the plugin's own rules
    read_settings(section, where=where, accepted=_SPEC_KEYS + _PLUGIN_KEYS, taker="the plugin")
    if section.get("policy") == "full":
        raise SettingError("policy", f"policy 'full' means no eviction; drop the '{SECTION}' section to run vLLM "
                           "unchanged", where=where, accepted=_SPEC_KEYS + _PLUGIN_KEYS)
    if section.get("budget") is None:  # the plugin has no default T (the spec's is None)
        raise SettingError("budget", "needs 'budget' (T, the pairs each KV head holds after a round), e.g. "
                           "{'policy': 'random', 'budget': 1024, 'buffer': 64}", where=where,
                           accepted=_SPEC_KEYS + _PLUGIN_KEYS)
    spec = EvictionSpec.from_mapping(section, where=where, keys=_SPEC_KEYS, extra=_PLUGIN_KEYS, taker="the plugin")
    log_dir = section.get("keep_log_dir")
    if log_dir is not None and not isinstance(log_dir, str):
        raise SettingError("keep_log_dir", f"keep_log_dir must be a folder path string, got {log_dir!r}",
                           where=where, key="keep_log_dir", accepted=_SPEC_KEYS + _PLUGIN_KEYS)
    return EngineConfig(spec=spec, keep_log_dir=log_dir)


def read_config(additional_config: Any) -> Optional[EngineConfig]:
    """The :class:`EngineConfig` in vLLM's ``additional_config``, or ``None`` when it has no ``"randattn"`` key."""
    if additional_config is None:
        return None
    if not isinstance(additional_config, Mapping):  # vLLM may wrap the dict; read it as one
        additional_config = dict(getattr(additional_config, "__dict__", {}) or {})
    section = additional_config.get(SECTION)
    return None if section is None else parse_config(section)


# The schedule is the round engine's (randattn.rounds): these read it with the config's T and r.
def _first_round(prompt_len: int, cfg: EngineConfig) -> int:
    return rounds.first_round(prompt_len, cfg.budget, cfg.buffer)


def round_lengths(prompt_len: int, cfg: EngineConfig, upto: int) -> list[int]:
    """The absolute lengths ``<= upto`` at which a request's rounds run (every layer the same)."""
    return rounds.round_lengths(prompt_len, cfg.budget, cfg.buffer, upto)


def next_round_length(prompt_len: int, computed: int, cfg: EngineConfig) -> int:
    """The smallest absolute length ``> computed`` at which a round runs: where a chunk that starts after
    ``computed`` tokens may end at the latest (a chunk may end at a round, never cross one)."""
    return rounds.next_round_length(prompt_len, computed, cfg.budget, cfg.buffer)


def held_pairs(prompt_len: int, n_tokens: int, cfg: EngineConfig) -> int:
    """Pairs each KV head of a layer holds after ``n_tokens`` tokens (prompt included) were processed."""
    return rounds.held_pairs(prompt_len, n_tokens, cfg.budget, cfg.buffer)


def max_held_pairs(prompt_len: int, cfg: EngineConfig) -> int:
    """The most pairs a request's layer ever holds (inside the forward that runs a round): ``max(prompt_len,
    T + r)``. The slots to allocate: ``ceil(max_held_pairs(prompt_len, cfg) / block_size)`` blocks."""
    return rounds.max_held_pairs(prompt_len, cfg.budget, cfg.buffer)
