"""The layers depend on each other one way only: randattn (the core) <- analysis (probe-row analysis) <- probes
(experiments) and analysis <- figures (plots), with no import cycle anywhere. Every import counts, also those inside
functions. The core is lean: it imports no lab package (analysis, probes, figures, bench) and none of the lab's
third-party packages (the `lab` extra: matplotlib, seaborn, math-verify), only its own dependencies, and it imports
and runs a cache with all of those made unimportable."""

import ast
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("randattn", "analysis", "probes", "figures", "bench")
LAB = ("analysis", "probes", "figures", "bench")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Imported by the core but installed by transformers (its own dependencies), so not listed in pyproject.
VIA_TRANSFORMERS = {"huggingface_hub", "tokenizers", "safetensors"}
# Integrations the core adapts to, each its own extra, imported only where that integration is used.
CORE_EXTRAS = ("nnsight", "transformer-lens", "vllm")
# Lab packages that are in no extra of the lab's but must stay out of the core all the same.
ALSO_LAB = {"pandas", "scipy", "datasets", "ray", "lm_eval", "kvpress", "nbclient", "nbformat", "IPython"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph() -> dict:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # `from pkg import sub` depends on the submodule sub; `from mod import name` on mod
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            else:
                continue
            for t in targets:
                # the longest known module the import names
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def test_no_import_cycles():
    graph = _graph()
    assert len(graph) > 40
    state: dict = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if dep.startswith(node + ".") or node.startswith(dep + ".") and graph.get(dep) and node in graph[dep]:
                pass  # a package and its own submodule importing each other's names is no layering problem
            if state.get(dep) == "open":
                cycle = stack[stack.index(dep):] + [dep] if dep in stack else [node, dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


@pytest.mark.parametrize("layer,forbidden", [
    ("randattn", ("analysis", "probes", "figures", "bench")),  # the core knows nothing above it
    ("analysis", ("probes", "figures", "bench")),  # row analysis: the core below it, nothing beside or above
    ("probes", ("figures",)),  # probes ask the figures command to draw; they never import it
    ("figures", ("probes", "bench")),  # figures plot tables they are given
])
def test_layers_import_one_way(layer, forbidden):
    # No exception, not even the console script: randattn.cli finds the lab's modules by name at run time.
    bad = sorted((m, d) for m, deps in _graph().items() if m == layer or m.startswith(layer + ".")
                 for d in deps if d.split(".")[0] in forbidden)
    assert not bad, bad


def _import_name(requirement: str) -> str:
    """The top-level import name of a requirement string (math-verify>=0.7 -> math_verify)."""
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("-", "_")


def _extra(name: str) -> set:
    """Import names of an extra's requirements (this project's own extras, randattn[...], left out)."""
    return {_import_name(r) for r in PYPROJECT["optional-dependencies"][name] if not r.startswith("randattn")}


def _third_party(package: str) -> dict:
    """{module: top-level names it imports that are neither the standard library's nor this repository's}."""
    std, own = set(sys.stdlib_module_names), set(PACKAGES)
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
        out[_module_name(path)] = names - std - own - {"__future__"}
    return out


def test_the_lab_extra_holds_the_plotting_and_grading_packages_and_the_core_does_not():
    lab = _extra("lab")
    assert {"matplotlib", "seaborn", "math_verify"} <= lab
    core = {_import_name(r) for r in PYPROJECT["dependencies"]}
    assert core >= {"torch", "transformers", "gguf"} and not core & (lab | ALSO_LAB), core & (lab | ALSO_LAB)
    # the console script names the same packages when one is missing
    from randattn.cli import LAB_IMPORTS
    assert set(LAB_IMPORTS) == lab
    # what serves the probes (and the test suite) brings the lab with it
    for extra in ("test", "tasks", "grid", "lm-eval"):
        assert any(r.replace(" ", "").startswith("randattn[") and "lab" in r for r in
                   PYPROJECT["optional-dependencies"][extra]), extra


def test_the_core_imports_only_its_own_dependencies():
    """Every third-party package a core module imports (inside functions too) is a core dependency, one transformers
    installs, or the integration extra it adapts to; none is the lab's."""
    allowed = {_import_name(r) for r in PYPROJECT["dependencies"]} | VIA_TRANSFORMERS
    allowed |= set().union(*(_extra(e) for e in CORE_EXTRAS))
    found = _third_party("randattn")
    assert sum(map(len, found.values())) > 10  # the scan sees the core's imports (torch, transformers, numpy, ...)
    lab = _extra("lab") | ALSO_LAB
    assert not allowed & lab, allowed & lab
    bad = sorted((m, n) for m, names in found.items() for n in names if n not in allowed)
    assert not bad, f"core modules import packages that are not the core's dependencies: {bad}"


# Run in a fresh interpreter: the lab's third-party dependencies made unimportable (sys.modules[name] = None, so
# `import` raises and importlib.util.find_spec answers None, as for a package that is not installed), then every core
# module imported and a tiny model generating through an evicting cache, with no lab package imported on the way; the
# console script's figures command then names the extra to install.
CORE_ONLY = """
    import importlib, io, pkgutil, sys, contextlib
    BLOCKED, LAB, OPTIONAL = {blocked!r}, {lab!r}, {optional!r}
    for name in BLOCKED:
        sys.modules[name] = None
    for name in BLOCKED:  # the blocker works
        try:
            importlib.import_module(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"{{name}} imported although blocked")
    import torch, randattn
    imported, skipped = [], []
    for info in pkgutil.walk_packages(randattn.__path__, "randattn."):
        try:
            importlib.import_module(info.name)
            imported.append(info.name)
        except ModuleNotFoundError as exc:  # an integration's module where that integration is not installed
            if (exc.name or "").split(".")[0] not in OPTIONAL:
                raise
            skipped.append(info.name)
    assert len(imported) > 20, imported
    from randattn.testing import tiny_model
    model = tiny_model("llama")
    ids = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(0))
    cache = randattn.EvictingCache("random", budget=16, buffer=4, seed=1)
    out = randattn.generate(model, ids, cache, max_new_tokens=24, do_sample=False)
    assert out.shape == (1, 32), out.shape
    assert min(cache.events) >= 1 and cache.physical_length(0) <= 16 + 4 - 1, cache.events
    from randattn import cli
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["--version"]) == 0
    lab = sorted(m for m in sys.modules if m.split(".")[0] in LAB)
    assert not lab, f"the core imported lab modules: {{lab}}"
    # the lab itself needs its extra, and the console script says which
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["figures", "--probe", "survival", "--out", "never-written"])
    assert rc == 2 and "randattn[lab]" in err.getvalue() and "matplotlib" in err.getvalue(), (rc, err.getvalue())
    print(len(imported), "core modules imported;", "skipped (integration not installed):", skipped)
"""


def test_the_core_imports_and_runs_without_the_lab(tmp_path):
    script = textwrap.dedent(CORE_ONLY.format(blocked=sorted(_extra("lab") | ALSO_LAB), lab=list(LAB),
                                              optional=sorted(set().union(*(_extra(e) for e in CORE_EXTRAS)))))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # Run from the checkout under test (its packages come first on sys.path, as under pytest).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "core modules imported" in done.stdout
