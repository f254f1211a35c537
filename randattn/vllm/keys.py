"""Request keys and keep-log file names of the vLLM plugin (issue 39).

A request's eviction draws are seeded by (seed, request key, layer, round, head), as an HF cache built with
``row_keys=[key]``. The key is ``SamplingParams(extra_args={"randattn_key": KEY})`` (a string, or an int in
``[0, 2**64)``; ``"vllm_xargs": {"randattn_key": KEY}`` in an OpenAI request). Without one (or with ``None``) it is
:func:`default_key` of the request's prompt token ids and its ``SamplingParams.seed``: the same from run to run for
the same request, never vLLM's request id (which carries a random suffix in vLLM 0.32). An HF user reproduces a
request's draws with ``EvictionSpec.make_cache(row_keys=[default_key(prompt_ids, seed)])``.

Keep-log file names (``keep_log_dir``): the key made file-safe (:func:`log_file_name`); the first request of an
engine with that name writes ``<name>.npz``, the n-th after it ``<name>+<n>.npz`` (``+`` never occurs in a
file-safe key), in the order the engine first schedules them (vLLM's default FCFS scheduler: the order they were
added). So two identical requests in one batch, or the same key sent twice to one engine, keep both logs; a fresh
engine starts again at ``<name>.npz`` (replacing a file of an earlier run in the same folder).

Importable without vLLM.
"""

from __future__ import annotations

import hashlib
import re
from typing import Iterable, Optional

import numpy as np

from ..seeding import check_row_key

__all__ = ["KEY_ARG", "default_key", "log_file_name", "request_key", "RequestNames"]

#: ``SamplingParams(extra_args={KEY_ARG: ...})``: the request key the draws are seeded by.
KEY_ARG = "randattn_key"


def _token_ids(prompt_token_ids) -> list[int]:
    if hasattr(prompt_token_ids, "tolist"):  # a tensor or an array
        prompt_token_ids = prompt_token_ids.tolist()
    if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Iterable):
        raise ValueError(f"default_key: prompt_token_ids must be a sequence of token ids (ints), got "
                         f"{type(prompt_token_ids).__name__}; tokenize the prompt first")
    ids = list(prompt_token_ids)
    if not ids:
        raise ValueError("default_key: prompt_token_ids is empty; a prompt has at least one token")
    out = []
    for t in ids:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or int(t) < 0:
            what = "a list (one batch row?)" if isinstance(t, (list, tuple)) else repr(t)
            raise ValueError(f"default_key: prompt_token_ids must be non-negative ints, got {what}; for a batch, "
                             "compute one key per row from that row's own (unpadded) ids")
        out.append(int(t))
    return out


def default_key(prompt_token_ids, seed: Optional[int] = None) -> str:
    """The key of a request sent without ``randattn_key``: a function of its prompt token ids and its sampling seed
    (``SamplingParams.seed``, ``None`` when unset) only.

    Exactly: ``"ids-" + blake2b(",".join(str(t) for t in ids).encode("ascii"), digest_size=16).hexdigest()``, then
    ``"-seed-<seed>"`` appended when ``seed`` is not None; ``ids`` are the prompt's token ids as vLLM received them
    (after tokenization, special tokens and chat template included; no padding), e.g. ``default_key([1, 2, 3])``
    is ``"ids-9db5f4d410570c374b9d541f81304c82"``. On the HF side::

        cache = spec.make_cache(row_keys=[default_key(ids, seed)])   # one key per batch row, from its unpadded ids
    """
    ids = _token_ids(prompt_token_ids)
    digest = hashlib.blake2b(",".join(map(str, ids)).encode("ascii"), digest_size=16).hexdigest()
    if seed is None:
        return f"ids-{digest}"
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"default_key: seed must be an int or None (SamplingParams.seed), got {seed!r}")
    return f"ids-{digest}-seed-{int(seed)}"


def request_key(extra_args, prompt_token_ids, seed: Optional[int], *, other_inputs: Optional[str] = None):
    """The key a request's draws are seeded by: ``extra_args["randattn_key"]`` when given (not None), else
    :func:`default_key` of its prompt token ids and seed. ``other_inputs`` names what else the prompt holds
    (``"prompt embeddings"``, ``"multimodal inputs"``): its token ids do not identify it then, so it needs a key.
    Raises ``ValueError`` naming the fix when there is no key to be had, or the given one is not a key."""
    explicit = (extra_args or {}).get(KEY_ARG)
    if explicit is not None:
        try:
            check_row_key(explicit, f"SamplingParams.extra_args[{KEY_ARG!r}]")
        except ValueError as exc:
            raise ValueError(f"randattn.vllm: {exc}") from None
        return explicit
    why = ("it has no prompt token ids" if prompt_token_ids is None else
           f"its prompt holds {other_inputs}, which its token ids do not identify" if other_inputs else None)
    if why:
        raise ValueError(f"randattn.vllm: this request has no default key ({why}); pass one: "
                         f"SamplingParams(extra_args={{{KEY_ARG!r}: ...}}) (\"vllm_xargs\": {{{KEY_ARG!r}: ...}} in "
                         "an OpenAI request), a string or an int in [0, 2**64)")
    return default_key(prompt_token_ids, seed)


def _file_stem(key) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(key))[:200] or "request"


def log_file_name(key, index: int = 0) -> str:
    """The keep-log file of the ``index``-th request (0 = the first) an engine ran under ``key``: ``<key>.npz``,
    then ``<key>+<index>.npz``; the key made file-safe (characters outside ``[A-Za-z0-9_.-]`` become ``_``, at most
    200 of them)."""
    stem = _file_stem(key)
    return f"{stem}.npz" if index == 0 else f"{stem}+{int(index)}.npz"


class RequestNames:
    """One engine's request keys and keep-log names, fixed when a request is first scheduled and kept until it
    finishes (a preempted request keeps its name: its recompute rewrites the same file). The counts per file name
    live as long as the engine, so its n-th request of a name is ``+n`` whatever finished in between."""

    def __init__(self) -> None:
        self._by_id: dict = {}
        self._counts: dict = {}

    def get(self, req_id: str, extra_args, prompt_token_ids, seed, *, log: bool, other_inputs: Optional[str] = None):
        """``(key, keep-log file name or None)`` of a request (``log``: the engine writes keep-logs)."""
        got = self._by_id.get(req_id)
        if got is None:
            key = request_key(extra_args, prompt_token_ids, seed, other_inputs=other_inputs)
            name = None
            if log:
                stem = _file_stem(key)
                n = self._counts.get(stem, 0)
                self._counts[stem] = n + 1
                name = log_file_name(key, n)
            got = self._by_id[req_id] = (key, name)
        return got

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self._by_id.pop(rid, None)
