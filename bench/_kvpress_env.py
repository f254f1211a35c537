"""The kvpress peer's own virtual environment: kvpress pins transformers < 5.3, below this project's range.

Created on first use with the standard library's venv and pip; every command is printed before it
runs. A marker file records the pins that were installed, so a changed pin reinstalls.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = REPO_ROOT / ".venv-kvpress"
# torch first and alone: a plain `torch` requirement would pull a multi-GB CUDA build.
TORCH_PIN = "torch==2.13.0"
# kvpress 0.5.5 is the newest release and has DecodingPress; 5.2.0 is the newest transformers it accepts.
PEER_PINS = ("kvpress==0.5.5", "transformers==5.2.0", "gguf==0.19.0", "accelerate==1.15.0")
_MARKER = ".randattn-pins"


class PeerEnvError(RuntimeError):
    """The peer environment could not be made or used; the message names the fix."""


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(cmd: list) -> None:
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    rc = subprocess.call([str(c) for c in cmd])
    if rc != 0:
        raise PeerEnvError(
            f"`{' '.join(str(c) for c in cmd)}` failed (exit {rc}); see its output above. Fix the cause (network to "
            f"PyPI, disk space, a pin no longer available) and rerun, or create an environment with kvpress yourself "
            f"and pass --peer-python PATH/bin/python"
        )


def ensure_venv(venv: Path = DEFAULT_VENV) -> Path:
    """The python of ``venv``, creating it and installing the pins when missing or out of date."""
    venv = Path(venv)
    python = venv_python(venv)
    wanted = "\n".join([TORCH_PIN, *PEER_PINS]) + "\n"
    marker = venv / _MARKER
    if python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    print(f"setting up the kvpress peer environment in {venv} (once; a few minutes)", flush=True)
    if not python.exists():
        _run([sys.executable, "-m", "venv", venv])
    _run([python, "-m", "pip", "install", TORCH_PIN])
    _run([python, "-m", "pip", "install", *PEER_PINS])
    marker.write_text(wanted)
    return python


def check_peer_python(python: Path) -> dict:
    """Versions in a user-given environment, or an error saying what it lacks."""
    python = Path(python)
    if not python.exists():
        raise PeerEnvError(f"--peer-python {python} does not exist; pass the python of an environment with kvpress "
                           f"installed, or leave the flag out to create {DEFAULT_VENV.name}/")
    probe = ("import json, importlib.metadata as m; "
             "print(json.dumps({d: m.version(d) for d in ('kvpress', 'transformers', 'torch', 'gguf')}))")
    res = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if res.returncode != 0:
        raise PeerEnvError(f"--peer-python {python} lacks a package the peer needs ({res.stderr.strip().splitlines()[-1]}); "
                           f"install {' '.join(PEER_PINS)} there, or leave the flag out to create {DEFAULT_VENV.name}/")
    import json

    return json.loads(res.stdout)
