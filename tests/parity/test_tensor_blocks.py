"""Tensor parallelism inside keras-hub Transformer blocks (custom layers that
call their sublayers in `call`): attention split by heads and the MLP (gated
or not) column -> row in every block, Megatron's 2 + 2 all-reduces per block,
1/t of the blocks' weights per device, and parity with one device."""

import functools
import re

import keras
import numpy as np
import pytest

import tfdist
from helpers import (
    LLAMA_MEGATRON_LAYOUT,
    assert_parity,
    devices,
    layout_map,
    train,
    trained_reference,
)
from test_engine import executed_op_counts
from tfdist.tensor.plan import plan

keras_hub = pytest.importorskip("keras_hub")

SEQ, WIDTH, HEADS, FF, VOCAB, BLOCKS = 8, 16, 4, 32, 24, 2


def gpt2():
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=BLOCKS, num_heads=HEADS, hidden_dim=WIDTH,
        intermediate_dim=FF, max_sequence_length=SEQ, dropout=0.0)


def bert():
    return keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=BLOCKS, num_heads=HEADS, hidden_dim=WIDTH,
        intermediate_dim=FF, max_sequence_length=SEQ, dropout=0.0)


def llama():
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=BLOCKS, num_query_heads=HEADS,
        num_key_value_heads=HEADS // 2, hidden_dim=WIDTH, intermediate_dim=FF, dropout=0.0)


def gemma():
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=BLOCKS, num_query_heads=HEADS,
        num_key_value_heads=HEADS // 2, hidden_dim=WIDTH, intermediate_dim=FF,
        head_dim=WIDTH // HEADS, dropout=0.0)


def qwen3():
    return keras_hub.models.Qwen3Backbone(
        vocabulary_size=VOCAB, num_layers=BLOCKS, num_query_heads=HEADS,
        num_key_value_heads=HEADS // 2, hidden_dim=WIDTH, intermediate_dim=FF,
        head_dim=WIDTH // HEADS, layer_norm_epsilon=1e-6, dropout=0.0)


def bloom():
    return keras_hub.models.BloomBackbone(
        vocabulary_size=VOCAB, num_layers=BLOCKS, num_heads=HEADS, hidden_dim=WIDTH,
        intermediate_dim=FF, dropout=0.0)


def gpt_neox():
    return keras_hub.models.GPTNeoXBackbone(
        vocabulary_size=VOCAB, num_layers=BLOCKS, num_heads=HEADS, hidden_dim=WIDTH,
        intermediate_dim=FF, rotary_percentage=0.5, max_sequence_length=SEQ, dropout=0.0)


def mixtral():
    """Four experts, two per token; the router's load-balancing loss at 0.1
    of the model's loss (keras-hub's default: 0.02)."""
    return keras_hub.models.MixtralBackbone(
        vocabulary_size=VOCAB, num_layers=BLOCKS, num_query_heads=HEADS,
        num_key_value_heads=HEADS // 2, hidden_dim=WIDTH, intermediate_dim=FF, num_experts=4,
        top_k=2, router_aux_loss_coef=0.1, dropout=0.0)


BACKBONES = {"gpt2": gpt2, "bert": bert, "llama": llama, "gemma": gemma, "qwen3": qwen3,
             "bloom": bloom, "gpt_neox": gpt_neox, "mixtral": mixtral}


def make_lm(backbone, seed=0):
    """An unchanged keras-hub backbone with a token classifier on top."""
    keras.utils.set_random_seed(seed)
    body = BACKBONES[backbone]()
    features = body.output["sequence_output"] if backbone == "bert" else body.output
    model = keras.Model(body.input, keras.layers.Dense(VOCAB)(features))
    # SGD with momentum, as in test_tensor_transformer: Adam's first steps
    # would turn rounding-sized gradient differences into 2 lr.
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


# Each backbone's recipe, `make(seed=0)`: a partial of `make_lm`, whose text
# names the backbone (`helpers.recipe_text`), so its reference is cached too.
(make_gpt2, make_bert, make_llama, make_gemma, make_qwen3, make_bloom, make_gpt_neox,
 make_mixtral) = (functools.partial(make_lm, name) for name in (
    "gpt2", "bert", "llama", "gemma", "qwen3", "bloom", "gpt_neox", "mixtral"))

# The models of every mode's matrix (test_keras_hub_modes.py).
MAKERS = {"gpt2": make_gpt2, "bert": make_bert, "llama": make_llama, "gemma": make_gemma}

# What describe says of one block's sublayers: (name, layout), in order.
BLOCK_LAYOUTS = {
    "gpt2": [("self_attention", "heads"), ("self_attention_layer_norm", "replicated"),
             ("feedforward_intermediate_dense", "column"),
             ("feedforward_output_dense", "row"), ("feedforward_layer_norm", "replicated")],
    "bert": [("self_attention_layer", "heads"), ("self_attention_layer_norm", "replicated"),
             ("feedforward_layer_norm", "replicated"),
             ("feedforward_intermediate_dense", "column"),
             ("feedforward_output_dense", "row")],
    "llama": [("attention_output", "row"), ("value", "column"), ("key", "column"),
              ("query", "column"), ("self_attention_layernorm", "replicated"),
              ("feedforward_intermediate_dense", "column"),
              ("feedforward_gate_dense", "column"), ("feedforward_output_dense", "row"),
              ("feedforward_layernorm", "replicated")],
}
# Vocabulary-split embeddings (one forward all-reduce each; sparse gradients):
# BERT's segment embedding (2 rows) too. Position embeddings are sliced, not
# looked up: dense gradients, replicated.
EMBEDDINGS = {"gpt2": 1, "bert": 2, "llama": 1}


def lm_data(backbone, n=192, seed=0):
    """Next-token data: n / 16 steps (12 by default) of 16 examples."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(n, SEQ + 1)).astype("int32")
    tokens[:, 1::2] = (tokens[:, 0:-1:2] * 5 + 3) % VOCAB
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, SEQ), "int32")}
    if backbone == "bert":
        x["segment_ids"] = np.zeros((n, SEQ), "int32")
    return x, tokens[:, 1:]


def blocks(model):
    return [layer for layer in model.layers
            if "transformer_layer" in layer.name or "decoder_block" in layer.name]


def projection_kernels(block):
    """The kernels of a block's attention and MLP projections."""
    return [layer.kernel for layer in block._flatten_layers(include_self=False)
            if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))]


