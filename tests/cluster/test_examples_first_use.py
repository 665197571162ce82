"""The examples as a first-time user meets them: help, bad flags, what they print."""

import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parents[2] / "keras_examples"


def run(name, *flags):
    return subprocess.run([sys.executable, str(EXAMPLES / name), *flags],
                          capture_output=True, text=True, timeout=300)


# The examples that train Model Garden models (the `model-garden` extra).
MODEL_GARDEN_EXAMPLES = ("model_garden_bert.py", "orbit_loop.py")


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.model_garden] if name in MODEL_GARDEN_EXAMPLES else [])
    for name in sorted(str(p.relative_to(EXAMPLES))
                       for p in [*EXAMPLES.glob("*.py"), EXAMPLES / "tfjob/train.py"]
                       if p.name != "digits.py" and p.name != "generate.py")])
def test_help_exits_0_and_shows_the_flags(name):
    done = run(name, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^  --\w+: ", done.stdout, re.M), done.stdout
    assert "--helpfull" not in done.stdout and "USAGE:" not in done.stdout


def test_devices_0_names_the_flag():
    done = run("data_parallel.py", "--devices=0")
    assert done.returncode == 1
    assert "flag --devices=0: --devices (logical CPU devices to create) must be >= 1" \
        in done.stderr
    assert "`n`" not in done.stderr


def test_demo_says_what_it_does_and_ends_with_a_summary():
    done = run("data_parallel.py", "--devices=2", "--epochs=1")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Made 2 virtual CPU devices (tfdist.use_virtual_devices); "
                               "training an MLP on the handwritten digits")
    accuracy = re.search(r"^epoch 1: loss [\d.]+  accuracy ([\d.]+)", done.stdout, re.M)[1]
    assert "\nDone: 2 devices (CPU:0, CPU:1)\n  mode: data parallel x2, microbatches=1, " \
           "precision=float32, xla=False\n" in done.stdout
    assert f"  final accuracy: {accuracy}\nNext: keras_examples/" in done.stdout
    # tfdist runs nothing per replica eagerly (TensorFlow would warn of its cost).
    assert "eagerly" not in done.stderr, done.stderr


@pytest.mark.parametrize("zero, parameter_ratio", [(1, 1.0), (3, 0.25)])
def test_zero_example_prints_the_unsharded_bytes_and_the_ratio(zero, parameter_ratio):
    done = run("zero_adam.py", "--devices=4", f"--zero={zero}", "--epochs=1")
    assert done.returncode == 0, done.stderr[-2000:]
    # digits MLP: 85,002 float32 parameters; Adam's two slots of each.
    for unsharded, ratio in ((680_016, 0.25), (340_008, parameter_ratio)):
        match = re.search(rf"CPU:3=([\d,]+)  \(unsharded: {unsharded:,} per device; "
                          rf"ratio ([\d.]+)\)", done.stdout)
        assert match, done.stdout
        assert int(match[1].replace(",", "")) / unsharded == pytest.approx(float(match[2]),
                                                                          abs=0.005)
        assert float(match[2]) == pytest.approx(ratio, abs=0.01)
