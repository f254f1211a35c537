"""randattn as an lm-evaluation-harness (0.4.13) model: every request through a fresh evicting cache.

    python -m probes.lm_eval_backend --model randattn --device cpu \\
        --model_args pretrained=smollm2-135m,policy=random,budget=1024,buffer=64,protect_prompt=True,seed=0 \\
        --tasks TASK [--include_path DIR] --log_samples --output_path OUT

takes lm-eval's own command line: this module registers the model ``randattn`` (a subclass of lm-eval's HF model)
and hands over to lm-eval's CLI, the way lm-eval 0.4.13 runs a model defined outside its package (it has no plugin
discovery). ``policy=full`` is full attention (HF's own cache, lm-eval's own code paths), the reference of
"policy vs full attention".

- ``generate_until``: lm-eval's generation (``--batch_size N`` batches, left-padded), with a fresh
  :class:`randattn.EvictingCache` per batch that learns each row's padding, so every row runs as its prompt alone;
  the prompt (the whole context, few-shot examples included) is the protected prefix under ``protect_prompt=True``.
- ``loglikelihood`` / ``loglikelihood_rolling``: teacher forcing with :class:`randattn.Replay`, the context as the
  (protected) prompt and the continuation scored token by token with eviction rounds exactly where decoding has
  them, so a log-likelihood sees the cache generation would see. One request per forward whatever the batch size
  (replay runs one prompt length at a time).
- Seeds: each request is a row key of its cache (a hash of its tokens), so its draws depend on ``seed`` and itself
  only: the same keep-sets in any order and any batch, and two runs with the same ``seed`` agree.

Per-sample outputs (``--log_samples``) feed ``python -m probes.compare_samples`` (the paired comparison).
"""

from __future__ import annotations

import hashlib
import logging
import numbers
import sys
from typing import Optional

import torch

import randattn
from randattn.spec import ALIASES, SettingError, read_settings, spec_default

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as exc:  # the optional extra is missing: say how to get it
    raise ImportError(f"probes.lm_eval_backend needs lm-evaluation-harness 0.4.13 ({exc}); install it with "
                      "`pip install -e \".[lm-eval]\"` (or `pip install lm_eval==0.4.13`)") from exc

__all__ = ["RandAttnLM", "ACCEPTED_ARGS", "FULL", "TRUE_SPELLINGS", "FALSE_SPELLINGS", "request_key", "main"]

FULL = "full"
#: The --model_args (and the settings lm-eval hands every model) randattn understands; anything else is refused.
ACCEPTED_ARGS = ("pretrained", "policy", "budget", "buffer", "recent", "protect_prompt", "seed", "batch_size",
                 "max_batch_size", "device", "dtype", "max_length", "tokenizer", "trust_remote_code")
_EVICTION_ARGS = ("budget", "buffer", "recent", "protect_prompt")
#: The spec keys --model_args takes (read by EvictionSpec.from_mapping, as every other source's).
_SPEC_ARGS = ("policy", *_EVICTION_ARGS, "seed")
#: This backend's own default T (the paper's; the spec has none); r and the rest are the spec's defaults.
DEFAULT_BUDGET = 1024
DEFAULT_BUFFER = spec_default("buffer")
WHERE = "--model_args"
#: How a boolean model argument may be spelt (any case); lm-eval itself turns true/false into booleans and 1/0 into
#: integers before the model sees them. Anything else is refused, never read as "on".
TRUE_SPELLINGS, FALSE_SPELLINGS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_UNSET = object()  # protect_prompt left out (lm-eval turns protect_prompt=none into None, which is refused)
log = logging.getLogger(__name__)
_KEYS = f"; the accepted keys are {', '.join(ACCEPTED_ARGS)}"


