"""Remote capture: `tfdist profile` records two running workers at once."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading

import pytest
from xprof.convert import raw_to_tool_data

from helpers import TFDIST
from tfdist.cluster.tf_config import free_ports

pytestmark = pytest.mark.alone

# Each launched worker trains on its own (tfdist.Strategy, 2 devices): remote
# capture of MultiWorkerStrategy workers can crash one on this stack (README).
TRAIN = pathlib.Path(__file__).parents[2] / "keras_examples" / "data_parallel.py"


@pytest.mark.multiprocess
def test_capture_from_two_running_workers_gives_two_host_traces(tmp_path):
    (port,) = free_ports(1)
    launcher = subprocess.Popen(
        [*TFDIST, "launch", "--workers=2", f"--profiler-port={port}", "--timeout=240",
         "--", sys.executable, str(TRAIN), "--devices=2", "--epochs=1000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, training = [], threading.Event()

    def drain():  # keep reading, or the workers block on a full pipe
        for line in launcher.stdout:
            lines.append(line)
            if line.startswith("[worker:1] epoch 1:"):
                training.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert training.wait(timeout=180), "".join(lines)[-3000:]
        done = subprocess.run(
            [*TFDIST, "profile", f"--tasks=127.0.0.1:{port},127.0.0.1:{port + 1}",
             f"--logdir={tmp_path}", "--duration-ms=6000"],
            capture_output=True, text=True, timeout=180)
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=60)
        reader.join(timeout=10)
    launched = "".join(line for line in lines if "epoch" not in line)[-3000:]
    assert done.returncode == 0, done.stderr[-2000:] + launched
    (run,) = (tmp_path / "plugins" / "profile").iterdir()
    hosts = sorted(p.name for p in run.iterdir())
    assert hosts == [f"127.0.0.1_{port}.xplane.pb", f"127.0.0.1_{port + 1}.xplane.pb"]
    assert sorted(done.stdout.split()[-2:]) == sorted(str(p) for p in run.iterdir())
    for host in run.iterdir():
        text, _ = raw_to_tool_data.xspace_to_tool_data([str(host)], "trace_viewer", {})
        events = json.loads(text)["traceEvents"]
        names = json.dumps(events)
        assert "tfdist/microbatch0/" in names and "tfdist/reduce/" in names, host.name
        # A capture without the Profiler's step ranges: one range per phase.
        phases = [e["name"] for e in events if e.get("ph") == "X"
                  and e["name"] in ("tfdist/microbatch0", "tfdist/reduce")]
        assert sorted(phases) == ["tfdist/microbatch0", "tfdist/reduce"], host.name
    assert launcher.returncode == 130


@pytest.mark.parametrize("args, message", [
    (["--tasks=nohost", "--logdir=x"], "`tasks` has 'nohost'; each task is 'host:port'"),
    (["--tasks=h:1", "--logdir=x", "--duration-ms=0"], "`duration_ms` must be an int > 0"),
])
def test_bad_profile_input(args, message):
    done = subprocess.run([*TFDIST, "profile", *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and message in done.stderr


def test_profile_needs_tasks_and_logdir():
    done = subprocess.run([*TFDIST, "profile", "--logdir=x"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "needs --tasks=host:port" in done.stderr


def test_bad_profiler_port_for_launch_and_environment():
    done = subprocess.run([*TFDIST, "launch", "--profiler-port=70000", "--", "true"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "`profiler_port` must be an int in 1..65534" in done.stderr
    script = "import tfdist; tfdist.Strategy()"
    bad = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, TFDIST_PROFILER_PORT="http"))
    assert bad.returncode != 0
    assert "$TFDIST_PROFILER_PORT must be a port number in 1..65535, got 'http'" in bad.stderr

