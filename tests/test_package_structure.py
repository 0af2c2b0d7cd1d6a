"""The package's shape: no import cycle between its modules, no module importing another
module's private (underscore) names, and layers 1-3 free of torch.distributed and of
the layers above them. Read from the source with ``ast``, so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "nemo_refit_reshard"
PACKAGE = "nemo_refit_reshard"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, list[str], bool]]:
    """``(imported module, names, at module level outside TYPE_CHECKING)`` per import of
    the package's own modules; ``from pkg import sub`` counts as importing ``pkg.sub``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    out: list[tuple[str, list[str], bool]] = []
    top_level = {id(n) for n in tree.body}
    guarded = {
        id(n)
        for stmt in tree.body
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test)
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        eager = id(node) in top_level and id(node) not in guarded
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            if not target.startswith(PACKAGE):
                continue
            names = [a.name for a in node.names]
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            out.append((target, [n for n in names if f"{target}.{n}" not in MODULES], eager))
            out.extend((s, [], eager) for s in subs)
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], eager) for a in node.names if a.name.startswith(PACKAGE))
    return out


def test_no_module_imports_a_private_name_of_another() -> None:
    offenders = [
        f"{module} imports {name} from {target}"
        for module in MODULES
        for target, names, _ in _imports(module)
        for name in names
        if name.startswith("_") and target != module
    ]
    assert offenders == []


def test_no_import_cycle() -> None:
    """Every import of the package's own modules, lazy ones (inside functions) and
    TYPE_CHECKING ones included, forms no cycle, packages' ``__init__`` re-exports
    aside (a package importing its own submodules is how it exposes them)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, _ in _imports(module):
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != module:
                if MODULES[module].name == "__init__.py" and target.startswith(module + "."):
                    continue  # the package re-exports its own submodule
                if MODULES[target].name == "__init__.py" and module.startswith(target + "."):
                    continue  # a submodule importing through its own package's __init__
                graph[module].add(target)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert cycles == []


@pytest.mark.parametrize("layer", ["spec", "layouts", "plan"])
def test_layers_1_to_3_need_no_process_group_and_no_layer_above(layer: str) -> None:
    """Layers 1-3 run anywhere: no torch.distributed, no engine or integrations."""
    above = ("engine", "integrations", "runner", "cli", "grpo_cpu")
    offenders = []
    for module, path in MODULES.items():
        if not module.startswith(f"{PACKAGE}.{layer}"):
            continue
        text = path.read_text()
        if "torch.distributed" in text:
            offenders.append(f"{module}: torch.distributed")
        for target, _, _ in _imports(module):
            if any(target.startswith(f"{PACKAGE}.{a}") for a in above):
                offenders.append(f"{module} imports {target}")
    assert offenders == []
