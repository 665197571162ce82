"""The `tfdist` command's flags: one spelling (--kebab-case, --snake_case accepted
too), help written for each command, usage errors exit 2, quiet output."""

import re
import subprocess
import sys

import pytest

from helpers import PRINT_TF_CONFIG, run_tfdist

COMMANDS = ("config", "launch", "tfjob", "profile", "version")
_LONG_FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w-]*)")
# A line of TensorFlow's C++ log ("2026-01-01 00:00:00.000000: I ...", "I0000 ...").
TF_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] |[IWEF]\d{4} )",
                         re.MULTILINE)


def test_overview_and_every_command_help_exit_0_and_describe_it():
    overview = run_tfdist("--help")
    assert overview.returncode == 0 and "usage: tfdist COMMAND" in overview.stdout
    for name in COMMANDS:
        for spelling in ("--help", "--helpshort", "--helpfull"):
            done = run_tfdist(name, spelling)
            assert done.returncode == 0, (name, spelling, done.stderr)
            assert done.stdout.startswith(f"usage: tfdist {name} [flags]"), done.stdout
            assert f"Example:\n  tfdist {name}" in done.stdout
    assert run_tfdist("help", "tfjob").stdout.startswith("usage: tfdist tfjob [flags]")


def test_help_says_what_a_flag_does_for_its_command():
    profile = run_tfdist("profile", "--help").stdout
    assert "given to the pods" not in profile
    assert re.search(r"--logdir +TensorBoard log directory the traces are written to",
                     profile)
    assert "given to the pods (TFDIST_LOGDIR)" in run_tfdist("tfjob", "--help").stdout
    launch = run_tfdist("launch", "--help").stdout
    assert "task k gets this port + k" in launch
    assert "task k gets" not in run_tfdist("tfjob", "--help").stdout


def test_every_long_flag_in_every_help_is_kebab_case():
    for name in COMMANDS:
        text = run_tfdist(name, "--help").stdout
        listed = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
        names = _LONG_FLAG.findall(text)
        assert names or name == "version", name
        assert not [flag for flag in names if "_" in flag], (name, text)
        assert all("_" not in flag for flag in listed)
    assert not [f for f in _LONG_FLAG.findall(run_tfdist("--help").stdout) if "_" in f]


def test_both_spellings_of_every_flag_name_the_same_flag():
    # In a process of its own: the examples some tests import define absl
    # flags of the same names as the CLI's.
    code = """
from tfdist import cli
for name, command in cli.COMMANDS.items():
    for flag in command.flags:
        kebab = cli.spelled(flag)
        snake = "--" + flag
        assert cli.normalise(kebab + "=1") == cli.normalise(snake + "=1") == snake + "=1"
        if "_" in flag:
            assert kebab in cli.command_help(name), (name, kebab)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


def test_every_config_field_is_a_flag_with_its_description():
    # The flags are made from ParallelConfig's fields: a new field needs no
    # edit here. In a process of its own, as above.
    code = """
import dataclasses
from tfdist import cli
from tfdist.config import ParallelConfig
docs = ParallelConfig.field_docs()
for field in dataclasses.fields(ParallelConfig):
    for command in ("config", "launch", "tfjob"):
        assert field.name in cli.COMMANDS[command].flags, (command, field.name)
    assert cli.FLAGS[field.name].help.endswith(docs[field.name]), field.name
print(len(docs), len(dataclasses.fields(ParallelConfig)))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    counts = done.stdout.split()
    assert len(counts) == 2 and counts[0] == counts[1], done.stderr


@pytest.mark.parametrize("spelling", ["kebab", "snake"])
def test_both_spellings_are_accepted_by_the_commands(spelling, tmp_path):
    def flag(name, value=None):
        name = name.replace("_", "-") if spelling == "kebab" else name
        return f"--{name}" + ("" if value is None else f"={value}")

    config = run_tfdist("config", flag("pipeline", 2), flag("schedule", "interleaved"),
                        flag("virtual_stages", 2), flag("microbatches", 4),
                        flag("stage_boundaries", "a,b,c"))
    assert config.returncode == 0, config.stderr
    assert '"virtual_stages": 2' in config.stdout
    assert '"stage_boundaries": ["a", "b", "c"]' in config.stdout
    tensor = run_tfdist("config", "--tensor=2", flag("vocab_parallel_classifier"))
    assert tensor.returncode == 0, tensor.stderr
    assert '"vocab_parallel_classifier": true' in tensor.stdout
    zero3 = run_tfdist("config", flag("zero", 3), flag("zero3_unit_params", 100))
    assert zero3.returncode == 0 and '"zero3_unit_params": 100' in zero3.stdout, zero3.stderr
    tfjob = run_tfdist("tfjob", "--name=a", "--image=i:1", flag("gpus_per_worker", 1),
                       flag("profiler_port", 6009), flag("restart_policy", "Never"),
                       flag("backoff_limit", 3), "--", "python", "t.py")
    assert tfjob.returncode == 0, tfjob.stderr
    assert "restartPolicy: Never" in tfjob.stdout and "backoffLimit: 3" in tfjob.stdout
    assert "nvidia.com/gpu" in tfjob.stdout
    launch = run_tfdist("launch", flag("restart_on_failure", 1), flag("host_network"),
                        "--", *PRINT_TF_CONFIG)
    assert launch.returncode == 0, launch.stderr
    assert "private network" not in launch.stdout  # --host-network took effect
    profile = run_tfdist("profile", "--tasks=h:1", f"--logdir={tmp_path}",
                         flag("duration_ms", 0))
    assert profile.returncode == 2 and "`duration_ms` must be an int > 0" in profile.stderr


@pytest.mark.parametrize("args, message", [
    (["config", "--workerz=2"], "Unknown command line flag 'workerz'"),
    (["config", "--data=two"], "flag --data=two: invalid literal"),
    (["config", "--precision=float8"], "flag --precision=float8"),
    (["config", "extra"], "`tfdist config` takes no arguments"),
    (["config", "--image=i:1"], "`tfdist config` does not take --image"),
    (["launch", "--profiler-port=6009"], "`tfdist launch` needs a command"),
    (["launch", "--duration-ms=5", "--", "true"], "`tfdist launch` does not take "
                                                  "--duration-ms"),
    (["tfjob", "--image=i:1", "--", "true"], "`tfdist tfjob` needs --name"),
    (["profile", "--logdir=x"], "needs --tasks=host:port"),
    (["version", "now"], "`tfdist version` takes no arguments"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    ([], "usage: tfdist COMMAND"),
])
def test_usage_errors_exit_2(args, message):
    done = run_tfdist(*args)
    assert done.returncode == 2, (args, done.stderr)
    assert message in done.stderr and "Traceback" not in done.stderr


def test_version_prints_the_versions_and_no_tensorflow_log(monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    done = run_tfdist("version", env=dict(__import__("os").environ))
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"tfdist \S+, tensorflow \S+, keras \S+\n", done.stdout)
    assert not TF_LOG_LINE.search(done.stdout + done.stderr), done.stderr


def test_failed_profile_says_what_failed_and_what_to_try(tmp_path):
    # Nothing listens on this port: TensorFlow's client finds no server.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run_tfdist("profile", f"--tasks=127.0.0.1:{port}", f"--logdir={tmp_path}",
                      "--duration-ms=50")
    assert done.returncode == 1
    assert "num_tracing_attempts" not in done.stdout + done.stderr
    assert f"tfdist profile: no trace recorded from 127.0.0.1:{port}" in done.stderr
    assert "--profiler-port" in done.stderr
    assert not TF_LOG_LINE.search(done.stdout + done.stderr), done.stderr
