"""Fails when a tfdist module imports from a higher layer, or imports form a cycle.

tfdist's modules are listed in `LAYERS`, lowest first. A module may import
modules of its own layer or of lower ones (function-level imports count the
same as the module's own); no chain of imports may come back to where it
started. A module no layer lists is an error too, so a new module is placed
when it is written. This reports, as `file:line: message`:

- an import of a module in a higher layer;
- an import cycle (the modules in it, and where each imports the next);
  importing `a.b.c` imports the packages `a.b` and `a` too (their
  `__init__` runs first), unless the importing module is inside them;
- a module that no layer lists, or that two list.

Exits 1 if anything is found, 0 otherwise.

Example:

```
python tools/check_layers.py            # checks tfdist/
python tools/check_layers.py --graph    # prints each module's layer and imports
```
"""

import argparse
import ast
import fnmatch
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tfdist"

# (name, module patterns), lowest first. A pattern is a dotted module name,
# or `package.*` for every module in that package (not the package itself);
# a module listed by name is in that layer, whatever a `package.*` says.
LAYERS = (
    ("Keras / TensorFlow internals", ("tfdist._compat", "tfdist._compat.*")),
    ("foundations: the config, logs, task environment, cluster plumbing",
     ("tfdist", "tfdist.config", "tfdist.logs", "tfdist.devices", "tfdist.input_options",
      "tfdist.sparse_gradients", "tfdist.weight_files",
      "tfdist.trace_phases", "tfdist.profiling", "tfdist.engine.metrics",
      "tfdist.pipeline.schedule", "tfdist.ps.ledger", "tfdist.cluster", "tfdist.cluster.*",
      # packages whose __init__ imports nothing: importing any of their
      # modules initialises them first, from whatever layer
      "tfdist.engine", "tfdist.pipeline")),
    ("element shards: layouts, storage, their collectives, checkpoints",
     ("tfdist.sharding", "tfdist.sharding.layout", "tfdist.sharding.storage",
      "tfdist.sharding.keys", "tfdist.sharding.slots", "tfdist.sharding.wire",
      "tfdist.sharding.collectives",
      "tfdist.sharding.replica_state",
      "tfdist.checkpoint")),
    ("tensor parallelism", ("tfdist.tensor", "tfdist.tensor.*", "tfdist.layers",
                            "tfdist.batch_statistics")),
    ("the step's generic parts",
     ("tfdist.engine.microbatch", "tfdist.engine.moving_statistics", "tfdist.engine.compute",
      "tfdist.engine.reduce", "tfdist.engine.compression", "tfdist.engine.update")),
    ("pipeline stages", ("tfdist.pipeline.*",)),
    ("sharded optimizer state and parameters", ("tfdist.optim", "tfdist.optim.*")),
    ("assembling a step from the config",
     ("tfdist.sharding.creation", "tfdist.sharding.activations", "tfdist.sharding.peak",
      "tfdist.engine.build",
      "tfdist.engine.modes", "tfdist.engine.tf_keras", "tfdist.engine.step",
      "tfdist.model_garden", "tfdist.usage_checks", "tfdist.step_time",
      "tfdist.planning")),
    ("strategies and callbacks",
     ("tfdist.strategy", "tfdist.chief", "tfdist.ps", "tfdist.ps.*", "tfdist.callbacks",
      "tfdist.callbacks.*", "tfdist.plan_trials")),
    ("the command line", ("tfdist.cli",)),
)


def module_name(path: pathlib.Path, package=PACKAGE) -> str:
    """The dotted name of the module at `path` inside `package`.

    Example:

    >>> module_name(PACKAGE / "engine" / "build.py")
    'tfdist.engine.build'
    >>> module_name(PACKAGE / "engine" / "__init__.py")
    'tfdist.engine'
    """
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, modules: set[str], package=PACKAGE):
    """`(line, imported module)` for every import of a tfdist module in the
    file at `path`, at any depth: `from a import b` names `a.b` when that is a
    module, else `a`."""
    name = module_name(path, package)
    own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                if target in modules:
                    yield node.lineno, target
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = own_package.split(".")[:len(own_package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base not in modules:
                continue
            for alias in node.names:
                yield node.lineno, (f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                                    else base)


def with_packages(found, module: str, modules: set[str]):
    """`found` (`(line, imported module)` pairs of `module`) with, after each,
    the packages Python initialises to import it: its parent packages that
    are not `module`'s own (those are initialised before `module` runs).

    Example:

    >>> list(with_packages([(3, "a.b.c")], "a.d", {"a", "a.b", "a.b.c", "a.d"}))
    [(3, 'a.b.c'), (3, 'a.b')]
    """
    own = {module.rsplit(".", k)[0] for k in range(module.count(".") + 1)}
    seen = set()
    for line, target in found:
        package = target
        while package:
            if package in modules and (package == target or package not in own) \
                    and (line, package) not in seen:
                seen.add((line, package))
                yield line, package
            package = package.rpartition(".")[0]


def layer_of(module: str, layers=LAYERS) -> list[int]:
    """The indices of the layers that list `module` by name or, if none
    does, by a `package.*` pattern (one, when it is placed right).

    Example:

    >>> layer_of("tfdist._compat.tf_graph"), layer_of("tfdist.pipeline.schedule")
    ([0], [1])
    """
    named = [k for k, (_, patterns) in enumerate(layers) if module in patterns]
    return named or [k for k, (_, patterns) in enumerate(layers)
                     if any(fnmatch.fnmatchcase(module, p) for p in patterns)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph` (module -> the modules it imports): each
    strongly connected group of more than one module, or one that imports
    itself, sorted.

    Example:

    >>> cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    [['a', 'b']]
    """
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def problems(package=PACKAGE, layers=LAYERS) -> list[str]:
    """Every violation in `package`, as `file:line: message` lines."""
    paths = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    modules = set(paths)
    found, graph, where = [], {}, {}
    for module, path in paths.items():
        placed = layer_of(module, layers)
        if len(placed) != 1:
            listed = ", ".join(repr(layers[k][0]) for k in placed) or "no layer"
            found.append(f"{path}:1: {module} is listed by {listed}: list it in exactly one "
                         f"layer of tools/check_layers.py")
    for module, path in paths.items():
        graph[module] = set()
        for line, target in with_packages(imports(path, modules, package), module, modules):
            if target == module:
                continue
            graph[module].add(target)
            where.setdefault((module, target), f"{path}:{line}")
            own, other = layer_of(module, layers), layer_of(target, layers)
            if len(own) == 1 and len(other) == 1 and other[0] > own[0]:
                found.append(f"{path}:{line}: {module} (layer {own[0]}, "
                             f"{layers[own[0]][0]}) imports {target} from a higher layer "
                             f"({other[0]}, {layers[other[0]][0]})")
    for group in cycles(graph):
        steps = [where[(a, b)] for a in group for b in sorted(graph[a]) if b in group]
        found.append(f"{steps[0]}: import cycle among {', '.join(group)} "
                     f"(imports at {', '.join(steps)})")
    return found


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", action="store_true",
                        help="print each module's layer and the tfdist modules it imports")
    parser.add_argument("--package", type=pathlib.Path, default=PACKAGE,
                        help="the package directory to check")
    args = parser.parse_args(argv)
    package = args.package.resolve()
    if args.graph:
        paths = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
        for module, path in paths.items():
            targets = sorted({t for _, t in imports(path, set(paths), package)} - {module})
            print(f"{layer_of(module)} {module}: {', '.join(targets)}")
    found = problems(package)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
