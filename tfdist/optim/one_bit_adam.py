"""1-bit Adam: Adam whose momentum, not gradient, crosses devices, as signs.

`OneBitAdam` (Tang et al. 2021, "1-bit Adam: Communication Efficient
Large-Scale Training with Adam's Convergence Speed"; DeepSpeed's
`OneBitAdam`) is Adam for its first `warmup_steps` steps, then Adam with its
variance frozen at the warm-up's last value: with the variance fixed, Adam's
update is linear in its momentum, so the replicas can average their momenta
instead of their gradients, and the momentum tolerates compression with error
feedback.

Alone (one device, or a strategy that does not compress) it is exactly that
optimizer. Under a tfdist strategy's data parallelism its step's reduce part
is `OneBitReduce` after a `WarmUp`: during the warm-up the gradients are
all-reduced as they are; then each replica computes its own momentum from its gradient,
`beta_1 * m + (1 - beta_1) * N * g` (the mean of which is Adam's momentum of
the global batch), adds its residual, and sends the signs, one bit per
element packed 32 to an int32, and one scale per tensor (its L2 norm over
the square root of its size); what the signs leave out is its next residual.
Each replica averages what every replica sent and hands the optimizer the
gradient that makes its momentum that average. After the warm-up a step
moves 1/32 of the gradient's bytes.

Example:

```python
strategy = tfdist.Strategy(data=4)
with strategy.scope():
    model = build_model()
    model.compile(optimizer=tfdist.optim.OneBitAdam(1e-3, warmup_steps=100), loss="mse")
model.fit(x, y)
```
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfdist._compat.keras_optimizer import variable_index
from tfdist.engine.compression import GatheredCompression
from tfdist.sharding.replica_state import ReplicaState
from tfdist.sharding.wire import summed_rows

_BITS = np.array([1, 2, 4, 8, 16, 32, 64, 128], np.int32)  # (no tensor at import)


class OneBitAdam(keras.optimizers.Optimizer):
    """Adam for `warmup_steps` steps, then Adam with its variance frozen; under
    a tfdist strategy's data parallelism, the replicas' momenta then cross
    devices as signs with error feedback (see the module).

    A frozen variance of zero (an element whose gradient was zero through the
    warm-up: a dead ReLU unit's weights) would make any later momentum of it
    an unbounded step, so after the warm-up each element's variance is taken
    as at least `variance_floor` times its weight's mean frozen variance.

    Args:
        learning_rate, beta_1, beta_2, epsilon: as `keras.optimizers.Adam`.
        warmup_steps: the steps of plain Adam (full-precision gradients)
            before the variance freezes and compression starts (>= 1).
        variance_floor: the floor's share of the weight's mean variance (>= 0).
        **kwargs: the base optimizer's (`weight_decay`, `clipnorm`, ...).

    Example:

    ```python
    model.compile(optimizer=tfdist.optim.OneBitAdam(1e-3, warmup_steps=100), loss="mse")
    ```
    """

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 warmup_steps=100, variance_floor=0.01, name="one_bit_adam", **kwargs):
        if not isinstance(warmup_steps, (int, np.integer)) or warmup_steps < 1:
            raise ValueError(f"`warmup_steps` must be an int >= 1, got {warmup_steps!r}.")
        if not variance_floor >= 0:
            raise ValueError(f"`variance_floor` must be >= 0, got {variance_floor!r}.")
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.warmup_steps = int(warmup_steps)
        self.variance_floor = variance_floor

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.momentums, self.velocities = self.add_optimizer_variables(
            var_list, ["momentum", "velocity"])

    def momentum(self, variable):
        """The momentum slot of `variable`.

        Example:

        ```python
        optimizer.momentum(model.layers[0].kernel)
        ```
        """
        return self.momentums[variable_index(self, variable)]

    def warming_up(self):
        """Whether the coming step is one of the warm-up's (a boolean tensor).

        Example:

        >>> bool(OneBitAdam(warmup_steps=2).warming_up())
        True
        """
        return self.iterations + 1 <= self.warmup_steps

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        step = ops.cast(self.iterations + 1, dtype)
        index = variable_index(self, variable)
        m, v = self.momentums[index], self.velocities[index]
        self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - self.beta_1))
        # The variance follows the gradients during the warm-up only, and
        # keeps the warm-up's bias correction after it.
        warm = ops.cast(ops.less_equal(step, self.warmup_steps), dtype)
        self.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v),
                                        (1 - self.beta_2) * warm))
        frozen = ops.minimum(step, ops.cast(self.warmup_steps, dtype))
        alpha = lr * ops.sqrt(1 - ops.power(ops.cast(self.beta_2, dtype), frozen)) / (
            1 - ops.power(ops.cast(self.beta_1, dtype), step))
        floor = (1 - warm) * self.variance_floor * ops.mean(v)
        self.assign_sub(variable, ops.divide(ops.multiply(m, alpha),
                                             ops.add(ops.sqrt(ops.maximum(v, floor)),
                                                     self.epsilon)))

    def get_config(self):
        config = super().get_config()
        config.update(beta_1=self.beta_1, beta_2=self.beta_2, epsilon=self.epsilon,
                      warmup_steps=self.warmup_steps, variance_floor=self.variance_floor)
        return config


class OneBitReduce(GatheredCompression):
    """The reduce part of a step whose optimizer is `OneBitAdam`, after its
    warm-up (`tfdist.engine.compression.WarmUp`): each replica's momentum as
    signs and a scale per tensor, with error feedback, averaged by every
    replica (see the module).

    Args:
        inner: the reduce part it stands for (`AllReduce`).
        optimizer: the model's `OneBitAdam` (built).
        mesh: the strategy's `replica_mesh` (N: its data group's size).

    Example:

    ```python
    reduce = OneBitReduce(AllReduce(), model.optimizer, strategy.replica_mesh)
    reduce.init(state_of(model), model.trainable_weights)   # the residuals
    reduce = WarmUp(reduce, model.optimizer.warming_up, strategy.replica_mesh)
    ```
    """

    name = "one_bit"

    def __init__(self, inner, optimizer: OneBitAdam, mesh):
        super().__init__(inner, mesh)
        self.optimizer = optimizer
        self.weights = self.residuals = None

    def init(self, state, weights):
        """Also creates each floating weight's zero residual in `state`."""
        super().init(state, weights)
        self.weights = list(weights)
        self.residuals = self._residuals(state, weights, "one_bit_residual")

    def encode(self, flats, positions):
        """[each momentum's signs, 32 to an int32; a float32 scale per tensor]."""
        beta = self.optimizer.beta_1
        replicas = tf.cast(self.mesh.data, tf.float32)
        signs, scales, done = [], [], []
        for flat, k in zip(flats, positions):
            # one weight at a time: each one's float32 temporaries made only
            # once the one before it is done
            with tf.control_dependencies(done):
                momentum = tf.reshape(
                    tf.cast(self.optimizer.momentum(self.weights[k]), tf.float32), [-1])
                local = beta * momentum + (1 - beta) * replicas * tf.cast(flat, tf.float32)
                local += tf.reshape(ReplicaState.own(self.residuals[k]), [-1])
                scale = tf.norm(local) / tf.sqrt(tf.cast(tf.size(local), tf.float32))
                positive = local >= 0
                done = [ReplicaState.assign_own(
                    self.residuals[k], local - tf.where(positive, scale, -scale))]
            signs.append(positive)
            scales.append(scale)
        return [_packed_bits(tf.concat(signs, 0)), tf.stack(scales)]

    def decode(self, gathered, sizes, positions):
        """The gradients that make each momentum the replicas' average."""
        packed, scales = gathered  # (N, words), (N, tensors)
        total, replicas = sum(sizes), self.mesh.data

        def replica(r):  # each tensor's signs as +-its scale (one replica at a time)
            bits = tf.split(_unpacked_bits(packed[r:r + 1])[0, :total], sizes)
            return [tf.where(b, scale, -scale)
                    for b, scale in zip(bits, tf.unstack(scales[r], len(sizes)))]

        beta = self.optimizer.beta_1
        return tf.concat([
            (total_k / replicas - beta * tf.reshape(
                tf.cast(self.optimizer.momentum(self.weights[k]), tf.float32), [-1])) / (1 - beta)
            for total_k, k in zip(summed_rows(replicas, replica), positions)], 0)


def _packed_bits(bits):
    """Booleans `bits` (n,) as int32 words, 32 to a word (zero-padded).

    Example:

    >>> words = _packed_bits(tf.constant([True, False, True] * 15))
    >>> words.shape, _unpacked_bits(words[tf.newaxis])[0, :4].numpy().tolist()
    (TensorShape([2]), [True, False, True, True])
    """
    padded = tf.pad(tf.cast(bits, tf.uint8), [[0, -bits.shape[0] % 32]])
    octets = tf.reduce_sum(tf.reshape(padded, [-1, 8]) * _BITS.astype(np.uint8), axis=1)
    return tf.bitcast(tf.reshape(octets, [-1, 4]), tf.int32)


def _unpacked_bits(words):
    """Each bit of the int32 `words` (N, w), as booleans: (N, 32 w)."""
    octets = tf.cast(tf.bitcast(words, tf.uint8), tf.int32)  # (N, w, 4)
    bits = tf.bitwise.bitwise_and(octets[..., tf.newaxis], _BITS) > 0  # (N, w, 4, 8)
    return tf.reshape(bits, [tf.shape(words)[0], -1])
