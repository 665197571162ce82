"""Fails when tfdist touches a Keras or TensorFlow internal outside `tfdist/_compat/`.

Every use of a private Keras / TensorFlow API lives in `tfdist/_compat/` (see
docs/architecture.md), so that upgrading Keras or TensorFlow means auditing
that package only. This check reports, as `file:line: name`, anywhere else in
`tfdist/`:

- an import of `keras.src...` or `tensorflow.python...`;
- a private attribute `x._name` (or `getattr(x, "_name")` and its `setattr`,
  `hasattr`, `delattr` kin) where `x` is not `self` / `cls` and `_name` is not
  a name tfdist defines itself: a function or class, a `self._name =` /
  `cls._name =` attribute, a module- or class-level `_name =`, or an attribute
  in tfdist's own `_tfdist...` namespace. Dunder names and named tuples'
  `_replace`, `_asdict`, ... are public, as is Python's documented `os._exit`.

Exits 1 if anything is found, 0 otherwise.

Example:

```
python tools/check_internals.py          # checks tfdist/
python tools/check_internals.py tfdist/strategy.py
```
"""

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tfdist"
COMPAT = PACKAGE / "_compat"
PRIVATE_MODULES = ("keras.src", "tensorflow.python")
OWN_NAMESPACE = "_tfdist"
_ATTRIBUTE_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}
# Named tuples' public API, underscored so as not to clash with field names.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
# Python's own documented names that start with an underscore.
PYTHON_API = {"_exit"}


def is_private(name: str) -> bool:
    """Whether `name` is private: one leading underscore, not a dunder.

    Example:

    >>> is_private("_value"), is_private("__class__"), is_private("value")
    (True, False, False)
    """
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def python_files(paths):
    """Every `.py` file under `paths` (files or directories), sorted."""
    for path in paths:
        path = pathlib.Path(path)
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def own_private_names(package=PACKAGE, compat=COMPAT) -> set[str]:
    """The private names `package` defines itself, outside `compat`.

    Example:

    >>> "_StepOwner" in own_private_names()
    True
    """
    names = set()
    for path in python_files([package]):
        if compat in path.parents:
            continue
        tree = ast.parse(path.read_text(), str(path))
        scopes = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for body in scopes:
            for node in body:
                targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and _is_self_or_cls(node.value)):
                names.add(node.attr)
    return {name for name in names if is_private(name)}


def _is_self_or_cls(node) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def violations(path, own_names):
    """`(line, name)` of each internal `path` touches, in source order.

    Example:

    ```python
    violations(pathlib.Path("tfdist/strategy.py"), own_private_names())   # []
    ```
    """
    tree = ast.parse(pathlib.Path(path).read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_private_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and _is_private_module(node.module or ""):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Attribute) and not _is_self_or_cls(node.value):
            if _is_foreign(node.attr, own_names):
                found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _ATTRIBUTE_FUNCTIONS and len(node.args) >= 2
              and not _is_self_or_cls(node.args[0])
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _is_foreign(node.args[1].value, own_names)):
            found.append((node.lineno, node.args[1].value))
    return sorted(found)


def _is_private_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in PRIVATE_MODULES)


def _is_foreign(name: str, own_names) -> bool:
    return (is_private(name) and name not in own_names and name not in NAMEDTUPLE_API
            and name not in PYTHON_API and not name.startswith(OWN_NAMESPACE))


def main(argv) -> int:
    paths = [pathlib.Path(p).resolve() for p in argv] or [PACKAGE]
    own_names = own_private_names()
    report = []
    for path in python_files(paths):
        if COMPAT in path.parents:
            continue
        shown = path.relative_to(ROOT) if ROOT in path.parents else path
        report += [f"{shown}:{line}: {name}" for line, name in violations(path, own_names)]
    for line in report:
        print(line)
    if report:
        print(f"{len(report)} use(s) of Keras / TensorFlow internals outside tfdist/_compat/; "
              f"move each into a named function there.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
