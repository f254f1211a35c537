"""The question task (probes.prompt_protection.Tasks) past one prompt layout: instances of the most common layout
keep their numbers, the others follow, and no batch mixes two layouts (a batch is one tensor)."""

import random
from collections import Counter

import pytest

from probes import prompt_protection
from probes.results import DEFAULT_TRACES


@pytest.fixture(scope="module")
def tasks(embedded):
    return prompt_protection.Tasks(embedded[1], prompt_protection.load_rows(DEFAULT_TRACES), body=64, seed=0)


def test_the_most_common_layout_comes_first_in_its_old_order(tasks):
    shapes = [(len(p), len(q)) for p, q in zip(tasks.prompts, tasks.restate)]
    shape, count = Counter(shapes).most_common(1)[0]
    old = [i for i, s in enumerate(shapes) if s == shape]
    random.Random(0).shuffle(old)  # the one-layout pool as it was built before the task widened
    assert tasks.pool[:count] == old
    assert tasks.prompt_len == shape[0] and tasks.layout(count) != shape
    assert sorted(tasks.pool) == list(range(len(shapes)))  # every trace is an instance, once


def test_batches_never_mix_layouts_and_cover_every_instance(tasks):
    n = 128
    batches = tasks.batches(n, 8)
    assert [k for b in batches for k in b] == list(range(n))
    assert all(len(b) <= 8 and len({tasks.layout(k) for k in b}) == 1 for b in batches)
    assert len({tasks.layout(b[0]) for b in batches}) == 2  # 128 reaches the second layout
    with pytest.raises(ValueError, match="traces make"):
        tasks.batches(len(tasks) + 1, 8)


def test_an_instance_of_another_layout_builds_with_its_own_prompt(tasks):
    k = next(k for k in range(len(tasks)) if tasks.layout(k) != tasks.layout(0))
    ids, start = tasks.build(k)
    prompt, restate = tasks.layout(k)
    assert len(ids) == prompt + tasks.body + restate and start == prompt + tasks.body + tasks.prefix_len
    assert ids[:prompt] == tasks.prompts[tasks.pool[k]]
