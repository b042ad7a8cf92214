"""The folder tree is the pipeline (docs/architecture.md): imports point one way.

    engine  <-  heads  <-  precompute  <-  evaluation  <-  train

A module may import its own layer or any layer to its left, never to its right; nothing
imports train. Lazy imports inside functions count the same as top-level ones.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["engine", "heads", "precompute", "evaluation", "train"]


def layer_of_module(mod: str) -> str | None:
    """Dotted module name -> its layer, None for anything outside the project."""
    parts = mod.split(".")
    top = parts[0]
    if top == "inference_eval":
        if len(parts) > 1 and parts[1] in ("engine", "hydra_app"):
            return "engine"
        return "evaluation"  # evaluation/, the eval and generate CLIs
    return top if top in ("heads", "precompute", "train") else None


def layer_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    mod = ".".join(p for p in rel.parts if p != "__init__")
    return layer_of_module(mod) or ""


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = list(path.relative_to(ROOT).parent.parts)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            # `from inference_eval import engine` names a subpackage, not an attribute
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names if a.name != "*"]
    return out


def project_files() -> list[Path]:
    return [p for d in ("inference_eval", "heads", "precompute", "train")
            for p in sorted((ROOT / d).rglob("*.py"))]


def violations(files: list[Path]) -> list[str]:
    """One line per offending import statement: file:line (layer) imports module (layer)."""
    bad: dict[tuple[str, int], str] = {}
    for f in files:
        mine = LAYERS.index(layer_of_file(f))
        for line, mod in imported_modules(f):
            theirs = layer_of_module(mod)
            key = (str(f.relative_to(ROOT)), line)
            if theirs is not None and LAYERS.index(theirs) > mine and key not in bad:
                bad[key] = f"{key[0]}:{line} ({LAYERS[mine]}) imports {mod} ({theirs})"
    return sorted(bad.values())


def test_imports_point_one_way():
    assert violations(project_files()) == []


def test_every_project_file_has_a_layer():
    assert all(layer_of_file(f) in LAYERS for f in project_files())


@pytest.mark.parametrize("where, line, layer", [
    ("heads/_probe.py", "from train.config import TrainConfig", "train"),
    ("inference_eval/engine/_probe.py", "import heads.base", "heads"),
    ("inference_eval/engine/_probe.py", "def f():\n    from inference_eval.evaluation import metrics",
     "evaluation"),
    ("precompute/_probe.py", "from inference_eval.evaluation.prompts import load_prompts",
     "evaluation"),
])
def test_a_wrong_way_import_is_caught(tmp_path, monkeypatch, where, line, layer):
    """The check must fail on the kind of import it exists to stop (heads importing train)."""
    probe = ROOT / where
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: line
                        if self == probe else Path.read_bytes(self).decode())
    found = violations([probe])
    assert len(found) == 1 and found[0].endswith(f"({layer})")


def module_graph() -> dict[str, set[str]]:
    """module -> project modules it imports (names that are packages map to their __init__)."""
    names = {}
    for f in project_files():
        rel = f.relative_to(ROOT).with_suffix("")
        names[".".join(p for p in rel.parts if p != "__init__")] = f
    graph = {}
    for mod, f in names.items():
        deps = set()
        for _, imp in imported_modules(f):
            while imp and imp not in names:
                imp = imp.rpartition(".")[0]
            if imp and imp != mod:
                deps.add(imp)
        graph[mod] = deps
    return graph


def folder_of(mod: str) -> str:
    return mod.rpartition(".")[0] if mod.count(".") else mod


def test_no_import_circle_between_folders():
    """Folders (packages) form a DAG: no folder imports one that imports it back."""
    edges: dict[str, set[str]] = {}
    for mod, deps in module_graph().items():
        a = folder_of(mod)
        for d in deps:
            b = folder_of(d)
            if a != b and not d.startswith(a + ".") and not a.startswith(b + "."):
                edges.setdefault(a, set()).add(b)
    seen, stack, cycles = set(), [], []

    def visit(node):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            visit(nxt)
        stack.pop()

    for n in sorted(edges):
        visit(n)
    assert cycles == []
