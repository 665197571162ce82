"""xla=True: the per-replica compute is really compiled by XLA when fit runs."""

import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "fit_test_mlp.py"


def fit_with_xla_dump(dump_dir, *flags):
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump_dir}")
    done = subprocess.run([sys.executable, str(SCRIPT), *flags],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["losses"]


def compiled_step_modules(dump_dir):
    return sorted(p for p in pathlib.Path(dump_dir).glob("*forward_backward*")
                  if p.name.endswith(".cpu_after_optimizations.txt"))


def test_xla_compiles_each_replicas_compute_and_fit_runs_it(tmp_path):
    losses = fit_with_xla_dump(tmp_path / "xla", "--devices=4", "--xla", "--microbatches=2")
    modules = compiled_step_modules(tmp_path / "xla")
    # One XLA executable per replica (each captures its own device's variables).
    assert len(modules) == 4, [m.name for m in modules]
    for module in modules:
        hlo = module.read_text()
        assert "HloModule" in hlo and " dot(" in hlo
    assert losses[-1] < losses[0]


def test_without_xla_nothing_of_the_step_is_compiled(tmp_path):
    fit_with_xla_dump(tmp_path / "plain", "--devices=4")
    assert compiled_step_modules(tmp_path / "plain") == []


def test_pipeline_compiles_each_stage_forward_and_backward(tmp_path):
    losses = fit_with_xla_dump(tmp_path / "xla", "--devices=2", "--pipeline=2",
                               "--microbatches=2", "--xla")
    modules = [p.name for p in pathlib.Path(tmp_path / "xla").glob(
        "*.cpu_after_optimizations.txt")]
    # One forward and one backward computation per stage (microbatches share them).
    assert sum("forward_stage_layers" in m for m in modules) == 2, modules
    assert sum("backward_stage_layers" in m for m in modules) == 2, modules
    assert losses[-1] < losses[0]
