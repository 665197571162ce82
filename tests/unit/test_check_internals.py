"""tools/check_internals.py: tfdist touches Keras / TensorFlow internals only in
tfdist/_compat/, and the check names any use elsewhere."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "check_internals.py"


def run_check(*paths):
    return subprocess.run([sys.executable, str(CHECK), *map(str, paths)],
                          capture_output=True, text=True, timeout=120)


def test_tfdist_uses_internals_only_in_compat():
    result = run_check()
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("source, name", [
    ("from keras.src import tree\n", "keras.src"),
    ("import tensorflow.python.ops\n", "tensorflow.python.ops"),
    ("def f(layer):\n    return layer._inbound_nodes\n", "_inbound_nodes"),
    ("def f(v):\n    return getattr(v, '_distribute_strategy', None)\n",
     "_distribute_strategy"),
])
def test_a_violation_fails_naming_it(tmp_path, source, name):
    path = tmp_path / "module.py"
    path.write_text("import keras\n\n" + source)
    result = run_check(path)
    assert result.returncode == 1
    line = len(source.splitlines()) + 2
    assert f"module.py:{line}: {name}" in result.stdout


def test_own_and_public_names_pass(tmp_path):
    path = tmp_path / "module.py"
    path.write_text(
        "from tfdist.strategy import _StepOwner\n\n"
        "class A:\n"
        "    def __init__(self, other):\n"
        "        self._x = 1\n"
        "        other._config = 2            # a name tfdist defines\n"
        "        other.__class__.__name__     # dunder\n"
        "        other._tfdist_layout = self  # tfdist's namespace on Keras objects\n"
        "        other.entry._replace(loss=1) # named tuple API\n")
    result = run_check(path)
    assert result.returncode == 0, result.stdout
