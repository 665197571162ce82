"""`tfdist launch` and TF_CONFIG: operator-shaped clusters on localhost, no orphans."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import TFDIST, alive

from tfdist.cluster.tf_config import TFConfig, local_tf_configs, read_tf_config

PRINT_TF_CONFIG = [sys.executable, "-c", "import os; print(os.environ['TF_CONFIG'])"]
# A task that serves until it is stopped, as ps servers do.
SERVE = "import signal; signal.pause()"


def tfdist(*args, timeout=120):
    return subprocess.run([*TFDIST, *args], capture_output=True, text=True,
                          timeout=timeout)


def task_lines(output):
    """{task: [lines]} of the prefixed output."""
    lines = {}
    for match in re.finditer(r"^\[([a-z]+:?\d*)\] (.*)$", output, re.M):
        lines.setdefault(match.group(1), []).append(match.group(2))
    return lines


def started_pids(output):
    return [int(p) for p in re.findall(r"^\[launch\] started \S+ \(pid (\d+)\)$", output, re.M)]


def test_every_task_gets_the_operators_tf_config_on_localhost():
    done = tfdist("launch", "--chief", "--workers=2", "--ps=1", "--", *PRINT_TF_CONFIG)
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


def test_evaluator_is_not_in_the_cluster_but_knows_it():
    configs = local_tf_configs(workers=2, evaluator=True)
    assert configs[-1].task == "evaluator:0"
    assert "evaluator" not in configs[-1].cluster
    assert all(c.cluster == configs[0].cluster for c in configs)


def test_parallel_config_reaches_every_task():
    show = [sys.executable, "-c", "import os; print(os.environ['TFDIST_CONFIG'])"]
    done = tfdist("launch", "--workers=2", "--microbatches=4", "--", *show)
    assert done.returncode == 0, done.stdout + done.stderr
    for task in ("worker:0", "worker:1"):
        assert json.loads(task_lines(done.stdout)[task][0])["microbatches"] == 4


def test_a_failing_task_stops_the_others_and_its_code_is_returned():
    fail_worker_1 = ("import json, os, sys, signal\n"
                     "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
                     "sys.exit(3) if task['index'] == 1 else signal.pause()")
    done = tfdist("launch", "--workers=3", "--", sys.executable, "-c", fail_worker_1)
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
    done = tfdist("launch", "--chief", "--workers=2", "--ps=1", "--timeout=2", "--",
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
    done = tfdist("launch", "--workers=2", "--restart-on-failure=1", "--",
                  sys.executable, "-c", fail_once_script(tmp_path / "a"))
    assert done.returncode == 0, done.stdout
    assert "[launch] worker:1 exited with code 7: restart 1 of 1" in done.stdout
    (line,) = [x for x in task_lines(done.stdout)["worker:1"] if x.startswith("done")]
    assert json.loads(line[5:])["task"] == {"type": "worker", "index": 1}
    # The same job without restarts fails with the task's code.
    (tmp_path / "b").mkdir()
    without = tfdist("launch", "--workers=2", "--", sys.executable, "-c",
                     fail_once_script(tmp_path / "b"))
    assert without.returncode == 7
    assert "[launch] worker:1 failed with exit code 7" in without.stdout


def test_ps_job_ends_when_the_chief_finishes_and_stops_the_servers():
    chief_finishes = ("import json, os, signal\n"
                      "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
                      "print('bye') if task['type'] == 'chief' else signal.pause()")
    start = time.monotonic()
    done = tfdist("launch", "--chief", "--workers=2", "--ps=1", "--",
                  sys.executable, "-c", chief_finishes)
    assert done.returncode == 0, done.stdout
    assert "[launch] job succeeded; stopping worker:0, worker:1, ps:0" in done.stdout
    assert not any(alive(p) for p in started_pids(done.stdout))
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("args, message", [
    (["--workers=0"], "`workers` must be an int >= 1, got 0"),
    (["--ps=-1"], "`ps` must be an int >= 0, got -1"),
    (["--restart-on-failure=-2"], "`restart_on_failure` must be an int >= 0, got -2"),
    (["--timeout=0"], "`timeout` must be a number of seconds > 0, got 0.0"),
    (["--microbatches=0"], "`microbatches` must be an int >= 1, got 0"),
])
def test_bad_launch_input(args, message):
    done = tfdist("launch", *args, "--", *PRINT_TF_CONFIG)
    assert done.returncode == 2
    assert message in done.stderr
    assert "[launch] started" not in done.stdout


def test_unknown_and_stray_flags_and_missing_command():
    unknown = tfdist("launch", "--workerz=2", "--", "true")
    assert unknown.returncode != 0 and "Unknown command line flag 'workerz'" in unknown.stderr
    stray = tfdist("launch", "--image=tf:2", "--", "true")
    assert stray.returncode != 0 and "`tfdist launch` does not take --image" in stray.stderr
    missing = tfdist("launch", "--workers=2")
    assert missing.returncode != 0 and "needs a command" in missing.stderr


@pytest.mark.parametrize("value, message", [
    ({"cluster": {"Worker": ["h:1"]}, "task": {"type": "worker", "index": 0}},
     r"task type 'Worker'; valid types are"),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 1}},
     r"task\"\] is worker:1, but the cluster has 1 worker task"),
    ({"cluster": {"worker": ["h"]}, "task": {"type": "worker", "index": 0}},
     r"has address 'h'; addresses are \"host:port\""),
    ({"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}},
     r"must be a non-empty list"),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker"}},
     r'TF_CONFIG\["task"\] must be'),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}, "x": 1},
     r"unknown key\(s\) \['x'\]"),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "trainer", "index": 0}},
     r"\"type\"\] is 'trainer'"),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": -1}},
     r"index\"\] must be an int >= 0, got -1"),
])
def test_bad_tf_config_names_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        TFConfig.from_dict(value)
    with pytest.raises(ValueError, match=message):
        read_tf_config({"TF_CONFIG": json.dumps(value)})


def test_tf_config_round_trip_and_absence():
    config = TFConfig({"chief": ["10.0.0.1:2222"], "worker": ["w-0.ns.svc:2222"]}, "chief", 0)
    assert TFConfig.from_json(config.to_json()) == config
    assert read_tf_config({}) is None
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        read_tf_config({"TF_CONFIG": "{cluster"})
