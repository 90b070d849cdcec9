"""The package's import graph: imports flow one way (no cycle, not even one hidden inside a
function), at the top of each module, and no module imports another's private name."""

from __future__ import annotations

import ast
from pathlib import Path

import fisherprune

SRC = Path(fisherprune.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out: dict[str, Path] = {}
    for path in SRC.rglob("*.py"):
        parts = ["fisherprune", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, str, bool]]:
    """``(module imported, name imported, at the top of the file)`` for each fisherprune
    import of ``path``; ``from pkg import sub`` counts as importing the submodule."""
    tree = ast.parse(path.read_text())
    top = set(tree.body)
    found: list[tuple[str, str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fisherprune"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                target = sub if sub in modules else node.module
                found.append((target, alias.name, node in top))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fisherprune"):
                    found.append((alias.name, "", node in top))
    return found


def test_no_import_cycle_no_hidden_import_no_private_import() -> None:
    """Peeling off modules whose fisherprune imports are all peeled empties the package (so
    there is no cycle); every fisherprune import sits at the top of its file; no module
    imports a ``_private`` name of another module."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    nested: list[str] = []
    private: list[str] = []
    for name, path in modules.items():
        edges = set()
        for target, imported, at_top in _imports(path, modules):
            if not at_top:
                nested.append(f"{name} imports {target}")
            if imported.startswith("_") and not imported.startswith("__") and target != name:
                private.append(f"{name} imports {target}.{imported}")
            if target != name:
                edges.add(target)
        graph[name] = edges
    assert len(graph) > 40  # the scan saw the package
    assert nested == [], nested
    assert private == [], private
    done: set[str] = set()
    while len(done) < len(graph):
        ready = {m for m in graph if m not in done and graph[m] <= done}
        assert ready, f"import cycle among {sorted(set(graph) - done)}"
        done |= ready


def test_starting_the_command_line_leaves_the_slow_distributed_modules_unimported() -> None:
    """Loading the CLI (what ``fisherprune --version`` does) imports neither
    ``torch.distributed.checkpoint`` nor FSDP: they cost ~0.7 s and only sharded recovery
    uses them, so ``fisherprune.recover`` imports them where it calls them."""
    import subprocess
    import sys

    probe = (
        "import sys, fisherprune.cli.main, fisherprune.recover\n"
        "slow = ('torch.distributed.checkpoint', 'torch.distributed.fsdp', "
        "'torch.distributed.tensor')\n"
        "print(sorted(m for m in sys.modules if m.startswith(slow)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out
