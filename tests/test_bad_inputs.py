"""The bad-input table: one row per way a careful user can get a command or the Python API wrong (issue 21).

Every CLI row runs the command's ``main(argv)`` in this process, in a scratch folder holding files the user owns
(a text file, selector modules, a JSONL that is not ours, a TOML spec), and asserts

- a clear refusal: a non-zero exit and the row's message on stderr, which names the parameter (``--flag: ...``) and
  the fix; an exception escaping ``main`` (a traceback) fails the row;
- nothing changed: every file in the scratch folder keeps its bytes and mtime, and the repository's own
  ``figures/`` and ``data/`` are untouched (nothing is written outside ``--out``).

Rows that load a model use the tiny 3-KV-head model (``tiny_dir``); most refusals happen before it loads.
``OK_ROWS`` are inputs that look wrong but have a defined, correct behaviour; ``API_ROWS`` the Python API.
"""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

import pytest
import torch

import randattn
import randattn.power
from randattn.testing import tiny_model

from conftest import random_ids

REPO = Path(__file__).resolve().parents[1]

SELECTORS = """import randattn, torch
class Boom(randattn.Policy):
    def __init__(self, **kw):
        raise RuntimeError('boom')
def score(view):
    return torch.zeros(view.shape)
def nan(view):
    return torch.full(view.shape, float('nan'))
def raises(view):
    raise KeyError('no statistics for this head')
"""
PLANTED = {  # files the user owns in the scratch folder (the working directory of every row)
    "notes.txt": b"my notes\n",
    "notes.json": b'{"mine": true}\n',
    "sel.py": SELECTORS.encode(),
    "exit.py": b"import sys\nsys.exit(3)\n",
    "raise.py": b"raise ImportError('broken selector module')\n",
    "rows.jsonl": b'{"instance": 0, "condition": "a", "fact": 0, "lp": -1.0, "config": {"probe": "head_pooling"}}\n',
    "sub/thesis.tex": b"\\documentclass{article}\n",
    "figs/head_pooling.png": b"\x89PNG my own plot, not randattn's\n",
    "config_alias.toml": b"K = 64\n",  # the settings reader's bad inputs (issue 35)
    "config_type.toml": b'budget = "12x"\n',
    "grid_alias.toml": b'probe = "accuracy"\nK = [64]\n',
}

PLANTED_ARGS = ["--model", "{TINY}", "--out", "{S}/out", "--budget", "64", "--buffer", "12", "--distance", "90",
                "--batch", "2", "--parity", "0", "--instances", "2", "--no-figure"]
SURVIVAL = ["--model", "{TINY}", "--out", "{S}/out", "--no-figure", "--budget", "128", "--buffer", "8", "--rounds", "3",
            "--sequences", "2", "--batch", "2", "--policies", "random"]
PROTECTION = ["--model", "{TINY}", "--out", "{S}/out", "--no-figure", "--budget", "128", "--buffer", "8", "--body",
              "120", "--instances", "2", "--batch", "2", "--policies", "random"]
PASSCODE = ["--model", "{TINY}", "--out", "{S}/out", "--no-figure", "--budget", "96", "--buffer", "16", "--rounds", "5",
            "--instances", "2", "--batch", "2", "--parity", "0"]
ACCURACY = ["--model", "{TINY}", "--out", "{S}/out", "--no-figure", "--task", "copy", "--problems", "2", "--runs", "1",
            "--max-new-tokens", "8", "--policy", "full", "random", "--budget", "224", "--buffer", "8"]
CHALLENGE = ["--model", "{TINY}", "--quick", "--out", "{S}/ch", "--no-figure"]
LEADERBOARD = ["--model", "{TINY}", "--out", "{S}/lb", "--no-figure", "--problems", "2", "--instances", "2",
               "--passcode-instances", "2", "--planted-instances", "2", "--policies", "recency"]
DEMO = ["--model", "{TINY}", "--max-new-tokens", "4", "--layers", "0"]
TRACES = ["--model", "{TINY}", "--out", "{S}/t.jsonl", "--batch", "2", "--max-new-tokens", "8", "--tokens", "10"]
BENCH = ["--model", "{TINY}", "--out", "{S}/b.json", "--new-tokens", "64", "--budget", "128", "--buffer", "8"]
CALIBRATE = ["--model", "{TINY}", "--tokens", "64", "--max-length", "32", "--quiet"]
NOT_OURS = "not a results file written by randattn"

