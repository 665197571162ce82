"""A job's private network: its tasks reachable from this host only (Linux).

TensorFlow's task servers listen on every interface (its gRPC server binds
`0.0.0.0:PORT` whatever host TF_CONFIG names) and run any graph sent to them.
`tfdist launch` therefore runs a job's tasks in a network namespace of their
own that holds only a loopback interface: the tasks reach each other on
127.0.0.1, nothing outside the namespace reaches them, and they reach nothing
outside it (no other host, no server on this host's own network).

A holder process, this file run as a script, makes the namespace and keeps it
for the job:

    python private_network.py hold [FD...]

It enters a new network namespace (when it may: `CAP_SYS_ADMIN`, as root),
else a new user namespace with a new network namespace in it (the user mapped
to itself: files and processes keep their owner), brings the loopback up and
prints `ready`, or what failed (then exits 1). Until its stdin closes it
forwards each port the launcher listens on for it, on this host's 127.0.0.1
(the sockets FD...): each connection is relayed to the same port on
127.0.0.1 inside (so `tfdist profile` reaches the tasks' profiler servers,
from this host only). Each task enters the namespace as it starts:

    python private_network.py join HOLDER_PID COMMAND...
"""

import contextlib
import ctypes
import fcntl
import os
import selectors
import socket
import struct
import subprocess
import sys
import threading

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sh22x"  # struct ifreq: the interface's name, then its flags
_CLOSE_SECONDS = 5.0
_libc = ctypes.CDLL(None, use_errno=True)
# Kernel settings that forbid an unprivileged user namespace, and the value that does.
_RESTRICTIONS = {"kernel.apparmor_restrict_unprivileged_userns": "1",
                 "kernel.unprivileged_userns_clone": "0",
                 "user.max_user_namespaces": "0"}


