"""The pipeline cost model, one kind of layer at a time, on tiny layers."""

import keras
import numpy as np
import pytest

from tfdist.pipeline.cost import node_cost, sequence_length_of
from tfdist.pipeline.stages import plan_stages

SEQ, WIDTH, HEADS, KEY, VOCAB = 16, 8, 2, 4, 50


def call_node(layer, *inputs, **kwargs):
    """The node of `layer` called on `inputs` (keras.Input shapes) in a model."""
    symbolic = [keras.Input(shape) for shape in inputs]
    layer(*symbolic, **kwargs)
    return layer._inbound_nodes[-1]


def test_attention_costs_its_projections_and_the_sequence_squared_work():
    layer = keras.layers.MultiHeadAttention(HEADS, KEY)
    node = call_node(layer, (None, WIDTH), (None, WIDTH))
    projections = 2 * layer.count_params() * SEQ
    pairs = SEQ * SEQ * HEADS
    assert node_cost(node, SEQ) == projections + 2 * pairs * (KEY + KEY) + 5 * pairs
    # Twice the sequence: the projections double, the score work quadruples.
    assert node_cost(node, 2 * SEQ) == 2 * projections + 4 * (node_cost(node, SEQ)
                                                             - projections)


def test_an_embedding_costs_a_lookup_and_its_reverse_call_a_matmul():
    layer = keras.layers.ReversibleEmbedding(VOCAB, WIDTH)
    tokens = keras.Input((None,), dtype="int32")
    hidden = layer(tokens)
    layer(hidden, reverse=True)
    lookup, projection = layer._inbound_nodes
    assert node_cost(lookup, SEQ) == SEQ * WIDTH
    assert node_cost(projection, SEQ) == 2 * VOCAB * WIDTH * SEQ


def test_dense_and_einsum_dense_cost_their_matmul_over_every_position():
    dense = call_node(keras.layers.Dense(WIDTH * 4), (None, WIDTH))
    assert node_cost(dense, SEQ) == 2 * WIDTH * WIDTH * 4 * SEQ + SEQ * WIDTH * 4
    einsum = keras.layers.EinsumDense("abc,cde->abde", (None, HEADS, KEY))
    node = call_node(einsum, (None, WIDTH))
    assert node_cost(node, SEQ) == 2 * WIDTH * HEADS * KEY * SEQ


def test_normalization_costs_a_few_operations_per_element():
    node = call_node(keras.layers.LayerNormalization(), (None, WIDTH))
    assert node_cost(node, SEQ) == 5 * SEQ * WIDTH


def test_a_layer_of_sublayers_costs_the_sum_of_theirs():
    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.attention = keras.layers.MultiHeadAttention(HEADS, KEY)
            self.norm = keras.layers.LayerNormalization()

        def call(self, x):
            return self.norm(x + self.attention(x, x))

    block = Block()
    node = call_node(block, (None, WIDTH))
    parts = [call_node(keras.layers.MultiHeadAttention(HEADS, KEY), (None, WIDTH),
                       (None, WIDTH)),
             call_node(keras.layers.LayerNormalization(), (None, WIDTH))]
    assert node_cost(node, SEQ) == sum(node_cost(part, SEQ) for part in parts)


def test_unknown_layers_use_each_weight_once_per_output_position():
    conv = call_node(keras.layers.Conv1D(WIDTH, 3, padding="same"), (SEQ, WIDTH))
    weights = 3 * WIDTH * WIDTH + WIDTH
    assert node_cost(conv) == 2 * weights * SEQ + SEQ * WIDTH


def test_the_sequence_length_moves_the_cut_to_the_attention():
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 64, name="embed")(tokens)
    x = keras.layers.Dense(64, name="dense")(x)
    x = keras.layers.MultiHeadAttention(2, 32, name="attention")(x, x)
    model = keras.Model(tokens, keras.layers.Dense(4, name="out")(x))
    short = [[layer.name for layer in s.layers] for s in plan_stages(model, 2, None, 1)]
    long = [[layer.name for layer in s.layers] for s in plan_stages(model, 2, None, 4096)]
    assert short[0] == ["embed", "dense"] and long[1] == ["attention", "out"]


@pytest.mark.parametrize("length", [0, -1, 2.5, "512", True])
def test_a_bad_sequence_length_is_refused(length):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=rf"`sequence_length` must be a positive int .*"
                                         rf"got {length!r}"):
        plan_stages(model, 2, sequence_length=length)


def test_the_sequence_length_is_read_from_a_batch_where_the_inputs_leave_it_unknown():
    ids = keras.Input((None,), name="ids")
    mask = keras.Input((None,), name="mask")
    fixed = keras.Input((3,), name="fixed")
    inputs = [fixed, ids, mask]   # tree.flatten of a dict sorts its keys
    batch = {"ids": np.zeros((2, 7)), "mask": np.zeros((2, 7)), "fixed": np.zeros((2, 3))}
    assert sequence_length_of(inputs, batch) == 7
    assert sequence_length_of([fixed], np.zeros((2, 3))) is None
    assert sequence_length_of(inputs, np.zeros((2, 7))) is None   # not the inputs' structure
