"""tools/check_layers.py and tools/check_mode_branches.py: tfdist's modules
import only downward through its layers, without cycles, and no module
branches on which modes are on beyond its written allowance."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import check_layers  # noqa: E402
import check_mode_branches  # noqa: E402


def run_tool(name, *args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / name), *args],
                          capture_output=True, text=True, timeout=120)


def test_tfdist_imports_only_downward_without_cycles():
    result = run_tool("check_layers.py")
    assert result.returncode == 0, result.stdout + result.stderr


def test_tfdist_has_no_mode_branch_beyond_its_allowance():
    result = run_tool("check_mode_branches.py")
    assert result.returncode == 0, result.stdout + result.stderr


def write_package(root, files):
    for name, source in files.items():
        path = root / "tfdist" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / "tfdist"


def test_an_upward_import_fails_naming_both_modules(tmp_path):
    package = write_package(tmp_path, {
        "__init__.py": "", "config.py": "from tfdist import cli\n", "cli.py": ""})
    found = check_layers.problems(package)
    assert len(found) == 1
    assert "config.py:1: tfdist.config (layer 1" in found[0]
    assert "imports tfdist.cli from a higher layer (9" in found[0]


def test_a_cycle_fails_naming_its_modules(tmp_path):
    package = write_package(tmp_path, {
        "__init__.py": "", "logs.py": "import tfdist.config\n",
        "config.py": "def f():\n    from tfdist import logs\n"})
    found = check_layers.problems(package)
    assert len(found) == 1
    assert "import cycle among tfdist.config, tfdist.logs" in found[0]
    assert "config.py:2" in found[0] and "logs.py:1" in found[0]


def test_a_module_no_layer_lists_fails(tmp_path):
    package = write_package(tmp_path, {"__init__.py": "", "novel.py": ""})
    found = check_layers.problems(package)
    assert found == [f"{package / 'novel.py'}:1: tfdist.novel is listed by no layer: "
                     "list it in exactly one layer of tools/check_layers.py"]


def test_mode_branches_are_counted_and_the_allowance_only_goes_down(tmp_path):
    path = tmp_path / "part.py"
    path.write_text(
        "def f(config, strategy, x, data):\n"
        "    if config.zero == 3:\n"                                  # 1
        "        pass\n"
        "    y = 1 if getattr(strategy, 'tensor_mesh', None) else 2\n"  # 2
        "    z = [v for v in x if self.mesh.tensor > 1]\n"            # 3
        "    while strategy.config.pipeline > 1 and x:\n"             # 4
        "        break\n"
        "    if x.data and data.tensor:\n"                             # not a config's
        "        pass\n")
    branches = check_mode_branches.mode_branches(path)
    assert [line for line, _ in branches] == [2, 4, 5, 6]
    found = {"tfdist/part.py": branches}
    assert check_mode_branches.problems(found, {"tfdist/part.py": 4}) == []
    over = check_mode_branches.problems(found, {"tfdist/part.py": 3})
    assert over[0].startswith("tfdist/part.py:2: 4 mode branches, 3 allowed: config.zero == 3")
    under = check_mode_branches.problems(found, {"tfdist/part.py": 5})
    assert under == ["tfdist/part.py:1: 4 mode branches, fewer than the 5 allowed: lower "
                     "its allowance in tools/check_mode_branches.py to 4"]


def test_a_modes_own_module_may_branch_on_its_own_fields_only(tmp_path):
    path = tmp_path / "layouts.py"
    path.write_text(
        "def f(mesh, config):\n"
        "    if mesh.tensor > 1:\n"                # the tensor mode's own
        "        pass\n"
        "    if mesh.strategy.config.zero == 3:\n"  # another mode's
        "        pass\n")
    own = check_mode_branches.own_fields("tfdist/tensor/layouts.py")
    assert [line for line, _ in check_mode_branches.mode_branches(path, own)] == [4]
    assert [line for line, _ in check_mode_branches.mode_branches(path)] == [2, 4]


def test_a_cycle_through_a_package_init_fails(tmp_path):
    # Importing tfdist.engine.compute runs tfdist/engine/__init__.py first:
    # when that imports the step, which imports the pipeline's compute, which
    # imports tfdist.engine.compute, `import tfdist.pipeline.compute` alone fails.
    package = write_package(tmp_path, {
        "__init__.py": "",
        "engine/__init__.py": "from tfdist.engine.step import TrainStep\n",
        "engine/compute.py": "",
        "engine/step.py": "import tfdist.pipeline.compute\n",
        "pipeline/__init__.py": "",
        "pipeline/compute.py": "from tfdist.engine.compute import LocalCompute\n"})
    found = check_layers.problems(package)
    assert any("import cycle among tfdist.engine, tfdist.engine.step, tfdist.pipeline.compute"
               in line for line in found), found
