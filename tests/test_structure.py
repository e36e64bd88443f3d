"""The package's shape, read from its source with `ast` (nothing is imported): the wings import down their order
only, no import cycle among flashdraft's modules, no module over 600 lines unless its docstring says why, no
function over 80 lines.

Data flows one way (prompts → completions → cache → training → checkpoint → evaluation → report, docs/design.md):
an import up the wing order, or a cycle, would mean a stage reads a later one. Imports at module level are checked
apart from all imports (inside functions and `if TYPE_CHECKING:` too): a deferred import still is a dependency,
only one resolved later. A module's reason to be longer is a sentence of its docstring containing STATED_REASON,
e.g. "over 600 lines because the drafter is one file, like the reference".
Each failure lists every offender as file:line name.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flashdraft"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
STATED_REASON = "over 600 lines because"

# The wings, lowest first: a module imports its own wing and those before it, never one after (docs/design.md).
# The components (target, drafter, decoding, serving) come before the stages that use them (data, evaluation,
# training); evaluation precedes training because training's held-out τ is evaluation's offline walk.
SHARED = ("errors", "files", "safe_load", "progress", "stop", "distributed")
WING_ORDER = (
    "shared",
    "target",
    "drafter",
    "decoding",
    "serving",
    "data",
    "evaluation",
    "train",
    "top",
    "commands",
    "cli",
)
TOP = ("api", "demo", "doctor")  # what the commands call; above them only the parser and the package itself
CLI = ("cli", "__main__")
MAX_ROOT_MODULES = 15


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # parsed once for the file's tests (nothing changes the trees)
def sources() -> dict[str, tuple[Path, ast.Module]]:
    """Every module of the package: name -> (path, syntax tree)."""
    return {module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The flashdraft modules an import statement names: `from a import b` is module a.b where that is one, else a;
    relative imports resolved against `module`. The packages above a module (run by Python first) are not counted:
    they are not what the statement asks for."""
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    found = set()
    for name in candidates:
        while name and name not in known:  # `import flashdraft.data.cache.x` names the module that exists
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_graph(deferred: bool) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first such import}; module-level imports only, or with `deferred`
    also those inside functions and `if TYPE_CHECKING:` blocks."""
    modules = sources()
    known = set(modules)
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}

    def visit(node: ast.AST, name: str, is_package: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not deferred:
                continue
            if (
                isinstance(child, ast.If)
                and isinstance(child.test, ast.Name)
                and child.test.id == "TYPE_CHECKING"
                and not deferred
            ):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in imported(child, name, is_package, known):
                    graph[name].setdefault(target, child.lineno)
            visit(child, name, is_package)

    for name, (path, tree) in modules.items():
        visit(tree, name, path.name == "__init__.py")
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [one_cycle(graph, component) for component in components]


def one_cycle(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest path back to the component's first module, through the component: [a, b, ..., a]."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return paths[v] + [start]
                if w in component and w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    modules = sources()
    steps = [
        f"{modules[a][0].relative_to(PACKAGE.parent)}:{graph[a][b]} imports {b}"
        for a, b in zip(cycle, cycle[1:], strict=False)
    ]
    return " -> ".join(cycle) + "\n    " + "\n    ".join(steps)


def wing_of(module: str) -> str:
    """The wing a module lives in: its subpackage, or for a module at the root "shared", "top" or "cli"."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in CLI:
        return "cli"
    if parts[1] in TOP:
        return "top"
    if parts[1] in SHARED:
        return "shared"
    if parts[1] in WING_ORDER:
        return parts[1]
    raise AssertionError(f"{module}: in no wing of WING_ORDER ({', '.join(WING_ORDER)}) and not a shared or top module")


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    modules = sources()
    found = []
    for importer, targets in sorted(graph.items()):
        for imported_module, line in sorted(targets.items()):
            low, high = wing_of(imported_module), wing_of(importer)
            if WING_ORDER.index(low) > WING_ORDER.index(high):
                where = modules[importer][0].relative_to(PACKAGE.parent)
                found.append(f"{where}:{line} imports {imported_module} ({high} -> {low}, up the wing order)")
    return found


def test_every_module_lives_in_a_known_wing():
    for name in sources():
        assert wing_of(name) in WING_ORDER, name
    wings = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert wings == set(WING_ORDER) - {"shared", "top", "cli"}, f"wing folders {sorted(wings)} against WING_ORDER"


def test_imports_run_down_the_wing_order_only():
    found = upward_imports(import_graph(deferred=True))
    assert not found, "imports against the wing order:\n" + "\n".join(found)


def test_the_wing_check_names_an_upward_import():
    # a target module importing evaluation is named with its file and line; the reverse is fine
    graph = {
        "flashdraft.target.model": {"flashdraft.evaluation.offline": 7},
        "flashdraft.evaluation.offline": {"flashdraft.target.model": 3},
    }
    assert upward_imports(graph) == [
        "flashdraft/target/model.py:7 imports flashdraft.evaluation.offline (target -> evaluation, up the wing order)"
    ]


def test_the_root_holds_at_most_15_modules_each_shared_top_or_cli():
    root = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert len(root) <= MAX_ROOT_MODULES, root
    assert set(root) <= set(SHARED + TOP + CLI), sorted(set(root) - set(SHARED + TOP + CLI))


def test_no_import_cycle_among_module_level_imports():
    graph = import_graph(deferred=False)
    found = [describe(c, graph) for c in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_no_import_cycle_even_through_imports_inside_functions():
    graph = import_graph(deferred=True)
    found = [describe(c, graph) for c in cycles(graph)]
    assert not found, "import cycles (through imports inside functions or TYPE_CHECKING blocks):\n" + "\n".join(found)


def test_the_import_graph_sees_module_level_and_deferred_imports():
    # the checks above are only as good as the graph: known edges of both kinds are in it
    top, every = import_graph(deferred=False), import_graph(deferred=True)
    assert "flashdraft.data.completions" in top["flashdraft.data.cache"]  # `from flashdraft.data.completions import`
    assert "flashdraft.data.cache_reader" not in top["flashdraft.evaluation.records"]  # imported inside a function
    assert "flashdraft.data.cache_reader" in every["flashdraft.evaluation.records"]
    assert "flashdraft.api" in every["flashdraft"] and "flashdraft.api" not in top["flashdraft"]  # TYPE_CHECKING
    assert cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == [["a", "b", "c", "a"]]


def long_modules() -> list[str]:
    found = []
    for path, tree in sources().values():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES and STATED_REASON not in (ast.get_docstring(tree) or ""):
            where = path.relative_to(PACKAGE.parent)
            found.append(f"{where}:1 {lines} lines, no '{STATED_REASON} ...' in its docstring")
    return found


def long_functions() -> list[str]:
    found = []
    for path, tree in sources().values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} {lines} lines")
    return found


def test_every_module_is_at_most_600_lines_or_says_why():
    found = long_modules()
    assert not found, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(found)


def test_every_function_is_at_most_80_lines():
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)
