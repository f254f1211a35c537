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

from .seeding import round_seed

__all__ = [
    "CacheView",
    "Policy",
    "register_policy",
    "make_policy",
    "known_policies",
    "load_policy",
    "score_function",
    "PAPER_MODES",
    "paper_mode_twin",
    "make_policy_and_mode",
    "RandomPolicy",
    "RandomSharedPolicy",
    "RecencyPolicy",
    "StreamingLLMPolicy",
]


@dataclass(frozen=True)
class CacheView:
    """Read-only view of one layer's cache at an eviction round.

    The view holds the round's *candidates* only: every stored pair except the newest ``recent``
    ones, which the core keeps untouched (the paper's engine scores ``k_cache[:, :cur_len - residual]``).
    The policy scores the candidates and the core keeps the top ``keep = budget - recent`` of them
    per head, so right after the round each head holds ``budget`` pairs, the newest ``recent`` among them.

    keys, values: ``[B, H_kv, S, D]``; keys are post-RoPE, as the attention saw them.
    positions: ``[B, H_kv, S]`` absolute token position of every slot, increasing along S.
    prompt_len: number of prompt positions (``0..prompt_len-1``); the core pins them when the
        cache protects the prompt (``protect_prompt``), so a policy never has to.
    seq_len: absolute length of the sequence so far (one past the newest position).
    budget: ``T``, pairs per head right after a round (recent window included); ``buffer``: ``r``;
        ``recent``: the newest pairs kept outside the competition; ``keep``: candidates kept.
    generator: seeded for this (seed, layer, round); draw on ``keys.device`` in float32. ``seed`` is
        the cache's seed, for a draw a policy must repeat at every round (e.g. a per-head role).
    pinned: ``[B, H_kv, S]`` bool, the candidates the core will keep whatever the score (protected
        prompt and keep-mask pins), or ``None``; a policy that fills "the remaining places" (VaSE's
        top set and sample) reads it.
    queries: the last ``w`` post-RoPE queries ``[B, H_q, w, D]`` (``query_positions[w]``), when
        the policy lists ``"queries"`` in ``needs``; ``scaling`` is the attention's softmax scale.
    attention: accumulated attention received per slot and query head ``[B, H_q, S]``, when the
        policy lists ``"attention"`` in ``needs``.
    row_key: the row's key (an int) when the cache has row keys: the view is then one row, whose keep-sets must
        not depend on the batch it sits in; ``None`` otherwise.
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
    recent: int = 0
    seed: int = 0
    protect_prompt: bool = False
    pinned: Optional[torch.Tensor] = None
    row_key: Optional[int] = None

    @property
    def keep(self) -> int:
        """Candidates each head keeps this round: ``budget - recent``."""
        return self.budget - self.recent

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
    #: recent queries to capture; ``None``: the queries since the last round (the buffer ``r``).
    window: Optional[int] = 0
    #: "layer": :meth:`score` sees one layer; "model": :meth:`score_layers` scores every layer's candidates
    #: at once (a keep-set shared by all layers), called once per round.
    scope: str = "layer"
    #: the prompt protection the policy is defined with (None: either). A policy that protects part of the
    #: prompt itself (``random-pcap``) says False, so the core does not pin the whole prompt over it.
    native_protection: Optional[bool] = None
    #: the prompt protection the paper's grid runs this policy with where it may run either way (``native_protection``
    #: None): the one table of each policy's mode (``probes.accuracy --protocol grid``); None: not in that grid, so
    #: that protocol refuses it rather than guess. A paper mode alias names its own (:data:`PAPER_MODES`).
    paper_protection: Optional[bool] = None
    #: whether the keep-sets depend on the cache's seed (``view.generator`` / ``view.seed``). A seed-free policy
    #: keeps the same pairs for every seed, so probes run it once per configuration. True unless declared.
    uses_seed: bool = True
    #: the constructor option holding calibration data made per model (TriAttention's ``"stats"``), or None;
    #: probes pass their ``--stats`` file to it, and :meth:`bind` fills it in when it can.
    calibration: Optional[str] = None

    def bind(self, model) -> "Policy":
        """Prepare to serve ``model`` (called by the cache before its first forward, or by a probe to fail early):
        check or load per-model calibration data. Raises ``ValueError`` naming what to pass when the policy cannot
        serve this model. Idempotent. The default needs nothing."""
        return self

    def score(self, view: CacheView) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def score_layers(self, views: "list[CacheView]") -> "list[torch.Tensor]":
        """Scores of every layer's candidates at one round (for ``scope = "model"``)."""
        return [self.score(v) for v in views]

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
        self.uses_seed = bool(getattr(fn, "uses_seed", True))
        unknown = self.needs - {"queries", "attention"}
        if unknown:
            raise ValueError(f"score function {self.name!r}: needs {sorted(unknown)} unknown; use 'queries' and/or "
                             "'attention'")
        if "queries" in self.needs and self.window < 1:
            raise ValueError(f"score function {self.name!r} needs 'queries' but window={self.window}; say how many "
                             "recent queries it reads, e.g. @score_function(needs=('queries',), window=32)")

    def score(self, view: CacheView) -> torch.Tensor:
        return self.fn(view)


