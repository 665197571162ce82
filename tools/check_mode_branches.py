"""Counts, per tfdist module, the conditionals that branch on which modes are on.

A *mode branch* is an `if` / `elif`, a conditional expression, a `while` or a
comprehension's `if` whose test reads a `ParallelConfig` field through a
config (`config.zero`, `self._config.tensor`, `strategy.config.pipeline`) or
the tensor mesh (`mesh`, `tensor_mesh`, `getattr(strategy, "tensor_mesh",
None)`) of a mode other than the module's own (`OWN`: the tensor modules may
ask the tensor mesh, the pipeline's its schedule). The rules on how modes
combine belong to `tfdist/config.py`; what each mode does to the model and
the step, and the choice of parts, to the table of modes
(`tfdist/engine/modes.py`). Every other module should take
what it needs when it is built and not ask which modes are on. `ALLOWED` is
the allowance per module, written down as the code stands: the check fails
when a module has more mode branches than its allowance (a new branch must be
argued for here), and when it has fewer (lower the allowance, so it only goes
down).

Exits 1 on either, 0 otherwise.

Example:

```
python tools/check_mode_branches.py            # checks tfdist/ against ALLOWED
python tools/check_mode_branches.py --list     # prints every mode branch
```
"""

import argparse
import ast
import collections
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tfdist"
sys.path.insert(0, str(ROOT))

from tfdist.config import ParallelConfig  # noqa: E402  (no TensorFlow import)

FIELDS = frozenset(field.name for field in dataclasses.fields(ParallelConfig))
MESH_NAMES = frozenset({"mesh", "tensor_mesh"})
# Modules whose job is the rules on modes: not counted.
RULES = ("tfdist/config.py", "tfdist/engine/modes.py")
# A mode's own modules (path prefixes) and its fields, the tensor mesh being
# the tensor mode's: a branch there on its own fields is its work, not a
# question of which modes are on; only other modes' fields count.
OWN = {
    "tfdist/tensor/": ("tensor", "vocab_parallel_classifier"),
    "tfdist/layers.py": ("tensor",),
    "tfdist/pipeline/": ("pipeline", "microbatches", "schedule", "virtual_stages",
                         "stage_boundaries", "remat"),
    "tfdist/optim/zero": ("zero", "zero3_unit_params"),
    "tfdist/engine/compression.py": ("compression", "compression_warmup"),
}
# Mode branches allowed per module (path from the repository's root).
ALLOWED: dict[str, int] = {}


def modes_read(test: ast.AST) -> set[str]:
    """The config fields the expression `test` reads through a config, with
    `tensor` for a read of the tensor mesh.

    Example:

    >>> sorted(modes_read(ast.parse("self._config.zero == 3 and mesh.data > 1", mode="eval")))
    ['tensor', 'zero']
    >>> modes_read(ast.parse("layer.built and x.data", mode="eval"))
    set()
    """
    found = set()
    for node in ast.walk(test):
        if isinstance(node, ast.Attribute):
            if node.attr in MESH_NAMES:
                found.add("tensor")
            receiver = ast.unparse(node.value).lower()
            if node.attr in FIELDS and receiver.endswith(("config", "cfg")):
                found.add(node.attr)
        elif isinstance(node, ast.Name) and node.id in MESH_NAMES:
            found.add("tensor")
        elif isinstance(node, ast.Constant) and node.value in MESH_NAMES:
            found.add("tensor")
    return found


def own_fields(name: str) -> frozenset:
    """The fields of the mode whose own module `name` (path from the
    package's parent) is: branching on them there is the mode's own work.

    Example:

    >>> sorted(own_fields("tfdist/tensor/layers.py"))
    ['tensor', 'vocab_parallel_classifier']
    """
    return frozenset(field for prefix, fields in OWN.items() if name.startswith(prefix)
                     for field in fields)


def mode_branches(path: pathlib.Path, own=frozenset()):
    """`(line, test source)` of every mode branch in the file at `path`
    (a test reading a mode other than the `own` fields), in line order."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = node.ifs
        else:
            continue
        found.extend((test.lineno, ast.unparse(test)) for test in tests
                     if modes_read(test) - own)
    return sorted(found)


def count(package=PACKAGE) -> dict[str, list]:
    """Every counted module's mode branches, by path from the package's parent."""
    found = collections.defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package.parent).as_posix()
        if name not in RULES:
            found[name].extend(mode_branches(path, own_fields(name)))
    return {name: branches for name, branches in found.items() if branches}


def problems(found: dict[str, list], allowed=ALLOWED) -> list[str]:
    """Every module whose count differs from its allowance, in words.

    Example:

    >>> problems({"tfdist/a.py": [(3, "config.zero")]}, allowed={})
    ['tfdist/a.py:3: 1 mode branch, 0 allowed: config.zero']
    """
    out = []
    for name in sorted(set(found) | set(allowed)):
        branches, allowance = found.get(name, []), allowed.get(name, 0)
        if len(branches) > allowance:
            listed = "; ".join(source for _, source in branches)
            out.append(f"{name}:{branches[0][0]}: {len(branches)} mode "
                       f"branch{'es' if len(branches) != 1 else ''}, {allowance} allowed: "
                       f"{listed}")
        elif len(branches) < allowance:
            out.append(f"{name}:1: {len(branches)} mode "
                       f"branch{'es' if len(branches) != 1 else ''}, fewer than the "
                       f"{allowance} allowed: lower its allowance in "
                       f"tools/check_mode_branches.py to {len(branches)}")
    return out


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every mode branch")
    args = parser.parse_args(argv)
    found = count()
    if args.list:
        for name, branches in found.items():
            for line, source in branches:
                print(f"{name}:{line}: {source}")
        total = sum(map(len, found.values()))
        print(f"{total} mode branches in {len(found)} modules")
    out = problems(found)
    for line in out:
        print(line)
    return 1 if out else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