@pytest.mark.parametrize("data_size", [1, 2])
@pytest.mark.parametrize("backbone", ["gpt2", "bert", "llama"])
def test_blocks_split_by_heads_and_column_row_and_match_one_device(backbone, data_size):
    x, y = lm_data(backbone)
    make = MAKERS[backbone]
    reference = trained_reference(make=make, x=x, y=y, batch_size=16)
    n = data_size * 2
    strategy = tfdist.Strategy(data=data_size, tensor=2, devices=devices(n))
    result = train(strategy, make=make, x=x, y=y, batch_size=16)
    # 12 steps, fp32, dropout off: losses and final weights within 1e-4.
    assert_parity(result, reference, steps=12)
    model = result[2]

    # Block sublayers are named by path: transformer_layer_0/self_attention/query.
    rows = [(line.split()[0].split("/")[-1], line.split()[2])
            for line in strategy.describe(model).splitlines()]
    expected = BLOCK_LAYOUTS[backbone]
    windows = [rows[i:i + len(expected)] for i in range(len(rows))]
    assert windows.count(expected) == BLOCKS

    # Every block's attention and MLP kernels: 1/2 of their bytes per device.
    for block in blocks(model):
        kernels = projection_kernels(block)
        assert len(kernels) == (7 if backbone == "llama" else 6)  # q, k, v, o, MLP
        full = sum(np.prod(k.shape) * 4 for k in kernels)
        for device in range(n):
            held = sum(k.value.values[device].shape.num_elements()
                       * k.value.values[device].dtype.size for k in kernels)
            assert held * 2 == full

    # Megatron: per block, the attention's and the MLP's all-reduce forward,
    # their inputs' gradients' backward; one forward per vocabulary-split
    # embedding; the packed all-reduce of the gradients and metric states
    # across data groups; the row count's over every replica.
    counts = executed_op_counts(model)
    per_replica = BLOCKS * (2 + 2) + EMBEDDINGS[backbone] + (data_size > 1) + 1
    assert counts["CollectiveReduceV2"] == n * per_replica
    # The tensor group exchanges its batch: x's arrays and y together (all
    # int32: the columns of one matrix; the trace counts the slices' rows, so
    # no rank's row count is exchanged). Across data groups each Embedding's
    # sparse gradient is gathered, not summed: its values and indices, as
    # they are (the exchanged batch's rows are known to the trace too).
    sparse = (data_size > 1) * 2 * EMBEDDINGS[backbone]
    assert counts["CollectiveGatherV2"] == n * (1 + sparse)


