"""`tfdist launch`'s private network: a job's task servers reachable from this host only.

TensorFlow's task servers listen on every interface; `ss`, run here in this
host's network, must not show any of a launched job's ports on an address
other hosts can reach.
"""

import ipaddress
import json
import re
import shutil
import socket
import subprocess
import sys

import pytest

from helpers import TFDIST, TINY_TASK, output_tail
from tfdist.cluster.tf_config import free_ports

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2)")]

# After the strategy starts the task's TensorFlow server: the task's address,
# pid, and the listening sockets it sees (`ss` in its own network); then it
# waits for the test's go-ahead (a file) and trains.
TRAIN = TINY_TASK + """
import pathlib, subprocess, time
config = json.loads(os.environ["TF_CONFIG"])
seen = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
print("serving", json.dumps({"address": config["cluster"]["worker"][index],
                             "pid": os.getpid(), "seen": seen}), flush=True)
go = time.monotonic() + 120
while not pathlib.Path(sys.argv[1]).exists():
    assert time.monotonic() < go, "the test never gave the go-ahead (120 s)"
    time.sleep(0.1)
history = model.fit(np.ones((64, 4)), np.zeros((64, 2)), batch_size=16, epochs=3,
                    verbose=0)
print("trained", history.history["loss"][-1] < history.history["loss"][0])
"""
# The same without TensorFlow: listens on its TF_CONFIG port on every
# interface (as TensorFlow's server does), connects to its peer on
# 127.0.0.1, reports, then serves until the go-ahead.
SERVE = """
import json, os, pathlib, socket, sys, time
config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
own, peer = (config["cluster"]["worker"][i] for i in (index, 1 - index))
server = socket.create_server(("", int(own.rsplit(":", 1)[1])))
deadline = time.monotonic() + 30
while True:
    try:
        socket.create_connection(("127.0.0.1", int(peer.rsplit(":", 1)[1]))).close()
        break
    except OSError:
        assert time.monotonic() < deadline, "the peer never answered"
        time.sleep(0.1)
print("serving", json.dumps({"address": own, "pid": os.getpid()}), flush=True)
go = time.monotonic() + 120
while not pathlib.Path(sys.argv[1]).exists():
    assert time.monotonic() < go, "the test never gave the go-ahead (120 s)"
    time.sleep(0.1)
"""


