"""Hosts joined by rate-limited links: network namespaces on one machine.

`linked_hosts(count, mbit)` makes `count` network namespaces, each a host
with one address, all joined by a Linux bridge in a hub namespace of their
own, as machines on one switch; each host's link carries at most `mbit`
Mbit/s each way (a `tc` token bucket on both ends of its veth pair), after
`delay_ms` of delay if given (netem: a kernel without `sch_netem` refuses
it). Everything is removed on exit. Needs root and iproute2 (`ip`, `tc`).

Example:

    with linked_hosts(2, mbit=100) as hosts:   # [(namespace, address), ...]
        (receiver, address), (sender, _) = hosts
        print(measure_mbit(receiver, address, sender))   # about 95

    python tools/linked_hosts.py --mbit=100   # the same, from the command line
"""

import contextlib
import os
import select
import shutil
import subprocess
import sys

SUBNET = "10.213.0"
PORT = 5201

# Run in the receiving namespace: counts what arrives on PORT; prints Mbit/s.
_RECEIVE = f"""
import socket, time
server = socket.create_server(("", {PORT}))
print("ready", flush=True)
connection, _ = server.accept()
received, start = 0, time.perf_counter()
while chunk := connection.recv(1 << 16):
    received += len(chunk)
print(received * 8 / (time.perf_counter() - start) / 1e6)
"""
# Run in the sending namespace, with the address and seconds: sends zeros.
_SEND = f"""
import socket, sys, time
connection = socket.create_connection((sys.argv[1], {PORT}))
block, end = bytes(1 << 16), time.perf_counter() + float(sys.argv[2])
while time.perf_counter() < end:
    connection.sendall(block)
connection.close()
"""


def _ip(*args):
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def _limit(namespace, device, mbit, delay_ms):
    """Caps what leaves `device` at `mbit` Mbit/s, after `delay_ms` of delay."""
    tc = ["netns", "exec", namespace, "tc", "qdisc", "add", "dev", device]
    burst = max(int(mbit * 1250), 16000)  # bytes: 10 ms at the rate, and at least a few packets
    bucket = ["tbf", "rate", f"{round(mbit * 1000)}kbit", "burst", str(burst), "latency", "50ms"]
    if delay_ms:
        _ip(*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms")
        _ip(*tc, "parent", "1:1", "handle", "10:", *bucket)
    else:
        _ip(*tc, "root", *bucket)


@contextlib.contextmanager
def linked_hosts(count, mbit=None, delay_ms=0):
    """Yields [(namespace, address)] of `count` hosts on one bridge, each
    link `mbit` Mbit/s each way (None: unlimited); removes them on exit.

    Raises RuntimeError if they cannot be made (not root, no iproute2)."""
    if os.geteuid() != 0:
        raise RuntimeError("linked_hosts needs root (it makes network namespaces).")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"linked_hosts needs `{tool}` (iproute2) on the PATH.")
    prefix = f"tfdist-link-{os.getpid()}"
    hub, hosts = f"{prefix}-hub", [f"{prefix}-{i}" for i in range(count)]
    made = []
    try:
        for namespace in [hub, *hosts]:
            _ip("netns", "add", namespace)
            made.append(namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "bridge", "type", "bridge")
        _ip("-n", hub, "link", "set", "bridge", "up")
        for i, host in enumerate(hosts):
            port = f"port{i}"
            _ip("-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", host)
            _ip("-n", hub, "link", "set", port, "master", "bridge", "up")
            _ip("-n", host, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")
            if mbit:
                _limit(host, "eth0", mbit, delay_ms)  # what the host sends
                _limit(hub, port, mbit, delay_ms)  # what it receives
        yield [(host, f"{SUBNET}.{i + 1}") for i, host in enumerate(hosts)]
    finally:
        for namespace in reversed(made):  # takes its veth ends, and their peers, along
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def measure_mbit(receiver, address, sender, seconds=3.0):
    """Mbit/s a TCP stream from namespace `sender` delivers to `address` in
    namespace `receiver` over `seconds`."""
    def python_in(namespace, code, *args):
        return ["ip", "netns", "exec", namespace, sys.executable, "-c", code, *args]

    with subprocess.Popen(python_in(receiver, _RECEIVE), stdout=subprocess.PIPE,
                          text=True) as receiving:
        try:
            if not select.select([receiving.stdout], [], [], 30)[0] or \
                    receiving.stdout.readline().strip() != "ready":
                raise RuntimeError(f"The receiver in {receiver} did not start listening on "
                                   f"port {PORT} within 30 s.")
            subprocess.run(python_in(sender, _SEND, address, str(seconds)),
                           check=True, timeout=seconds + 30)
            out, _ = receiving.communicate(timeout=30)
        finally:
            receiving.kill()
    return float(out)


def main():
    import argparse

    parser = argparse.ArgumentParser(description="Measures a link of two linked hosts.")
    parser.add_argument("--mbit", type=float, default=100, help="rate (0: unlimited)")
    parser.add_argument("--delay_ms", type=float, default=0)
    parser.add_argument("--seconds", type=float, default=3)
    args = parser.parse_args()
    with linked_hosts(2, args.mbit or None, args.delay_ms) as hosts:
        (receiver, address), (sender, _) = hosts
        measured = measure_mbit(receiver, address, sender, args.seconds)
    print(f"asked {args.mbit or 'unlimited'} Mbit/s, measured {measured:.1f} Mbit/s")


if __name__ == "__main__":
    main()
