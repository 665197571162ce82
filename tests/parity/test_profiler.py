"""tfdist.callbacks.Profiler: traces read back by xprof and by TensorBoard itself."""

import gzip
import json
import pathlib
import subprocess
import sys
import time
import urllib.request

import pytest

import tfdist
from helpers import data, devices, make_model, trace_events
from tfdist.cluster.tf_config import free_ports


def fit_with(profiler, steps=20, microbatches=2):
    strategy = tfdist.Strategy(data=2, microbatches=microbatches, devices=devices(2))
    with strategy.scope():
        model = make_model()
    x, y = data(32 * steps)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[profiler])


def get_json(url):
    with urllib.request.urlopen(url, timeout=5) as response:
        body = response.read()
        if response.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
    return json.loads(body)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("logs")
    profiler = tfdist.callbacks.Profiler(logdir, steps=(2, 5))
    fit_with(profiler)
    return logdir, profiler


def test_trace_holds_the_step_range_and_tfdist_phases(profiled):
    logdir, profiler = profiled
    path = pathlib.Path(profiler.trace_path)
    assert path.parent.parent == logdir / "plugins" / "profile"
    assert [p.name for p in (logdir / "plugins" / "profile").iterdir()] == [path.parent.name]
    events = trace_events(path)
    steps = sorted(int(e["args"]["step_num"]) for e in events
                   if e.get("name", "").startswith("tfdist/step "))
    assert steps == [2, 3, 4]
    phases = {e["args"]["long_name"].split("tfdist/")[1].split("/")[0]
              for e in events if "tfdist/" in e.get("args", {}).get("long_name", "")}
    assert phases == {"split", "microbatch0", "microbatch1", "metrics", "reduce", "apply"}
    assert not list(logdir.glob(".tfdist-profile-*"))  # session dir cleaned up


def test_tensorboard_lists_the_run(profiled):
    logdir, profiler = profiled
    run = pathlib.Path(profiler.trace_path).parent.name
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", f"--logdir={logdir}",
         "--host=127.0.0.1", f"--port={port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, runs, error = time.monotonic() + 90, None, None
        while runs is None:
            assert time.monotonic() < deadline, f"TensorBoard on port {port}: {error}"
            try:
                runs = get_json(f"http://127.0.0.1:{port}/data/plugin/profile/runs")
            except OSError as e:  # not listening yet: wait on the server, then retry
                error = e
                try:
                    code = server.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    continue
                raise AssertionError(f"TensorBoard exited with {code}") from e
        assert run in json.dumps(runs)
    finally:
        server.kill()
        server.wait()


def test_range_beyond_the_run_warns_at_the_end(tmp_path):
    profiler = tfdist.callbacks.Profiler(tmp_path, steps=(100, 105))
    with pytest.warns(UserWarning, match=r"steps=\(100, 105\) is beyond this run's 20 steps"):
        fit_with(profiler, microbatches=1)
    assert profiler.trace_path is None


def test_range_cut_short_keeps_what_it_recorded(tmp_path):
    profiler = tfdist.callbacks.Profiler(tmp_path, steps=(18, 30))
    with pytest.warns(UserWarning, match=r"ended after 20 steps, inside the range"):
        fit_with(profiler, microbatches=1)
    steps = [e for e in trace_events(profiler.trace_path)
             if e.get("name", "").startswith("tfdist/step ")]
    assert len(steps) == 2
