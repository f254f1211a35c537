"""The layers depend on each other one way only: randattn (the core) <- probes (experiments) and randattn <- figures
(plots), with no import cycle anywhere. Every import counts, also those inside functions."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("randattn", "analysis", "probes", "figures", "bench")


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
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
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
    # randattn.cli is the console script, the one module above every layer (it dispatches probes, bench, figures).
    bad = sorted((m, d) for m, deps in _graph().items() if (m == layer or m.startswith(layer + ".")) and m != "randattn.cli"
                 for d in deps if d.split(".")[0] in forbidden)
    assert not bad, bad


def test_every_package_directory_is_installed():
    """pyproject lists its packages (the data folder installs as randattn_data): none may be left out."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(p.parent / "__init__.py") for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
    assert "randattn_data" in listed and (ROOT / "data" / "__init__.py").exists()
