"""bench.rows_identity's compare: synthetic run folders, no model."""

import csv
import io
import json

from bench import rows_identity as ri


def _folder(root, rows, *, summary=None, bench=None, probes=("p",), out_name=None):
    """A `rows_identity run` folder: a manifest, one JSONL file, a CSV summary and a bench-style JSON file."""
    root.mkdir()
    (root / "p").mkdir()
    (root / "p" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(root / "p" / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["policy", "retrieval"])
        w.writeheader()
        w.writerows(summary or [{"policy": "random", "retrieval": "0.5"}])
    (root / "p" / "bench.json").write_text(json.dumps(bench or {"meta": {"git": "abc", "date": "2026-01-01"},
                                                                "rows": [{"policy": "random", "ms": 1.0}]}))
    (root / "_logs").mkdir()
    (root / "_logs" / "p.log").write_text("whatever")
    manifest = {"root": "/code/" + root.name, "out": str(root), "probes": {
        name: {"module": "probes.p", "args": ["--x"], "rc": 0, "wall_s": 1.0, "files": [], "ok": True}
        for name in probes}}
    (root / ri.MANIFEST).write_text(json.dumps(manifest))
    return root


ROWS = [{"instance": 0, "lp": -1.25, "retrieved": True, "path": "{out}/x",
         "config": {"budget": 64, "revision": "1166596", "versions": {"torch": "2"}, "device": "cpu",
                    "date": "2026-12-02"}},
        {"instance": 1, "lp": -2.5, "retrieved": False, "path": "{out}/y", "seconds": 3.0,
         "config": {"budget": 64, "revision": "1166596"}}]


def _rows(root, changes=None):
    rows = json.loads(json.dumps(ROWS).replace("{out}", str(root)))
    for (i, key), value in (changes or {}).items():
        rows[i][key] = value
    return rows


def _compare(a, b, **kw):
    buf = io.StringIO()
    rc = ri.compare(a, b, out=buf, **kw)
    return rc, buf.getvalue()


def test_identical_folders_pass(tmp_path):
    a = _folder(tmp_path / "a", _rows(tmp_path / "a"))
    b = _folder(tmp_path / "b", _rows(tmp_path / "b"))
    rc, text = _compare(a, b)
    assert rc == 0, text
    assert "3 of 3 files identical" in text


def test_a_changed_field_fails_and_is_named(tmp_path):
    a = _folder(tmp_path / "a", _rows(tmp_path / "a"))
    b = _folder(tmp_path / "b", _rows(tmp_path / "b", {(1, "lp"): -2.5000001}))
    rc, text = _compare(a, b)
    assert rc == 1
    assert "FAIL p/rows.jsonl: 1 of 2 rows differ" in text and "lp: 1 rows" in text
    assert "retrieved" not in text.split("FAIL")[1]
    # a tolerance admits it, on the fields it names only
    assert _compare(a, b, atol=1e-5)[0] == 0
    assert _compare(a, b, atol=1e-5, atol_fields=["config.*"])[0] == 1


def test_a_nested_or_csv_change_fails(tmp_path):
    a = _folder(tmp_path / "a", _rows(tmp_path / "a"))
    rows = _rows(tmp_path / "b")
    rows[0]["config"]["budget"] = 65
    b = _folder(tmp_path / "b", rows, summary=[{"policy": "random", "retrieval": "0.75"}])
    rc, text = _compare(a, b)
    assert rc == 1 and "config.budget" in text and "FAIL p/summary.csv" in text and "retrieval" in text


def test_excluded_fields_are_ignored(tmp_path):
    a = _folder(tmp_path / "a", _rows(tmp_path / "a"))
    rows = _rows(tmp_path / "b", {(1, "seconds"): 99.0})
    rows[0]["config"].update(revision="fffffff", device="cuda:0", date="2027-01-01", versions={"torch": "3"})
    b = _folder(tmp_path / "b", rows, bench={"meta": {"git": "def", "date": "2027-01-01"},
                                             "rows": [{"policy": "random", "ms": 2.0}]})
    rc, text = _compare(a, b)
    assert rc == 0, text
    assert "fields left out (where present): date, device, git, ms, revision, seconds, versions" in text


def test_a_missing_file_or_probe_fails(tmp_path):
    a = _folder(tmp_path / "a", _rows(tmp_path / "a"), probes=("p", "q"))
    b = _folder(tmp_path / "b", _rows(tmp_path / "b"), probes=("p",))
    (b / "p" / "summary.csv").unlink()
    rc, text = _compare(a, b)
    assert rc == 1
    assert "FAIL p/summary.csv: missing after" in text and "FAIL probe q: not run after" in text


def test_a_failed_probe_or_a_reordered_file_fails(tmp_path):
    a = _folder(tmp_path / "a", _rows(tmp_path / "a"))
    b = _folder(tmp_path / "b", _rows(tmp_path / "b")[::-1])
    manifest = json.loads((b / ri.MANIFEST).read_text())
    manifest["probes"]["p"].update(rc=2, ok=False)
    (b / ri.MANIFEST).write_text(json.dumps(manifest))
    rc, text = _compare(a, b)
    assert rc == 1 and "FAIL probe p: failed after (exit 2" in text and "the same 2 rows in another order" in text


def test_only_compares_the_named_probes(tmp_path):
    a = _folder(tmp_path / "a", _rows(tmp_path / "a"), probes=("p", "q"))
    b = _folder(tmp_path / "b", _rows(tmp_path / "b"), probes=("p",))
    rc, text = _compare(a, b, only=["p"])
    assert rc == 0, text


def test_ignore_leaves_out_the_named_paths(tmp_path):
    a = _folder(tmp_path / "a", _rows(tmp_path / "a"))
    b = _folder(tmp_path / "b", _rows(tmp_path / "b"))
    (b / "p" / "summary.csv").unlink()
    assert _compare(a, b)[0] == 1
    rc, text = _compare(a, b, ignore=["p/*.csv"])
    assert rc == 0 and "ignored by --ignore p/*.csv: 1 files" in text