def trained_at_tensor_2(make, backbone):
    """The model of recipe `make` trained at tensor=2 on `backbone`'s data,
    checked against one device (12 steps, rtol 1e-4), and describe's rows:
    {layer path: [layout, reason]}."""
    x, y = lm_data(backbone)
    reference = trained_reference(make=make, x=x, y=y, batch_size=16)
    strategy = tfdist.Strategy(tensor=2, devices=devices(2))
    losses, weights, model = train(strategy, make=make, x=x, y=y, batch_size=16)
    assert_parity((losses, weights, model), reference, steps=12)
    return model, {line.split()[0]: line.split(None, 3)[2:]
                   for line in strategy.describe(model).splitlines()}


def test_gemma_splits_its_attention_by_hidden_features_and_its_gated_mlp():
    """Gemma's attention kernels hold the heads first, (heads, d, size), and
    its call reshapes by its own head counts: not split by heads, but by
    hidden features (query/key/value over their inputs' features, the
    attention whole on every device, the output over its input's heads).
    Its MLP is EinsumDense matrix products ("btd,df->btf"): gate and up
    column, down row."""
    model, rows = trained_at_tensor_2(make_gemma, "gemma")
    for block in blocks(model):
        layouts = {name.split("/")[-1]: layout for name, (layout, _) in rows.items()
                   if name.startswith(block.name + "/")}
        assert layouts == {"pre_attention_norm": "replicated", "query": "row",
                           "key": "row", "value": "row", "attention_output": "row",
                           "pre_ffw_norm": "replicated", "ffw_gating": "column",
                           "ffw_gating_2": "column", "ffw_linear": "row"}
        assert "holds its heads on axis 0" in rows[f"{block.name}/attention/query"][1]
        kernels = projection_kernels(block)
        assert len(kernels) == 7
        for device in range(2):
            assert sum(k.value.values[device].shape.num_elements() for k in kernels) * 2 == sum(
                np.prod(k.shape) for k in kernels)
    # Per block: forward the all-reduces of query, key, value, the attention
    # output and the MLP; backward the MLP input's gradient (the attention
    # inputs' gradients are all-gathered); the embedding's forward; the row
    # count's (one data group: the metric states need no sum).
    counts = executed_op_counts(model)
    assert counts["CollectiveReduceV2"] == 2 * (BLOCKS * (5 + 1) + 1 + 1)


def test_qwen3_normalises_each_devices_query_and_key_heads():
    """Qwen3's attention normalises each query and key head (an RMS norm
    over the head's features, a weight of head size): split by heads, each
    device normalises its own heads, and each norm's weight, whole on every
    device, gets its gradient summed over the tensor group."""
    model, rows = trained_at_tensor_2(make_qwen3, "qwen3")
    for block in blocks(model):
        layouts = {name.split("/")[-1]: layout for name, (layout, _) in rows.items()
                   if name.startswith(block.name + "/self_attention/")}
        assert layouts == {"query": "column", "key": "column", "value": "column",
                           "attention_output": "row", "query_dense_layernorm": "per-slice",
                           "key_dense_layernorm": "per-slice"}
    # The blocks' parameters per device: a half, but for their norms.
    weights = [w for block in blocks(model) for w in block.trainable_weights]
    total = sum(np.prod(w.shape) for w in weights)
    for device in range(2):
        held = sum(w.value.values[device].shape.num_elements() for w in weights)
        assert held / total <= 0.55


