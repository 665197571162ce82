"""The examples run as documented (small settings, fresh processes)."""

import pathlib
import re
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).parents[1] / "keras_examples"


def run_example(name, *flags):
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *flags],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_data_parallel_example_prints_loss_and_throughput_per_epoch():
    out = run_example("data_parallel.py", "--epochs=3", "--microbatches=2")
    epochs = re.findall(r"epoch (\d): loss ([\d.]+)  accuracy ([\d.]+)  ([\d,]+) examples/s", out)
    assert [e[0] for e in epochs] == ["1", "2", "3"]
    losses = [float(e[1]) for e in epochs]
    assert losses[2] < losses[0]
    assert '"microbatches": 2' in out


def test_profile_fit_example_writes_a_trace_and_scalars(tmp_path):
    out = run_example("profile_fit.py", f"--logdir={tmp_path}", "--epochs=2")
    trace = re.search(r"^trace: (.*\.xplane\.pb)$", out, re.M)[1]
    assert pathlib.Path(trace).parent.parent == tmp_path / "plugins" / "profile"
    assert list((tmp_path / "tfdist").glob("events.out.tfevents.*"))
