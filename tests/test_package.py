"""The package's structure: no import cycles among ulbtorch's modules, and
ulbtorch.nn independent of the integrations. Read from the sources with
ast, every import counted, function-level ones too."""
import ast
from pathlib import Path

import ulbtorch

PACKAGE = Path(ulbtorch.__file__).parent


def _module_name(path: Path) -> str:
    parts = ("ulbtorch",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The ulbtorch modules that module `name` imports anywhere in its source
    (`from . import x` counts as importing x where x is a module)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    deps = set()
    for target in found:
        # `import ulbtorch.a.b` imports the packages above b as well
        parts = target.split(".")
        deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in known)
    deps.discard(name)
    return deps


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []  # state: 1 on the current path, 2 done

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def _without_ancestors(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph without the edges from a module to the packages above it:
    `from . import x` in ulbtorch/ops.py reads as an import of ulbtorch, but
    the package's __init__ has run before any of its modules does; what
    counts is the module it names (x)."""
    return {name: {d for d in deps if not name.startswith(d + ".")} for name, deps in graph.items()}


def test_the_graph_sees_function_level_and_relative_imports():
    graph = _graph()
    assert "ulbtorch.ops" in graph["ulbtorch.nn.linear"]  # `from .. import ops`
    assert "ulbtorch._lib" in graph["ulbtorch.ops"]
    assert "ulbtorch.nn" in graph["ulbtorch.hugepages"]  # inside a function


def test_no_import_cycles():
    cycle = _find_cycle(_without_ancestors(_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_nn_does_not_import_the_integrations():
    graph = _graph()
    wrong = {name: sorted(d for d in deps if d.startswith("ulbtorch.integrations"))
             for name, deps in graph.items() if name == "ulbtorch.nn" or name.startswith("ulbtorch.nn.")}
    assert not any(wrong.values()), {k: v for k, v in wrong.items() if v}


def test_only_the_binding_module_loads_the_library():
    """ulbtorch._lib is the one module that binds the kernel library with ctypes."""
    users = [name for name, path in _modules().items() if "CDLL(" in path.read_text()]
    assert users == ["ulbtorch._lib"]
