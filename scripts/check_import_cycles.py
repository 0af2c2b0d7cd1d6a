"""Find import cycles between the modules of a package (every import, also the ones
inside functions: a lazy import hides a circle, it does not remove it).

    python scripts/check_import_cycles.py [PACKAGE_DIR ...]   # default: nemo_refit_reshard

Prints each cycle (a strongly connected group of modules) and exits 1 if there is one.
An edge goes to the module an import names: ``from .pkg import name`` to ``pkg`` (its
``__init__``) unless ``name`` is a submodule of it. A package's ``__init__`` importing
its own submodules is not a cycle (Python imports the package first by design).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir``."""
    base = package_dir.parent
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a (possibly relative) import inside ``module``."""
    if level == 0:
        return target or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``module`` imports (anywhere in its body)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    own_package = module if is_package else module.rpartition(".")[0]
    # A package's __init__ importing its own submodules, and a module importing its own
    # parent packages, are how Python packages work, not cycles.
    return {
        m
        for m in out
        if m in known
        and m != module
        and not (is_package and m.startswith(own_package + "."))
        and not (module.startswith(m + "."))
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    group.append(m)
                    if m == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def import_cycles(package_dirs: Iterable[Path]) -> list[list[str]]:
    """Every import cycle inside each of ``package_dirs``."""
    out = []
    for package_dir in package_dirs:
        files = module_files(package_dir)
        known = set(files)
        graph = {m: imports(m, p, known) for m, p in files.items()}
        out += cycles(graph)
    return out


def main(argv: list[str]) -> int:
    dirs = [Path(a) for a in argv] or [ROOT / "nemo_refit_reshard"]
    found = import_cycles(dirs)
    for group in found:
        print("import cycle: " + " <-> ".join(group))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
