"""The package's modules import each other without a cycle: every import statement counts,
at module level or inside a function, absolute or relative."""

import ast
import os

import cupy_rmsnorm

PACKAGE = "cupy_rmsnorm"
ROOT = os.path.dirname(os.path.abspath(cupy_rmsnorm.__file__))


def _modules():
    """{module name: path} of every Python file of the package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join([PACKAGE] + parts)] = path
    return found


def _imports(module, path, modules):
    """The package's modules that ``module`` imports anywhere in its file."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:      # `from . import x` imports the module x if there is one
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
    return {t for t in targets if t in modules and t != module}


def _graph():
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_graph_sees_the_package():
    graph = _graph()
    assert f"{PACKAGE}._pipeline" in graph[f"{PACKAGE}.ops.forward"]      # a relative import
    assert f"{PACKAGE}._torch" in graph[f"{PACKAGE}.ops.forward"]         # inside a function
    assert f"{PACKAGE}.ops.forward" in graph[f"{PACKAGE}.ops"]            # `from . import forward`


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_shared_layers_never_import_a_family_or_the_torch_layer():
    """The pipeline, interop, layout, plan and launch layers take a family's spec as data: they
    import no family, and no torch layer (the families bind their torch ops themselves)."""
    graph = _graph()
    torch_layer = {f"{PACKAGE}._torch", f"{PACKAGE}.torch"}
    for module, targets in graph.items():
        if module.startswith((f"{PACKAGE}.ops", f"{PACKAGE}.bench", f"{PACKAGE}.hf")) or module in torch_layer \
                or module == PACKAGE:
            continue
        families = {t for t in targets if t.startswith(f"{PACKAGE}.ops")}
        assert not targets & torch_layer and not families, f"{module} imports {(targets & torch_layer) | families}"


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
