"""What reaches a parameter-server fit's chief as a lost ps becomes one clear error.

A ps restarted on its address before TensorFlow's coordinator noticed it
died does not answer "unavailable": the steps in flight then fail with
"Unable to find the relevant tensor remote_handle", or a variable the new
ps does not hold. The multi-process drill is tests/cluster/test_ps.py.
"""

import pytest
import tensorflow as tf

from tfdist.cluster.tf_config import free_ports
from tfdist.ps.keras_fit import _ps_failure_explained

FROM_PS = ("Additional GRPC error information from remote target /job:ps/replica:0/task:0 "
           "while calling /tensorflow.eager.EagerService/RunComponentFunction")


@pytest.mark.parametrize("error", [
    tf.errors.UnavailableError(None, None, "Socket closed"),
    tf.errors.InvalidArgumentError(
        None, None, f"Unable to find the relevant tensor remote_handle: Op ID: 401\n{FROM_PS}"),
    tf.errors.AbortedError(None, None, f"Aborted\n{FROM_PS}"),
    tf.errors.NotFoundError(None, None, f"Resource localhost/dense/kernel does not exist\n"
                                        f"{FROM_PS}"),
], ids=["unavailable", "restarted-ps-handle", "aborted-from-ps", "variable-gone-from-ps"])
def test_a_lost_ps_is_said_so(error):
    with pytest.raises(RuntimeError, match=r"^A parameter server task became unreachable "
                                           r"during fit .*BackupAndRestore") as raised:
        with _ps_failure_explained({}):
            raise error
    assert raised.value.__cause__ is error


@pytest.mark.parametrize("error", [
    tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [32,4] vs. [32,3]"),
    tf.errors.NotFoundError(None, None, "No such file: weights.h5"),
    ValueError("a Python error of the model's own"),
])
def test_other_errors_pass_through_unchanged(error):
    with pytest.raises(type(error)) as raised:
        with _ps_failure_explained({}):
            raise error
    assert raised.value is error


def test_any_error_while_a_ps_task_is_down_is_said_so():
    # The coordinator may first report a worker's step cancelled by the loss.
    (port,) = free_ports(1)  # nothing listens there: the ps is down
    error = tf.errors.CancelledError(None, None, "RemoteExecuteNode::RunAsync")
    with pytest.raises(RuntimeError, match=rf"unreachable during fit \(ps:0 at "
                                           rf"127\.0\.0\.1:{port} is down\)") as raised:
        with _ps_failure_explained({"ps:0": f"127.0.0.1:{port}"}):
            raise error
    assert raised.value.__cause__ is error
