"""The planted-fact instrument: plant ``Let zq = 4729.`` in real reasoning text, evict, ask for it.

An instance is laid out as (positions are absolute tokens)::

    [stub prompt][filler ............][fact box][filler ..................][query][value]
                                      ^ box_start                               ^ box_start + distance

* stub prompt: the chat template around one instruction, prefilled;
* filler: contiguous text from a traces file (the model's own reasoning), never containing the
  planted values;
* fact box: ``Let zq = 4729.`` padded with newlines to ``box_width`` tokens, variable names and
  4-digit values varied per instance. The box ends exactly where an eviction round fires, so the
  first round after the model has read the fact is the one that applies the condition's keep-mask;
* query ``Recall: zq =`` and the value tokens, teacher-forced: ``LP`` is the sum of their
  log-probs and ``retrieved`` says whether the greedy prediction is right at every value token.

Every instance of a run has the same layout (same box positions, same length), so instances run
as a batch and a keep-mask is the same for all rows. Conditions (:class:`Condition`) are
keep-masks on the box: kept in a set of KV heads (in every layer, or given layers), deleted from
every head, kept everywhere, or left to the background policy. Everything before the box is the
same for all conditions, so it is replayed once and forked (:class:`randattn.Replay`).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

import randattn

from .config import ConfigError
from randattn.seeding import batch_seed

__all__ = ["Fact", "Instance", "InstanceBuilder", "Condition", "run_batch", "audit_keep_log", "fact_metrics"]

CONSONANTS = "bcdfghjklmnpqrstvwxz"
INSTRUCTION = "Read the worked solutions below. Some lines define variables; remember their values."
FACT = " Let {name} = {value}."
QUERY = "\nRecall: {name} ="


@dataclass(frozen=True)
class Fact:
    """One planted fact of an instance: its box and its answer span (absolute positions, end exclusive)."""

    name: str
    value: str
    box_start: int
    box_end: int
    answer_start: int
    answer_end: int

    @property
    def box(self) -> range:
        return range(self.box_start, self.box_end)


@dataclass
class Instance:
    index: int
    ids: list[int]
    prompt_len: int
    facts: list[Fact]
    filler_start: int  # token offset of the filler in the traces stream (for provenance)


class InstanceBuilder:
    """Builds planted-fact instances with one fixed layout from a traces corpus.

    Args:
        tokenizer: the model's tokenizer (a fast one: the value span is found from offsets).
        texts: reasoning traces; they are joined into one token stream and filler is cut from it.
        budget, buffer: the cache's K and r (the box is aligned to end where a round fires).
        distance: tokens from the first token of a fact box to the first token of its answer.
        box_width: tokens per fact box (the sentence plus newline padding); must be <= buffer so a
            single round can delete a whole box.
        n_facts: facts per instance; fact ``i+1``'s box follows fact ``i``'s, and its query follows
            fact ``i``'s answer, so every answer sits exactly ``distance`` after its own box.
        seed: instance ``i`` depends only on ``(seed, i)``.
        fact, query, instruction: the texts (``{name}`` and ``{value}`` are filled in per fact); the
            query must end right before the value, which must appear once in ``fact``.
        deletable: conditions will force-evict whole boxes, so a box must fit in one round's drop
            (``box_width <= buffer``); False when the boxes are only ever left to the policy.

    A layout that cannot be built is a :class:`~probes.config.ConfigError` (a ``ValueError``) naming the setting to
    change (``box_width``, ``distance``, ``traces``, ``model``).
    """

    def __init__(self, tokenizer, texts: Sequence[str], *, budget: int, buffer: int, distance: int,
                 box_width: int = 12, n_facts: int = 1, seed: int = 0, fact: str = FACT, query: str = QUERY,
                 instruction: str = INSTRUCTION, deletable: bool = True):
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("model", "the planted-fact probe needs a fast tokenizer (offset mapping) to find the value tokens")
        if deletable and box_width > buffer:
            raise ConfigError("box_width",
                f"--box-width {box_width} exceeds the buffer r={buffer}: one round can drop only r pairs, so a box "
                f"that wide cannot be deleted at once; use --box-width <= {buffer} or a larger --buffer"
            )
        self.tok, self.budget, self.buffer = tokenizer, budget, buffer
        self.fact_text, self.query_text, self.instruction = fact, query, instruction
        self.distance, self.box_width, self.n_facts, self.seed = distance, box_width, n_facts, seed
        self.newline = self._encode("\n")[-1]
        self.stream = np.asarray(self._join(texts), dtype=np.int64)
        self.trace_starts = self._trace_starts(texts)
        self.stub = self._stub()
        self.value_len = len(self._box("zq", "5831")[1])
        self._layout()

    # -- tokenisation helpers ----------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _join(self, texts) -> list[int]:
        out = []
        for t in texts:
            out += self._encode(t.strip() + "\n\n")
        return out

    def _trace_starts(self, texts) -> np.ndarray:
        starts, n = [], 0
        for t in texts:
            starts.append(n)
            n += len(self._encode(t.strip() + "\n\n"))
        return np.asarray(starts)

    def _stub(self) -> list[int]:
        msgs = [{"role": "user", "content": self.instruction}]
        if getattr(self.tok, "chat_template", None):
            ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
            return list(ids["input_ids"])
        return self._encode(self.instruction + "\n\n")  # a base model without a chat template

    def _box(self, name: str, value: str) -> tuple[list[int], list[int], list[int]]:
        """(box tokens, value token ids, query tokens) for one fact."""
        text = self.fact_text.format(name=name, value=value)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        v0 = text.index(value)
        span = [i for i, (a, b) in enumerate(offsets) if a < v0 + len(value) and b > v0]
        lead = max((i for i, (a, b) in enumerate(offsets) if b <= v0 and text[a:b].strip()), default=-1)
        if len(ids) > self.box_width:
            raise ConfigError("box_width",
                f"the fact sentence {text!r} takes {len(ids)} tokens but --box-width is {self.box_width}; "
                f"raise --box-width (and --buffer if needed)"
            )
        # Whitespace tokens between the last word before the value and the digits belong to the query,
        # so the answer is the digits only.
        query = self._encode(self.query_text.format(name=name)) + ids[lead + 1 : span[0]]
        box = ids + [self.newline] * (self.box_width - len(ids))
        return box, ids[span[0] : span[-1] + 1], query

    # -- layout ----------------------------------------------------------------------------------
    def _layout(self) -> None:
        p, k, r, w = len(self.stub), self.budget, self.buffer, self.box_width
        # Rounds fire after the token that brings the cache to K + r, then every r tokens.
        j = 0
        while k + r + j * r - w < p:
            j += 1
        self.first_box = k + r + j * r - w
        # Consecutive boxes are `gap` apart; answer i+1 comes `gap` after answer i.
        self.gap = 2 * w
        last_box = self.first_box + (self.n_facts - 1) * self.gap
        self.length = last_box + self.distance + self.value_len
        if self.distance < w + 16:
            raise ConfigError("distance", f"--distance {self.distance} is too short for a {w}-token box and a query; use >= {w + 16}")

    @property
    def score_from(self) -> int:
        """First answer position: nothing before it is scored."""
        return self.first_box + self.distance

    def build(self, index: int) -> Instance:
        rng = random.Random(batch_seed(self.seed, index))
        need = self.length  # an upper bound on filler tokens
        for _ in range(100):
            start = int(rng.choice(self.trace_starts[self.trace_starts < max(1, len(self.stream) - need)]))
            filler = self.stream[start : start + need].tolist()
            text = self.tok.decode(filler)
            facts = self._draw_facts(rng, text)
            if facts is not None:
                return self._assemble(index, filler, facts, start)
        raise ConfigError("traces", "could not draw fact values absent from the filler; the traces may be too short or too numeric")

    def _draw_facts(self, rng: random.Random, filler_text: str):
        out, names = [], set()
        for _ in range(self.n_facts):
            for _ in range(200):
                name = rng.choice(CONSONANTS) + rng.choice(CONSONANTS)
                value = str(rng.randint(1000, 9999))
                if name in names or f"{name} " in filler_text or value in filler_text:
                    continue
                box, value_ids, query = self._box(name, value)
                if len(value_ids) != self.value_len:
                    continue  # keep every instance the same length (some tokenizers split numbers unevenly)
                names.add(name)
                out.append((name, value, box, value_ids, query))
                break
            else:
                return None
        return out

    def _assemble(self, index: int, filler: list[int], facts, filler_start: int) -> Instance:
        ids = list(self.stub)
        take = iter(filler)
        ids += [next(take) for _ in range(self.first_box - len(ids))]
        boxes = []
        for i, (name, value, box, value_ids, query) in enumerate(facts):
            if i:  # filler between boxes
                ids += [next(take) for _ in range(self.first_box + i * self.gap - len(ids))]
            boxes.append(len(ids))
            ids += box
        placed = []
        for i, (name, value, box, value_ids, query) in enumerate(facts):
            answer = boxes[i] + self.distance
            n_fill = answer - len(query) - len(ids)
            if n_fill < 0:
                raise ConfigError("distance", f"--distance {self.distance} leaves no room for the query of fact {i}")
            ids += [next(take) for _ in range(n_fill)] + query
            ids += value_ids
            placed.append(Fact(name, value, boxes[i], boxes[i] + self.box_width, answer, answer + len(value_ids)))
        assert len(ids) == self.length, (len(ids), self.length)
        return Instance(index, ids, len(self.stub), placed, filler_start)


# -- conditions --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Condition:
    """A keep-mask on the fact boxes.

    ``keep[i]`` says what happens to fact ``i``'s box: ``None`` leaves it to the background policy;
    otherwise it is a tuple with one entry per box token, each the set of KV heads that keep that
    token (pinned at every round; force-evicted from every other head at the first round after the
    box). ``layers`` restricts the mask to those layers; in all other layers the box is deleted.
    """

    name: str
    keep: tuple
    layers: Optional[tuple[int, ...]] = None
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    full_cache: bool = False  # no eviction at all: the full cache, Recall R's other top endpoint

    @classmethod
    def heads(cls, name: str, kv_heads, width: int, n_facts: int = 1, *, layers=None, **meta) -> "Condition":
        """Every token of every box kept in ``kv_heads`` (empty: deleted; all heads: kept everywhere)."""
        spec = tuple(frozenset(kv_heads) for _ in range(width))
        return cls(name, (spec,) * n_facts, layers, meta)

    @classmethod
    def full(cls, name: str = "full", n_facts: int = 1, **meta) -> "Condition":
        """No eviction at all (the whole sequence through a cache too large to evict): the full-cache top of
        Recall R, beside ``all`` (the fact kept everywhere, the background evicted), the paper code's top."""
        return cls(name, (None,) * n_facts, None, meta, full_cache=True)

    @classmethod
    def policy(cls, name: str = "policy", n_facts: int = 1, **meta) -> "Condition":
        """The boxes are evicted like the rest of the text, by the cache's policy."""
        return cls(name, (None,) * n_facts, None, meta)

    def apply(self, cache: randattn.EvictingCache, facts: Sequence[Fact], n_heads: int, n_layers: int) -> None:
        all_heads = frozenset(range(n_heads))
        layers = None if self.layers is None else list(self.layers)
        for fact, spec in zip(facts, self.keep):
            if spec is None:
                continue
            if len(spec) != fact.box_end - fact.box_start:
                raise ValueError(f"condition {self.name!r}: {len(spec)} token specs for a {len(fact.box)}-token box")
            groups: dict[frozenset, list[int]] = {}
            for pos, heads in zip(fact.box, spec):
                bad = [h for h in heads if not 0 <= h < n_heads]
                if bad:
                    raise ValueError(f"condition {self.name!r} names KV heads {bad}; the model has {n_heads} (0..{n_heads - 1})")
                groups.setdefault(frozenset(heads), []).append(pos)
            for heads, positions in groups.items():
                if heads:
                    cache.pin(positions, heads=sorted(heads), layers=layers)
                if all_heads - heads:
                    cache.force_evict(positions, heads=sorted(all_heads - heads), layers=layers)
            if layers is not None:
                others = [l for l in range(n_layers) if l not in set(layers)]
                if others:
                    cache.force_evict(list(fact.box), layers=others)

    def expected(self, fact_idx: int, layer: int, n_heads: int) -> Optional[np.ndarray]:
        """Bool ``[H_kv, box_width]``: where fact ``fact_idx``'s box must survive in ``layer`` (None: free)."""
        spec = self.keep[fact_idx]
        if spec is None:
            return None
        out = np.zeros((n_heads, len(spec)), dtype=bool)
        if self.layers is not None and layer not in self.layers:
            return out
        for t, heads in enumerate(spec):
            out[sorted(heads), t] = True
        return out


