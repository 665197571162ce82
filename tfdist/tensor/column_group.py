"""Projections of one group that read one input through one shared operator.

A gated MLP's gate and up projections, or an attention layer's query, key and
value projections, each split by output features, read the same input: one
`mesh.copy` ("f": identity forward, all-reduce of the gradient backward) of it
serves them all, so a block keeps Megatron's one backward all-reduce per
column-parallel group. Split by input features instead (`RowOfSlicedInput`:
attention's projections along the hidden axis, as keras-hub's Llama
`get_layout_map` asks), they share one `mesh.take_slice` of it (one
all-gather of the gradient backward).
"""

import threading

from tfdist._compat import keras_layers
from tfdist.tensor.layouts import Column, Row


class SharedInput:
    """The operator on the input a group of layers reads ("f", or this
    rank's slice of it): made by the first of them, reused by the others
    while they read the same tensor (per replica: each replica's thread keeps
    its own).

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
        return self._once(inputs, lambda: mesh.copy(inputs))

    def take_slice(self, mesh, inputs, axis):
        """`mesh.take_slice(inputs, axis)`, once per distinct tensor read in a row."""
        return self._once(inputs, lambda: mesh.take_slice(inputs, axis))

    def _once(self, inputs, make):
        last = getattr(self._last, "pair", None)
        if last is None or last[0] is not inputs:
            last = self._last.pair = (inputs, make())
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


class RowOfSlicedInput(Row):
    """A `Row` layer reading a whole input (the same on every rank): each
    rank takes its slice of the input along `input_axis` (shared with its
    group), multiplies it by its rows of the kernel, and the group sums.

    Args:
        shared: the group's `SharedInput`.
        input_axis: the input axis to slice; the kernel is split along the
            axis the layer contracts it with (a Dense: -1 and kernel axis 0;
            attention's query "btd,dnh->btnh": -1 and 0; its output
            "btnh,nhd->btd": -2, the heads, and 0).

    Example:

    ```python
    shared = SharedInput()
    for projection in (query, key, value):   # (d, heads, size) -> (d/t, heads, size)
        RowOfSlicedInput(shared, -1).apply(projection, mesh)
    RowOfSlicedInput(SharedInput(), -2).apply(output, mesh)   # (heads/t, size, d)
    ```
    """

    def __init__(self, shared, input_axis=-1):
        self.shared = shared
        self.input_axis = input_axis

    def weight_axes(self, layer):
        """The kernel along the axis the sliced input axis meets (the plan
        checked there is one)."""
        return [(keras_layers.kernel_variable(layer), kernel_axis(layer, self.input_axis))]

    def sharded_call(self, layer, mesh, inputs, training=None):
        """The partial products of this rank's input slice, summed ("g")."""
        return super().sharded_call(
            layer, mesh, self.shared.take_slice(mesh, inputs, self.input_axis))


def kernel_axis(layer, input_axis):
    """The kernel axis a Dense / EinsumDense contracts input axis `input_axis`
    with (None if the equation does not name one).

    Example:

    >>> import keras
    >>> kernel_axis(keras.layers.EinsumDense("btnh,nhd->btd", (None, 8)), -2)
    0
    >>> kernel_axis(keras.layers.EinsumDense("btd,ndh->btnh", (None, 2, 4)), -1)
    1
    """
    equation = getattr(layer, "equation", None)
    if equation is None:  # Dense: (..., d) x (d, units)
        return 0 if input_axis == -1 else None
    data, kernel = equation.replace(" ", "").split("->")[0].split(",")
    letter = data[input_axis]
    return kernel.index(letter) if letter.isalpha() and letter in kernel else None
