"""`tfdist launch` and TF_CONFIG: operator-shaped clusters on localhost, no orphans."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import PRINT_TF_CONFIG, TFDIST, alive, run_tfdist
from tfdist.cluster.release_memory import RELEASE_MEMORY_ENV
from tfdist.cluster.tf_config import read_tf_config

pytestmark = pytest.mark.alone

# A task that serves until it is stopped, as ps servers do.
SERVE = "import signal; signal.pause()"


def task_lines(output):
    """{task: [lines]} of the prefixed output."""
    lines = {}
    for match in re.finditer(r"^\[([a-z]+:?\d*)\] (.*)$", output, re.M):
        lines.setdefault(match.group(1), []).append(match.group(2))
    return lines


def started_pids(output):
    return [int(p) for p in re.findall(r"^\[launch\] started \S+ \(pid (\d+)\)$", output, re.M)]


def test_every_task_gets_the_operators_tf_config_on_localhost():
    done = run_tfdist("launch", "--chief", "--workers=2", "--ps=1", "--", *PRINT_TF_CONFIG)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = task_lines(done.stdout)
    tasks = {"chief:0", "worker:0", "worker:1", "ps:0"}
    assert tasks <= set(lines)
    configs = {task: json.loads(lines[task][0]) for task in tasks}
    clusters = {json.dumps(c["cluster"], sort_keys=True) for c in configs.values()}
    assert len(clusters) == 1  # the same cluster in all
    cluster = configs["chief:0"]["cluster"]
    assert sorted(cluster) == ["chief", "ps", "worker"]
    assert [len(cluster[t]) for t in ("chief", "worker", "ps")] == [1, 2, 1]
    addresses = [a for addrs in cluster.values() for a in addrs]
    assert len(set(addresses)) == 4
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in addresses)
    for task, config in configs.items():
        task_type, index = task.split(":")
        assert config["task"] == {"type": task_type, "index": int(index)}
        assert config["environment"] == "cloud"
        assert set(config) == {"cluster", "task", "environment"}
        assert read_tf_config({"TF_CONFIG": json.dumps(config)}).task == task


def test_release_memory_sets_the_allocator_settings_the_user_has_not():
    show = [sys.executable, "-c", "import json, os; print(json.dumps("
            f"{{k: os.environ.get(k) for k in {list(RELEASE_MEMORY_ENV)}}}))"]
    mine = dict(os.environ, MALLOC_ARENA_MAX="4")
    mine.pop("MALLOC_MMAP_THRESHOLD_", None)
    released = run_tfdist("launch", "--workers=2", "--release_memory", "--", *show, env=mine)
    plain = run_tfdist("launch", "--workers=1", "--", *show, env=mine)
    for done in (released, plain):
        assert done.returncode == 0, done.stdout + done.stderr
    for task in ("worker:0", "worker:1"):
        assert json.loads(task_lines(released.stdout)[task][0]) == {
            **RELEASE_MEMORY_ENV, "MALLOC_ARENA_MAX": "4"}
    assert json.loads(task_lines(plain.stdout)["worker:0"][0])["MALLOC_MMAP_THRESHOLD_"] is None


def test_parallel_config_reaches_every_task():
    show = [sys.executable, "-c", "import os; print(os.environ['TFDIST_CONFIG'])"]
    done = run_tfdist("launch", "--workers=2", "--microbatches=4", "--", *show)
    assert done.returncode == 0, done.stdout + done.stderr
    for task in ("worker:0", "worker:1"):
        assert json.loads(task_lines(done.stdout)[task][0])["microbatches"] == 4


def test_a_failing_task_stops_the_others_and_its_code_is_returned():
    fail_worker_1 = ("import json, os, sys, signal\n"
                     "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
                     "sys.exit(3) if task['index'] == 1 else signal.pause()")
    done = run_tfdist("launch", "--workers=3", "--", sys.executable, "-c", fail_worker_1)
    assert done.returncode == 3
    assert re.search(r"\[launch\] worker:1 failed with exit code 3: stopping the other "
                     r"tasks \(still running: worker:0, worker:2\)", done.stdout)
    pids = started_pids(done.stdout)
    assert len(pids) == 3 and not any(alive(p) for p in pids)


def test_sigint_to_the_launcher_leaves_no_child_alive():
    launcher = subprocess.Popen([*TFDIST, "launch", "--chief", "--workers=2", "--ps=1",
                                 "--", sys.executable, "-c", SERVE],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = ""
        while len(started_pids(output)) < 4:
            line = launcher.stdout.readline()
            assert line, f"launcher ended early:\n{output}"
            output += line
        pids = started_pids(output)
        assert all(alive(p) for p in pids)
        launcher.send_signal(signal.SIGINT)
        rest, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130
    assert "[launch] interrupted: stopping every task" in rest
    assert not any(alive(p) for p in pids)


def test_timeout_names_the_tasks_still_running():
    done = run_tfdist("launch", "--chief", "--workers=2", "--ps=1", "--timeout=2", "--",
                  sys.executable, "-c", SERVE)
    assert done.returncode == 124
    assert ("[launch] timed out after 2 s; tasks still running: chief:0, worker:0, "
            "worker:1, ps:0") \
        in done.stdout
    assert not any(alive(p) for p in started_pids(done.stdout))


def fail_once_script(marker_dir):
    """Worker 1 exits 7 the first time it runs (leaving a marker), then succeeds."""
    return ("import json, os, sys\n"
            "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
            f"marker = os.path.join({str(marker_dir)!r}, str(task['index']))\n"
            "if task['index'] == 1 and not os.path.exists(marker):\n"
            "    open(marker, 'w').close(); sys.exit(7)\n"
            "print('done', os.environ['TF_CONFIG'])")


def test_restart_on_failure_restarts_a_failed_task(tmp_path):
    (tmp_path / "a").mkdir()
    done = run_tfdist("launch", "--workers=2", "--restart-on-failure=1", "--",
                  sys.executable, "-c", fail_once_script(tmp_path / "a"))
    assert done.returncode == 0, done.stdout
    assert "[launch] worker:1 exited with code 7: restart 1 of 1" in done.stdout
    (line,) = [x for x in task_lines(done.stdout)["worker:1"] if x.startswith("done")]
    assert json.loads(line[5:])["task"] == {"type": "worker", "index": 1}
    # The same job without restarts fails with the task's code.
    (tmp_path / "b").mkdir()
    without = run_tfdist("launch", "--workers=2", "--", sys.executable, "-c",
                     fail_once_script(tmp_path / "b"))
    assert without.returncode == 7
    assert "[launch] worker:1 failed with exit code 7" in without.stdout


def test_ps_job_ends_when_the_chief_finishes_and_stops_the_servers():
    chief_finishes = ("import json, os, signal\n"
                      "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
                      "print('bye') if task['type'] == 'chief' else signal.pause()")
    start = time.monotonic()
    done = run_tfdist("launch", "--chief", "--workers=2", "--ps=1", "--",
                  sys.executable, "-c", chief_finishes)
    assert done.returncode == 0, done.stdout
    assert "[launch] job succeeded; stopping worker:0, worker:1, ps:0" in done.stdout
    assert not any(alive(p) for p in started_pids(done.stdout))
    assert time.monotonic() - start < 60
