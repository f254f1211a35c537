"""randattn: per-KV-head KV-cache eviction for HF causal LMs, and the tools to test Random Attention.

Core objects:
    EvictingCache   the (K, r) per-head evicting cache; drop it into ``model.generate``.
    EvictionSpec    one eviction setting, checked once; ``make_cache()`` builds its caches.
    attach          ``with randattn.attach(model):`` the guards for one block (``install_guards``: for good).
    load_model      the embedded SmolLM2-135M-Instruct by default, or any HF causal LM.
    replay          teacher-forced replay with eviction rounds where decoding has them.
    policies        score functions; ``register_policy`` adds your own.
"""

from .cache import ENGINE, EvictingCache, EvictingLayer, round_seed
from .spec import EvictionSpec, SpecError
from .decoding import Replay, ReplayResult, decode_step, generate, replay, replay_tokenwise
from .keeplog import KeepLog
from .models import (
    DEFAULT_MODEL,
    ModelRef,
    UnsupportedModelError,
    cache_argument_name,
    check_model,
    install_guards,
    load_model,
    resolve_device,
)
from .policies import (
    COMPARED_POLICIES,
    PAPER_MODES,
    CacheView,
    Policy,
    known_policies,
    load_policy,
    make_policy,
    register_policy,
    score_function,
)
from .attach import attach
from . import selectors  # noqa: F401  (registers h2o, snapkv, snapkv-longbench, rkv, rkv-official, vase)
from . import triattention  # noqa: F401  (registers triattention)
from .triattention import TriAttentionStats, check_stats, load_stats

__version__ = "0.1.0"

__all__ = [
    "ENGINE",
    "EvictingCache",
    "EvictingLayer",
    "EvictionSpec",
    "SpecError",
    "ModelRef",
    "KeepLog",
    "CacheView",
    "Policy",
    "register_policy",
    "make_policy",
    "known_policies",
    "COMPARED_POLICIES",
    "PAPER_MODES",
    "load_policy",
    "score_function",
    "load_model",
    "DEFAULT_MODEL",
    "resolve_device",
    "check_model",
    "install_guards",
    "attach",
    "cache_argument_name",
    "UnsupportedModelError",
    "generate",
    "decode_step",
    "replay",
    "replay_tokenwise",
    "Replay",
    "ReplayResult",
    "round_seed",
    "TriAttentionStats",
    "load_stats",
    "check_stats",
]
