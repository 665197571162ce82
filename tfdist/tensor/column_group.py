"""Column-parallel projections that read one input through one Megatron "f".

A gated MLP's gate and up projections, or an attention layer's query, key and
value projections, each split by output features, read the same input: one
`mesh.copy` ("f": identity forward, all-reduce of the gradient backward) of it
serves them all, so a block keeps Megatron's one backward all-reduce per
column-parallel group.
"""

import threading

from tfdist.tensor.layouts import Column


class SharedInput:
    """The "f" of the input a group of column-parallel layers reads: made by
    the first of them, reused by the others while they read the same tensor
    (per replica: each replica's thread keeps its own).

    Example:

    ```python
    shared = SharedInput()
    gate = ColumnOfGroup(shared)
    up = ColumnOfGroup(shared)   # gate(x), up(x): one mesh.copy(x)
    ```
    """

    def __init__(self):
        self._last = threading.local()

    def copy(self, mesh, inputs):
        """`mesh.copy(inputs)`, once per distinct tensor read in a row."""
        last = getattr(self._last, "pair", None)
        if last is None or last[0] is not inputs:
            last = self._last.pair = (inputs, mesh.copy(inputs))
        return last[1]


class ColumnOfGroup(Column):
    """A `Column` layer whose input's "f" is shared with its group.

    Args:
        shared: the group's `SharedInput`.
        axis: the kernel's output axis to split (-2 for (d, heads, size)
            attention projections).

    Example:

    ```python
    shared = SharedInput()
    ColumnOfGroup(shared).apply(gate_dense, mesh)
    ColumnOfGroup(shared).apply(up_dense, mesh)
    Row().apply(down_dense, mesh)
    ```
    """

    def __init__(self, shared, axis=-1):
        super().__init__(axis=axis, copy_input=False)
        self.shared = shared

    def sharded_call(self, layer, mesh, inputs, training=None):
        """This rank's slice of the output, its input through the group's "f"."""
        return super().sharded_call(layer, mesh, self.shared.copy(mesh, inputs))
