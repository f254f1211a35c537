"""The lm-eval backend as lm-eval hands it its arguments: --model_args through lm-eval's own parser (booleans and
integers parsed strictly, never by truthiness) and the documented command line itself, --batch_size N included (lm-eval
passes it as a string), on a tiny random model saved to a folder and a tiny local task."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="the lm-eval extra is not installed (pip install -e \".[lm-eval]\")")

from lm_eval.api.instance import Instance  # noqa: E402
from probes.lm_eval_backend import FALSE_SPELLINGS, TRUE_SPELLINGS, RandAttnLM  # noqa: E402
from randattn.testing import tiny_model, tiny_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Prompts of 22, 15 and 28 words (each word one token of the tiny tokenizer): a batch of 2 is left-padded.
QUESTIONS = [" ".join(f"w{(5 * i + k) % 200 + 3}" for i in range(n)) for k, n in ((1, 22), (4, 15), (7, 28))]
TASK_YAML = """\
task: tiny_words
custom_dataset: !function tiny_words.load
test_split: test
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["never-appears"]
  max_gen_toks: 12
  do_sample: false
process_results: !function tiny_words.score
metric_list:
  - metric: same
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
TASK_PY = '''\
import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load(**_metadata):
    rows = [json.loads(line) for line in (HERE / "words.jsonl").read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def score(doc, results):
    return {"same": float(results[0].strip() == doc["answer"])}
'''


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """(model folder, tokenizer folder, task folder): a tiny random Llama saved as an HF checkpoint, its word-level
    tokenizer in a folder of its own, and the tiny_words generate_until task."""
    root = tmp_path_factory.mktemp("lm_eval_cli")
    model_dir, tok_dir, task_dir = root / "tiny-llama", root / "tok", root / "tasks"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer(tok_dir)
    task_dir.mkdir()
    (task_dir / "tiny_words.yaml").write_text(TASK_YAML)
    (task_dir / "tiny_words.py").write_text(TASK_PY)
    rows = [json.dumps({"question": q, "answer": "w3"}) + "\n" for q in QUESTIONS]
    (task_dir / "words.jsonl").write_text("".join(rows))
    return model_dir, tok_dir, task_dir


def _args(tiny_dirs, extra: str) -> str:
    model_dir, tok_dir, _ = tiny_dirs
    return f"pretrained={model_dir},tokenizer={tok_dir},{extra}"


# -- booleans: lm-eval's parser keeps anything but true/false a string, which must not turn protection on ----------
@pytest.mark.parametrize("value", ["maybe", "none", "None", "2", "1.0", "'true'x", "ja"])
@pytest.mark.parametrize("key", ["protect_prompt", "trust_remote_code"])
def test_a_non_boolean_flag_is_refused_with_the_key_and_the_accepted_spellings(key, value):
    with pytest.raises(ValueError) as err:  # refused before anything loads: the path need not exist
        RandAttnLM.create_from_arg_string(f"pretrained=/no/such/dir,{key}={value}")
    msg = str(err.value)
    assert f"--model_args {key}=" in msg and "not a boolean" in msg
    assert "true/1/yes/on" in msg and "false/0/no/off" in msg and "/no/such/dir" not in msg


@pytest.mark.parametrize("spelling,want", [(s, True) for s in TRUE_SPELLINGS + ("True", "YES", "On")]
                         + [(s, False) for s in FALSE_SPELLINGS + ("False", "NO", "Off")])
def test_the_accepted_boolean_spellings(tiny_dirs, spelling, want):
    lm = RandAttnLM.create_from_arg_string(_args(tiny_dirs, f"budget=64,buffer=8,protect_prompt={spelling},"
                                                            f"trust_remote_code={spelling}"),
                                           {"batch_size": 1, "device": "cpu"})
    assert lm.settings["protect_prompt"] is want and lm.eviction_spec.protect_prompt is want
    assert lm.get_model_info()["randattn"]["protect_prompt"] is want


def test_protect_prompt_off_really_runs_unprotected(tiny_dirs):
    """protect_prompt=off with a budget too small for the prompt: unprotected, so rounds fire; the old truthy reading
    protected it and refused the request (the budget cannot hold a protected prompt)."""
    lm = RandAttnLM.create_from_arg_string(_args(tiny_dirs, "budget=12,buffer=4,protect_prompt=off"),
                                           {"batch_size": 1, "device": "cpu"})
    kwargs = {"until": ["never-appears"], "max_gen_toks": 8, "do_sample": False}
    lm.generate_until([Instance("generate_until", {}, (QUESTIONS[0], dict(kwargs)), 0)], disable_tqdm=True)
    assert lm.requests_evicted == 1


