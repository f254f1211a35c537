"""Pre-registered board tasks (probes.registration): a registered task's spec is fixed; a run asking another value
is refused by field before any model loads; tasks and selectors may be added; --restart registers anew."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from probes import leaderboard, registration
from probes.config_errors import ConfigError


def _config(**kw):
    return leaderboard.Config(**{"tasks": ("passcode",), **kw})


def test_a_registered_task_is_fixed_and_the_refusal_names_the_field(tmp_path):
    first = leaderboard.registered(_config())
    registration.record(tmp_path, first)
    registration.check(tmp_path, first)  # the same setting passes
    with pytest.raises(ConfigError) as err:
        registration.check(tmp_path, leaderboard.registered(_config(rounds=24)))
    assert err.value.field == "rounds" and "rounds = 57" in err.value.message and "24" in err.value.message
    with pytest.raises(ConfigError) as err:
        registration.check(tmp_path, leaderboard.registered(_config(passcode_instances=64)))
    assert err.value.field == "passcode_instances"
    registration.check(tmp_path, leaderboard.registered(_config(rounds=24)), restart=True)  # --restart: anew


def test_tasks_and_selectors_may_be_added_and_are_registered_when_they_first_run(tmp_path):
    registration.record(tmp_path, leaderboard.registered(_config()))
    more = _config(tasks=("passcode", "question"), policies=("snapkv",))
    registration.check(tmp_path, leaderboard.registered(more))  # selectors are not part of a task's spec
    registration.record(tmp_path, leaderboard.registered(more), rows_exist={"question": True})
    tasks = registration.read(tmp_path)
    assert set(tasks) == {"passcode", "question"}
    assert tasks["passcode"]["preregistered"] and not tasks["question"]["preregistered"]
    assert tasks["question"]["spec"]["instances"] == 16 and tasks["question"]["spec"]["verdict"]["adjustment"] == "holm"
    with pytest.raises(ConfigError, match="registered its question task with body = 512"):
        registration.check(tmp_path, leaderboard.registered(_config(tasks=("question",), body=256)))


def test_a_spec_file_that_is_not_ours_is_refused_and_kept(tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps({"mine": 1}))
    for call in (lambda: registration.check(tmp_path, leaderboard.registered(_config())),
                 lambda: registration.record(tmp_path, leaderboard.registered(_config()), restart=True)):
        with pytest.raises(ConfigError, match="is not a board spec randattn wrote") as err:
            call()
        assert err.value.field == "out"
    assert json.loads((tmp_path / "spec.json").read_text()) == {"mine": 1}


def test_the_command_line_refuses_a_changed_setting_before_the_model_loads(tmp_path):
    cfg = _config(out=str(tmp_path))
    root = leaderboard.board_root(cfg, "smollm2-135m")
    registration.record(root, leaderboard.registered(cfg))
    out = subprocess.run([sys.executable, "-m", "probes.leaderboard", "--tasks", "passcode", "--rounds", "24",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "--rounds: the board in" in out.stderr and "registered its passcode task with rounds = 57" in out.stderr
    assert "Traceback" not in out.stderr and "Loading" not in out.stderr + out.stdout
    assert sorted(p.name for p in root.iterdir()) == ["spec.json"]  # nothing else written


def test_the_shipped_board_is_registered_with_the_setting_of_its_rows():
    from randattn.shipped import shipped_result

    root = shipped_result("leaderboard/smollm2-135m-K256-r16-s0-protected")
    tasks = registration.read(root)
    assert set(tasks) == {"copy", "repeat", "question", "passcode", "planted", "cost"}
    assert not any(t["preregistered"] for t in tasks.values())  # registered after its rows: said so
    cfg = leaderboard.Config(runs=3, instances=8, cost_repeats=1)  # docs/probes.md's shipped command
    registration.check(root, leaderboard.registered(cfg))


def test_sampling_and_the_reference_log_prob_are_registered_and_an_older_spec_reads_as_greedy(tmp_path):
    """--temperature, --top-p, --reference-lp and --reference-tokens are registered per copy and repeat task (a sampled
    board is pre-registered as such); a spec written before they existed reads as the one setting there was then."""
    cfg = _config(tasks=("copy", "repeat"))
    spec = leaderboard.registered(cfg)
    for task in ("copy", "repeat"):
        added = {k: v for k, v in registration.ADDED_FIELDS.items() if k in registration.TASK_FIELDS[task]}
        assert {k: spec[task][k] for k in added} == added and ("repeat_buffer" in added) == (task == "repeat")
    assert leaderboard.registered(_config(tasks=("repeat",), temperature=0.7, top_p=0.9, reference_lp=True,
                                          reference_tokens=64))["repeat"]["temperature"] == 0.7
    registration.record(tmp_path, spec)
    data = json.loads((tmp_path / "spec.json").read_text())
    for task in data["tasks"].values():  # as a board registered before issue 37 wrote it
        for field in registration.ADDED_FIELDS:
            task["spec"].pop(field, None)
    (tmp_path / "spec.json").write_text(json.dumps(data))
    registration.check(tmp_path, leaderboard.registered(cfg))
    for change, field in (({"temperature": 0.7}, "temperature"), ({"reference_lp": True}, "reference_lp"),
                          ({"reference_lp": True, "reference_tokens": 32}, "reference_lp")):
        with pytest.raises(ConfigError) as err:
            registration.check(tmp_path, leaderboard.registered(_config(tasks=("copy", "repeat"), **change)))
        assert err.value.field == field and "registered its copy task" in err.value.message
    with pytest.raises(ConfigError) as err:  # the repeat task's r: an older spec ran the task's own (None here)
        registration.check(tmp_path, leaderboard.registered(_config(tasks=("copy", "repeat"), repeat_buffer=64)))
    assert err.value.field == "repeat_buffer" and "registered its repeat task" in err.value.message
