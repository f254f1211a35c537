"""Data and grading for the offline lm-eval tasks in this folder (loaded by the YAMLs' ``!function`` tags).

The JSONL files sit beside this module, so the tasks work from any working directory and never reach a hub.
"""

import json
from pathlib import Path

import datasets

from probes.tasks import Problem, grade_copy

HERE = Path(__file__).resolve().parent


def load_jsonl(file: str, **_metadata) -> datasets.DatasetDict:
    """``custom_dataset``: the rows of ``file`` (beside this module) as the test split. lm-eval also passes the run's
    metadata (the model arguments among them), which the data does not depend on."""
    rows = [json.loads(line) for line in (HERE / file).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def copy_score(doc: dict, results: list) -> dict:
    """The copy task's grade (probes.tasks.grade_copy): the fraction of the numbers reproduced in order."""
    problem = Problem(doc["id"], doc["question"], doc["answer"], "copy")
    return {"copy_score": grade_copy(results[0], problem).score}
