"""`quiet_server_logs`: no INFO dumps from TensorFlow's gRPC servers.

Every time a parameter-server chief connects, each worker and ps server logs
its whole `SessionOptions` protobuf at INFO (`eager_service_impl.cc`, about 20
lines per task). Those lines come from Abseil's C++ logging, which
`TF_CPP_MIN_LOG_LEVEL` does not reach in this TensorFlow build; only Abseil's
own minimum level does, and it has no Python binding, so it is set through
the exported symbol of TensorFlow's framework library.
"""

import ctypes
import os

import tensorflow as tf

# absl::log_internal::RawSetMinLogLevel(absl::LogSeverityAtLeast), Abseil LTS
# 2025-01-27 (the one TensorFlow 2.20 links).
_SET_MIN_LOG_LEVEL = ("_ZN4absl12lts_2025012712log_internal17RawSetMinLogLevel"
                      "ENS0_18LogSeverityAtLeastE")
_WARNING = 1


def quiet_server_logs() -> bool:
    """Raises the C++ log threshold of this process to WARNING.

    Does nothing when `TF_CPP_MIN_LOG_LEVEL=0` asks for TensorFlow's INFO
    logs, or when the library does not export the setter (another
    TensorFlow build). Returns whether the threshold was set.

    Example:

    ```python
    quiet_server_logs()   # before starting or connecting to servers
    ```
    """
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0":
        return False
    try:
        library = ctypes.CDLL(tf.sysconfig.get_lib() + "/libtensorflow_framework.so.2")
        set_min_log_level = getattr(library, _SET_MIN_LOG_LEVEL)
    except (OSError, AttributeError):
        return False
    set_min_log_level.argtypes = [ctypes.c_int]
    set_min_log_level(_WARNING)
    return True
