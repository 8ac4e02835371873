"""The package's shape: no import cycle between its parts, and `layers/` holds only layers.

A cycle between two parts (say the communicator and the planner) means neither can be read,
tested or changed alone; the check parses the source rather than importing it, so an import
inside a function counts as much as one at the top of a module.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "syncsgd")
FACADE = "syncsgd"    # the root package: the pycaffe names, re-exported from the parts


def module_files():
    """{dotted module name: path} of every module of the package."""
    found = {}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in sorted(files):
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel)] = os.path.join(folder, name)
    return found


def unit(module):
    """The first-level part a dotted name belongs to: syncsgd.plan.costs -> syncsgd.plan."""
    return ".".join(module.split(".")[:2])


def imported_modules(path, module, is_package):
    """Dotted names of what a module imports (anywhere in it), with each `from X import name`
    given as (X, name) so that names of the root package can be told apart."""
    tree = ast.parse(open(path).read(), path)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                yield base, alias.name


def facade_names(files):
    """{name: unit} of what the root package re-exports from its parts."""
    names = {}
    for imported, name in imported_modules(files[FACADE], FACADE, True):
        if name and imported.startswith(FACADE + "."):
            names[name] = unit(imported)
    return names


def import_graph():
    """{unit: {imported unit: first importing module}} between the parts of syncsgd.

    The root package's own imports are left out: it is the facade that gathers every part.
    `from syncsgd import X` counts as an import of the part X comes from (a submodule, or the
    part the facade re-exports it from), or of the root's own constants (TRAIN, TEST).
    """
    files = module_files()
    units = {unit(m) for m in files}
    reexports = facade_names(files)
    graph = {u: {} for u in units}
    for module, path in files.items():
        if module == FACADE:
            continue
        is_package = os.path.basename(path) == "__init__.py"
        for imported, name in imported_modules(path, module, is_package):
            if imported == FACADE and name:
                target = (f"{FACADE}.{name}" if f"{FACADE}.{name}" in units
                          else reexports.get(name, FACADE))
            elif imported == FACADE or imported.startswith(FACADE + "."):
                target = unit(imported)
            else:
                continue
            source = unit(module)
            if target != source:
                graph[source].setdefault(target, module)
    return graph


def cycles(graph):
    """One cycle (a list of units, first repeated last) in each strongly connected group of
    more than one unit, by Tarjan's algorithm."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [shortest_cycle(graph, group) for group in groups]


def shortest_cycle(graph, group):
    """A shortest cycle through the smallest-named unit of a strongly connected group."""
    start = min(group)
    paths, frontier = {start: [start]}, [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return paths[v] + [start]
                if w in group and w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def describe(graph, cycle):
    return " -> ".join(cycle) + "\n" + "\n".join(
        f"    {a} -> {b} (in {graph[a][b]})" for a, b in zip(cycle, cycle[1:]))


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b": "a.x"}, "b": {"c": "b.y"}, "c": {"a": "c.z", "d": "c.z"}, "d": {}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    graph["c"].pop("a")
    assert cycles(graph) == []


def test_root_constants_count_as_their_own_unit_not_as_everything():
    graph = import_graph()
    assert FACADE in graph["syncsgd.net"]             # TRAIN / TEST
    assert graph[FACADE] == {}
    assert "syncsgd.solvers" in graph and "syncsgd.cli" in graph


def test_no_import_cycle_between_the_parts_of_syncsgd():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles between parts of syncsgd:\n" + "\n".join(
        describe(graph, c) for c in found)


def registers_or_bases_a_layer(path):
    """Whether a module registers a layer type (@register) or defines a layer base class."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for decorator in node.decorator_list:
            name = decorator.attr if isinstance(decorator, ast.Attribute) else \
                getattr(decorator, "id", None)
            if name == "register":
                return True
        if any(getattr(base, "id", getattr(base, "attr", None)) == "Layer"
               for base in node.bases):
            return True
    return False


def test_layers_holds_only_layer_types_and_their_bases():
    folder = os.path.join(PACKAGE, "layers")
    allowed = {"__init__.py", "registry.py", "base.py"}
    strays = sorted(name for name in os.listdir(folder)
                    if name.endswith(".py") and name not in allowed
                    and not registers_or_bases_a_layer(os.path.join(folder, name)))
    others = sorted(name for name in os.listdir(folder)
                    if not name.endswith(".py") and name != "__pycache__")
    assert not strays and not others, (
        f"syncsgd/layers/ should hold layer types only; move these elsewhere: {strays + others}")
