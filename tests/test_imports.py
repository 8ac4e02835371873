"""The package's shape: no import cycle between its parts, `layers/` holds only layers, and a
layer module is imported when a net names its type, found by the type it declares.

A cycle between two parts (say the communicator and the planner) means neither can be read,
tested or changed alone; the check parses the source rather than importing it, so an import
inside a function counts as much as one at the top of a module.
"""
import ast
import importlib
import json
import os
import subprocess
import sys

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "syncsgd")


def module_files(package):
    """{dotted module name: path} of every module of the package in folder `package`."""
    found = {}
    top = os.path.dirname(package)
    for folder, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in sorted(files):
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), top)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel)] = os.path.join(folder, name)
    return found


def unit(module):
    """The first-level part a dotted name belongs to: syncsgd.plan.costs -> syncsgd.plan."""
    return ".".join(module.split(".")[:2])


def parsed(path):
    with open(path) as f:
        return ast.parse(f.read(), path)


def imported_modules(path, module, is_package):
    """(module, name, bound name) of each import of a module (anywhere in it): `import X` gives
    (X, None, None), `from X import name as bound` gives (X, name, bound), relative imports
    resolved."""
    tree = parsed(path)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                yield base, alias.name, alias.asname or alias.name


def facade_names(files, root):
    """{name: unit} of what the root package re-exports from its parts."""
    names = {}
    for imported, _, bound in imported_modules(files[root], root, True):
        if bound and imported.startswith(root + "."):
            names[bound] = unit(imported)
    return names


def import_graph(package=PACKAGE):
    """{unit: {imported unit: first importing module}} between the parts of a package.

    The root package's own imports are left out: it is the facade that gathers every part (for
    syncsgd, the pycaffe names). `from syncsgd import X` counts as an import of the part X comes
    from (a submodule, or the part the facade re-exports it from), or of the root's own
    constants (TRAIN, TEST), a unit of its own.
    """
    root = os.path.basename(package)
    files = module_files(package)
    units = {unit(m) for m in files}
    reexports = facade_names(files, root)
    graph = {u: {} for u in units}
    for module, path in files.items():
        if module == root:
            continue
        is_package = os.path.basename(path) == "__init__.py"
        for imported, name, _ in imported_modules(path, module, is_package):
            if imported == root and name:
                target = (f"{root}.{name}" if f"{root}.{name}" in units
                          else reexports.get(name, root))
            elif imported == root or imported.startswith(root + "."):
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


def plant(folder, files):
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_graph_resolves_the_facade_relative_imports_and_imports_in_functions(tmp_path):
    plant(tmp_path / "pkg", {
        "__init__.py": "TRAIN = 0\nfrom pkg.net import Net as Graph\nfrom pkg.solvers import sgd\n",
        "net.py": "from pkg import TRAIN\nimport numpy\n",
        "solvers/__init__.py": "from pkg import Graph\nfrom . import sgd\n",
        "solvers/sgd.py": "from ..net import Net\n",
        "cli/__init__.py": "def main():\n    from pkg.solvers.sgd import step\n",
        "cli/__main__.py": "from pkg import cli\n",
    })
    graph = import_graph(str(tmp_path / "pkg"))
    assert graph == {"pkg": {}, "pkg.net": {"pkg": "pkg.net"},
                     "pkg.solvers": {"pkg.net": "pkg.solvers"},
                     "pkg.cli": {"pkg.solvers": "pkg.cli"}}
    assert cycles(graph) == []
    plant(tmp_path / "pkg", {"net.py": "def run():\n    import pkg.cli.tools\n"})
    assert cycles(import_graph(str(tmp_path / "pkg"))) == [["pkg.cli", "pkg.solvers", "pkg.net",
                                                            "pkg.cli"]]


def test_no_import_cycle_between_the_parts_of_syncsgd():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles between parts of syncsgd:\n" + "\n".join(
        describe(graph, c) for c in found)


def registers_or_bases_a_layer(path):
    """Whether a module registers a layer type (@register) or defines a layer base class."""
    for node in ast.walk(parsed(path)):
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


def not_layers(folder):
    """Files of a layers folder that neither register a layer type nor define a layer base."""
    allowed = {"__init__.py", "registry.py", "base.py", "__pycache__"}
    return sorted(name for name in os.listdir(folder) if name not in allowed and not (
        name.endswith(".py") and registers_or_bases_a_layer(os.path.join(folder, name))))


def test_not_layers_tells_a_helper_module_from_layer_modules(tmp_path):
    plant(tmp_path, {
        "__init__.py": "", "base.py": "class Layer:\n    pass\n",
        "relu.py": "from .registry import register\n@register\nclass ReLU(NeuronLayer):\n"
                   "    type = 'ReLU'\n",
        "neuron.py": "from . import base\nclass NeuronLayer(base.Layer):\n    pass\n",
        "gemm.py": "def gemm(a, b):\n    return a @ b\n",
        "data/notes.txt": "",
    })
    assert not_layers(tmp_path) == ["data", "gemm.py"]


def test_layers_holds_only_layer_types_and_their_bases():
    strays = not_layers(os.path.join(PACKAGE, "layers"))
    assert not strays, f"syncsgd/layers/ should hold layer types only; move these: {strays}"


def test_each_layer_module_declares_the_type_it_registers():
    """The registry finds a type's module by its `type = "..."` line, without importing it:
    importing each module must register exactly the type it declares."""
    from syncsgd.layers import registry
    declared = registry.declared_types()
    assert len(declared) > 90 and declared["Convolution"] == "syncsgd.layers.convolution"
    for name, module in declared.items():
        importlib.import_module(module)
        assert registry._REGISTRY[name].__module__ == module, (name, module)
    assert {t for t, cls in registry._REGISTRY.items() if not cls.internal} == set(declared)


def test_importing_syncsgd_imports_no_layer_module_a_net_did_not_ask_for(tmp_path):
    net = tmp_path / "net.prototxt"
    net.write_text('input: "data" input_shape { dim: 1 dim: 3 dim: 8 dim: 8 } '
                   'layer { name: "c" type: "Convolution" bottom: "data" top: "c" '
                   'convolution_param { num_output: 2 kernel_size: 3 } } '
                   'layer { name: "r" type: "ReLU" bottom: "c" top: "c" }')
    code = ("import json, sys, syncsgd; net = syncsgd.Net(sys.argv[1], syncsgd.TEST); "
            "print(json.dumps([m for m in sys.modules if m.startswith('syncsgd.layers.')]))")
    out = subprocess.run([sys.executable, "-c", code, str(net)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    loaded = set(json.loads(out.strip().splitlines()[-1]))
    assert {"syncsgd.layers.convolution", "syncsgd.layers.relu"} <= loaded
    assert not loaded & {"syncsgd.layers.multibox_loss", "syncsgd.layers.ctc_loss",
                         "syncsgd.layers.annotated_data", "syncsgd.layers.lstm"}
