"""The docs' measured tables are generated from the shipped results, so a stale number fails here."""

from pathlib import Path

import figures.tables as tables

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_doc_table_equals_its_result_file(capsys):
    assert tables.main(["--check"]) == 0, capsys.readouterr().out


def test_a_changed_number_is_caught(tmp_path):
    page = tmp_path / "page.md"
    fresh = tables.render("<!-- table: head_pooling -->\n<!-- /table -->\n", "page")
    page.write_text(fresh.replace("0.", "9.", 1))
    assert tables.main(["--check", "--docs", str(tmp_path)]) == 1
    assert tables.main(["--docs", str(tmp_path)]) == 0 and page.read_text() == fresh


def test_every_table_a_doc_marks_is_known_and_every_known_table_is_used():
    marked = {m["name"] for p in tables.DOCS.glob("*.md") for m in tables.BLOCK.finditer(p.read_text())}
    assert marked == set(tables.TABLES)


def test_readme_stays_short_and_links_existing_pages():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for link in set(__import__("re").findall(r"\]\((docs/[\w.-]+\.md)", text)):
        assert (README.parent / link).exists(), link