@pytest.mark.parametrize("args,needle", [
    ("budget=1e3", "--model_args budget=1000.0: not an integer >= 1"),
    ("budget=true", "--model_args budget=True: not an integer"),
    ("buffer=8x", "--model_args buffer='8x': not an integer >= 1"),
    ("recent=-1", "--model_args recent=-1: not an integer >= 0"),
    ("max_length=0", "--model_args max_length=0: not an integer >= 1"),
    ("max_length=2.5", "--model_args max_length=2.5"),
    ("max_batch_size=zero", "--model_args max_batch_size='zero'"),
    ("seed=1.5", "--model_args seed=1.5: not an integer in [0, 2**64)"),
    ("seed=true", "--model_args seed=True"),
    ("seed=²", "--model_args seed='²'"),  # str.isdigit() says yes; int() says no
])
def test_a_non_integer_is_refused_with_the_key(args, needle):
    with pytest.raises(ValueError) as err:
        RandAttnLM.create_from_arg_string(f"pretrained=/no/such/dir,{args}")
    assert needle in str(err.value) and "/no/such/dir" not in str(err.value)


# -- --batch_size as lm-eval's command line hands it over -------------------------------------------------------
@pytest.mark.parametrize("given,want", [("2", 2), (" 3 ", 3), (4, 4)])
def test_batch_size_from_the_command_line_is_a_string(tiny_dirs, given, want):
    lm = RandAttnLM.create_from_arg_string(_args(tiny_dirs, "budget=64,buffer=8"), {"batch_size": given,
                                                                                     "device": "cpu"})
    assert lm.batch_size == want


@pytest.mark.parametrize("given", ["auto", "auto:4", "0", "-2", "2.0", True])
def test_a_batch_size_that_is_no_positive_integer_is_refused(given):
    with pytest.raises(ValueError, match=r"batch_size=.*a fixed batch size, a positive integer"):
        RandAttnLM.create_from_arg_string("pretrained=/no/such/dir", {"batch_size": given})


def test_the_documented_command_line_with_batch_size_2(tiny_dirs, tmp_path):
    """`python -m probes.lm_eval_backend --model randattn ... --batch_size 2` as docs/integrations.md writes it, on
    the tiny model and task: it runs (it was refused, lm-eval hands --batch_size over as '2'), protect_prompt=off
    arrives as False, rounds fire, and every generation is the one the same request gets alone (batch 1, in
    process)."""
    model_dir, tok_dir, task_dir = tiny_dirs
    model_args = _args(tiny_dirs, "policy=random,budget=16,buffer=4,protect_prompt=off,seed=0")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "probes.lm_eval_backend", "--model", "randattn", "--device", "cpu",
           "--model_args", model_args, "--include_path", str(task_dir), "--tasks", "tiny_words",
           "--batch_size", "2", "--limit", "3", "--log_samples", "--output_path", str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, textwrap.shorten(done.stderr[-4000:], 4000)
    (results,) = (tmp_path / "out").rglob("results_*.json")
    config = json.loads(results.read_text())["config"]
    assert str(config["batch_size"]) == "2"
    info = config["randattn"]
    assert info["protect_prompt"] is False and info["budget"] == 16 and info["pretrained"] == str(model_dir)
    assert info["requests"] == info["requests_with_eviction_rounds"] == 3
    (samples,) = (tmp_path / "out").rglob("samples_tiny_words_*.jsonl")
    got = {json.loads(line)["doc"]["question"]: json.loads(line)["resps"][0][0]
           for line in samples.read_text().splitlines()}
    assert sorted(got) == sorted(QUESTIONS)

    alone = RandAttnLM.create_from_arg_string(model_args, {"batch_size": 1, "device": "cpu"})
    kwargs = {"until": ["never-appears"], "max_gen_toks": 12, "do_sample": False}
    want = alone.generate_until([Instance("generate_until", {}, (q, dict(kwargs)), i)
                                 for i, q in enumerate(QUESTIONS)], disable_tqdm=True)
    assert [got[q] for q in QUESTIONS] == want
