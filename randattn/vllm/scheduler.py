"""The plugin's scheduler: chunks that end at round boundaries, prompt lengths for the KV manager, and counters.

vLLM preempts a request by freeing all its blocks; when it resumes, vLLM recomputes its prompt and every token it
generated, normally in as few chunks as the token budget allows. Under eviction that recompute must replay the
rounds the request already ran, at the same lengths, or it would keep other pairs than it kept the first time
(and need more blocks than its cap). A round runs in the forward that brings a layer's stored count to
``first = max(prompt_len, T + r)``, then at every ``r`` tokens after (:func:`randattn.vllm.config.round_lengths`),
and the engine's backend refuses a chunk that crosses one. So :class:`EvictionScheduler` ends every chunk of every
request at the next round length at the latest (:func:`randattn.vllm.config.next_round_length`): a resumed request
recomputes its prompt plus the tokens up to the first round in one chunk, then ``r`` tokens per chunk, each chunk
ending with the round it replays. The draws of a round depend on (seed, request key, layer, round, head) only, so
the replayed rounds keep the same pairs and the request continues as if it had never been preempted
(``tests/test_vllm_memory.py`` checks the tokens). Fresh requests are chunked by the same rule; their decode steps
(one token) never cross a boundary.

The chunk limit is applied in ``Scheduler._reserve_prefill_lookahead``, the hook vLLM 0.32.0 calls for every
running and waiting request right after it sizes the request's chunk and before it allocates the chunk's slots (its
own use, multi-token-prediction lookahead, is off with eviction: speculative decoding is refused). That is a
private method of a pinned release, so it is part of what :data:`randattn.vllm.checks.SUPPORTED_VLLM` pins.

The scheduler also tells the evicting KV-cache manager each request's prompt length when it is added (its cap,
:mod:`randattn.vllm.kv_cache`), and keeps :attr:`EvictionScheduler.counters`: peak blocks in use, most requests
running at once, preemptions, tokens computed (recomputation included). With no ``"randattn"`` key it only counts,
which is how ``bench/vllm.py`` measures full attention with the same code path.

vLLM picks it up from ``scheduler_cls`` (:func:`randattn.vllm.checks.configure` sets it); the engine config is
checked again here, in the engine core, where the scheduler is built.
"""

from __future__ import annotations

import json
import os
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from .checks import configure
from .config import next_round_length
from .kv_cache import evicting_managers

__all__ = ["EvictionScheduler", "COUNTERS_ENV"]

#: When set, the scheduler writes its counters as JSON to this path at shutdown (for runs in another process).
COUNTERS_ENV = "RANDATTN_VLLM_COUNTERS"


class EvictionScheduler(Scheduler):
    """vLLM's scheduler with chunks ending at round boundaries (under eviction) and memory counters."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args, **kwargs) -> None:
        self.randattn = configure(vllm_config)  # None: full attention, the counters only
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        self._evicting = evicting_managers(self.kv_cache_manager)
        if self.randattn is not None and not self._evicting:
            raise RuntimeError(
                "randattn.vllm: additional_config has a 'randattn' key but no attention layer reported the evicting "
                "KV-cache spec, so blocks would be allocated for full attention while the backend evicts; the "
                "plugin's attention backend is not in use (is randattn installed in this environment, so that vLLM "
                "loads its vllm.general_plugins entry point?)")
        for manager in self._evicting:
            manager.note_max_model_len(self.max_model_len)
        pool = self.kv_cache_manager.block_pool
        self.counters = {"num_blocks": pool.num_gpu_blocks - 1, "block_size": self.block_size, "peak_blocks_used": 0,
                         "max_request_blocks": 0, "max_running": 0, "running_steps": 0, "preemptions": 0,
                         "steps": 0, "tokens_computed": 0, "evicting": self.randattn is not None}

    def add_request(self, request: Any) -> None:
        super().add_request(request)
        for manager in self._evicting:
            manager.note_request(request.request_id, request.num_prompt_tokens)

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if self.randattn is None or num_new_tokens <= 0:
            return num_new_tokens
        boundary = next_round_length(request.num_prompt_tokens, num_computed_tokens, self.randattn)
        return min(num_new_tokens, boundary - num_computed_tokens)

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        c, pool = self.counters, self.kv_cache_manager.block_pool
        c["steps"] += 1
        c["peak_blocks_used"] = max(c["peak_blocks_used"], pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        c["max_running"] = max(c["max_running"], len(self.running))
        c["running_steps"] += len(self.running)  # / steps: the requests running in an average step
        managers = self.kv_cache_manager.coordinator.single_type_managers
        held = [len(blocks) for m in managers for blocks in m.req_to_blocks.values()]
        c["max_request_blocks"] = max([c["max_request_blocks"], *held])
        c["preemptions"] += len(out.preempted_req_ids or ())
        c["tokens_computed"] += int(out.total_num_scheduled_tokens)
        return out

    def shutdown(self) -> None:
        path = os.environ.get(COUNTERS_ENV)
        if path:
            with open(path, "w") as f:
                json.dump(self.counters, f)
        super().shutdown()