def score_function(*, needs: "tuple[str, ...]" = (), window: int = 0, uses_seed: bool = True):
    """Mark a plain ``score(view)`` function as wanting ``view.queries`` (the last ``window`` post-RoPE queries)
    and/or ``view.attention`` (attention received, accumulated over decoding); ``uses_seed=False`` declares that
    it never draws on ``view.generator`` / ``view.seed`` (probes then run it once per configuration)::

        @randattn.score_function(needs=("queries",), window=16, uses_seed=False)
        def my_score(view): ...
    """

    def deco(fn):
        fn.needs, fn.window, fn.uses_seed = tuple(needs), window, bool(uses_seed)
        return fn

    return deco


#: Modules loaded from ``path/file.py`` specs, by resolved path: each file runs once per process.
_LOADED_FILES: dict[Path, object] = {}


def _import_error(spec: str, where: str, exc: BaseException) -> ValueError:
    what = "called sys.exit()" if isinstance(exc, SystemExit) else f"raised {type(exc).__name__}: {exc}"
    return ValueError(f"policy {spec!r}: importing {where!r} {what}; fix the module (it runs when the spec is "
                      "loaded), or give another, e.g. my_selector:score or path/to/my_selector.py:score")


def _load_file(spec: str, where: str):
    path = Path(where).expanduser()
    if not path.is_file():
        raise ValueError(f"policy {spec!r}: no file {where}" + (" (it is a directory)" if path.is_dir() else "")
                         + "; give the path of a .py file, e.g. path/to/my_selector.py:score")
    path = path.resolve()
    if path in _LOADED_FILES:
        return _LOADED_FILES[path]
    for module in list(sys.modules.values()):  # already imported under its own name: the same module, not a rerun
        file = getattr(module, "__file__", None)
        if file and file.endswith(".py") and Path(file).resolve() == path:
            _LOADED_FILES[path] = module
            return module
    module_spec = importlib.util.spec_from_file_location(f"_randattn_selector_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        raise _import_error(spec, where, exc) from exc
    _LOADED_FILES[path] = module
    return module


def _load_module(spec: str, where: str):
    top = where.split(".")[0]
    if top not in sys.modules:
        # A module next to the working directory, as `python -m` would find it, without adding it to sys.path.
        cwd = Path.cwd()
        package, single = cwd / top / "__init__.py", cwd / f"{top}.py"
        found = package if package.is_file() else single if single.is_file() else None
        if found is not None:
            locations = [str(found.parent)] if found is package else None
            module_spec = importlib.util.spec_from_file_location(top, found, submodule_search_locations=locations)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[top] = module  # as an import would; a package's submodules and relative imports need it
            try:
                module_spec.loader.exec_module(module)
            except (Exception, SystemExit) as exc:
                sys.modules.pop(top, None)
                raise _import_error(spec, where, exc) from exc
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name is not None and where.startswith(exc.name) and where[len(exc.name):len(exc.name) + 1] in ("", "."):
            raise ValueError(f"policy {spec!r}: cannot import {where!r} (no module {exc.name!r} on sys.path or in the "
                             f"working directory {Path.cwd()}); put the module on PYTHONPATH or give a file path, "
                             "e.g. path/to/my_selector.py:score") from exc
        raise _import_error(spec, where, exc) from exc
    except (Exception, SystemExit) as exc:
        raise _import_error(spec, where, exc) from exc


def load_policy(spec: str, **kwargs) -> Policy:
    """A policy defined outside the package: ``"module:attr"`` or ``"path/to/file.py:attr"``, where ``attr`` is a
    score function, a :class:`Policy` subclass (built with ``kwargs``) or a Policy instance. The policy is named
    ``spec``, so results say where it came from.

    **A spec runs code**: loading it executes the module or file, as ``import`` does (it is code execution, so
    only load selectors you trust). Each file (by resolved path) and each module is executed once per process
    and then reused, so module-level state persists across the caches made from one spec and side effects happen
    once; editing the file afterwards needs a new process. A Policy subclass is instantiated anew for every cache;
    a Policy instance named by the spec is shared by all of them.

    ``module`` is looked up in the working directory first (``<cwd>/module.py`` or ``<cwd>/module/__init__.py``,
    as ``python -m`` would find it; ``sys.path`` is not changed), then by a normal import. A module that fails to
    import, calls ``sys.exit()``, or a class whose constructor fails gives a ``ValueError`` naming the spec."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"policy {spec!r}: expected a known name ({', '.join(known_policies())}) or MODULE:CALLABLE, "
                         "e.g. my_selector:score or path/to/my_selector.py:score")
    module = _load_file(spec, where) if where.endswith(".py") else _load_module(spec, where)
    if not hasattr(module, attr):
        found = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(f"policy {spec!r}: {where} has no {attr!r}; callables there: {', '.join(found) or 'none'}")
    target = getattr(module, attr)
    if isinstance(target, type) and issubclass(target, Policy):
        try:
            policy = target(**kwargs)
        except (Exception, SystemExit) as exc:
            what = "called sys.exit()" if isinstance(exc, SystemExit) else f"raised {type(exc).__name__}: {exc}"
            try:
                accepted = [p for p in inspect.signature(target.__init__).parameters if p != "self"]
            except (TypeError, ValueError):
                accepted = []
            raise ValueError(f"policy {spec!r}: {attr}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) {what}; "
                             f"its constructor takes {accepted or 'no options'}: pass options it accepts, or fix "
                             f"the class") from exc
    elif isinstance(target, Policy) or callable(target):
        if kwargs:
            raise ValueError(f"policy {spec!r}: options {sorted(kwargs)} need a Policy subclass; a score function or "
                             "instance takes none")
        policy = target if isinstance(target, Policy) else _FunctionPolicy(target)
    else:
        raise ValueError(f"policy {spec!r}: {attr} is a {type(target).__name__}, not a score function or Policy")
    policy.name = spec
    return policy


#: The policies a comparison runs by default (every probe's ``--policies``): Random Attention, its shared-draw
#: ablation, and the selectors the paper compared it with; the other registered policies are ablations and
#: variants to ask for by name.
COMPARED_POLICIES: tuple[str, ...] = ("random", "random-shared", "recency", "streamingllm", "h2o", "snapkv", "rkv",
                                      "rkv-official", "vase", "triattention")


#: The paper's engine modes (``--eviction_mode`` in ``kvcompress/engine/cache_utils.py``) by name:
#: ``(policy, options, prompt protected)``. Options are the paper grid's (``scripts/run_cell.sh``).
PAPER_MODES: dict[str, tuple[str, dict, bool]] = {
    "random_pp": ("random", {}, True),
    "recency_pp": ("recency", {}, True),
    "random_unified": ("random-shared", {}, True),
    "random_block_pp": ("random-block", {}, True),
    "random_pcap": ("random-pcap", {}, False),
    "random_pmix": ("random-pmix", {}, False),
    "random_ppp": ("random-ppp", {"whole_prompt": False}, False),
    "attn": ("snapkv", {}, False),
    "attn_pp": ("snapkv", {}, True),
    "attn_rkv": ("rkv", {}, False),
    "attn_rkv_pp": ("rkv", {}, True),
    "rkv_official": ("rkv-official", {}, False),
    "range_sink_sample_attn": ("vase", {}, False),
    "range_sink_sample_attn_pp": ("vase", {}, True),
    "triattn_ph": ("triattention", {}, True),
    "triattn_pl": ("triattention", {"shared_layers": False}, True),
}


def paper_mode_twin(name: str) -> Optional[str]:
    """The paper mode with the other prompt protection (``"attn"`` <-> ``"attn_pp"``), if it has one."""
    if name not in PAPER_MODES:
        return None
    twin = name[:-3] if name.endswith("_pp") else name + "_pp"
    return twin if twin in PAPER_MODES else None


def make_policy_and_mode(spec, **kwargs) -> "tuple[Policy, Optional[bool]]":
    """:func:`make_policy`, and the prompt protection the spec names (a paper mode, or a policy defined with
    one), else ``None``."""
    if isinstance(spec, str) and spec in PAPER_MODES and spec not in _REGISTRY:
        name, options, protect = PAPER_MODES[spec]
        policy = make_policy(name, **{**options, **kwargs})
        policy.name = spec
        return policy, protect
    policy = make_policy(spec, **kwargs)
    return policy, getattr(policy, "native_protection", None)


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
        if spec in PAPER_MODES:
            return make_policy_and_mode(spec, **kwargs)[0]
        if spec not in _REGISTRY:
            raise ValueError(f"unknown policy {spec!r}; known policies: {', '.join(known_policies())}; the paper's "
                             f"mode names: {', '.join(sorted(PAPER_MODES))}")
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
    """Random Attention (the paper's Algorithm 1; its engine's ``random_pp`` mode): ``s_i ~ Uniform(0, 1)``
    i.i.d. per head over the candidates.

    With prompt protection on (the cache's default) the prompt is pinned at ``+inf`` by the core,
    so this is exactly ``s = rand(B, H_kv, S); s[:, :, :l_p] = inf; keep = topk(s, T - r)`` over the pairs
    older than the recent window. A non-prompt candidate then survives one round with probability
    ``(T - r - l_p) / (T - l_p)``.
    """

    paper_protection = True  # the paper grid's mode (Policy.paper_protection)
    def score(self, view: CacheView) -> torch.Tensor:
        return torch.rand(view.shape, generator=view.generator, device=view.keys.device, dtype=torch.float32)


def _rand(view: CacheView) -> torch.Tensor:
    return torch.rand(view.shape, generator=view.generator, device=view.keys.device, dtype=torch.float32)


@register_policy("random-shared")
class RandomSharedPolicy(Policy):
    """One uniform draw per absolute position, shared by every KV head of a layer (the paper's
    ``random_unified``: same signal and protection as Random, one keep-set for all heads).

    The draw is keyed by position rather than slot, so heads that already differ (e.g. after a
    keep-mask pin) still rank a given token identically. Batch rows draw independently.
    """

    paper_protection = True  # the paper grid's mode (Policy.paper_protection)
    def score(self, view: CacheView) -> torch.Tensor:
        b, h, _ = view.shape
        u = torch.rand((b, view.seq_len), generator=view.generator, device=view.keys.device, dtype=torch.float32)
        return torch.gather(u[:, None, :].expand(b, h, view.seq_len), 2, view.positions)


@register_policy("recency")
class RecencyPolicy(Policy):
    """Most recent pairs first. With prompt protection this is Prefix Sliding (the paper's ``recency_pp``:
    prompt + recent window); without it, a plain sliding window."""

    paper_protection = True  # the paper grid's mode (Policy.paper_protection)
    uses_seed = False

    def score(self, view: CacheView) -> torch.Tensor:
        return view.positions.to(torch.float32)


@register_policy("streamingllm")
class StreamingLLMPolicy(Policy):
    """StreamingLLM: the first ``n_sink`` positions (attention sinks) plus the most recent window."""

    paper_protection = False  # the paper grid's mode (Policy.paper_protection)
    uses_seed = False

    def __init__(self, n_sink: int = 4):
        if not isinstance(n_sink, int) or n_sink < 0:
            raise ValueError(f"streamingllm n_sink must be a non-negative int, got {n_sink!r}")
        self.n_sink = n_sink

    def score(self, view: CacheView) -> torch.Tensor:
        s = view.positions.to(torch.float32)
        return torch.where(view.positions < self.n_sink, torch.full_like(s, float("inf")), s)


@register_policy("random-block")
class RandomBlockPolicy(Policy):
    """Random eviction in contiguous blocks of ``block`` tokens; every head ranks blocks by its own uniform
    draw each round, so a block is kept or dropped as a unit. ``block=1`` is Random Attention.

    ``align="slot"`` (default, the paper's ``random_block_pp`` with its ``BLOCK_SIZE`` 32): the candidates'
    *slots* are cut into blocks ``[j*block, (j+1)*block)`` afresh at every round, so after compaction a
    block may join survivors of two earlier blocks. ``align="position"`` (a toolkit variant): blocks are
    fixed ranges of absolute positions, so what survives stays contiguous in the text. When a round must
    cut into a block, its oldest slots go first (the paper's engine leaves that tie to ``topk``).

    T / block is about the number of blocks a head can hold: the quantity the paper's block experiment
    varies (1..64 cost almost nothing; 256 leaves too few blocks per head).
    """

    paper_protection = True  # the paper grid's mode (Policy.paper_protection)
    def __init__(self, block: int = 32, align: str = "slot"):
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"random-block block must be a positive int (tokens per block), got {block!r}")
        if align not in ("slot", "position"):
            raise ValueError(f"random-block align must be 'slot' (the paper's) or 'position', got {align!r}")
        self.block, self.align = block, align

    def score(self, view: CacheView) -> torch.Tensor:
        b, h, s = view.shape
        index = (torch.arange(s, device=view.keys.device).expand(b, h, s) if self.align == "slot"
                 else view.positions)
        span = s if self.align == "slot" else view.seq_len
        block_of = index // self.block
        draw = torch.rand((b, h, span // self.block + 1), generator=view.generator, device=view.keys.device)
        rank = draw.argsort(dim=-1).argsort(dim=-1).to(torch.float32)  # integers: no ties between blocks
        within = (index % self.block).to(torch.float32) / self.block  # in [0, 1): older first out
        return torch.gather(rank, 2, block_of) + within


def _clamped_prompt(view: CacheView) -> int:
    """The paper's ``pl = min(prompt_len, K - 1)`` with ``K = T - r`` the candidates kept."""
    return min(view.prompt_len, view.keep - 1)


@register_policy("random-pcap")
class RandomPromptCapPolicy(Policy):
    """Random with capped prompt protection (the paper's ``random_pcap``): the first ``cap`` prompt tokens
    and every second token of the rest of the prompt are pinned, everything else is Random. For long
    prompts, where protecting all of it leaves too little budget for the trace (``PROMPT_CAP`` 512).
    The policy pins the prompt itself, so the cache runs it with ``protect_prompt=False``."""

    paper_protection = False  # the paper grid's mode (Policy.paper_protection)
    native_protection = False

    def __init__(self, cap: int = 512):
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise ValueError(f"random-pcap cap must be a non-negative int (prompt tokens kept whole), got {cap!r}")
        self.cap = cap

    def score(self, view: CacheView) -> torch.Tensor:
        pl = _clamped_prompt(view)
        cap = min(self.cap, pl)
        p = view.positions
        designated = (p < cap) | ((p >= cap) & (p < pl) & ((p - cap) % 2 == 0))
        return _rand(view).masked_fill(designated, float("inf"))


@register_policy("random-pmix")
class RandomPromptMixPolicy(Policy):
    """Random with per-head probabilistic prompt protection (the paper's ``random_pmix``). Each KV head of a
    layer is, once and for the whole sequence, an *archivist* (probability ``p``, 0.25; keeps the whole
    prompt) or a *scatterer* (keeps only the first ``small`` prompt tokens, 256); at least one archivist
    per layer. The roles are drawn from the cache's seed and the layer, so they repeat at every round. The
    policy pins the prompt itself, so the cache runs it with ``protect_prompt=False``."""

    paper_protection = False  # the paper grid's mode (Policy.paper_protection)
    native_protection = False

    def __init__(self, p: float = 0.25, small: int = 256):
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"random-pmix p must be a probability in [0, 1], got {p!r}")
        if isinstance(small, bool) or not isinstance(small, int) or small < 0:
            raise ValueError(f"random-pmix small must be a non-negative int, got {small!r}")
        self.p, self.small = float(p), small

    def archivists(self, view: CacheView) -> torch.Tensor:
        """Bool ``[H_kv]``: which heads of this layer keep the whole prompt."""
        gen = torch.Generator(device="cpu").manual_seed(round_seed(view.seed, view.layer_idx, 0x70_6D_69_78))
        h = view.shape[1]
        roles = torch.rand(h, generator=gen) < self.p
        if not bool(roles.any()):
            roles[int(torch.randint(h, (1,), generator=gen))] = True
        return roles.to(view.keys.device)

    def score(self, view: CacheView) -> torch.Tensor:
        pl = _clamped_prompt(view)
        small = min(self.small, pl)
        limit = torch.where(self.archivists(view), pl, small)  # [H_kv]
        return _rand(view).masked_fill(view.positions < limit[None, :, None], float("inf"))


@register_policy("random-ppp")
class RandomPlanPrefixPolicy(Policy):
    """Random with the prompt and a plan prefix protected (the paper's ``random_ppp``): the candidate slots
    ``[0, min(pl + plan_prefix, K - min_scatter))`` are pinned (``pl`` the prompt clamped to ``K - 1``, ``K = T - r``;
    768 and 64 by default), the rest is Random; compaction keeps the earliest survivors in those slots, so they hold
    the prompt and the first generated tokens. As in the paper's engine, a negative end (``K < min_scatter``) pins
    all but the last ``min_scatter - K`` slots, and when that is more than ``K`` the ``K`` of them ``torch.topk``
    returns are kept.

    ``whole_prompt=False`` (what the paper's mode name ``random_ppp`` sets) is the paper's: the prompt is protected
    only through that slice, so when ``K - min_scatter`` is shorter than the prompt the rest of it competes.
    ``whole_prompt=True`` (the default of the name ``random-ppp``) also has the core pin the whole prompt; the two
    keep the same pairs whenever the prompt fits in ``K - min_scatter``."""

    paper_protection = True  # the paper grid's mode (Policy.paper_protection)
    def __init__(self, plan_prefix: int = 768, min_scatter: int = 64, whole_prompt: bool = True):
        for name, val in (("plan_prefix", plan_prefix), ("min_scatter", min_scatter)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"random-ppp {name} must be a non-negative int, got {val!r}")
        if not isinstance(whole_prompt, bool):
            raise ValueError(f"random-ppp whole_prompt must be True (the core also pins the whole prompt) or False "
                             f"(the paper's random_ppp: only the pinned slice), got {whole_prompt!r}")
        self.plan_prefix, self.min_scatter, self.whole_prompt = plan_prefix, min_scatter, whole_prompt

    @property
    def native_protection(self) -> bool:  # the core pins the whole prompt only with whole_prompt
        return self.whole_prompt

    def score(self, view: CacheView) -> torch.Tensor:
        draw = _rand(view)
        n = draw.shape[-1]
        end = min(_clamped_prompt(view) + self.plan_prefix, view.keep - self.min_scatter)
        if end < 0:  # the engine's slice rs[..., :end] with a negative end
            end = max(0, n + end)
        pinned = torch.arange(n, device=draw.device) < end
        if end <= view.keep:
            return draw.masked_fill(pinned, float("inf"))
        # More pinned than kept: the engine keeps the K its topk returns among the tied +inf. A finite 2 ranks as
        # its +inf does (above every draw), so topk over the same pattern makes the same choice; the core's own pins
        # rank first, so the choice never exceeds K with them.
        rank = draw.masked_fill(pinned, 2.0)
        if view.pinned is not None:
            rank = rank.masked_fill(view.pinned, 3.0)
        chosen = torch.topk(rank, view.keep, dim=-1).indices
        return torch.zeros_like(draw).scatter(-1, chosen, float("inf"))