@pytest.mark.parametrize("backbone", ["bloom", "gpt_neox"])
def test_attention_reshaping_by_its_own_head_count_splits_by_hidden_features(backbone):
    """Bloom's attention reshapes its heads to the hidden size by its own head
    count before a Dense output projection (and adds ALiBi biases by head);
    GPT-NeoX's projects query, key and value in one layer and its call
    returns an absent cache (None) the planner's trace must get through.
    Neither can run on a device's heads: both are split by hidden features
    (each projection over its input's features, the attention whole, the
    output over its input's features), every attention weight 1/2 per device."""
    make = {"bloom": make_bloom, "gpt_neox": make_gpt_neox}[backbone]
    model, rows = trained_at_tensor_2(make, backbone)
    for block in blocks(model):
        attention = [name for name in rows if name.startswith(block.name + "/self_attention/")]
        assert len(attention) == (4 if backbone == "bloom" else 2)
        assert {rows[name][0] for name in attention} == {"row"}
        kernels = projection_kernels(block)
        for device in range(2):
            assert sum(k.value.values[device].shape.num_elements() for k in kernels) * 2 == sum(
                np.prod(k.shape) for k in kernels)


@pytest.mark.parametrize("tensor", [1, 2])
@pytest.mark.parametrize("backbone", ["gpt2", "bert", "llama", "gemma"])
def test_backbone_in_pipeline_stages_matches_one_device(backbone, tensor):
    """Stages cut inside the backbone (a nested functional model), 1F1B over
    2 microbatches; with tensor=2 each stage's blocks split over its devices."""
    x, y = lm_data(backbone)
    make = MAKERS[backbone]
    reference = trained_reference(make=make, x=x, y=y, batch_size=16)
    strategy = tfdist.Strategy(pipeline=2, tensor=tensor, microbatches=2, schedule="1f1b",
                               devices=devices(2 * tensor))
    result = train(strategy, make=make, x=x, y=y, batch_size=16)
    assert_parity(result, reference, steps=12)
    described = strategy.describe(result[2])
    assert re.search(r"^stage 1 .*(transformer_layer|decoder_block)_1", described,
                     re.M), described


@pytest.mark.parametrize("schedule, virtual, tensor, remat", [
    ("zb1", 1, 1, False), ("zb1", 1, 2, True),
    ("interleaved", 2, 1, True), ("interleaved", 2, 2, False),
    ("zbv", 2, 1, True), ("zbv", 2, 2, False)])
def test_gpt2_backbone_under_zero_bubble_and_interleaved_schedules(
        schedule, virtual, tensor, remat):
    x, y = lm_data("gpt2", n=20 * 16)   # 20 steps
    reference = trained_reference(make=make_gpt2, x=x, y=y, batch_size=16)
    strategy = tfdist.Strategy(pipeline=2, tensor=tensor, microbatches=2, schedule=schedule,
                               virtual_stages=virtual, remat=remat,
                               devices=devices(2 * tensor))
    result = train(strategy, make=make_gpt2, x=x, y=y, batch_size=16)
    assert_parity(result, reference, steps=20)
    described = strategy.describe(result[2])
    assert len(re.findall(r"^stage \d", described, re.M)) == 2 * virtual, described


