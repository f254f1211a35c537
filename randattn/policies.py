"""Eviction policies as score functions.

A policy only answers "how much is each cached pair worth to this KV head?". Everything else
(prompt protection, keep-mask pins and forced evictions, per-head top-K, chronological
compaction, seeding) is done by the cache, so a new policy is a few lines::

    from randattn import register_policy, Policy

    @register_policy("oldest-first")
    class OldestFirst(Policy):
        '''Keep the oldest pairs (a deliberately bad baseline).'''
        def score(self, view):
            return -view.positions.float()

Scores have shape ``[B, H_kv, S]`` (or anything that broadcasts to it, e.g. ``[B, 1, S]`` for a
draw shared by every head) and higher means "keep". The top ``K`` of every head survive.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

__all__ = [
    "CacheView",
    "Policy",
    "register_policy",
    "make_policy",
    "known_policies",
    "load_policy",
    "score_function",
    "RandomPolicy",
    "RandomSharedPolicy",
    "RecencyPolicy",
    "StreamingLLMPolicy",
]


@dataclass(frozen=True)
class CacheView:
    """Read-only view of one layer's cache at an eviction round.

    keys, values: ``[B, H_kv, S, D]``; keys are post-RoPE, as the attention saw them.
    positions: ``[B, H_kv, S]`` absolute token position of every slot, increasing along S.
    prompt_len: number of prompt positions (``0..prompt_len-1``); the core pins them when the
        cache protects the prompt, so a policy never has to.
    seq_len: absolute length of the sequence so far (one past the newest position).
    generator: seeded for this (seed, layer, round); draw on ``keys.device`` in float32.
    queries: the last ``w`` post-RoPE queries ``[B, H_q, w, D]`` (``query_positions[w]``), when
        the policy lists ``"queries"`` in ``needs``; ``scaling`` is the attention's softmax scale.
    attention: accumulated attention received per slot and query head ``[B, H_q, S]``, when the
        policy lists ``"attention"`` in ``needs``.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    layer_idx: int
    round_idx: int
    prompt_len: int
    seq_len: int
    budget: int
    buffer: int
    generator: torch.Generator
    queries: Optional[torch.Tensor] = None
    query_positions: Optional[torch.Tensor] = None
    scaling: Optional[float] = None
    attention: Optional[torch.Tensor] = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(B, H_kv, S)``: the shape a score tensor must broadcast to."""
        return tuple(self.positions.shape)  # type: ignore[return-value]


class Policy:
    """Base class: subclasses implement :meth:`score`.

    ``name`` is filled in by :func:`register_policy`. Policies are stateless by default; one
    that needs per-layer state keeps it keyed by ``view.layer_idx``.
    """

    name: str = "custom"
    #: what the cache must capture for this policy: "queries" (last ``window`` post-RoPE queries)
    #: and/or "attention" (attention received, accumulated over decoding).
    needs: frozenset = frozenset()
    window: int = 0

    def score(self, view: CacheView) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        args = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        return f"{type(self).__name__}({args})"


_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator that makes a policy available by name (``EvictingCache("name", ...)``)."""

    def deco(cls: type[Policy]) -> type[Policy]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"policy name {name!r} is already registered to {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def known_policies() -> list[str]:
    """Names accepted by :func:`make_policy`, sorted."""
    return sorted(_REGISTRY)


class _FunctionPolicy(Policy):
    """Wraps a plain ``score(view) -> Tensor`` callable; its ``needs`` and ``window`` attributes (set by
    :func:`score_function`) ask the cache for recent queries or accumulated attention."""

    def __init__(self, fn: Callable[[CacheView], torch.Tensor], name: Optional[str] = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "function")
        self.needs = frozenset(getattr(fn, "needs", ()))
        self.window = int(getattr(fn, "window", 0))
        unknown = self.needs - {"queries", "attention"}
        if unknown:
            raise ValueError(f"score function {self.name!r}: needs {sorted(unknown)} unknown; use 'queries' and/or "
                             "'attention'")
        if "queries" in self.needs and self.window < 1:
            raise ValueError(f"score function {self.name!r} needs 'queries' but window={self.window}; say how many "
                             "recent queries it reads, e.g. @score_function(needs=('queries',), window=32)")

    def score(self, view: CacheView) -> torch.Tensor:
        return self.fn(view)


def score_function(*, needs: "tuple[str, ...]" = (), window: int = 0):
    """Mark a plain ``score(view)`` function as wanting ``view.queries`` (the last ``window`` post-RoPE queries)
    and/or ``view.attention`` (attention received, accumulated over decoding)::

        @randattn.score_function(needs=("queries",), window=16)
        def my_score(view): ...
    """

    def deco(fn):
        fn.needs, fn.window = tuple(needs), window
        return fn

    return deco


