"""`wait_for_peers`: a bounded wait for the other tasks of a synchronous job.

`tf.distribute.MultiWorkerMirroredStrategy` waits for its peers inside
TensorFlow's C++ runtime (the coordination service's registration and the
remote-device discovery of `enable_collective_ops`) with no deadline: a worker
whose peer never starts waits forever, and Python signal handlers do not run
meanwhile. `wait_for_peers` runs before that, with a deadline.

How: until TensorFlow starts its gRPC server, a task's own `TF_CONFIG` port is
free, so the task listens on it with a plain TCP socket and connects to every
peer's port until each accepts (the peer is either in this same wait or
already serving TensorFlow's gRPC server on it, both of which accept a TCP
connection). Only when every peer has answered does TensorFlow get the port;
a peer that has not answered by the deadline is named in a `TimeoutError`.
The port is released before TensorFlow binds it; a peer probing in that
instant retries until TensorFlow's server is up.
"""

import contextlib
import errno
import socket
import threading
import time

from tfdist.cluster.tf_config import TFConfig, read_tf_config

SYNCHRONOUS_TASK_TYPES = ("chief", "master", "worker")
_RETRY_SECONDS = 0.2


def wait_for_peers(timeout_seconds: float, cluster_resolver=None,
                   environ=None, peer_types=SYNCHRONOUS_TASK_TYPES) -> TFConfig | None:
    """Validates this task's cluster and waits until its peers are up.

    The cluster comes from `cluster_resolver` if given, else from `TF_CONFIG`
    (validated: a malformed or incomplete one raises `ValueError` naming the
    field). Without either, there is no peer to wait for and None is returned.
    The peers are the cluster's tasks of `peer_types` other than this one
    (chief and worker tasks; a parameter-server chief also waits for the ps).

    Args:
        timeout_seconds: how long to wait for every peer, a number > 0.
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`,
            or None to read `TF_CONFIG`.
        environ: the environment to read `TF_CONFIG` from (default `os.environ`).
        peer_types: the task types to wait for.

    Returns:
        This task's `TFConfig`, or None when it runs alone.

    Raises:
        ValueError: `TF_CONFIG` is malformed or incomplete.
        TimeoutError: some peer did not answer within `timeout_seconds`; the
            message names each such task and its address.

    Example:

    ```python
    # on every worker of the job, before creating the strategy:
    wait_for_peers(60)
    ```
    """
    config = _this_task(cluster_resolver, environ)
    if config is None or config.task_type not in SYNCHRONOUS_TASK_TYPES:
        return config
    own = config.cluster[config.task_type][config.task_index]
    peers = {f"{task_type}:{index}": address
             for task_type in peer_types
             for index, address in enumerate(config.cluster.get(task_type, []))
             if address != own}
    if not peers:
        return config
    deadline = time.monotonic() + timeout_seconds
    with _answering(own, config.task):
        missing = {task: address for task, address in peers.items()
                   if not _reach(address, deadline)}
    if missing:
        listed = ", ".join(f"{task} ({address})" for task, address in missing.items())
        raise TimeoutError(
            f"{config.task} waited {timeout_seconds:g} s for the other tasks of the "
            f"job, but {listed} did not start: check that every task of TF_CONFIG "
            f"runs the same script (and, on a cluster, that the address is "
            f"reachable from here), or raise `timeout_seconds`.")
    _handed_to_tensorflow.add(own)
    return config


# The addresses whose port this process has handed to TensorFlow's server.
_handed_to_tensorflow = set()


def check_timeout_seconds(timeout_seconds):
    """Raises ValueError unless `timeout_seconds` is a number > 0.

    Example:

    >>> check_timeout_seconds(0)
    Traceback (most recent call last):
    ...
    ValueError: `timeout_seconds` must be a number > 0, got 0.
    """
    if not isinstance(timeout_seconds, (int, float)) or timeout_seconds <= 0:
        raise ValueError(f"`timeout_seconds` must be a number > 0, got {timeout_seconds!r}.")


def _this_task(cluster_resolver, environ):
    if cluster_resolver is None:
        return read_tf_config(environ)
    spec = cluster_resolver.cluster_spec().as_dict()
    if not spec or cluster_resolver.task_type is None:
        return None  # no cluster, or TensorFlow reports the missing task itself
    cluster = {task_type: list(addresses.values()) if isinstance(addresses, dict)
               else list(addresses) for task_type, addresses in spec.items()}
    return TFConfig(cluster, cluster_resolver.task_type, cluster_resolver.task_id)


@contextlib.contextmanager
def _answering(address, task):
    """Accepts (and drops) connections on `address`'s port while in the block.

    If the port is taken by this process's TensorFlow server (a second
    strategy), that server answers instead; taken by another process, the
    task could never serve: an OSError says so at once.
    """
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        host, port = address.rsplit(":", 1)
        # A loopback job (tfdist launch) listens on loopback only.
        local = host in ("127.0.0.1", "localhost")
        listener.bind((host if local else "", int(port)))
    except OSError as error:
        listener.close()
        if error.errno != errno.EADDRINUSE:
            raise
        if address not in _handed_to_tensorflow:
            raise OSError(
                error.errno,
                f"{task}'s address {address} (TF_CONFIG) is in use by another "
                f"process, so this task cannot serve there: stop that process, or "
                f"give the task a free port") from error
        yield
        return
    listener.listen(16)
    listener.settimeout(_RETRY_SECONDS)
    stop = threading.Event()

    def answer():
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            connection.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        listener.close()


def _reach(address, deadline):
    """Whether `host:port` accepts a TCP connection before `deadline` (monotonic)."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            with socket.create_connection((host, int(port)),
                                          timeout=min(remaining, 2.0)):
                return True
        except OSError:
            time.sleep(min(_RETRY_SECONDS, max(0.0, deadline - time.monotonic())))