def start_job(command, go, *args, prefix=()):
    """A launched 2-worker job running `command` and the workers' `serving` reports."""
    launcher = subprocess.Popen(
        [*prefix, *TFDIST, "launch", "--workers=2", "--timeout=240", *args, "--",
         sys.executable, "-c", command, str(go)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, reports = "", []
    while len(reports) < 2:
        line = launcher.stdout.readline()
        if not line:
            launcher.wait()
            pytest.fail(f"the job ended before serving:\n{output_tail(output)}")
        output += line
        match = re.match(r"\[worker:\d\] serving (.*)$", line)
        if match:
            reports.append(json.loads(match.group(1)))
    return launcher, reports


def finish(launcher, go):
    go.touch()
    rest, _ = launcher.communicate(timeout=200)
    return rest


def exposed(reports):
    """The job's ports listening, in this host's network, on a non-loopback address."""
    ports = {int(r["address"].rsplit(":", 1)[1]) for r in reports}
    pids = {r["pid"] for r in reports}
    found = []
    listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True,
                               check=True).stdout
    for line in listening.splitlines():
        local = line.split()[3]
        host, port = local.rsplit(":", 1)
        owners = {int(pid) for pid in re.findall(r"pid=(\d+)", line)}
        if int(port) in ports and owners & pids and not loopback(host):
            found.append(line)
    return found


def loopback(host):
    host = host.strip("[]").split("%")[0]
    if host == "*":
        return False
    address = ipaddress.ip_address(host)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def test_a_launched_jobs_tensorflow_servers_are_reachable_from_this_host_only(tmp_path):
    go = tmp_path / "go"
    launcher, reports = start_job(TRAIN, go)
    try:
        assert exposed(reports) == []
        for report in reports:  # inside, TensorFlow's server is on every interface
            port = report["address"].rsplit(":", 1)[1]
            inside = [line.split()[3] for line in report["seen"].splitlines()]
            assert any(re.fullmatch(rf"(\*|0\.0\.0\.0|\[::\]):{port}", a) for a in inside), \
                report["seen"]
    finally:
        rest = finish(launcher, go)
    assert launcher.returncode == 0, output_tail(rest)
    assert rest.count("trained True") == 2, output_tail(rest)


@pytest.mark.parametrize("args, hidden", [((), True), (("--host-network",), False)])
def test_host_network_is_the_opt_out(tmp_path, args, hidden):
    go = tmp_path / "go"
    launcher, reports = start_job(SERVE, go, *args)
    try:
        assert (exposed(reports) == []) == hidden
    finally:
        rest = finish(launcher, go)
    assert launcher.returncode == 0, rest


def test_profiler_ports_are_forwarded_from_this_hosts_loopback(tmp_path):
    (port,) = free_ports(1)
    greet = ("import os, socket, sys\n"
             "server = socket.create_server(('', int(os.environ['TFDIST_PROFILER_PORT'])))\n"
             "print('serving', flush=True)\n"
             "connection, _ = server.accept()\n"
             "connection.sendall(connection.recv(100).upper())\n")
    launcher = subprocess.Popen(
        [*TFDIST, "launch", "--workers=2", f"--profiler-port={port}", "--timeout=60", "--",
         sys.executable, "-c", greet], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    output = ""
    while output.count(" serving\n") < 2:
        line = launcher.stdout.readline()
        assert line, output
        output += line
    listening = subprocess.run(["ss", "-ltnH", f"sport >= :{port} and sport <= :{port + 1}"],
                               capture_output=True, text=True, check=True).stdout
    assert sorted(line.split()[3] for line in listening.splitlines()) == [
        f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    for k in range(2):
        with socket.create_connection(("127.0.0.1", port + k), timeout=30) as connection:
            connection.sendall(b"hello")
            assert connection.recv(100) == b"HELLO"
    rest, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, output + rest
    assert f"profiler ports {port}-{port + 1} forwarded from this host's 127.0.0.1" in output


def test_a_profiler_port_taken_on_this_host_is_refused_before_anything_starts():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([*TFDIST, "launch", f"--profiler-port={port - 1}", "--workers=2",
                               "--", "true"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (f"tfdist launch: Port {port} of this host's 127.0.0.1, to be forwarded to the "
            f"job's private network, is taken: Address already in use; pick another."
            ) in done.stderr
    assert "[launch] started" not in done.stdout


# Run as an unprivileged user: uid 1000 in a user namespace of its own.
UNPRIVILEGED = ["unshare", "--user", "--map-user=1000", "--map-group=1000"]
# Run where no user namespace can be made: root without capabilities, in a
# user namespace that allows no other inside it.
NO_USER_NAMESPACES = [
    "unshare", "--user", "--map-root-user", "sh", "-c",
    'echo 0 > /proc/sys/user/max_user_namespaces && exec setpriv --bounding-set=-all '
    '--inh-caps=-all -- "$@"', "sh"]
needs_user_namespaces = pytest.mark.skipif(
    shutil.which("setpriv") is None or shutil.which("unshare") is None
    or subprocess.run([*UNPRIVILEGED, "true"], capture_output=True).returncode != 0,
    reason="needs util-linux's unshare and setpriv, and user namespaces")


@needs_user_namespaces
def test_an_unprivileged_user_gets_a_private_network_too(tmp_path):
    go = tmp_path / "go"
    launcher, reports = start_job(SERVE, go, prefix=UNPRIVILEGED)
    try:
        assert exposed(reports) == []
    finally:
        rest = finish(launcher, go)
    assert launcher.returncode == 0, rest


@needs_user_namespaces
def test_without_user_namespaces_launch_refuses_and_names_the_opt_out():
    done = subprocess.run([*NO_USER_NAMESPACES, *TFDIST, "launch", "--workers=2", "--", "true"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("tfdist launch: The job's tasks run in a private network (TensorFlow's task "
            "servers listen on every interface and run any graph sent to them), which "
            "cannot be made here: cannot create a user namespace: No space left on device "
            "(user.max_user_namespaces = 0).") in done.stderr
    assert "--host-network" in done.stderr and "[launch] started" not in done.stdout
    opted_out = subprocess.run(
        [*NO_USER_NAMESPACES, *TFDIST, "launch", "--workers=2", "--host-network", "--", "true"],
        capture_output=True, text=True, timeout=120)
    assert opted_out.returncode == 0, opted_out.stdout + opted_out.stderr