def test_llama_trained_from_a_layout_map_of_the_same_plan_is_identical():
    x, y = lm_data("llama")
    own = train(tfdist.Strategy(tensor=2, devices=devices(2)), make=make_llama, x=x, y=y,
                batch_size=16)
    strategy = tfdist.Strategy(tensor=2, devices=devices(2),
                               layout_map=layout_map(LLAMA_MEGATRON_LAYOUT))
    mapped = train(strategy, make=make_llama, x=x, y=y, batch_size=16)
    # The same layouts, line by line (the head's name differs: a second model).
    assert [line.split()[1:3] for line in strategy.describe(mapped[2]).splitlines()] == [
        line.split()[1:3] for line in strategy.describe(own[2]).splitlines()]
    np.testing.assert_array_equal(mapped[0], own[0])
    for a, b in zip(mapped[1], own[1]):
        np.testing.assert_array_equal(a, b)
    # The map is what fit follows: without its MLP entries, the MLPs stay whole.
    attention_only = {key: axes for key, axes in LLAMA_MEGATRON_LAYOUT.items()
                      if "feedforward" not in key}
    strategy = tfdist.Strategy(tensor=2, devices=devices(2),
                               layout_map=layout_map(attention_only))
    with strategy.scope():
        model = make_llama()
    model.fit({k: v[:16] for k, v in x.items()}, y[:16], batch_size=16, verbose=0)
    for block in blocks(model):
        for layer in block._flatten_layers(include_self=False):
            if layer.name.startswith("feedforward_") and layer.weights:
                kernel = layer.weights[0]
                assert all(v.shape == kernel.shape for v in kernel.value.values), layer.path
        query = block._self_attention_layer._query_dense.kernel
        assert [v.shape for v in query.value.values] == [(WIDTH, HEADS // 2, WIDTH // HEADS)] * 2


@pytest.mark.parametrize("data_size", [1, 2])
def test_llama_trained_from_keras_hubs_own_layout_map_matches_one_device(data_size):
    """keras-hub's `LlamaBackbone.get_layout_map(mesh)`, unchanged: query /
    key / value split along the hidden axis, the attention output by heads,
    the MLP column -> row, weights also on the data axis (with 2 data
    replicas: zero=3, which shards every weight over them)."""
    x, y = lm_data("llama")
    reference = trained_reference(make=make_llama, x=x, y=y, batch_size=16)
    n = 2 * data_size
    mesh = keras.distribution.DeviceMesh((data_size, 2), ("batch", "model"),
                                         [f"cpu:{i}" for i in range(n)])
    strategy = tfdist.Strategy(
        data=data_size, tensor=2, zero=3 if data_size > 1 else 0, devices=devices(n),
        layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh))
    result = train(strategy, make=make_llama, x=x, y=y, batch_size=16)
    assert_parity(result, reference, steps=12)
    model = result[2]
    for block in blocks(model):
        kernels = projection_kernels(block)
        full = sum(np.prod(k.shape) for k in kernels)
        for device in range(n):
            held = sum(k.value.values[device].shape.num_elements() for k in kernels)
            assert held * 2 * data_size == full
    if data_size == 1:
        # Per block forward: query, key, value, the attention output and the
        # MLP summed; backward the MLP input's gradient (the attention's
        # input gradients are all-gathered); the embedding's forward; the row
        # count's (one data group: the metric states need no sum).
        counts = executed_op_counts(model)
        assert counts["CollectiveReduceV2"] == 2 * (BLOCKS * (5 + 1) + 1 + 1)


class Block(keras.layers.Layer):
    """A custom MLP block: up -> (activation) -> down, optionally reading
    the hidden features twice."""

    def __init__(self, activation="relu", reuse_hidden=False, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(FF, activation=activation, name="up")
        self.down = keras.layers.Dense(WIDTH, name="down")
        self.reuse_hidden = reuse_hidden

    def build(self, input_shape):
        self.up.build(input_shape)
        self.down.build((*input_shape[:-1], FF))

    def call(self, x):
        hidden = self.up(x)
        y = self.down(hidden)
        return y + keras.ops.mean(hidden, axis=-1, keepdims=True) if self.reuse_hidden else y


def reasons(model, tensor):
    return {(d.name.split("/")[-1], d.layout.name, d.reason) for d in plan(model, tensor)}


def test_describe_says_why_block_sublayers_stay_whole():
    def custom(**kwargs):
        inputs = keras.Input((SEQ, WIDTH))
        return keras.Model(inputs, Block(**kwargs)(inputs))

    assert {r[:2] for r in reasons(custom(), 2)} == {("up", "column"), ("down", "row")}
    assert ("down", "replicated", "its column partner up: activation 'softmax' is not "
            "elementwise") in reasons(custom(activation="softmax"), 2)
    assert ("down", "replicated", "the output of up is read elsewhere too") in reasons(
        custom(reuse_hidden=True), 2)
    # Grouped-query attention: 2 key/value heads do not split 4 ways, the
    # attention is split by hidden features; the gated MLP by units.
    found = reasons(llama(), 4)
    assert {(name, "row") for name in ("query", "key", "value", "attention_output")} <= {
        r[:2] for r in found}
    assert all(r[2].endswith("not by heads: key's 2 heads are not divisible by tensor=4")
               for r in found if r[0] in ("query", "key", "value"))
    # Neither: 3 divides no head count nor the 16 hidden features.
    why = ("attention left whole: query's 4 heads are not divisible by tensor=3; query's "
           "input features are not divisible by tensor=3")
    assert {(name, "replicated", why) for name in ("query", "key", "value",
                                                   "attention_output")} <= reasons(llama(), 3)
    assert {r[:2] for r in found if r[0].startswith("feedforward_") and "dense" in r[0]} == {
        ("feedforward_gate_dense", "column"), ("feedforward_intermediate_dense", "column"),
        ("feedforward_output_dense", "row")}

