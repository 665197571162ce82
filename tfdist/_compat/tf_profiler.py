"""TensorFlow's profiler trace format: the `XSpace` protocol buffer of an
`.xplane.pb` file (TensorFlow ships its module under `tensorflow.tsl`, which
is not a public API).

Example:

```python
from tfdist._compat.tf_profiler import read_xspace
space = read_xspace("logs/plugins/profile/run/host.xplane.pb")
[plane.name for plane in space.planes]   # ['/host:CPU', ...]
```
"""

from tensorflow.tsl.profiler.protobuf import xplane_pb2

XSpace = xplane_pb2.XSpace


def read_xspace(path) -> XSpace:
    """The `XSpace` stored in the `.xplane.pb` file at `path`."""
    space = XSpace()
    with open(path, "rb") as file:
        space.ParseFromString(file.read())
    return space


def write_xspace(space: XSpace, path):
    """Stores `space` in the `.xplane.pb` file at `path`."""
    with open(path, "wb") as file:
        file.write(space.SerializeToString())