def _flag(key: str, value) -> bool:
    """A boolean model argument, parsed strictly: ``True``/``False``, the integers 1/0, or one of
    :data:`TRUE_SPELLINGS` / :data:`FALSE_SPELLINGS` in any case; anything else (``maybe``, ``none``, ``2``) is a
    ``ValueError`` naming the key and the accepted values."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_SPELLINGS + FALSE_SPELLINGS:
        return value.strip().lower() in TRUE_SPELLINGS
    unset = " (leave the key out for its default)" if value is None else ""
    raise SettingError(key, f"not a boolean; give {key}=true or {key}=false{unset} (accepted, any case: "
                       f"{'/'.join(TRUE_SPELLINGS)} for on, {'/'.join(FALSE_SPELLINGS)} for off){_KEYS}",
                       where=f"{WHERE} {key}={value!r}", key=key, accepted=ACCEPTED_ARGS)


def _integer(key: str, value, *, minimum: int, example: int, below: Optional[int] = None,
             optional: bool = False) -> Optional[int]:
    """An integer argument, parsed strictly: an int (not a bool) or a string of decimal digits (lm-eval's command
    line hands ``--batch_size 2`` over as ``'2'``), in ``[minimum, below)``; ``None`` only where ``optional``.
    Anything else (``1.5``, ``'12x'``, ``True``) is a ``ValueError`` naming the argument and what it takes."""
    if value is None and optional:
        return None
    parsed = value
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        parsed = int(value.strip())
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        parsed = int(value)  # numpy integers too
    if isinstance(parsed, bool) or not isinstance(parsed, int) or parsed < minimum or (below is not None
                                                                                      and parsed >= below):
        span = f"in [{minimum}, {'2**64' if below == 2**64 else below})" if below is not None else f">= {minimum}"
        raise SettingError(key, f"not an integer {span}{' (or left out)' if optional else ''}; give whole digits, e.g. "
                           f"{key}={example}{_KEYS}", where=f"{WHERE} {key}={value!r}", key=key,
                           accepted=ACCEPTED_ARGS)
    return parsed


class ModelArgError(SettingError, TypeError):
    """A key --model_args does not take: the settings' one error type, and a ``TypeError`` as lm-eval's own models
    raise for an unexpected keyword."""


def request_key(tokens) -> int:
    """The row key of one request (:class:`randattn.EvictingCache` ``row_keys``): a hash of its token ids, so its
    draws depend on ``seed`` and itself only, not on lm-eval's order or the batch it lands in."""
    digest = hashlib.blake2b(str(list(map(int, tokens))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@register_model("randattn")
class RandAttnLM(HFLM):
    """lm-eval's HF model with randattn's evicting cache; see the module docstring for what each request does."""

    def __init__(self, pretrained: Optional[str] = None, policy: str = "random", budget: Optional[int] = None,
                 buffer: Optional[int] = None, recent: Optional[int] = None, protect_prompt: Optional[bool] = _UNSET,
                 seed: int = 0, batch_size: "int | str" = 1, max_batch_size: Optional[int] = None,
                 device: Optional[str] = None, dtype: Optional[str] = None, max_length: Optional[int] = None,
                 tokenizer: Optional[str] = None, trust_remote_code: bool = False, **unknown):
        if unknown:
            # another spelling of a spec key (K, T, r): the settings reader's refusal, "did you mean budget?"
            read_settings({k: v for k, v in unknown.items() if k in ALIASES}, where=WHERE, accepted=ACCEPTED_ARGS)
            raise ModelArgError(sorted(unknown)[0], f"--model_args {', '.join(sorted(unknown))}: not a randattn model "
                                f"argument; the accepted ones are {', '.join(ACCEPTED_ARGS)} (lm-eval's other HF "
                                "options are not passed through)", key=sorted(unknown)[0], accepted=ACCEPTED_ARGS)
        # Every argument is parsed strictly, before the model loads: lm-eval hands --model_args over as its parser
        # guessed them (true/false as booleans, digits as integers, anything else as a string) and --batch_size as
        # a string, so a value is never taken by its truthiness.
        try:
            batch_size = _integer("batch_size", batch_size, minimum=1, example=8)
        except ValueError:
            raise ValueError(f"batch_size={batch_size!r}: the randattn model takes a fixed batch size, a positive "
                             "integer (lm-eval's 'auto' sizes batches with full-attention forwards, which say nothing "
                             "of an evicting cache); pass e.g. --batch_size 8") from None
        seed = _integer("seed", seed, minimum=0, below=2**64, example=0)
        max_batch_size = _integer("max_batch_size", max_batch_size, minimum=1, optional=True, example=8)
        max_length = _integer("max_length", max_length, minimum=1, optional=True, example=2048)
        budget = _integer("budget", budget, minimum=1, optional=True, example=DEFAULT_BUDGET)
        buffer = _integer("buffer", buffer, minimum=1, optional=True, example=DEFAULT_BUFFER)
        recent = _integer("recent", recent, minimum=0, optional=True, example=DEFAULT_BUFFER)
        protect_prompt = None if protect_prompt is _UNSET else _flag("protect_prompt", protect_prompt)
        trust_remote_code = _flag("trust_remote_code", trust_remote_code)
        self.policy_name = str(policy)
        given = {k: v for k, v in zip(_EVICTION_ARGS, (budget, buffer, recent, protect_prompt)) if v is not None}
        if self.policy_name == FULL and given:
            log.warning("policy=full is full attention (no eviction): %s ignored", ", ".join(given))
        self.settings = {"policy": self.policy_name, "seed": seed, **({} if self.policy_name == FULL else {
            "budget": DEFAULT_BUDGET, "buffer": DEFAULT_BUFFER, "recent": None, "protect_prompt": None, **given})}
        # A bad policy, budget or seed is refused here, before the model loads.
        self.eviction_spec = randattn.EvictionSpec.full() if self.policy_name == FULL else self._spec_of(self.settings)
        model, tok = self._load(pretrained, tokenizer, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        self.pretrained_name = (pretrained or randattn.DEFAULT_MODEL) if isinstance(pretrained, (str, type(None))) \
            else getattr(model, "name_or_path", type(model).__name__)
        # lm-eval warns that a model object bypasses its loading options: randattn loaded it, with those options.
        hf_log = logging.getLogger("lm_eval.models.huggingface")
        level = hf_log.level
        hf_log.setLevel(logging.ERROR)
        try:
            super().__init__(pretrained=model, tokenizer=tok, batch_size=batch_size, max_length=max_length)
        finally:
            hf_log.setLevel(level)
        self.requests_seen = 0
        self.requests_evicted = 0  # requests during which at least one eviction round ran

    @staticmethod
    def _load(pretrained, tokenizer, **options):
        """``(model, tokenizer)``: loaded by :func:`randattn.load_model` from a name or directory, or given as objects
        (``RandAttnLM(model, tokenizer=tok, ...)`` from Python; the model gets randattn's guards)."""
        if pretrained is None or isinstance(pretrained, str):
            return randattn.load_model(pretrained, tokenizer=tokenizer, **options)
        if tokenizer is None or isinstance(tokenizer, str):
            raise ValueError("pretrained is a model object, so tokenizer must be its tokenizer object too; pass "
                             "tokenizer=tok, or pretrained=NAME_OR_DIR to load both")
        randattn.check_model(pretrained)
        randattn.install_guards(pretrained)
        return pretrained.eval(), tokenizer

    # -- caches ------------------------------------------------------------------------------------
    @staticmethod
    def _spec_of(s: dict) -> randattn.EvictionSpec:
        return randattn.EvictionSpec.from_mapping(
            {k: s[k] for k in _SPEC_ARGS}, keys=_SPEC_ARGS, where=f"{WHERE} policy={s['policy']},budget={s['budget']},"
            f"buffer={s['buffer']}")

    def _cache_for(self, keys: list) -> randattn.EvictingCache:
        """A fresh cache for one batch, one row key per request (:func:`request_key`)."""
        return self.eviction_spec.make_cache(row_keys=keys)

    def _count(self, cache: randattn.EvictingCache, rows: int = 1) -> None:
        """Requests run, and those whose cache ran at least one round (a batch counts whole: its rounds are shared)."""
        self.requests_seen += rows
        self.requests_evicted += rows if cache.layers and sum(cache.events) > 0 else 0

    def _check_fits(self, prompt_len: int, what: str) -> None:
        problem = self.eviction_spec.validate(prompt_len)
        if problem:
            raise ValueError(problem.worded(budget_text=f"budget={problem.budget}", what=what,
                                            fix="protect_prompt=False, or fewer few-shot examples (--num_fewshot)"))

    # -- generate_until ----------------------------------------------------------------------------
    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self.policy_name == FULL:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        # lm-eval pads a batch on the left; the cache learns each row's padding from the attention mask
        mask = generation_kwargs.get("attention_mask")
        rows = [ids[m.bool()] if m is not None else ids for ids, m in
                zip(context, mask if mask is not None else [None] * len(context))]
        cache = self._cache_for([request_key(r.tolist()) for r in rows])
        self._check_fits(max(len(r) for r in rows), "prompt")
        # lm-eval's generate (stop sequences, sampling settings) with the cache; the model's guards refuse a used one
        generation_kwargs[randattn.cache_argument_name(self.model)] = cache
        try:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        finally:
            self._count(cache, len(rows))

    # -- loglikelihood -----------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: Optional[int] = None):
        if self.policy_name == FULL:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        from tqdm.auto import tqdm

        out = []
        for cache_key, context, continuation in tqdm(requests, disable=disable_tqdm or self.rank != 0,
                                                     desc="randattn loglikelihood"):
            answer = self._score(list(context), list(continuation))
            if cache_key is not None:  # rolling windows come without a key; lm-eval caches their sum itself
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
            out.append(answer)
        return out

    @torch.no_grad()
    def _score(self, context: list, continuation: list) -> tuple[float, bool]:
        """(sum of log p(continuation | context), whether greedy decoding reproduces it) under eviction."""
        ids = (context + continuation)[-(self.max_length + 1):]  # lm-eval's left truncation
        n = len(continuation)
        prompt_len = len(ids) - n
        if prompt_len < 1:
            raise ValueError(f"a {n}-token continuation leaves no context within max_length={self.max_length}; "
                             "raise --model_args max_length")
        cache = self._cache_for([request_key(ids)])
        self._check_fits(prompt_len, "context")
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        # Feed all but the last token: the logits after it predict the last one (no forward past the sequence).
        # score_from skips the LM head over the context, whose own log-probs are not asked for.
        res = randattn.Replay(self.model, x, cache, prompt_len=prompt_len, score_from=prompt_len).run(
            until=len(ids) - 1).result()
        self._count(cache)
        last_lp = torch.log_softmax(res.last_logits[0].float(), -1)
        target = torch.tensor(ids[prompt_len:])
        lps = torch.cat([res.logprobs[0, prompt_len:-1], last_lp[target[-1:]]])
        greedy = torch.cat([res.argmax[0, prompt_len:-1], last_lp.argmax(-1, keepdim=True)])
        return float(lps.sum()), bool(torch.equal(greedy, target))

    # -- provenance --------------------------------------------------------------------------------
    def get_model_info(self) -> dict:
        """What lm-eval writes into the results' config: the model and randattn's settings (no hub lookup)."""
        info = {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(self.model.dtype), "model_revision": None, "model_sha": ""}
        info["randattn"] = {**self.settings, "pretrained": self.pretrained_name, "engine": randattn.ENGINE,
                            "version": randattn.__version__, "requests": self.requests_seen,
                            "requests_with_eviction_rounds": self.requests_evicted}
        if self.policy_name != FULL and self.requests_seen and not self.requests_evicted:
            log.warning("no request reached budget + buffer, so no eviction round ran: this run measured full "
                        "attention. Lower budget or raise max_gen_toks.")
        return info


def main(argv=None) -> int:
    """lm-eval's command line, with the ``randattn`` model registered (lm-eval reads ``sys.argv`` itself)."""
    from lm_eval.__main__ import cli_evaluate

    saved = list(sys.argv)
    if argv is not None:
        sys.argv = [saved[0] if saved else "lm_eval_backend", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv[:] = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
