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
    for name in ("config", "launch", "tfjob", "profile", "version"):
        assert f"\n  {name} " in done.stdout
    assert "USAGE: tfdist [flags]" not in done.stdout + done.stderr


@pytest.mark.parametrize("command, flag", [("launch", "--workers"), ("tfjob", "--image"),
                                           ("config", "--microbatches")])
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
                        "launch, tfjob, profile, version"),
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
