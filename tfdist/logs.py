"""TensorFlow's C++ log lines at an entry point's start, without importing TensorFlow.

TensorFlow reads `TF_CPP_MIN_LOG_LEVEL` once, when it first logs (during its
import), so the level must be in the environment before TensorFlow loads:
`quiet_tensorflow()` sets it (2: errors only) unless the user set it. The
`tfdist` command and the `keras_examples/` scripts call it first thing;
`import tfdist` does the same when TensorFlow is not loaded yet (a script that
imports `keras` or `tensorflow` first keeps TensorFlow's own default).
"""

import os
import sys

LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
DEFAULT_LEVEL = "2"  # errors only: no INFO (oneDNN, CPU features) nor WARNING lines


def quiet_tensorflow(discover_devices: bool = False) -> str:
    """Sets `TF_CPP_MIN_LOG_LEVEL` to 2 unless it is set; returns the level.

    With `discover_devices`, also imports TensorFlow and lists its physical
    devices now, with stderr silenced when the level is 2 or more and the
    host has no NVIDIA driver: TensorFlow's CUDA build then logs a `failed
    call to cuInit` ERROR line, which says only that there is no GPU.

    Example:

    ```python
    from tfdist.logs import quiet_tensorflow
    quiet_tensorflow()    # before keras / tensorflow are imported
    import keras
    ```
    """
    level = os.environ.setdefault(LEVEL_ENV, DEFAULT_LEVEL)
    if discover_devices:
        discover_devices_quietly()
    return level


_discovered = False


def discover_devices_quietly():
    """Lists TensorFlow's physical devices once, with stderr silenced when
    `TF_CPP_MIN_LOG_LEVEL` is 2 or more and the host has no NVIDIA driver (the
    `failed call to cuInit` ERROR line of TensorFlow's CUDA build then only
    says there is no GPU). tfdist calls it before it first looks at devices.

    Example:

    ```python
    discover_devices_quietly()
    tf.config.list_physical_devices("GPU")   # [] on this host, and no log line
    ```
    """
    global _discovered
    if _discovered:
        return
    level = os.environ.get(LEVEL_ENV, "0")
    quiet = level.isdigit() and int(level) >= 2 and not _has_nvidia_driver()
    with silenced_fds((2,)) if quiet else _nothing():
        import tensorflow as tf

        tf.config.list_physical_devices()
    _discovered = True


def _has_nvidia_driver() -> bool:
    return not sys.platform.startswith("linux") or os.path.exists("/proc/driver/nvidia")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


class silenced_fds:
    """Sends file descriptors `fds` to /dev/null, C++ output included.

    Example:

    ```python
    with silenced_fds((2,)):
        import tensorflow   # its C++ lines on stderr are dropped
    ```
    """

    def __init__(self, fds=(1, 2)):
        self._fds = fds

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = [os.dup(fd) for fd in self._fds]
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in self._fds:
            os.dup2(null, fd)
        os.close(null)
        return self

    def __exit__(self, *exc_info):
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip(self._fds, self._saved):
            os.dup2(saved, fd)
            os.close(saved)
        return False
