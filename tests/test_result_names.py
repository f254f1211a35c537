"""Result file names have one definition (analysis.names): every shipped file is named by it from its own recorded
configuration, figures and tables find the shipped results through it, and no probe or figure types a name by hand."""

import ast
import json
import re
from pathlib import Path

import pytest

from analysis.names import PARTS, SHIPPED, policy_slug, protection_tag, result_name, shipped_name, summary_beside

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "data" / "results"
ROWS = sorted(p for p in RESULTS.rglob("*.jsonl") if "/planted/" not in p.as_posix())  # scratch of planted-fact runs


def _config(path: Path) -> dict:
    with open(path) as f:
        return json.loads(f.readline())["config"]


@pytest.mark.parametrize("path", ROWS, ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_shipped_rows_file_is_named_by_its_recorded_configuration(path):
    config = _config(path)
    part = "nll" if path.name.startswith("nll-") else "reference_lp" if ".reference_lp" in path.name else "rows"
    assert result_name(config["probe"], config, part) == path.name


def test_the_rows_files_checked_cover_every_probe_that_ships_rows():
    assert len(ROWS) > 30
    assert {_config(p)["probe"] for p in ROWS} >= {"head_pooling", "scatter", "two_facts", "blocks", "shared_draw",
                                                   "passcode", "prompt_protection", "survival", "accuracy", "autopsy"}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_name_is_a_shipped_file(name):
    probe = SHIPPED[name][1]
    for part in PARTS[probe]:
        if part == "group":  # a folder name a grid makes, not a file the probe writes
            continue
        rel = shipped_name(name, part)
        if part in ("protection", "reference_lp") and not (RESULTS / rel).exists():
            continue  # written only by a run with protected and score-only arms (the copy task's default run has it),
            # or with --reference-lp (no shipped run has it)
        assert (RESULTS / rel).exists(), rel


def test_the_figures_and_tables_read_the_shipped_names():
    from figures.__main__ import FIGURES

    assert FIGURES["head_pooling"][2] == shipped_name("head_pooling")
    assert FIGURES["passcode"][2] == shipped_name("passcode", "summary")
    assert FIGURES["challenge"][2] == shipped_name("challenge", "folder") + "/verdict.csv"
    assert all((RESULTS / FIGURES[k][2]).exists() for k in FIGURES)


def test_names_from_a_config_object_and_keyword_fields():
    class Config:  # a probe's Config: attributes, no model (keywords supply it)
        budget, buffer, distance, seed, protect_prompt, policy = 128, 8, 200, 3, True, "dir/sel.py:score"

    assert result_name("head_pooling", Config(), model="org/Some-Model") == \
        "Some-Model-sel.score-K128-r8-d200-s3-protected.jsonl"
    assert result_name("head_pooling", Config(), "summary", model="m", policy="random") == \
        "m-random-K128-r8-d200-s3-protected.summary.csv"
    record = {"model": "m", "task": "copy", "buffer": 16, "max_new_tokens": 64, "temperature": 0.6, "top_p": 0.95,
              "seed": 1, "pack": True}
    assert result_name("accuracy", record) == "m-copy-r16-n64-T0.6-p0.95-packed-s1.jsonl"
    assert result_name("accuracy", record, "table") == "m-copy-r16-n64-T0.6-p0.95-packed-s1.table.csv"
    assert summary_beside("a-b.jsonl") == "a-b.summary.csv" and summary_beside("a-b.jsonl", 4) == "a-b.n4.summary.csv"
    assert protection_tag(False) == "score-only" and policy_slug("my mod:f") == "my_mod.f"


def test_a_missing_field_or_an_unknown_part_is_named():
    with pytest.raises(KeyError, match="'distance'"):
        result_name("scatter", {"model": "m", "policy": "random", "budget": 1, "buffer": 1, "seed": 0,
                                "protect_prompt": False})
    with pytest.raises(ValueError, match="no 'nll' file"):
        result_name("scatter", {}, "nll")
    with pytest.raises(ValueError, match="no result names for the probe 'nope'"):
        result_name("nope", {})


# A hand-typed result name: a shipped file's name as a string, or an f-string composing one (`-K{...}-r{...}`).
_COMPOSED = re.compile(r"-K\{\}|-r\{\}-|^summary-\{\}|^nll-\{\}")
# figures.before_after names the previous engine's files as they were at an old revision: history, not a name rule.
_HISTORY = {("figures/before_after.py", "OLD_FILES"), ("figures/before_after.py", "SURVIVAL")}


def _hand_typed(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    rel = path.relative_to(ROOT).as_posix()
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and (rel, t.id) in _HISTORY for t in node.targets):
            skip |= {id(n) for n in ast.walk(node.value)}
    shipped = {p.name for p in RESULTS.rglob("*") if p.is_file()}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            if _COMPOSED.search(text):
                found.append(f"{rel}:{node.lineno}: f{text!r}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" not in node.value:
            if Path(node.value).name in shipped and re.search(r"-s\d", node.value):
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize("package", ["figures", "probes"])
def test_no_result_name_is_typed_by_hand(package):
    found = [hit for path in sorted((ROOT / package).rglob("*.py")) for hit in _hand_typed(path)]
    assert not found, "compose result names with analysis.names.result_name / shipped_name:\n" + "\n".join(found)
