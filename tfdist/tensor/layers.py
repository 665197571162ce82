"""Explicit tensor-parallel layers for hand-written models.

Each is its Keras parent (same arguments, weights, checkpoints) whose weights,
when it is built under a tfdist strategy with `tensor` > 1, are split across
the tensor group by its layout (`Column`, `Row`, `Vocabulary` of
`tfdist.tensor.layouts`, the ones `plan` uses); anywhere else it is exactly
its parent.
"""

import keras
import tensorflow as tf

from tfdist.tensor.layouts import Column, Row, Vocabulary


def current_mesh():
    """The `TensorMesh` of the strategy in scope, or None (no tensor groups).

    Example:

    ```python
    with tfdist.Strategy(tensor=2).scope():
        current_mesh().tensor        # 2
    ```
    """
    return getattr(tf.distribute.get_strategy(), "tensor_mesh", None)


def _check_splittable(layer, what, value, mesh):
    for weight in layer.trainable_weights:
        if weight.constraint is not None:
            raise ValueError(
                f"Layer {layer.name!r} ({type(layer).__name__}): weight "
                f"{weight.path!r} has a constraint ({type(weight.constraint).__name__}), "
                f"which acts on the whole weight, not on one shard. Drop the "
                f"constraint, or use a plain keras.layers."
                f"{type(layer).__mro__[1].__name__} (replicated).")
    if value % mesh.tensor:
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}): {what}={value} is not "
            f"divisible by tensor={mesh.tensor}, so its weights cannot be split "
            f"into {mesh.tensor} equal shards. Use a {what} that is a multiple "
            f"of {mesh.tensor}, or a plain keras.layers.{type(layer).__mro__[1].__name__} "
            f"(replicated).")


@keras.saving.register_keras_serializable(package="tfdist")
class ColumnParallelDense(keras.layers.Dense):
    """A Dense whose output features (kernel columns, bias) are split over the
    tensor group; each device computes its slice of the output.

    Feed its output to a `RowParallelDense` (the Megatron MLP), or pass
    `gather_output=True` to get the whole output on every device.

    Args:
        units: as `keras.layers.Dense`; must be divisible by `tensor`.
        gather_output: all-gather the output slices (last axis).
        **kwargs: as `keras.layers.Dense`.

    Example:

    ```python
    with tfdist.Strategy(tensor=2).scope():
        mlp = keras.Sequential([keras.Input((64,)),
                                tfdist.layers.ColumnParallelDense(256, activation="gelu"),
                                tfdist.layers.RowParallelDense(64)])
    ```
    """

    def __init__(self, units, gather_output=False, **kwargs):
        super().__init__(units, **kwargs)
        self.gather_output = gather_output

    def build(self, input_shape):
        super().build(input_shape)
        mesh = current_mesh()
        if mesh is not None:
            _check_splittable(self, "units", self.units, mesh)
            Column(gather_output=self.gather_output).apply(self, mesh)

    def get_config(self):
        return {**super().get_config(), "gather_output": self.gather_output}


@keras.saving.register_keras_serializable(package="tfdist")
class RowParallelDense(keras.layers.Dense):
    """A Dense whose input features (kernel rows) are split over the tensor
    group: it takes a `ColumnParallelDense`'s sliced output, and the partial
    products are summed across the group (one all-reduce) before the bias.

    Args:
        units, **kwargs: as `keras.layers.Dense`; its input size must be
            divisible by `tensor`.

    Example:

    ```python
    tfdist.layers.RowParallelDense(64)   # after ColumnParallelDense(256)
    ```
    """

    def build(self, input_shape):
        super().build(input_shape)
        mesh = current_mesh()
        if mesh is not None:
            _check_splittable(self, "input size", input_shape[-1], mesh)
            Row().apply(self, mesh)


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelEmbedding(keras.layers.Embedding):
    """An Embedding whose table is split by vocabulary rows over the tensor
    group; each device looks up the ids it holds and the group sums.

    Args:
        input_dim, output_dim, **kwargs: as `keras.layers.Embedding`;
            `input_dim` must be divisible by `tensor`.

    Example:

    ```python
    tfdist.layers.ParallelEmbedding(32000, 512)   # 16000 rows per device at tensor=2
    ```
    """

    def build(self, input_shape=None):
        super().build(input_shape)
        mesh = current_mesh()
        if mesh is not None:
            _check_splittable(self, "input_dim", self.input_dim, mesh)
            Vocabulary().apply(self, mesh)