# (id, module, argv, message on stderr). {S}: the scratch folder; {TINY}: the tiny model's directory.
CLI_ROWS = [
    # -- the planted-fact probes (head_pooling, scatter, two_facts, blocks, shared_draw) --------------------------
    ("hp-seed-negative", "probes.head_pooling", ["--seed", "-1"], "--seed: must be an integer in [0, 2**64), got -1"),
    ("hp-seed-fraction", "probes.head_pooling", ["--seed", "1.7"], "--seed: expected an integer, got '1.7'"),
    ("hp-seed-2**64", "probes.head_pooling", ["--seed", str(2**64)], "--seed: must be an integer in [0, 2**64), got 18446744073709551616"),
    ("hp-budget-0", "probes.head_pooling", ["--budget", "0"], "--budget: must be a positive integer, got 0"),
    ("hp-budget-abc", "probes.head_pooling", ["--budget", "abc"], "--budget: expected an integer, got 'abc'"),
    ("hp-buffer-0", "probes.head_pooling", ["--buffer", "0"], "--buffer: must be a positive integer, got 0"),
    ("hp-buffer-fills-budget", "probes.head_pooling", ["--buffer", "64"], "--budget: T=64 must exceed the recent window r=64"),
    ("hp-instances-0", "probes.head_pooling", ["--instances", "0"], "--instances: must be a positive integer"),
    ("hp-batch-0", "probes.head_pooling", ["--batch", "0"], "--batch: must be a positive integer"),
    ("hp-parity-negative", "probes.head_pooling", ["--parity", "-1"], "--parity: must be a non-negative integer"),
    ("hp-distance-0", "probes.head_pooling", ["--distance", "0"], "--distance: must be a positive integer"),
    ("hp-box-width-0", "probes.head_pooling", ["--box-width", "0"], "--box-width: must be a positive integer"),
    ("hp-box-wider-than-r", "probes.head_pooling", ["--budget", "16", "--buffer", "4"],
     "--box-width: --box-width 12 exceeds the buffer r=4"),
    ("hp-K-below-box-and-prompt", "probes.head_pooling", ["--protect-prompt"],
     "--budget: T=64 cannot hold 1 pinned fact box(es) of 12 beside the"),
    ("hp-policy-unknown", "probes.head_pooling", ["--policy", "nope"], "--policy: 'nope' is unknown; choose from"),
    ("hp-selector-file-missing", "probes.head_pooling", ["--policy", "{S}/nope.py:score"], "--policy: policy"),
    ("hp-selector-module-missing", "probes.head_pooling", ["--policy", "nosuchmod:score"],
     "--policy: policy 'nosuchmod:score': cannot import 'nosuchmod'"),
    ("hp-selector-ctor-raises", "probes.head_pooling", ["--policy", "{S}/sel.py:Boom"], "Boom() raised RuntimeError"),
    ("hp-selector-sys-exit", "probes.head_pooling", ["--policy", "{S}/exit.py:score"], "called sys.exit()"),
    ("hp-selector-nan-mid-run", "probes.head_pooling", ["--policy", "{S}/sel.py:nan"],
     "--policy: policy '{S}/sel.py:nan' returned NaN scores at layer 0, round 0"),
    ("hp-selector-raises-mid-run", "probes.head_pooling", ["--policy", "{S}/sel.py:raises"],
     "--policy: policy '{S}/sel.py:raises' failed at layer 0, round 0: KeyError"),
    ("passcode-selector-raises-mid-run", "probes.passcode", PASSCODE + ["--policies", "{S}/sel.py:raises"],
     "--policies: policy '{S}/sel.py:raises' failed at layer 0, round 0"),
    ("hp-stats-missing", "probes.head_pooling", ["--policy", "triattention", "--stats", "{S}/nope.pt"],
     "--stats: TriAttention statistics"),
    ("hp-stats-garbage", "probes.head_pooling", ["--policy", "triattention", "--stats", "{S}/notes.txt"],
     "could not read TriAttention statistics"),
    ("hp-stats-unused", "probes.head_pooling", ["--stats", "smollm2-135m"],
     "--stats: no policy of this run reads calibration statistics (random); drop --stats"),
    ("hp-traces-missing", "probes.head_pooling", ["--traces", "{S}/nope.jsonl"], "--traces: --traces"),
    ("hp-traces-folder", "probes.head_pooling", ["--traces", "{S}"], "--traces: [Errno 21] Is a directory"),
    ("hp-traces-garbage", "probes.head_pooling", ["--traces", "{S}/notes.txt"], "line 1 is not JSON"),
    ("hp-device-cuda", "probes.head_pooling", ["--device", "cuda"], "--device: device 'cuda' asked for CUDA"),
    ("hp-device-cuda-index", "probes.head_pooling", ["--device", "cuda:5"], "--device: device 'cuda:5'"),
    ("hp-device-gpu0", "probes.head_pooling", ["--device", "gpu0"], "--device: device 'gpu0' is not a torch device"),
    ("hp-model-missing", "probes.head_pooling", ["--model", "{S}/nomodel"], "--model: model directory"),
    ("hp-model-file", "probes.head_pooling", ["--model", "{S}/notes.txt"], "is a file, not a directory"),
    ("hp-model-no-config", "probes.head_pooling", ["--model", "{S}/sub"], "has no config.json"),
    ("hp-model-hub-offline", "probes.head_pooling", ["--model", "someone/no-such-model"],
     "not in the local HF cache while hub downloads are off"),
    ("hp-out-a-file", "probes.head_pooling", ["--out", "{S}/notes.txt"],
     "--out: {S}/notes.txt is a file, not a folder"),
    ("hp-out-under-a-file", "probes.head_pooling", ["--out", "{S}/notes.txt/x"], "--out: {S}/notes.txt is a file"),
    ("hp-out-unwritable", "probes.head_pooling", ["--out", "/proc/randattn-out"], "--out: "),
    ("passcode-figure-dir-a-file", "probes.passcode", [a for a in PASSCODE if a != "--no-figure"] + [
        "--figure-dir", "{S}/notes.txt"], "--figure-dir: {S}/notes.txt is a file, not a folder"),
    ("hp-distance-negative", "probes.head_pooling", ["--distance", "-5"], "--distance: must be a positive integer"),
    ("hp-unknown-flag", "probes.head_pooling", ["--no-protect-prompt"], "unrecognized arguments: --no-protect-prompt"),
    ("scatter-seed-negative", "probes.scatter", ["--seed", "-1"], "--seed: must be an integer in [0, 2**64)"),
    ("scatter-parity-negative", "probes.scatter", ["--parity", "-1"], "--parity: must be a non-negative integer"),
    ("scatter-policy-unknown", "probes.scatter", ["--policy", "nope"], "--policy: 'nope' is unknown"),
    ("two-facts-instances-0", "probes.two_facts", ["--instances", "0"], "--instances: must be a positive integer"),
    ("two-facts-box-wider-than-r", "probes.two_facts", ["--budget", "16", "--buffer", "4"], "--box-width: "),
    ("blocks-block-0", "probes.blocks", ["--blocks", "0"], "--blocks: must be a positive integer, got 0"),
    ("blocks-block-abc", "probes.blocks", ["--blocks", "abc"], "--blocks: expected an integer, got 'abc'"),
    ("blocks-block-twice", "probes.blocks", ["--blocks", "4", "4"], "--blocks: lists 4 twice"),
    ("blocks-length-short", "probes.blocks", ["--length", "10"], "--length: 10 must exceed T + r = 76"),
    ("blocks-skip-everything", "probes.blocks", ["--skip-nll", "--skip-planted"],
     "--skip-nll: --skip-nll --skip-planted together leave nothing to run"),
    ("shared-draw-rounds-0", "probes.shared_draw", ["--rounds", "0"], "--rounds: must be a positive integer"),
    ("shared-draw-passcode-instances-0", "probes.shared_draw", ["--passcode-instances", "0"],
     "--passcode-instances: must be a positive integer"),
    ("shared-draw-skip-everything", "probes.shared_draw", ["--skip-nll", "--skip-planted", "--skip-passcode"],
     "leave nothing to run"),
    # -- survival, prompt_protection, passcode ---------------------------------------------------------------------
    ("survival-policy-unknown", "probes.survival", SURVIVAL + ["--policies", "nope"], "--policies: 'nope' is unknown"),
    ("survival-policy-twice", "probes.survival", SURVIVAL + ["--policies", "random", "random"],
     "--policies: lists 'random' twice"),
    ("survival-mode-unknown", "probes.survival", SURVIVAL + ["--modes", "both"], "argument --modes: invalid choice"),
    ("survival-rounds-0", "probes.survival", SURVIVAL + ["--rounds", "0"], "--rounds: must be a positive integer"),
    ("survival-rounds-past-traces", "probes.survival", SURVIVAL + ["--rounds", "100000"],
     "--rounds: the traces run out"),
    ("survival-age-bin-0", "probes.survival", SURVIVAL + ["--age-bin", "0"], "--age-bin: must be a positive integer"),
    ("survival-entropy-bins-0", "probes.survival", SURVIVAL + ["--entropy-bins", "0"], "--entropy-bins: must be"),
    ("survival-stats-missing", "probes.survival", SURVIVAL + ["--policies", "triattention", "--stats", "{S}/nope.pt"],
     "--stats: TriAttention statistics"),
    ("survival-stats-unused", "probes.survival", SURVIVAL + ["--stats", "smollm2-135m"], "--stats: no policy"),
    ("survival-traces-folder", "probes.survival", SURVIVAL + ["--traces", "{S}"], "--traces: "),
    ("survival-no-prompt-fits", "probes.survival", SURVIVAL + ["--budget", "40", "--modes", "protected"], "--budget: "),
    ("protection-body-0", "probes.prompt_protection", PROTECTION + ["--body", "0"], "--body: must be a positive"),
    ("protection-body-past-max-position", "probes.prompt_protection", PROTECTION + ["--body", "100000"],
     "--body: 100000 makes instances of"),
    ("protection-budget-below-prompt", "probes.prompt_protection", PROTECTION + ["--budget", "16", "--buffer", "4"],
     "--budget: T=16 cannot hold the"),
    ("protection-policy-full", "probes.prompt_protection", PROTECTION + ["--policies", "full"],
     "--policies: 'full' is unknown"),
    ("passcode-single-policy-flag", "probes.passcode", PASSCODE + ["--policy", "random"],
     "unrecognized arguments: --policy random"),
    ("passcode-distance-is-set-by-rounds", "probes.passcode", PASSCODE + ["--distance", "100"],
     "unrecognized arguments: --distance 100"),
    ("passcode-both-protections", "probes.passcode", PASSCODE + ["--protect-prompt", "--no-protect-prompt"],
     "unrecognized arguments: --protect-prompt"),
    ("passcode-rounds-0", "probes.passcode", PASSCODE + ["--rounds", "0"], "--rounds: must be a positive integer"),
    ("passcode-rounds-too-few", "probes.passcode", PASSCODE + ["--rounds", "1", "--buffer", "12"],
     "--rounds: --rounds 1 leaves too few tokens"),
    ("passcode-policy-full", "probes.passcode", PASSCODE + ["--policies", "full"], "--policies: 'full' is unknown"),
    ("passcode-budget-below-stub", "probes.passcode", PASSCODE + ["--budget", "20", "--buffer", "4"], "--budget: T=20"),
    ("passcode-stats-unused", "probes.passcode", PASSCODE + ["--policies", "random", "--stats", "smollm2-135m"],
     "--stats: no policy"),
    ("passcode-unbound-policy-before-any-run", "probes.passcode", PASSCODE + ["--policies", "random", "triattention"],
     "--policies: triattention: triattention needs TriAttention statistics"),
    # -- accuracy ----------------------------------------------------------------------------------------------------
    ("acc-compression-nan", "probes.accuracy", ACCURACY + ["--compression", "nan"], "--compression: must be"),
    ("acc-compression-0", "probes.accuracy", ACCURACY + ["--compression", "0"], "--compression: must be a positive"),
    ("acc-budget-and-compression", "probes.accuracy", ACCURACY + ["--compression", "0.5"],
     "--compression: --budget and --compression both set T"),
    ("acc-temperature-nan", "probes.accuracy", ACCURACY + ["--temperature", "nan"], "--temperature: must be"),
    ("acc-temperature-negative", "probes.accuracy", ACCURACY + ["--temperature", "-1"], "--temperature: must be"),
    ("acc-top-p-0", "probes.accuracy", ACCURACY + ["--top-p", "0"], "--top-p: must be in (0, 1], got 0.0"),
    ("acc-top-p-1.5", "probes.accuracy", ACCURACY + ["--top-p", "1.5"], "--top-p: must be in (0, 1]"),
    ("acc-top-p-while-greedy", "probes.accuracy", ACCURACY + ["--top-p", "0.5"], "--top-p: applies only when sampling"),
    ("acc-runs-0", "probes.accuracy", ACCURACY + ["--runs", "0"], "--runs: must be a positive integer"),
    ("acc-problems-0", "probes.accuracy", ACCURACY + ["--problems", "0"], "--problems: must be a positive integer"),
    ("acc-max-new-tokens-0", "probes.accuracy", ACCURACY + ["--max-new-tokens", "0"], "--max-new-tokens: must be"),
    ("acc-batch-0", "probes.accuracy", ACCURACY + ["--batch", "0"], "--batch: must be a positive integer"),
    ("acc-budget-at-r", "probes.accuracy", ACCURACY + ["--budget", "8"], "--budget: T=8 must exceed the recent window"),
    ("acc-policy-unknown", "probes.accuracy", ACCURACY + ["--policy", "nope"], "--policy: 'nope' is unknown"),
    ("acc-policy-option-malformed", "probes.accuracy", ACCURACY + ["--policy-option", "h2o"],
     "--policy-option: 'h2o': expected POLICY:KEY=VALUE"),
    ("acc-policy-option-unknown", "probes.accuracy", ACCURACY + ["--policy-option", "h2o:nope=1"],
     "--policy-option: for h2o: policy 'h2o' does not take option(s) ['nope']"),
    ("acc-data-for-generated-task", "probes.accuracy", ACCURACY + ["--data", "{S}/nope.jsonl"],
     "--data: --task copy generates its own problems; drop --data"),
    ("acc-task-unknown", "probes.accuracy", ACCURACY + ["--task", "nope"], "argument --task: invalid choice"),
    ("acc-stats-missing", "probes.accuracy", ACCURACY + ["--policy", "triattention", "--stats", "{S}/nope.pt"],
     "--policy: triattention: TriAttention statistics"),
    ("acc-stats-unused", "probes.accuracy", ACCURACY + ["--stats", "smollm2-135m"], "--stats: no policy"),
    ("acc-protocol-contradiction", "probes.accuracy", ACCURACY + ["--protocol", "protected", "--no-protect-prompt"],
     "--protocol: --no-protect-prompt and --protocol protected disagree"),
    ("acc-out-unwritable", "probes.accuracy", ACCURACY + ["--out", "/proc/randattn-out"], "--out: "),
    ("acc-seed-negative", "probes.accuracy", ACCURACY + ["--seed", "-1"], "--seed: must be an integer in [0, 2**64)"),
    ("acc-reference-tokens-0", "probes.accuracy", ACCURACY + ["--reference-lp", "--reference-tokens", "0"],
     "--reference-tokens: must be a positive integer, got 0"),
    ("acc-reference-tokens-without-lp", "probes.accuracy", ACCURACY + ["--reference-tokens", "8"],
     "--reference-tokens: applies only with --reference-lp"),
    # -- re-grading accuracy rows (probes.regrade) ------------------------------------------------------------------
    ("regrade-file-missing", "probes.regrade", ["{S}/nope.jsonl"], "{S}/nope.jsonl: no such results file"),
    ("regrade-not-json", "probes.regrade", ["{S}/notes.txt"], "{S}/notes.txt: line 1 is not JSON"),
    ("regrade-not-accuracy-rows", "probes.regrade", ["{S}/rows.jsonl"],
     "{S}/rows.jsonl: line 1 is not a generation row of the accuracy harness"),
    # -- challenge ---------------------------------------------------------------------------------------------------
    ("challenge-no-selector", "probes.challenge", CHALLENGE, "--policy: give your selector"),
    ("challenge-random-as-selector", "probes.challenge", CHALLENGE + ["--policy", "random"],
     "--policy: random is the reference"),
    ("challenge-selector-missing-callable", "probes.challenge", CHALLENGE + ["--policy", "{S}/sel.py:nothere"],
     "has no 'nothere'; callables there: Boom, nan, raises, score"),
    ("challenge-selector-ctor-raises", "probes.challenge", CHALLENGE + ["--policy", "{S}/sel.py:Boom"],
     "Boom() raised RuntimeError: boom"),
    ("challenge-selector-sys-exit", "probes.challenge", CHALLENGE + ["--policy", "{S}/exit.py:score"],
     "called sys.exit()"),
    ("challenge-selector-import-raises", "probes.challenge", CHALLENGE + ["--policy", "{S}/raise.py:score"],
     "raised ImportError: broken selector module"),
    ("challenge-restart-a-users-folder", "probes.challenge", CHALLENGE + ["--policy", "recency", "--out", "{S}",
                                                                          "--restart"],
     "already holds files randattn did not write"),
    ("challenge-only-and-skip-cancel", "probes.challenge", CHALLENGE + ["--policy", "recency", "--only", "cost",
                                                                        "--skip", "cost"], "--only: "),
    ("challenge-part-unknown", "probes.challenge", CHALLENGE + ["--policy", "recency", "--only", "nope"],
     "argument --only: invalid choice"),
    ("challenge-baseline-unknown", "probes.challenge", CHALLENGE + ["--policy", "recency", "--baselines", "nope"],
     "--baselines: 'nope' is unknown"),
    ("challenge-stats-unused", "probes.challenge", CHALLENGE + ["--policy", "recency", "--stats", "smollm2-135m"],
     "--stats: no policy"),
    ("challenge-device-cuda", "probes.challenge", CHALLENGE + ["--policy", "recency", "--device", "cuda"],
     "--device: device 'cuda'"),
    ("challenge-model-missing", "probes.challenge", CHALLENGE + ["--policy", "recency", "--model", "{S}/nomodel"],
     "--model: model directory"),
    # -- leaderboard -------------------------------------------------------------------------------------------------
    ("leaderboard-selector-unknown", "probes.leaderboard", LEADERBOARD + ["--policies", "nope"],
     "--policies: 'nope' is unknown"),
    ("leaderboard-selector-missing-callable", "probes.leaderboard", LEADERBOARD + ["--selector", "{S}/sel.py:nothere"],
     "--selector: policy '{S}/sel.py:nothere': {S}/sel.py has no 'nothere'; callables there: Boom, nan, raises, score"),
    ("leaderboard-selector-import-raises", "probes.leaderboard", LEADERBOARD + ["--selector", "{S}/raise.py:score"],
     "raised ImportError: broken selector module"),
    ("leaderboard-random-as-selector", "probes.leaderboard", LEADERBOARD + ["--selector", "random"],
     "--selector: random is the reference every selector is measured against"),
    ("leaderboard-target-mde-zero", "probes.leaderboard", LEADERBOARD + ["--target-mde", "0"],
     "--target-mde: must be strictly between 0 and 1"),
    ("leaderboard-target-mde-above-one", "probes.leaderboard", LEADERBOARD + ["--target-mde", "1.5"],
     "--target-mde: must be strictly between 0 and 1"),
    ("leaderboard-no-selector", "probes.leaderboard", LEADERBOARD + ["--policies"],
     "argument --policies: expected at least one argument"),
    ("leaderboard-budget-below-copy-prompt", "probes.leaderboard", LEADERBOARD + ["--budget", "200", "--tasks", "copy"],
     "--budget: T=200 cannot hold the protected prompt of 213 tokens plus one free slot beside the recent window of 16; "
     "use T >= 230"),
    ("leaderboard-budget-below-question-prompt", "probes.leaderboard",
     LEADERBOARD + ["--budget", "40", "--buffer", "8", "--tasks", "question"],
     "--budget: question task: T=40 cannot hold the protected prompt of 78 tokens"),
    ("leaderboard-question-instances-past-traces", "probes.leaderboard", LEADERBOARD + ["--instances", "1000",
                                                                                     "--tasks", "question"],
     "--instances: the question task's traces make 480 instances; use --instances <= 480 or more traces"),
    ("leaderboard-budget-below-passcode-stub", "probes.leaderboard",
     LEADERBOARD + ["--budget", "24", "--buffer", "8", "--tasks", "passcode"],
     "--budget: passcode task stub: T=24 cannot hold the protected prompt of 39 tokens"),
    ("leaderboard-task-unknown", "probes.leaderboard", LEADERBOARD + ["--tasks", "nope"],
     "argument --tasks: invalid choice"),
    ("leaderboard-stats-unused", "probes.leaderboard", LEADERBOARD + ["--stats", "smollm2-135m"], "--stats: no policy"),
    ("leaderboard-reference-tokens-0", "probes.leaderboard", LEADERBOARD + ["--reference-lp", "--reference-tokens", "0"],
     "--reference-tokens: must be a positive integer, got 0"),
    ("leaderboard-reference-tokens-without-lp", "probes.leaderboard", LEADERBOARD + ["--reference-tokens", "8"],
     "--reference-tokens: applies only with --reference-lp"),
    ("leaderboard-temperature-negative", "probes.leaderboard", LEADERBOARD + ["--temperature", "-0.5"],
     "--temperature: must be a non-negative number, got -0.5"),
    ("leaderboard-top-p-while-greedy", "probes.leaderboard", LEADERBOARD + ["--top-p", "0.9"],
     "--top-p: applies only when sampling"),
    ("leaderboard-top-p-0", "probes.leaderboard", LEADERBOARD + ["--temperature", "0.7", "--top-p", "0"],
     "--top-p: must be in (0, 1], got 0.0"),
    # -- grid --------------------------------------------------------------------------------------------------------
    ("grid-spec-missing", "probes.grid", ["{S}/nope.toml"], "spec: no file"),
    ("grid-spec-not-toml", "probes.grid", ["{S}/notes.txt"], "is not valid TOML"),
    ("grid-address-without-ray", "probes.grid", ["examples/grid_copy.toml", "--address", "auto"],
     "--address needs --backend ray"),
    ("grid-workers-0", "probes.grid", ["examples/grid_copy.toml", "--backend", "ray", "--workers", "0"],
     "argument --workers: expected a positive integer"),
    ("grid-retries-negative", "probes.grid", ["examples/grid_copy.toml", "--retries", "-1"], "--retries -1: must be"),
    ("grid-gpus-negative", "probes.grid", ["examples/grid_copy.toml", "--backend", "ray", "--gpus-per-worker", "-1"],
     "--gpus-per-worker -1: must be >= 0"),
    ("grid-backend-unknown", "probes.grid", ["examples/grid_copy.toml", "--backend", "slurm"], "invalid choice"),
    ("grid-out-a-file", "probes.grid", ["{REPO}/examples/grid_copy.toml", "--out", "{S}/notes.txt"],
     "--out: {S}/notes.txt is a file, not a folder"),
    # -- demo, traces ------------------------------------------------------------------------------------------------
    ("demo-layer-past-model", "probes.demo", DEMO + ["--layers", "99"], "--layers: [99] out of range"),
    ("demo-layer-abc", "probes.demo", DEMO + ["--layers", "abc"], "--layers: expected an integer, got 'abc'"),
    ("demo-layer-twice", "probes.demo", DEMO + ["--layers", "0", "0"], "--layers: lists 0 twice"),
    ("demo-max-new-tokens-0", "probes.demo", DEMO + ["--max-new-tokens", "0"], "--max-new-tokens: must be"),
    ("demo-buffer-fills-budget", "probes.demo", DEMO + ["--budget", "16", "--buffer", "32"], "--budget: T=16"),
    ("demo-out-would-overwrite", "probes.demo", DEMO + ["--out", "{S}/notes"],
     "--out: {S}/notes.json exists and is not a demo result randattn wrote; nothing was changed"),
    ("traces-top-p-0", "probes.traces", TRACES + ["--top-p", "0"], "--top-p: must be in (0, 1], got 0.0"),
    ("traces-temperature-nan", "probes.traces", TRACES + ["--temperature", "nan"], "--temperature: must be"),
    ("traces-tokens-0", "probes.traces", TRACES + ["--tokens", "0"], "--tokens: must be a positive integer"),
    ("traces-out-folder", "probes.traces", TRACES + ["--out", "{S}"], "--out: {S} is a folder"),
    ("traces-out-not-ours", "probes.traces", TRACES + ["--out", "{S}/notes.txt"],
     "--out: {S}/notes.txt is not a traces file written by probes.traces; nothing was changed"),
    ("traces-out-other-jsonl", "probes.traces", TRACES + ["--out", "{S}/rows.jsonl"], "is not a traces file"),
    # -- figures -----------------------------------------------------------------------------------------------------
    ("figures-results-missing", "figures.__main__", ["--probe", "head_pooling", "--results", "{S}/nope.jsonl",
                                                     "--out", "{S}/f"], "head_pooling: no results at {S}/nope.jsonl"),
    ("figures-results-garbage", "figures.__main__", ["--probe", "head_pooling", "--results", "{S}/notes.txt",
                                                     "--out", "{S}/f"], "cannot draw from {S}/notes.txt"),
    ("figures-results-folder", "figures.__main__", ["--probe", "head_pooling", "--results", "{S}", "--out", "{S}/f"],
     "is a folder; give the result file itself"),
    ("figures-results-wrong-probe", "figures.__main__", ["--probe", "passcode", "--results", "{S}/rows.jsonl",
                                                         "--out", "{S}/f"], "it is not a result file of"),
    ("figures-results-two-probes", "figures.__main__", ["--probe", "head_pooling", "--probe", "scatter", "--results",
                                                        "{S}/notes.txt"], "--results needs exactly one --probe"),
    ("figures-probe-unknown", "figures.__main__", ["--probe", "nope"], "argument --probe: invalid choice"),
    ("figures-runs-0", "figures.__main__", ["--probe", "accuracy", "--runs", "0", "--out", "{S}/f"],
     "--runs: must be a positive integer, got 0"),
    ("figures-runs-for-other-probe", "figures.__main__", ["--probe", "scatter", "--runs", "2"],
     "--problems and --runs apply to --probe accuracy only"),
    ("figures-out-a-file", "figures.__main__", ["--probe", "passcode", "--out", "{S}/notes.txt"],
     "--out: {S}/notes.txt is a file, not a folder"),
    ("figures-out-holds-a-users-figure", "figures.__main__", ["--probe", "passcode", "--probe", "head_pooling",
                                                              "--out", "{S}/figs"],
     "--out: {S}/figs/head_pooling.png was not written by randattn (it has no randattn mark in its metadata); "
     "nothing was changed"),
    # -- bench.* -----------------------------------------------------------------------------------------------------
    *[(f"{b}-threads-negative", f"bench.{b}", BENCH + ["--threads", "-2"],
       "--threads: must be a positive integer, got -2")
      for b in ("decode", "batch_scaling", "equal_memory", "memory", "replay_speed", "kvpress_peer")],
    *[(f"{b}-seed-negative", f"bench.{b}", BENCH + ["--seed", "-1"], "--seed: must be an integer in [0, 2**64)")
      for b in ("decode", "memory", "replay_speed")],
    *[(f"{b}-out-not-ours", f"bench.{b}", BENCH + ["--out", "{S}/notes.json"],
       "--out: {S}/notes.json exists and is not a result file randattn wrote; nothing was changed")
      for b in ("decode", "batch_scaling", "equal_memory")],
    ("decode-new-tokens-0", "bench.decode", BENCH + ["--new-tokens", "0"],
     "--new-tokens: must be a positive integer, got 0"),
    ("decode-batches-0", "bench.decode", BENCH + ["--batches", "0"], "--batches: must be a positive integer, got 0"),
    ("decode-policy-unknown", "bench.decode", BENCH + ["--policies", "nope"], "--policies: 'nope' is unknown"),
    ("decode-no-round-runs", "bench.decode", BENCH + ["--new-tokens", "1", "--policies", "random"],
     "never reach T + r"),
    ("decode-device-cuda", "bench.decode", BENCH + ["--device", "cuda", "--policies", "random"],
     "--device: device 'cuda' asked for CUDA"),
    ("decode-out-a-folder", "bench.decode", BENCH + ["--out", "{S}"], "--out: {S} is a folder"),
    ("replay-speed-device-cuda", "bench.replay_speed", BENCH + ["--device", "cuda"], "--device: device 'cuda'"),
    ("memory-device-cuda", "bench.memory", BENCH + ["--device", "cuda"], "--device: device 'cuda'"),
    ("equal-memory-kv-memory-negative", "bench.equal_memory", BENCH + ["--kv-memory", "-1"],
     "--kv-memory: must be a positive integer, got -1"),
    ("kvpress-peer-python-missing", "bench.kvpress_peer", BENCH + ["--peer-python", "{S}/nope/python"],
     "--peer-python {S}/nope/python does not exist"),
    ("kvpress-check-tokens-negative", "bench.kvpress_peer", BENCH + ["--check-tokens", "-1", "--skip-peer"],
     "--check-tokens: must be a non-negative integer, got -1"),
    ("round-cost-prompt-huge", "bench.round_cost", ["--prompt", "100000", "--out", "{S}/rc.json"],
     "--prompt: 100000 protected tokens do not fit"),
    ("round-cost-threads-negative", "bench.round_cost", ["--threads", "-2", "--out", "{S}/rc.json"],
     "--threads: must be a positive integer, got -2"),
    ("round-cost-seed-negative", "bench.round_cost", ["--seed", "-1", "--out", "{S}/rc.json"],
     "--seed: must be an integer in [0, 2**64)"),
    ("round-cost-repeats-0", "bench.round_cost", ["--repeats", "0", "--out", "{S}/rc.json"],
     "--repeats: must be a positive integer, got 0"),
    ("round-cost-policy-unknown", "bench.round_cost", ["--policies", "nope", "--out", "{S}/rc.json"],
     "--policies: 'nope' is unknown"),
    ("round-cost-paper-mode", "bench.round_cost", ["--policies", "attn_pp", "--out", "{S}/rc.json"],
     "--policies: unknown ['attn_pp']"),
    ("round-cost-out-a-folder", "bench.round_cost", ["--out", "{S}"], "--out: {S} is a folder"),
    ("round-cost-out-not-ours", "bench.round_cost", ["--out", "{S}/notes.txt"], "is not a result file randattn wrote"),
    ("pack-problems-0", "bench.pack", ["--problems", "0", "--out", "{S}/pk.json"], "--problems: must be a positive"),
    ("pack-out-not-ours", "bench.pack", ["--out", "{S}/notes.txt"], "notes.txt"),
    ("grid-overhead-spec-missing", "bench.grid_overhead", ["--spec", "{S}/none.toml", "--out", "{S}/go.json"],
     "--spec: {S}/none.toml is not a file"),
    ("grid-overhead-arm-unknown", "bench.grid_overhead", ["--arms", "slurm", "--out", "{S}/go.json"],
     "argument --arms: invalid choice: 'slurm'"),
    ("grid-overhead-out-not-ours", "bench.grid_overhead", ["--out", "{S}/notes.txt"],
     "is not a result file randattn wrote"),
    # -- randattn.calibrate ------------------------------------------------------------------------------------------
    ("calibrate-out-unwritable", "randattn.calibrate", CALIBRATE + ["--out", "/proc/nope/s.pt", "--text",
                                                                    "{S}/notes.txt"], "--out: cannot write in"),
    ("calibrate-out-a-folder", "randattn.calibrate", CALIBRATE + ["--out", "{S}", "--text", "{S}/notes.txt"],
     "--out: {S} is a folder"),
    ("calibrate-out-not-ours", "randattn.calibrate", CALIBRATE + ["--out", "{S}/notes.txt", "--text", "{S}/notes.txt"],
     "--out: {S}/notes.txt exists and is not a statistics file randattn wrote; nothing was changed"),
    ("calibrate-traces-missing", "randattn.calibrate", CALIBRATE + ["--out", "{S}/s.pt", "--traces", "{S}/no.jsonl"],
     "--traces: {S}/no.jsonl: no such file"),
    ("calibrate-traces-garbage", "randattn.calibrate", CALIBRATE + ["--out", "{S}/s.pt", "--traces", "{S}/notes.txt"],
     "--traces: {S}/notes.txt cannot be read"),
    ("calibrate-traces-folder", "randattn.calibrate", CALIBRATE + ["--out", "{S}/s.pt", "--traces", "{S}"],
     "--traces: {S} is a folder"),
    ("calibrate-text-missing", "randattn.calibrate", CALIBRATE + ["--out", "{S}/s.pt", "--text", "{S}/nope.txt"],
     "--text: {S}/nope.txt: no such file"),
    ("calibrate-tokens-0", "randattn.calibrate", CALIBRATE + ["--out", "{S}/s.pt", "--tokens", "0"],
     "--tokens: must be a positive integer, got 0"),
    ("calibrate-max-length-0", "randattn.calibrate", CALIBRATE + ["--out", "{S}/s.pt", "--max-length", "0"],
     "--max-length: must be a positive integer"),
    ("calibrate-text-and-traces", "randattn.calibrate", CALIBRATE + ["--out", "{S}/s.pt", "--text", "{S}/notes.txt",
                                                                     "--traces", "{S}/notes.txt"], "not allowed with"),
    ("calibrate-model-missing", "randattn.calibrate", CALIBRATE + ["--out", "{S}/s.pt", "--model", "{S}/nomodel"],
     "randattn.calibrate: model directory"),
    ("calibrate-device-cuda", "randattn.calibrate", CALIBRATE + ["--out", "{S}/s.pt", "--device", "cuda"],
     "randattn.calibrate: device 'cuda' asked for CUDA"),
    # -- the randattn command ----------------------------------------------------------------------------------------
    ("cli-command-unknown", "randattn.cli", ["nope"], "unknown command 'nope'; known commands: probe"),
    ("cli-probe-unknown", "randattn.cli", ["probe", "nope"], "unknown probe 'nope'; known probes:"),
    ("cli-bench-unknown", "randattn.cli", ["bench", "nope"], "unknown benchmark 'nope'; known benchmarks:"),
    # -- one settings reader (issue 35): another spelling of a key, a wrong type; naming the flag or file and line
    ("passcode-flag-alias-K", "probes.passcode", ["--K", "128"],
     "the command line: --K: not a key here; did you mean --budget?"),
    ("passcode-flag-alias-r", "probes.passcode", ["-r", "8"], "the command line: -r: not a key here; did you mean --buffer?"),
    ("passcode-config-alias-K", "probes.passcode", ["--config", "{S}/config_alias.toml"],
     "config_alias.toml:1: K: not a key here; did you mean budget?"),
    ("passcode-config-budget-string", "probes.passcode", ["--config", "{S}/config_type.toml"],
     "config_type.toml:1: --budget: expected an integer, got '12x'; the accepted keys are"),
    ("grid-alias-K", "probes.grid", ["{S}/grid_alias.toml"], "grid_alias.toml:2: K: not a key here; did you mean budget?"),
]
# -- the board (probes.board): its spec files, refused before any model loads, nothing written ----------------------
_BOARD = '[board]\nalpha = 0.05\nadjustment = "holm"\nout = "bout"\n'
_PASSCODE = '[tasks.passcode]\nbudget = 96\nbuffer = 16\ninstances = 2\n'
_CALIBRATED = _BOARD + _PASSCODE + 'rounds = "calibrated"\ncalibration = "{}"\n'
PLANTED.update({name: text.encode() for name, text in {
    "board_ok.toml": _BOARD + _PASSCODE + "rounds = 5\n",
    "board_bad.toml": '[board]\nalpha = 0.05\nadjustment = "holm\n',
    "board_table.toml": _BOARD + "[settings]\nx = 1\n",
    "board_task.toml": _BOARD + "[tasks.pascode]\nbudget = 96\nbuffer = 16\n",
    "board_key.toml": _BOARD + _PASSCODE + "distance = 100\n",
    "board_type.toml": _BOARD + '[tasks.passcode]\nbudget = 96\nbuffer = 16\ninstances = "many"\n',
    "board_value.toml": _BOARD + "[tasks.passcode]\nbudget = 96\nbuffer = 16\ninstances = 0\n",
    "board_budget.toml": _BOARD + "[tasks.passcode]\nbudget = 16\nbuffer = 16\n",
    "board_alpha.toml": '[board]\nalpha = 1.5\nadjustment = "holm"\n' + _PASSCODE,
    "board_adjust.toml": '[board]\nalpha = 0.05\nadjustment = "bonferroni"\n' + _PASSCODE,
    "board_undeclared.toml": '[board]\nadjustment = "holm"\n' + _PASSCODE,
    "board_board_key.toml": _BOARD + "budget = 96\n" + _PASSCODE,
    "board_selector.toml": _BOARD + 'selectors = ["nope"]\n' + _PASSCODE,
    "board_random.toml": _BOARD + 'selectors = ["random"]\n' + _PASSCODE,
    "regime_none.json": '{"task": "passcode", "knob": "rounds", "chosen": null, "reason": "no point satisfies '
                        'ceiling >= 0.8 (5: ceiling 0.100, random 0.000, recency 0.000)"}\n',
    "regime_planted.json": '{"task": "planted", "knob": "distance", "chosen": {"distance": 128}, "reason": "1 of 2"}\n',
    "regime_passcode.json": '{"task": "passcode", "knob": "rounds", "chosen": {"rounds": 5}, "reason": "1 of 2", '
                            '"settings": {"budget": 96, "buffer": 64}}\n',
    "board_cal_none.toml": _CALIBRATED.format("regime_none.json"),
    "board_cal_missing.toml": _CALIBRATED.format("regime_nope.json"),
    "board_cal_task.toml": _CALIBRATED.format("regime_planted.json"),
    "board_cal_buffer.toml": _CALIBRATED.format("regime_passcode.json"),
    "board_cal_knob.toml": _BOARD + '[tasks.passcode]\nbudget = "calibrated"\nbuffer = 64\n'
                                    'calibration = "regime_passcode.json"\n',
    "board_cal_alone.toml": _BOARD + _PASSCODE + 'rounds = "calibrated"\n',
}.items()})
CLI_ROWS += [
    ("board-spec-missing", "probes.board", ["register", "{S}/nope.toml"], "{S}/nope.toml: no such file"),
    ("board-spec-not-toml", "probes.board", ["register", "{S}/board_bad.toml"],
     "{S}/board_bad.toml:3: not valid TOML"),
    ("board-table-unknown", "probes.board", ["register", "{S}/board_table.toml"],
     "board_table.toml:5: unknown table [settings]; the spec has the tables [board] and [tasks.<task>]"),
    ("board-task-unknown", "probes.board", ["register", "{S}/board_task.toml"],
     "board_task.toml:5: [tasks.pascode]: unknown task 'pascode'; did you mean passcode?"),
    ("board-task-key-unknown", "probes.board", ["register", "{S}/board_key.toml"],
     "board_key.toml:9: [tasks.passcode] distance: the passcode task does not take distance; did you mean instances?; "
     "the accepted ones are budget, buffer, instances, passcode_instances, rounds, batch, calibration"),
    ("board-board-key-unknown", "probes.board", ["register", "{S}/board_board_key.toml"],
     "board_board_key.toml:5: [board] budget: not a key of the [board] table; the accepted ones are name, model"),
    ("board-wrong-type", "probes.board", ["register", "{S}/board_type.toml"],
     "board_type.toml:8: [tasks.passcode] instances: must be an integer, got 'many' (str)"),
    ("board-bad-value", "probes.board", ["register", "{S}/board_value.toml"],
     "board_value.toml:8: [tasks.passcode] instances: must be a positive integer, got 0"),
    ("board-budget-at-r", "probes.board", ["register", "{S}/board_budget.toml"],
     "board_budget.toml:6: [tasks.passcode] budget: T=16 must exceed the recent window r=16"),
    ("board-alpha-above-one", "probes.board", ["register", "{S}/board_alpha.toml"],
     "board_alpha.toml:2: [board] alpha: must be strictly between 0 and 1, got 1.5"),
    ("board-adjustment-unknown", "probes.board", ["register", "{S}/board_adjust.toml"],
     "board_adjust.toml:3: [board] adjustment: must be one of holm, bh"),
    ("board-alpha-undeclared", "probes.board", ["register", "{S}/board_undeclared.toml"],
     "board_undeclared.toml:1: [board]: declare alpha"),
    ("board-selector-unknown", "probes.board", ["register", "{S}/board_selector.toml"],
     "board_selector.toml:5: [board] selectors: 'nope' is unknown"),
    ("board-random-as-selector", "probes.board", ["register", "{S}/board_random.toml"],
     "board_random.toml:5: [board] selectors: random is the reference"),
    ("board-calibration-chose-nothing", "probes.board", ["register", "{S}/board_cal_none.toml"],
     "board_cal_none.toml:9: [tasks.passcode] rounds: regime_none.json chose nothing: no point satisfies ceiling >= "
     "0.8 (5: ceiling 0.100, random 0.000, recency 0.000)"),
    ("board-calibration-missing", "probes.board", ["register", "{S}/board_cal_missing.toml"],
     "board_cal_missing.toml:9: [tasks.passcode] rounds: the calibration file regime_nope.json does not exist"),
    ("board-calibration-other-task", "probes.board", ["register", "{S}/board_cal_task.toml"],
     "[tasks.passcode] rounds: regime_planted.json is the regime of the planted task, not of passcode"),
    ("board-calibration-other-knob", "probes.board", ["register", "{S}/board_cal_knob.toml"],
     "[tasks.passcode] budget: regime_passcode.json calibrated the passcode task's rounds, not budget"),
    ("board-calibration-other-r", "probes.board", ["register", "{S}/board_cal_buffer.toml"],
     "board_cal_buffer.toml:7: [tasks.passcode] buffer: regime_passcode.json was calibrated at buffer = 64; this task "
     "runs at 16"),
    ("board-calibrated-without-file", "probes.board", ["register", "{S}/board_cal_alone.toml"],
     "[tasks.passcode] rounds: 'calibrated' needs calibration = \"path/to/regime.json\""),
    ("board-run-unregistered", "probes.board", ["run", "{S}/board_ok.toml"],
     "[tasks.passcode]: the passcode task is not registered in bout/passcode/spec.json; run `python -m probes.board "
     "register {S}/board_ok.toml`"),
    ("board-run-task-not-in-spec", "probes.board", ["run", "{S}/board_ok.toml", "--tasks", "planted"],
     "--tasks: planted not in {S}/board_ok.toml (its tasks: passcode)"),
    ("board-run-processes-negative", "probes.board", ["run", "{S}/board_ok.toml", "--processes", "-1"],
     "--processes: must be a non-negative integer, got -1"),
    ("board-target-mde-zero", "probes.board", ["merge", "{S}/board_ok.toml", "--target-mde", "0"],
     "--target-mde: must be strictly between 0 and 1"),
    ("board-target-mde-one", "probes.board", ["merge", "{S}/board_ok.toml", "--target-mde", "1"],
     "--target-mde: must be strictly between 0 and 1"),
    ("board-stage-unknown", "probes.board", ["rerun", "{S}/board_ok.toml"], "invalid choice: 'rerun'"),
]
# Planted-fact rows without their own flag set take PLANTED_ARGS (their flags come last and win).
_PLANTED_PROBES = ("probes.head_pooling", "probes.scatter", "probes.two_facts", "probes.blocks", "probes.shared_draw")
CLI_ROWS = [(i, m, (PLANTED_ARGS + a if m in _PLANTED_PROBES else a), msg) for i, m, a, msg in CLI_ROWS]


