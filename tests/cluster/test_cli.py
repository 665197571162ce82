"""The `tfdist` command for a first-time user: help, COMMAND's own flags, clear errors."""

import os
import subprocess
import sys

import pytest

import tfdist
from helpers import TFDIST


def tfdist_cli(*args, env=None):
    return subprocess.run([*TFDIST, *args], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["help"]])
def test_help_lists_every_command_with_one_line(args):
    done = tfdist_cli(*args)
    assert done.returncode == 0
    assert "usage: tfdist COMMAND" in done.stdout
    for name in ("config", "launch", "tfjob", "profile", "plan", "version"):
        assert f"\n  {name} " in done.stdout
    assert "USAGE: tfdist [flags]" not in done.stdout + done.stderr


@pytest.mark.parametrize("command, flag", [("launch", "--workers"), ("tfjob", "--image"),
                                           ("config", "--microbatches"),
                                           ("plan", "--memory-per-device")])
def test_command_help_shows_its_flags_and_an_example(command, flag):
    done = tfdist_cli(command, "--help")
    assert done.returncode == 0
    assert done.stdout.startswith(f"usage: tfdist {command} [flags]")
    assert f"  {flag} " in done.stdout and "Example:\n  tfdist " + command in done.stdout
    assert "--alsologtostderr" not in done.stdout  # absl's own flags stay out


def test_everything_after_the_program_belongs_to_it():
    done = tfdist_cli("launch", "--workers", "2", sys.executable, "-c",
                      "import sys; print(sys.argv[1:])", "--data", "2", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("['--data', '2', '--help']") == 2


def test_split_argv_keeps_flag_values_with_tfdist():
    # In a process of its own: the examples some tests import define absl
    # flags of the same names as the CLI's.
    code = ("from tfdist.cli import split_argv; print(split_argv(['tfdist', 'launch', "
            "'--chief', '--ps', '1', '--', 'a', '-x']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == str(
        (["tfdist", "launch", "--chief", "--ps", "1"], ["a", "-x"])), done.stderr


@pytest.mark.parametrize("args, code, message", [
    (["launch", "--config", "/nonexistent.json", "true"], 2,
     "tfdist launch: --config=/nonexistent.json: cannot read it (No such file or "
     "directory)."),
    (["frobnicate"], 2, "tfdist: unknown command 'frobnicate'; commands are config, "
                        "launch, tfjob, profile, plan, version"),
])
def test_errors_are_one_clear_line(args, code, message):
    done = tfdist_cli(*args)
    assert done.returncode == code
    assert message in done.stderr and "Traceback" not in done.stderr


def test_malformed_config_file_and_kubeconfig(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{bad")
    done = tfdist_cli("config", "--config", str(bad))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"tfdist config: --config={bad} is not valid JSON" in done.stderr
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nclusters: [bad\n")
    done = tfdist_cli("tfjob", "--name=a", "--image=i:1", "--submit", "python", "t.py",
                      env=dict(os.environ, KUBECONFIG=str(kubeconfig)))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "Cannot submit TFJob 'a': the kubeconfig is not valid YAML" in done.stderr


def test_parallel_config_from_bad_json_says_what_is_wrong():
    with pytest.raises(ValueError, match=r"ParallelConfig.from_json: `text` is not valid "
                                         r"JSON .*got '\{bad'"):
        tfdist.ParallelConfig.from_json("{bad")


PLANNED_MODEL = """
import keras

def build():
    model = keras.Sequential([keras.Input((32,))] + [keras.layers.Dense(128, "relu")
                                                     for _ in range(4)] + [keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss="mse")
    return model
"""


def test_plan_prints_a_config_that_launch_and_tfjob_take(tmp_path):
    (tmp_path / "planned.py").write_text(PLANNED_MODEL)
    plan = ["plan", "--model", "planned:build", "--devices", "4", "--batch-size", "32",
            "--device-flops", "1e10"]
    done = subprocess.run([*TFDIST, *plan, "--memory-per-device", "64MiB", "--zero", "3",
                           "--json"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    config = tfdist.ParallelConfig.from_json(done.stdout)
    assert config.zero == 3 and config.data * config.tensor * config.pipeline == 4
    (tmp_path / "plan.json").write_text(done.stdout)
    checked = tfdist_cli("config", "--config", str(tmp_path / "plan.json"))
    assert checked.returncode == 0 and tfdist.ParallelConfig.from_json(checked.stdout) == config
    table = subprocess.run([*TFDIST, *plan, "--memory-per-device", "64MiB", "--headroom", "0"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert table.returncode == 0 and "fit in 64.00 MiB per device" in table.stdout
    none_fit = subprocess.run([*TFDIST, *plan, "--memory-per-device", "1KiB", "--json"],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert none_fit.returncode == 2 and "Traceback" not in none_fit.stderr
    assert "tfdist plan: No configuration fits in memory_per_device=1.00 KiB" in none_fit.stderr
    missing = subprocess.run([*TFDIST, *plan, "--memory-per-device", "64MiB", "--model",
                              "planned:nothing"], capture_output=True, text=True, timeout=120,
                             cwd=tmp_path)
    assert missing.returncode == 2
    assert "--model='planned:nothing': 'planned' has no 'nothing'" in missing.stderr