def subsets(n_heads: int) -> list[tuple[int, ...]]:
    """Every subset of ``range(n_heads)``, by size then lexicographically (empty first, all last)."""
    return [c for k in range(n_heads + 1) for c in itertools.combinations(range(n_heads), k)]


# -- running -------------------------------------------------------------------------------------
def model_shape(model) -> tuple[int, int]:
    """(KV heads, layers) of a model."""
    cfg = model.config
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads), int(cfg.num_hidden_layers)


def fact_metrics(result: randattn.ReplayResult, ids: torch.Tensor, fact: Fact) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (LP = summed log-prob of the value tokens, retrieved = greedy right at every value token)."""
    span = slice(fact.answer_start, fact.answer_end)
    lp = result.logprobs[:, span].sum(-1).double().numpy()
    ok = (result.argmax[:, span] == ids[:, span].cpu()).all(-1).numpy()
    return lp, ok


def run_batch(model, instances: Sequence[Instance], conditions: Sequence[Condition], make_cache, *,
              audit: bool = False):
    """Replay a batch of same-layout instances under every condition; yields
    ``(condition, ReplayResult, cache, rounds)`` as each finishes, ``rounds`` being the eviction rounds
    (layer 0, from the event counter) that ran between the start of the first box and the first answer.

    The text before the first box is replayed once and forked per condition; with ``audit`` the
    caches keep their keep-logs.
    """
    ids = torch.tensor([inst.ids for inst in instances], device=model.device)
    first = instances[0]
    if any(inst.prompt_len != first.prompt_len or len(inst.ids) != len(first.ids) for inst in instances):
        raise ValueError("instances in one batch must share their layout")
    n_heads, n_layers = model_shape(model)
    base = randattn.Replay(model, ids, make_cache(keep_log=audit), prompt_len=first.prompt_len,
                           score_from=first.facts[0].answer_start)
    base.run(until=first.facts[0].box_start)
    before = base.cache.events[0] if base.cache.layers else 0
    for cond in conditions:
        if cond.full_cache:
            full = randattn.EvictionSpec.full().make_cache(max_tokens=ids.shape[1], keep_log=audit)
            branch = randattn.Replay(model, ids, full, prompt_len=first.prompt_len,
                                     score_from=first.facts[0].answer_start).run()
            yield cond, branch.result(), branch.cache, 0
            continue
        branch = base.fork()
        cond.apply(branch.cache, first.facts, n_heads, n_layers)
        branch.run(until=first.facts[0].answer_start)
        rounds = branch.cache.events[0] - before
        branch.run()
        yield cond, branch.result(), branch.cache, rounds


def audit_keep_log(cache: randattn.EvictingCache, cond: Condition, facts: Sequence[Fact], n_heads: int) -> int:
    """Check from the keep-log that every box survived exactly where ``cond`` says, at every round the whole
    box competed in (complete and older than the recent window, which every head keeps untouched). Returns the
    number of (round, layer, row, head) records checked; raises on a violation."""
    log = cache.keep_log
    checked = 0
    for layer_idx in sorted(set(log.layers)):
        for round_idx, seq_len, kept in log.for_layer(layer_idx):
            for i, fact in enumerate(facts):
                want = cond.expected(i, layer_idx, n_heads)
                if want is None or seq_len - log.recent < fact.box_end:
                    continue
                box = np.arange(fact.box_start, fact.box_end)
                have = (kept[..., None] == box).any(axis=2)  # [B, H, width]
                if not (have == want[None]).all():
                    b, h = np.argwhere((have != want[None]).any(-1))[0]
                    raise AssertionError(
                        f"audit failed: condition {cond.name!r}, fact {i}, layer {layer_idx}, round {round_idx}, "
                        f"row {b}, head {h}: box positions kept {box[have[b, h]].tolist()}, expected "
                        f"{box[want[h]].tolist()}"
                    )
                checked += have.shape[0] * have.shape[1]
    return checked