def _plant(folder: Path) -> None:
    for rel, data in PLANTED.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _repo_snapshot() -> dict:
    """What the repository ships that a command could overwrite by writing to a default path."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns)
            for d in ("figures", "data/results", "data/traces", "randattn/stats") for p in (REPO / d).rglob("*")
            if p.is_file()}


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A folder of the user's own files, and the working directory of the command."""
    folder = tmp_path / "work"
    folder.mkdir()
    _plant(folder)
    monkeypatch.chdir(folder)
    return folder


def _argv(argv, scratch, tiny_dir):
    return [a.replace("{S}", str(scratch)).replace("{TINY}", tiny_dir).replace("{REPO}", str(REPO)) for a in argv]


def _run(module: str, argv: list) -> int:
    main = importlib.import_module(module).main
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's usage errors, and sys.exit("message")
        if isinstance(exc.code, str):
            import sys

            print(exc.code, file=sys.stderr)
            return 1
        return exc.code or 0
    return status if isinstance(status, int) else 0


@pytest.mark.parametrize("module, argv, message", [r[1:] for r in CLI_ROWS], ids=[r[0] for r in CLI_ROWS])
def test_a_bad_command_line_is_refused_clearly_and_changes_nothing(module, argv, message, scratch, tiny_dir, capsys,
                                                                   monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CUDA rows hold on a GPU machine too
    before, repo = _snapshot(scratch), _repo_snapshot()
    status = _run(module, _argv(argv, scratch, tiny_dir))
    err = capsys.readouterr().err
    assert status != 0, f"accepted: {err[-1000:]}"
    assert message.replace("{S}", str(scratch)) in err, err[-2000:]
    assert "Traceback" not in err
    after = _snapshot(scratch)
    assert all(after.get(k) == v for k, v in before.items()), "a file the user owns changed"
    assert _repo_snapshot() == repo, "a file outside --out changed"


# -- inputs that look wrong and have a defined behaviour --------------------------------------------------------------
def _results_name(tiny_dir, **over):
    c = {"policy": "random", "K": 64, "r": 12, "d": 90, "s": 0, "tag": "score-only", **over}
    return f"{Path(tiny_dir).name}-{c['policy']}-K{c['K']}-r{c['r']}-d{c['d']}-s{c['s']}-{c['tag']}.jsonl"


def test_out_may_be_a_folder_of_the_users_files_which_stay_untouched(scratch, tiny_dir, capsys):
    from probes import head_pooling

    before = _snapshot(scratch)
    args = [a for a in _argv(PLANTED_ARGS, scratch, tiny_dir)]
    args[args.index("--out") + 1] = str(scratch)
    assert head_pooling.main(args) == 0
    after = _snapshot(scratch)
    assert all(after[k] == v for k, v in before.items())
    assert (scratch / _results_name(tiny_dir)).exists()


def test_a_foreign_file_with_a_torn_line_under_the_results_name_is_refused_not_repaired(scratch, tiny_dir, capsys):
    """Issue 21 item 2: torn-line repair only ever cuts our own rows."""
    from probes import head_pooling

    victim = scratch / "out" / _results_name(tiny_dir)
    victim.parent.mkdir()
    victim.write_bytes(b'{"important": 1}\n{"half a li')
    before = _snapshot(scratch)
    with pytest.raises(SystemExit):
        head_pooling.main(_argv(PLANTED_ARGS, scratch, tiny_dir))
    assert NOT_OURS in capsys.readouterr().err and _snapshot(scratch) == before


def test_a_shorter_rerun_keeps_the_full_summary_and_the_default_figure_goes_under_the_working_folder(
        scratch, tiny_dir, capsys):
    """Issue 21 item 6: a rerun with fewer instances writes its own summary; figures never go to the package's
    figures/ (the default is figures/ under the working directory)."""
    from probes import head_pooling

    args = [a for a in _argv(PLANTED_ARGS, scratch, tiny_dir) if a != "--no-figure"]
    repo = _repo_snapshot()
    assert head_pooling.main(args) == 0
    full = next((scratch / "out").glob("*-score-only.summary.csv"))
    text = full.read_text()
    args[args.index("--instances") + 1] = "1"
    assert head_pooling.main([*args, "--no-figure"]) == 0
    assert full.read_text() == text and len(list((scratch / "out").glob("*.n1.summary.csv"))) == 1
    assert (scratch / "figures" / "head_pooling.png").exists() and _repo_snapshot() == repo


def test_traces_stop_within_the_batch_that_reaches_tokens(scratch, tiny_dir):
    """Issue 21 item 8: --tokens 10 writes one batch at most (not thousands of tokens)."""
    from probes import traces

    assert traces.main(_argv(TRACES, scratch, tiny_dir)) == 0
    rows = [json.loads(x) for x in (scratch / "t.jsonl").read_text().splitlines()]
    assert 1 <= len(rows) <= 2 and sum(r["tokens"] for r in rows) <= 2 * 8
    # a torn last row of ours (a kill mid-write) is cut off on resume, and other settings are refused
    (scratch / "t.jsonl").write_bytes((scratch / "t.jsonl").read_bytes() + b'{"id": 9, "quest')
    assert traces.main(_argv(TRACES, scratch, tiny_dir)) == 0
    assert [json.loads(x) for x in (scratch / "t.jsonl").read_text().splitlines()] == rows
    with pytest.raises(SystemExit):
        traces.main(_argv(TRACES, scratch, tiny_dir) + ["--temperature", "0.3"])


def test_demo_counts_layers_from_the_last_and_rewrites_only_its_own_out(scratch, tiny_dir, capsys):
    from probes import demo

    argv = _argv(DEMO, scratch, tiny_dir)
    argv[argv.index("--layers") + 1] = "-1"
    assert demo.main([*argv, "--out", str(scratch / "d")]) == 0
    assert "layer 1: evicted positions" in capsys.readouterr().out
    assert demo.main([*argv, "--out", str(scratch / "d")]) == 0  # its own files: replaced


# -- the Python API ---------------------------------------------------------------------------------------------------
def _bound(budget=16, buffer=4, **kw):
    return randattn.EvictingCache("random", budget=budget, buffer=buffer, **kw).bind(tiny_model("llama"))


def _used_cache():
    model = tiny_model("llama")
    cache = randattn.EvictingCache("random", budget=32, buffer=8)
    model.generate(random_ids(1, 8), past_key_values=cache, max_new_tokens=2, do_sample=False)
    return model, cache


def _fresh(policy="random"):
    return randattn.EvictingCache(policy, budget=16, buffer=4)


def _generate(policy="random", ids=None, **kwargs):
    return randattn.generate(tiny_model("llama"), random_ids(1, 8) if ids is None else ids, _fresh(policy),
                             max_new_tokens=24, do_sample=False, **kwargs)


def float64_overflow(view):
    return torch.full(view.shape, 1e300, dtype=torch.float64)


def minus_inf_scores(view):
    return torch.full(view.shape, float("-inf"))


def meta_scores(view):
    return torch.zeros(view.shape, device="meta")


def writes_keys(view):
    view.keys.zero_()
    return torch.zeros(view.shape)


def raises_in_score(view):
    raise IndexError("head 9")


API_ROWS = [
    ("power-target-mde-zero", lambda: randattn.power.units_for_mde(0.0),
     "--target-mde must be strictly between 0 and 1"),
    ("power-adjust-unknown", lambda: randattn.power.adjust([0.1], "bonferonni"),
     "adjustment must be one of holm, bh, none"),
    ("budget-0", lambda: randattn.EvictingCache("random", budget=0), "budget must be a positive integer"),
    ("budget-bool", lambda: randattn.EvictingCache("random", budget=True), "budget must be a positive integer"),
    ("budget-str", lambda: randattn.EvictingCache("random", budget="8"), "budget must be a positive integer"),
    ("budget-float", lambda: randattn.EvictingCache("random", budget=2.5), "budget must be a positive integer"),
    ("buffer-0", lambda: randattn.EvictingCache("random", budget=8, buffer=0), "buffer must be a positive integer"),
    ("buffer-none", lambda: randattn.EvictingCache("random", budget=8, buffer=None), "buffer must be a positive"),
    ("recent-negative", lambda: randattn.EvictingCache("random", budget=32, buffer=8, recent=-1), "recent must be"),
    ("recent-fills-budget", lambda: randattn.EvictingCache("random", budget=32, buffer=8, recent=32), "recent must be"),
    ("budget-at-default-r", lambda: randattn.EvictingCache("random", budget=32), "must exceed the recent window"),
    ("seed-fraction", lambda: randattn.EvictingCache("random", budget=32, buffer=8, seed=1.7), "seed must be an"),
    ("seed-negative", lambda: randattn.EvictingCache("random", budget=32, buffer=8, seed=-1), "seed must be an"),
    ("seed-2**64", lambda: randattn.EvictingCache("random", budget=32, buffer=8, seed=2**64), "seed must be an"),
    ("policy-unknown", lambda: randattn.EvictingCache("h2oo", budget=8, buffer=4), "random-shared"),
    ("policy-option-unknown", lambda: randattn.EvictingCache("streamingllm", budget=8, buffer=4, sinks=2),
     "does not take option"),
    ("paper-mode-protection", lambda: randattn.EvictingCache("attn", budget=32, buffer=8, protect_prompt=True),
     "runs with the prompt unprotected by definition"),
    ("prompt-past-budget", lambda: randattn.EvictingCache("random", budget=16, buffer=4, prompt_len=12),
     "budget T=16 cannot hold the protected prompt of 12 tokens"),
    ("make-policy-unknown", lambda: randattn.make_policy("nope"), "nope"),
    ("make-policy-option", lambda: randattn.make_policy("h2o", nope=1), "does not take option"),
    ("load-policy-missing-file", lambda: randattn.load_policy("/no/such/sel.py:score"), "no file"),
    ("pin-layer-out-of-range", lambda: _bound().pin([1], layers=[5]), "layers [5] out of range"),
    ("pin-head-out-of-range", lambda: _bound().pin([1], heads=[7]), "heads [7] out of range"),
    ("force-evict-layer-out-of-range", lambda: _bound().force_evict([1], layers=[2]), "force_evict(layers=[2])"),
    ("pin-layers-bool", lambda: _bound().pin([1], layers=[True]), "layers must be non-negative integer indices"),
    ("pin-position-negative", lambda: _bound().pin([-1]), "positions must be absolute token positions >= 0"),
    ("pin-position-fraction", lambda: _bound().pin([1.7]), "positions must be integer token positions, got 1.7"),
    ("force-evict-position-bool", lambda: _bound().force_evict([2, True]), "integer token positions, got True"),
    ("pin-position-float-tensor", lambda: _bound().pin(torch.tensor([2.5])), "got a torch.float32 tensor [2.5]"),
    ("load-model-missing-dir", lambda: randattn.load_model("/no/such/model", device="cpu"), "does not exist"),
    ("load-model-hub-offline", lambda: randattn.load_model("someone/no-such-model", device="cpu"), "hub"),
    ("resolve-device-gpu0", lambda: randattn.resolve_device("gpu0"), "is not a torch device"),
    ("resolve-device-cuda", lambda: randattn.resolve_device("cuda"), "no usable GPU"),
    ("reused-cache-plain-generate", lambda: (lambda m, c: m.generate(random_ids(1, 8), past_key_values=c,
                                                                     max_new_tokens=2))(*_used_cache()),
     "already holds a sequence"),
    ("reused-cache-replay", lambda: (lambda m, c: randattn.replay(m, random_ids(1, 8), c, prompt_len=4))(*_used_cache()),
     "already holds a sequence"),
    ("round-seed-fraction", lambda: __import__("randattn.seeding").seeding.round_seed(0, 1.5, 0), "round_seed"),
    ("generate-use-cache-false", lambda: _generate(use_cache=False), "randattn.generate: use_cache=False with an"),
    ("plain-generate-use-cache-false", lambda: tiny_model("llama").generate(
        random_ids(1, 8), past_key_values=_fresh(), max_new_tokens=2, use_cache=False), "model.generate: use_cache=False"),
    ("forward-use-cache-false", lambda: tiny_model("llama")(random_ids(1, 8), past_key_values=_fresh(), use_cache=False),
     "model(...): use_cache=False"),
    ("generate-second-cache-keyword", lambda: _generate(past_key_values=_fresh()),
     "randattn.generate: past_key_values= beside cache="),
    ("generate-empty-prompt", lambda: _generate(ids=torch.zeros((1, 0), dtype=torch.long)),
     "randattn.generate: input_ids must be [batch, tokens] with at least one row and one token, got shape (1, 0)"),
    ("replay-empty-batch", lambda: randattn.replay(tiny_model("llama"), torch.zeros((0, 5), dtype=torch.long), _fresh(),
                                                   prompt_len=1), "randattn.replay: input_ids must be [batch, tokens]"),
    ("decode-step-empty-prompt", lambda: randattn.decode_step(tiny_model("llama"), torch.zeros((1, 0), dtype=torch.long),
                                                              _fresh()), "randattn.decode_step: input_ids must be"),
    ("score-float64-overflow", lambda: _generate(float64_overflow),
     "policy 'float64_overflow' returned float64 scores at layer 0, round 0 that float32 cannot hold"),
    ("score-minus-inf", lambda: _generate(minus_inf_scores), "policy 'minus_inf_scores' returned -inf scores at layer 0"),
    ("score-on-meta-device", lambda: _generate(meta_scores),
     "policy 'meta_scores' returned scores on device meta at layer 0, round 0"),
    ("policy-writes-into-its-view", lambda: _generate(writes_keys),
     "policy 'writes_keys' wrote into view.keys at layer 0, round 0; a policy must not modify the tensors it is shown"),
    ("policy-raises", lambda: _generate(raises_in_score),
     "policy 'raises_in_score' failed at layer 0, round 0: IndexError: head 9"),
    # Padded batches (issue 27): each a refusal naming the argument before anything is generated.
    ("mask-right-padded", lambda: _generate(ids=random_ids(2, 8), attention_mask=torch.tensor([[1] * 6 + [0] * 2, [1] * 8])),
     "attention_mask: rows [0] are not left-padded"),
    ("mask-all-padding-row", lambda: _generate(ids=random_ids(2, 8), attention_mask=torch.tensor([[0] * 8, [1] * 8])),
     "attention_mask: rows [0] are all padding"),
    ("mask-shape", lambda: _generate(ids=random_ids(2, 8), attention_mask=torch.ones(2, 7, dtype=torch.long)),
     "attention_mask must match input_ids (2, 8)"),
    ("mask-4d", lambda: randattn.decode_step(tiny_model("llama"), random_ids(1, 8), _fresh(),
                                             attention_mask=torch.ones(1, 1, 8, 8)), "attention_mask of the prompt"),
    ("mask-prompt-too-long-for-T", lambda: _generate(ids=random_ids(2, 14), attention_mask=torch.tensor(
        [[1] * 14, [0] * 6 + [1] * 8])), "cannot hold the protected prompt of 14 tokens"),
    ("row-keys-length", lambda: randattn.generate(tiny_model("llama"), random_ids(2, 8), randattn.EvictingCache(
        "random", budget=16, buffer=4, row_keys=[1]), max_new_tokens=24), "row_keys has 1 keys but the batch has 2"),
    ("row-key-float", lambda: randattn.EvictingCache("random", budget=16, buffer=4, row_keys=[1.5]),
     "row_keys[0] must be a string"),
    ("snapkv-score-dtype", lambda: randattn.make_policy("snapkv", score_dtype="bf16"), "score_dtype must be one of"),
    ("rkv-score-dtype", lambda: randattn.make_policy("rkv", score_dtype=torch.bfloat16), "score_dtype must be one of"),
    ("random-ppp-whole-prompt", lambda: randattn.make_policy("random-ppp", whole_prompt="no"),
     "whole_prompt must be True"),
    ("random-ppp-paper-mode-protected", lambda: randattn.EvictingCache("random_ppp", budget=32, buffer=8,
                                                                         protect_prompt=True),
     "runs with the prompt unprotected by definition"),
    ("vllm-config-unknown-key", lambda: _vllm_config({"budget": 64, "buffer": 8, "bufer": 8}), "unknown keys ['bufer']"),
    ("vllm-config-no-budget", lambda: _vllm_config({"policy": "random", "buffer": 8}), "needs 'budget'"),
    # h2o is served since issue 39 (its attention recomputed by the plugin); TriAttention needs its statistics given
    ("vllm-policy-triattention-no-stats", lambda: _vllm_config({"policy": "triattention", "budget": 64, "buffer": 8}),
     "policy 'triattention' needs per-model calibration statistics and none were given"),
    # One settings reader (issue 35): another spelling of a key, a key the source does not take, a wrong type; each
    # names the source and the key and lists the accepted keys (tests/test_settings_reader.py has every source).
    ("vllm-config-alias-K", lambda: _vllm_config({"K": 64, "buffer": 8}),
     "additional_config['randattn']: K: not a key here; did you mean budget?"),
    ("vllm-config-alias-r", lambda: _vllm_config({"budget": 64, "r": 8}),
     "additional_config['randattn']: r: not a key here; did you mean buffer?"),
    ("vllm-config-budget-string", lambda: _vllm_config({"budget": "64", "buffer": 8}),
     "additional_config['randattn']: budget: must be an integer, got '64' (str); the accepted keys are policy, budget"),
    ("spec-from-mapping-alias-T", lambda: randattn.EvictionSpec.from_mapping({"T": 64}, where="settings"),
     "settings: T: not a key here; did you mean budget?"),
    ("lm-eval-model-args-alias-K", lambda: _lm_eval("K=512"), "--model_args: K: not a key here; did you mean budget?"),
    ("lm-eval-model-args-unknown", lambda: _lm_eval("window=3"),
     "--model_args window: not a randattn model argument; the accepted ones are pretrained, policy"),
]


def _lm_eval(args):
    """lm-eval's way of building the model from --model_args (refused before anything loads)."""
    from probes.lm_eval_backend import RandAttnLM

    return RandAttnLM.create_from_arg_string(f"pretrained=/no/such/dir,{args}")


def _vllm_config(section):
    """The vLLM plugin's config check (randattn.vllm.runner.engine_config), as vLLM's front end calls it."""
    from types import SimpleNamespace

    from randattn.vllm.runner import engine_config

    return engine_config(SimpleNamespace(additional_config={"randattn": section}))


@pytest.mark.parametrize("call, message", [r[1:] for r in API_ROWS], ids=[r[0] for r in API_ROWS])
def test_a_bad_api_call_raises_a_value_error_naming_the_parameter(call, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # RuntimeError: a policy that fails or writes into its view, named with its layer and round
    with pytest.raises((ValueError, TypeError, FileNotFoundError, OSError, RuntimeError)) as err:
        call()
    assert message in str(err.value)


def test_reset_forgets_prompt_length_pins_and_keep_log():
    """Issue 21 item 5."""
    model = tiny_model("llama")
    cache = randattn.EvictingCache("random", budget=16, buffer=4, keep_log=True)
    cache.pin([1])
    randattn.generate(model, random_ids(1, 10), cache, max_new_tokens=20)
    assert cache.prompt_len == 10 and cache._rules and len(cache.keep_log) > 0
    cache.reset()
    assert cache.prompt_len is None and not cache._rules and len(cache.keep_log) == 0


def test_a_sequence_past_max_position_warns():
    """Issue 21 item 11."""
    model = tiny_model("llama", max_position_embeddings=24)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        randattn.generate(model, random_ids(1, 8), randattn.EvictingCache("random", budget=16, buffer=4),
                          max_new_tokens=24)
    assert any("max_position_embeddings" in str(w.message) for w in caught)


def test_the_table_covers_every_command():
    modules = {m for _, m, _, _ in CLI_ROWS}
    for name in ("head_pooling", "scatter", "two_facts", "blocks", "survival", "prompt_protection", "shared_draw",
                 "passcode", "accuracy", "challenge", "leaderboard", "board", "grid", "demo", "traces"):
        assert f"probes.{name}" in modules
    assert {"figures.__main__", "randattn.calibrate", "randattn.cli"} <= modules
    assert {m for m in modules if m.startswith("bench.")} == {f"bench.{b}" for b in (
        "decode", "batch_scaling", "equal_memory", "memory", "replay_speed", "kvpress_peer", "round_cost",
        "grid_overhead", "pack")}
    assert len(CLI_ROWS) >= 180 and len(API_ROWS) >= 30


# -- issue 29 item 6: --data errors name both sources and the right fields -----------------------------------
@pytest.mark.parametrize("task, fields, source", [
    ("livecodebench", "'question_content'", "livecodebench/code_generation_lite"),
    ("gpqa_diamond", "'correct'", "Idavidrein/gpqa"),
    ("math500", "'answer'", "HuggingFaceH4/MATH-500"),
])
def test_task_data_errors_name_both_sources_and_the_tasks_fields(task, fields, source, monkeypatch, tmp_path):
    from probes import tasks

    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # the HF route unavailable: its error offers --data
    with pytest.raises(tasks.TaskDataError) as err:
        tasks.load_problems(tasks.get_task(task))
    assert "--data FILE.jsonl" in str(err.value) and fields in str(err.value) and source in str(err.value)
    if task == "livecodebench":
        assert "'incorrect'" not in str(err.value)  # not GPQA's fields
    with pytest.raises(tasks.TaskDataError) as err:  # a missing --data file names the HF source too
        tasks.load_problems(tasks.get_task(task), tmp_path / "missing.jsonl")
    assert "no such file" in str(err.value) and source in str(err.value)
