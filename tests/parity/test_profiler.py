"""tfdist.callbacks.Profiler: traces read back by xprof and by TensorBoard itself."""

import gzip
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import urllib.request

import pytest
from playwright import sync_api as playwright

import tfdist
from helpers import data, devices, make_model, trace_events
from tfdist.cluster.tf_config import free_ports

CHROMIUM = "/usr/bin/chromium"
# Headless, and nothing that reaches beyond localhost.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


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
    # Each phase's row: one range per step, titled for the trace viewer's search.
    for phase in phases:
        ranges = [e for e in events if e.get("name") == f"tfdist/{phase}"]
        assert sorted(int(e["args"]["tfdist_step"]) for e in ranges) == [2, 3, 4], phase
    assert not list(logdir.glob(".tfdist-profile-*"))  # session dir cleaned up


@pytest.fixture(scope="module")
def tensorboard(profiled):
    """The port of a TensorBoard server reading the profiled run."""
    logdir, _ = profiled
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", f"--logdir={logdir}",
         "--host=127.0.0.1", f"--port={port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, error = time.monotonic() + 90, None
        while True:
            assert time.monotonic() < deadline, f"TensorBoard on port {port}: {error}"
            try:
                get_json(f"http://127.0.0.1:{port}/data/plugin/profile/runs")
                break
            except OSError as e:  # not listening yet: wait on the server, then retry
                error = e
                try:
                    code = server.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    continue
                raise AssertionError(f"TensorBoard exited with {code}") from e
        yield port
    finally:
        server.kill()
        server.wait()


def test_tensorboard_lists_the_run(profiled, tensorboard):
    _, profiler = profiled
    run = pathlib.Path(profiler.trace_path).parent.name
    runs = get_json(f"http://127.0.0.1:{tensorboard}/data/plugin/profile/runs")
    assert run in json.dumps(runs)


def test_trace_viewer_finds_each_phase_by_search(profiled, tensorboard, tmp_path):
    """As a user does: TensorBoard's Profile tab in a browser, the Trace Viewer
    tool, a search for a phase; every profiled step's range is found."""
    # Chromium is a system package: `make test` installs Debian's (`make
    # browser`) where it can (root, apt-get); elsewhere this test cannot run.
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"needs Chromium at {CHROMIUM} (`make browser` installs Debian's)")
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(60_000)
            page.goto(f"http://127.0.0.1:{tensorboard}/#profile")
            profile = page.frame_locator("iframe").first
            profile.get_by_text("Overview Page").click()  # the tool menu
            profile.get_by_role("option", name="Trace Viewer").first.click()
            viewer = profile.frame_locator("iframe").first
            # The trace streams in after the page: expand the host's rows
            # once they are there (a click before expands an empty model).
            phase_row = viewer.get_by_text("tfdist/reduce", exact=True)
            for _ in range(12):
                viewer.get_by_text("Expand All").click()
                try:
                    phase_row.wait_for(timeout=5_000)
                    break
                except playwright.TimeoutError:
                    continue
            page.screenshot(path=tmp_path / "loaded.png")  # kept for a look
            rows = viewer.locator("body").inner_text().split("\n")
            for phase in ("reduce", "apply"):
                search = viewer.get_by_placeholder("Find Events...")
                search.fill(f"tfdist/{phase}")
                search.press("Enter")
                found = viewer.get_by_text(re.compile(r"^\d+ of [1-9]\d*$"))
                found.wait_for(timeout=20_000)
                page.screenshot(path=tmp_path / f"{phase}.png")
                assert found.inner_text().endswith(" of 3"), (found.inner_text(), tmp_path)
        finally:
            browser.close()
    # The steps' row, then the phases' rows, above the host's threads.
    python = next(i for i, row in enumerate(rows) if row.split()[-1:] == ["python"])
    first = rows[python + 1:][:6]
    assert first == ["tfdist/split", "tfdist/microbatch0", "tfdist/microbatch1",
                     "tfdist/metrics", "tfdist/reduce", "tfdist/apply"], rows


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