class PrivateNetwork:
    """A private network for one job's tasks, from its start to `close()`.

    Args:
        forward: ports of this host's 127.0.0.1 relayed to the same ports
            inside (the tasks' profiler servers).

    Raises:
        RuntimeError: this host cannot make one (not Linux; user namespaces
            forbidden to this user), saying why and what to do instead.
        ValueError: a port of `forward` is in use on this host.

    Example:

    ```python
    with PrivateNetwork(forward=[6009]) as network:
        subprocess.run(network.command(["python", "train.py"]))
    ```
    """

    def __init__(self, forward=()):
        if not sys.platform.startswith("linux"):
            _refuse("network namespaces are Linux only", linux=False)
        with contextlib.ExitStack() as stack:
            fds = [stack.enter_context(_listen(port)).fileno() for port in forward]
            self.holder = subprocess.Popen(
                [sys.executable, __file__, "hold", *map(str, fds)], pass_fds=fds,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                start_new_session=True)
        reply = self.holder.stdout.readline().strip()
        if reply != "ready":
            self.close()
            _refuse(reply or f"its holder process exited with code {self.holder.returncode}")

    def command(self, command):
        """`command` (a list) run inside the network.

        Example:

        ```python
        network.command(["python", "train.py"])
        # [sys.executable, ".../private_network.py", "join", "4242", "python", "train.py"]
        ```
        """
        return [sys.executable, __file__, "join", str(self.holder.pid), *command]

    def close(self):
        """Stops the holder: no more forwarding nor joining; tasks inside keep running.

        Example:

        ```python
        network.close()
        ```
        """
        self.holder.stdin.close()
        try:
            self.holder.wait(_CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            self.holder.kill()
            self.holder.wait()
        self.holder.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def _refuse(reason, linux=True):
    restrictions = ", ".join(f"{name} = {value}" for name, value in _restrictions().items())
    allow = ("Allow this user to create user namespaces (on Ubuntu: sysctl "
             "kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile "
             "granting `userns` to this Python), or run" if linux else "Run")
    raise RuntimeError(
        f"The job's tasks run in a private network (TensorFlow's task servers listen "
        f"on every interface and run any graph sent to them), which cannot be made "
        f"here: {reason}{f' ({restrictions})' if restrictions else ''}. {allow} the "
        f"tasks in this host's network with --host-network (`host_network=True`), "
        f"their ports then open to whoever reaches this host.")


def _restrictions():
    """The kernel settings in force that forbid unprivileged user namespaces."""
    found = {}
    for name, forbidding in _RESTRICTIONS.items():
        with contextlib.suppress(OSError):
            with open("/proc/sys/" + name.replace(".", "/")) as f:
                if f.read().strip() == forbidding:
                    found[name] = forbidding
    return found


def _libc_call(function, *args, what):
    if function(*args) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def _enter_new_network():
    try:
        _libc_call(_libc.unshare, _CLONE_NEWNET, what="cannot create a network namespace")
        return
    except PermissionError:
        pass  # not privileged: a user namespace of its own first
    uid, gid = os.geteuid(), os.getegid()
    _libc_call(_libc.unshare, _CLONE_NEWUSER | _CLONE_NEWNET,
               what="cannot create a user namespace")
    for path, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"),
                       ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
        except OSError as error:
            raise OSError(error.errno, f"cannot write the user namespace's {path}: "
                                       f"{error.strerror}") from error


def _bring_up_loopback():
    try:
        with socket.socket() as s:
            (flags,) = struct.unpack(_IFREQ, fcntl.ioctl(
                s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1:]
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
    except OSError as error:
        raise OSError(error.errno, f"cannot bring up the loopback interface of a new "
                                   f"network namespace: {error.strerror}") from error


def _listen(port):
    try:
        return socket.create_server(("127.0.0.1", port))
    except OSError as error:
        raise ValueError(f"Port {port} of this host's 127.0.0.1, to be forwarded to the "
                         f"job's private network, is taken: {os.strerror(error.errno)}; pick "
                         f"another.") from error


def _forward(listener):
    """Relays every connection to `listener` (this host's network) to its port inside."""
    port = listener.getsockname()[1]
    while True:
        outside, _ = listener.accept()
        try:
            inside = socket.create_connection(("127.0.0.1", port))
        except OSError:  # nothing serves there yet: the client sees its connection close
            outside.close()
            continue
        threading.Thread(target=_relay, args=(outside, inside), daemon=True).start()


def _relay(a, b):
    """Copies bytes both ways until both sides have finished sending."""
    peers = {a: b, b: a}
    with a, b, selectors.DefaultSelector() as selector, contextlib.suppress(OSError):
        for side in peers:
            selector.register(side, selectors.EVENT_READ)
        while selector.get_map():
            for key, _ in selector.select():
                data = key.fileobj.recv(1 << 16)
                if data:
                    peers[key.fileobj].sendall(data)
                else:
                    selector.unregister(key.fileobj)
                    peers[key.fileobj].shutdown(socket.SHUT_WR)


def _hold(fds):
    listeners = [socket.socket(fileno=fd) for fd in fds]  # in this host's network
    try:
        _enter_new_network()
        _bring_up_loopback()
    except OSError as error:
        print(error.strerror, flush=True)
        return 1
    print("ready", flush=True)
    for listener in listeners:
        threading.Thread(target=_forward, args=(listener,), daemon=True).start()
    sys.stdin.read()  # until the launcher closes it, or dies
    return 0


def _join(holder, command):
    try:
        user, net = (os.open(f"/proc/{holder}/ns/{kind}", os.O_RDONLY)
                     for kind in ("user", "net"))
        if os.fstat(user).st_ino != os.stat("/proc/self/ns/user").st_ino:
            _libc_call(_libc.setns, user, _CLONE_NEWUSER, what="cannot enter its user namespace")
        _libc_call(_libc.setns, net, _CLONE_NEWNET, what="cannot enter its network namespace")
    except OSError as error:
        print(f"cannot join the job's private network (holder pid {holder}): "
              f"{error.strerror}", file=sys.stderr)
        return 1
    os.close(user)
    os.close(net)
    try:
        os.execvp(command[0], command)
    except OSError as error:
        print(f"cannot run {command[0]!r}: {error.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        sys.exit(_hold([int(fd) for fd in sys.argv[2:]]))
    sys.exit(_join(int(sys.argv[2]), sys.argv[3:]))