def load_policy(spec: str, **kwargs) -> Policy:
    """A policy defined outside the package: ``"module:attr"`` or ``"path/to/file.py:attr"``, where ``attr`` is a
    score function, a :class:`Policy` subclass (built with ``kwargs``) or a Policy instance. The policy is named
    ``spec``, so results say where it came from."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"policy {spec!r}: expected a known name ({', '.join(known_policies())}) or MODULE:CALLABLE, "
                         "e.g. my_selector:score or path/to/my_selector.py:score")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.exists():
                raise ValueError(f"policy {spec!r}: no file {where}")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if "" not in sys.path and "." not in sys.path:
                sys.path.insert(0, "")  # a module next to the user's working directory, as `python -m` would find it
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"policy {spec!r}: cannot import {where!r} ({type(exc).__name__}: {exc}); put the module on "
                         "PYTHONPATH or give a file path, e.g. path/to/my_selector.py:score") from exc
    if not hasattr(module, attr):
        found = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(f"policy {spec!r}: {where} has no {attr!r}; callables there: {', '.join(found) or 'none'}")
    target = getattr(module, attr)
    if isinstance(target, type) and issubclass(target, Policy):
        policy = target(**kwargs)
    elif isinstance(target, Policy) or callable(target):
        if kwargs:
            raise ValueError(f"policy {spec!r}: options {sorted(kwargs)} need a Policy subclass; a score function or "
                             "instance takes none")
        policy = target if isinstance(target, Policy) else _FunctionPolicy(target)
    else:
        raise ValueError(f"policy {spec!r}: {attr} is a {type(target).__name__}, not a score function or Policy")
    policy.name = spec
    return policy


def make_policy(spec: "str | Policy | Callable[[CacheView], torch.Tensor]", **kwargs) -> Policy:
    """Turn a policy name, ``"module:callable"`` spec (see :func:`load_policy`), instance or score function into a
    :class:`Policy`.

    Keyword arguments go to the named policy's constructor (e.g. ``n_sink=4`` for
    ``"streamingllm"``); unknown names and unknown keywords raise a ``ValueError`` that lists
    what is accepted.
    """
    if isinstance(spec, Policy):
        if kwargs:
            raise ValueError(f"policy options {sorted(kwargs)} given with a Policy instance; set them on the instance")
        return spec
    if isinstance(spec, str):
        if spec not in _REGISTRY and ":" in spec:
            return load_policy(spec, **kwargs)
        if spec not in _REGISTRY:
            raise ValueError(f"unknown policy {spec!r}; known policies: {', '.join(known_policies())}")
        cls = _REGISTRY[spec]
        accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "args", "kwargs")]
        bad = sorted(set(kwargs) - set(accepted))
        if bad:
            raise ValueError(
                f"policy {spec!r} does not take option(s) {bad}; it accepts {accepted if accepted else 'no options'}"
            )
        return cls(**kwargs)
    if callable(spec):
        if kwargs:
            raise ValueError(f"policy options {sorted(kwargs)} given with a score function; bind them yourself")
        return _FunctionPolicy(spec)
    raise TypeError(
        f"policy must be a name ({', '.join(known_policies())}), a Policy instance or a callable "
        f"score(view) -> Tensor, not {type(spec).__name__}"
    )


@register_policy("random")
class RandomPolicy(Policy):
    """Random Attention (the paper's Algorithm 1): ``s_i ~ Uniform(0, 1)`` i.i.d. per head.

    With prompt protection on (the cache's default) the prompt is pinned at ``+inf`` by the core,
    so this is exactly ``s = rand(B, H_kv, S); s[:, :, :l_p] = inf; keep = topk(s, K)``. A pair
    then survives one round with probability ``K / (K + r)``.
    """

    def score(self, view: CacheView) -> torch.Tensor:
        return torch.rand(view.shape, generator=view.generator, device=view.keys.device, dtype=torch.float32)


@register_policy("random-shared")
class RandomSharedPolicy(Policy):
    """One uniform draw per absolute position, shared by every KV head of a layer.

    The draw is keyed by position rather than slot, so heads that already differ (e.g. after a
    keep-mask pin) still rank a given token identically. Batch rows draw independently.
    """

    def score(self, view: CacheView) -> torch.Tensor:
        b, h, _ = view.shape
        u = torch.rand((b, view.seq_len), generator=view.generator, device=view.keys.device, dtype=torch.float32)
        return torch.gather(u[:, None, :].expand(b, h, view.seq_len), 2, view.positions)


@register_policy("recency")
class RecencyPolicy(Policy):
    """Most recent pairs first. With prompt protection this is Prefix Sliding (prompt + recent window);
    without it, a plain sliding window."""

    def score(self, view: CacheView) -> torch.Tensor:
        return view.positions.to(torch.float32)


@register_policy("streamingllm")
class StreamingLLMPolicy(Policy):
    """StreamingLLM: the first ``n_sink`` positions (attention sinks) plus the most recent window."""

    def __init__(self, n_sink: int = 4):
        if not isinstance(n_sink, int) or n_sink < 0:
            raise ValueError(f"streamingllm n_sink must be a non-negative int, got {n_sink!r}")
        self.n_sink = n_sink

    def score(self, view: CacheView) -> torch.Tensor:
        s = view.positions.to(torch.float32)
        return torch.where(view.positions < self.n_sink, torch.full_like(s, float("inf")), s)


@register_policy("random-block")
class RandomBlockPolicy(Policy):
    """Random eviction in contiguous blocks: absolute positions ``[j*block, (j+1)*block)`` form block
    ``j``; every head ranks blocks by its own uniform draw each round, so a block is kept or
    dropped as a unit. When a round must cut into a block (``block > r``), the block's oldest slots
    go first, so what survives stays contiguous. ``block=1`` is Random Attention.

    K / block is the number of blocks a head can hold: the quantity the paper's block experiment
    varies (1..64 cost almost nothing; 256 leaves too few blocks per head).
    """

    def __init__(self, block: int = 16):
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"random-block block must be a positive int (tokens per block), got {block!r}")
        self.block = block

    def score(self, view: CacheView) -> torch.Tensor:
        b, h, _ = view.shape
        block_of = view.positions // self.block
        draw = torch.rand((b, h, view.seq_len // self.block + 1), generator=view.generator, device=view.keys.device)
        rank = draw.argsort(dim=-1).argsort(dim=-1).to(torch.float32)  # integers: no ties between blocks
        within = (view.positions % self.block).to(torch.float32) / self.block  # in [0, 1): older first out
        return torch.gather(rank, 2, block_of) + within
