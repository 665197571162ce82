"""ZeRO-3 (`zero=3`, sharded parameters): parity with zero=0 on the same mesh
and with one device, what each device keeps, what a step gathers at once and
sends, checkpoints, evaluate and predict, refusals."""

import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import (
    FLOAT16_CPU,
    assert_parity,
    data,
    devices,
    make_model,
    step_ops,
    step_peak_bytes,
    train,
    trained_reference,
)
from test_tensor_transformer import lm_data, make_lm
from test_zero import _step_graph
from tfdist.callbacks.metrics import variable_bytes
from tfdist.optim.zero3 import plan_units
from tfdist.pipeline.placement import component_devices
from tfdist.pipeline.schedule import stage_device
from tfdist.sharding import collectives

keras_hub = pytest.importorskip("keras_hub")

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.05),
}
_RECIPES = {}


def lm(optimizer):
    """The Transformer LM (Embedding, MultiHeadAttention, Dense pair,
    LayerNormalization, vocabulary classifier) compiled with `optimizer`: one
    recipe per name, so that `trained_reference` trains each once."""
    if optimizer not in _RECIPES:
        def make(seed=0):
            model = make_lm(seed)
            model.compile(optimizer=OPTIMIZERS[optimizer](), loss=model.loss)
            return model
        _RECIPES[optimizer] = make
    return _RECIPES[optimizer]


def lm_run(n, optimizer, tensor=1, **config):
    x, y = lm_data()
    return train(tfdist.Strategy(data=n, tensor=tensor, devices=devices(n * tensor), **config),
                 make=lm(optimizer), x=x, y=y, batch_size=16)


@functools.cache
def zero0_lm_run(n, optimizer, tensor=1, microbatches=1):
    """`lm_run` at zero=0 on the same mesh, trained once for every test of
    this module that compares against it (its results are only read)."""
    return lm_run(n, optimizer, tensor, microbatches=microbatches)


@pytest.mark.parametrize("n, optimizer, microbatches, tensor", [
    (2, "sgd", 1, 1), (4, "adam", 1, 1), (8, "adamw", 1, 1), (2, "adam", 2, 1),
    (2, "adamw", 2, 2)])
def test_transformer_lm_matches_zero0_and_one_device(n, optimizer, microbatches, tensor):
    x, y = lm_data()
    result = lm_run(n, optimizer, tensor, zero=3, microbatches=microbatches)
    plain = zero0_lm_run(n, optimizer, tensor, microbatches)
    # The same arithmetic as zero=0 on the same mesh except the order of the
    # gradient sums (reduce-scattered per microbatch, summed after).
    assert_parity(result, plain, rtol=1e-5, atol=1e-6)
    assert_parity(result, trained_reference(make=lm(optimizer), x=x, y=y, batch_size=16))
    # Every trainable weight is held as n element shards, one per device (of
    # each tensor rank's slice: 1/tensor of a weight the tensor group splits).
    for weight, unsharded in zip(result[2].trainable_weights, plain[2].trainable_weights):
        components = weight.value.values
        local = unsharded.value.values[0].shape.num_elements()  # a rank's slice
        assert len({c.device for c in components}) == n * tensor
        assert [c.shape for c in components] == [(-(-local // n),)] * (n * tensor)
    if n == 4 or tensor > 1:  # evaluate and predict compute with the parameters gathered:
        # as one device holding the same weights
        sharded, one_device = result[2], lm(optimizer)()
        one_device.set_weights(result[1])
        x, y = x[:64], y[:64]
        np.testing.assert_allclose(sharded.evaluate(x, y, batch_size=16, verbose=0),
                                   one_device.evaluate(x, y, batch_size=16, verbose=0),
                                   rtol=1e-5)
        np.testing.assert_allclose(sharded.predict(x, batch_size=16, verbose=0),
                                   one_device.predict(x, batch_size=16, verbose=0),
                                   rtol=1e-5, atol=1e-6)


def test_mixed_float16_matches_zero0_on_the_same_mesh():
    # Without gradients summed across units: the same arithmetic, Adam included.
    def make():
        return make_model(optimizer=keras.optimizers.Adam(1e-2))

    for zero in (0, 3):
        strategy = tfdist.Strategy(data=2, zero=zero, precision="mixed_float16",
                                   devices=devices(2))
        runs = locals().get("runs", []) + [train(strategy, make=make)]
    if FLOAT16_CPU:  # units fuse differently (helpers.FLOAT16_CPU): measured
        # 9.0e-5 relative in the losses, 6.8e-3 in weights after 20 Adam steps
        assert_parity(runs[1], runs[0], rtol=1e-3, atol=1e-2)
    else:
        assert_parity(runs[1], runs[0], rtol=1e-5, atol=1e-6)
    scaler, ref_scaler = runs[1][2].optimizer, runs[0][2].optimizer
    assert float(scaler.dynamic_scale.numpy()) == float(ref_scaler.dynamic_scale.numpy())
    # The LM's embedding output feeds attention and the residual in the unit
    # after it: its float16 gradient is summed by that unit's tape, in another
    # order than the whole model's tape sums it (4 terms; 1e-3 apart in float16).
    result = lm_run(2, "sgd", zero=3, precision="mixed_float16")
    reference = lm_run(2, "sgd", precision="mixed_float16")
    np.testing.assert_allclose(result[0], reference[0], rtol=1e-4)
    for weight, other in zip(result[1], reference[1]):
        np.testing.assert_allclose(weight, other, atol=1e-3)
    # Gathered in the dtype each layer computes with: float16, except the
    # LayerNormalization weights and the embedding table (Keras reads both in
    # float32: their layers do not autocast).
    model = result[2]
    gathers, _ = _gathers_and_scatters(_step_graph(model), "CPU:0")
    received = {}
    for op in gathers:
        if "/gather/" in op.name:
            received[op.inputs[0].dtype.name] = (received.get(op.inputs[0].dtype.name, 0)
                                                 + _received_bytes(op, 2))
    normalized = {id(w) for layer in model.layers
                  if isinstance(layer, (keras.layers.LayerNormalization, keras.layers.Embedding))
                  for w in layer.trainable_weights}
    head = model.layers[-1]  # the vocabulary classifier, the last unit
    elements = {False: 0, True: 0}
    for w in model.trainable_weights:
        # Forward and backward: each weight gathered twice; the last unit's once.
        times = 1 if any(w is v for v in head.trainable_weights) else 2
        elements[id(w) in normalized] += times * 2 * -(-w.shape.num_elements() // 2)
    assert received == {"float16": 2 * elements[False], "float32": 4 * elements[True]}
    assert (f"gathered {2 * head.count_params():,} B  per device "
            f"{4 * sum(-(-w.shape.num_elements() // 2) for w in head.weights):,} B  "
            f"layers: {head.name}") in model.distribute_strategy.describe(model)


@pytest.mark.parametrize("schedule, virtual, precision", [
    ("1f1b", 1, "float32"), ("zbv", 2, "mixed_float16")])
def test_pipeline_stages_gather_their_parameters_over_their_data_group(
        schedule, virtual, precision):
    x, y = lm_data()

    def run(**config):
        strategy = tfdist.Strategy(data=2, pipeline=2, microbatches=2, remat=True,
                                   schedule=schedule, virtual_stages=virtual,
                                   precision=precision, devices=devices(4), **config)
        return train(strategy, make=lm("adam"), x=x, y=y, batch_size=16)

    result, plain = run(zero=3), run()
    if precision == "float32":
        assert_parity(result, plain, rtol=1e-5, atol=1e-6)
        assert_parity(result, trained_reference(make=lm("adam"), x=x, y=y, batch_size=16))
        np.testing.assert_allclose(result[2].evaluate(x[:64], y[:64], batch_size=16, verbose=0),
                                   plain[2].evaluate(x[:64], y[:64], batch_size=16, verbose=0),
                                   rtol=1e-5)
    else:  # float16 gradients summed per stage, as in the unit test above
        np.testing.assert_allclose(result[0], plain[0], rtol=1e-4)
        for weight, other in zip(result[1], plain[1]):
            np.testing.assert_allclose(weight, other, atol=1e-3)
    # Each weight is held as two shards, where zero=0 keeps its two copies
    # (its stage's device of each data replica).
    for weight, unsharded in zip(result[2].trainable_weights, plain[2].trainable_weights):
        shards = weight.value.values
        assert [s.device for s in shards] == component_devices(unsharded)
        assert [s.shape for s in shards] == [(-(-weight.shape.num_elements() // 2),)] * 2
    # A stage's gathers run on its device, among the two replicas' copies of
    # it: replica r's stage s is on CPU:(2r + its device index).
    gathers = [op for op in _step_graph(result[2]).get_operations()
               if op.type == "CollectiveGatherV2" and "/gather/" in op.name]
    stages = {int(re.search(r"stage(\d+)/", op.name).group(1)) for op in gathers}
    assert stages == set(range(2 * virtual))
    for op in gathers:
        stage = int(re.search(r"stage(\d+)/", op.name).group(1))
        index = stage_device(schedule, stage, 2)
        assert op.device.endswith((f"CPU:{index}", f"CPU:{2 + index}")), (op.name, op.device)
        assert op.inputs[1].op.get_attr("value").int_val == [2]  # the group's size
    if precision == "mixed_float16":
        assert {op.inputs[0].dtype.name for op in gathers} == {"float16", "float32"}
    # What describe says each stage's device keeps is what it holds.
    model = result[2]
    lines = model.distribute_strategy.describe(model).splitlines()
    held = variable_bytes(model.trainable_weights)
    own = [0, 0]  # by pipeline device index: its stages' "per device" bytes
    for stage in range(2 * virtual):
        (line,) = [line for line in lines if line.startswith(f"stage {stage}  params")]
        own[stage_device(schedule, stage, 2)] += int(
            re.search(r"per device ([\d,]+) B", line).group(1).replace(",", ""))
    for index in range(2):
        assert held[f"CPU:{index}"] == held[f"CPU:{2 + index}"] == own[index]
    # Each stage's gradients are reduce-scattered on its own device, among
    # the two replicas' copies of it: a device receives its stages' whole
    # gradients, not the model's (the whole model's were once moved to the
    # replica's own device first).
    scattered = [0, 0]  # by pipeline device index: bytes entering its reduce-scatters
    for op in _step_graph(result[2]).get_operations():
        if op.type == "CollectiveAllToAllV2":
            cpu = int(op.device.rpartition(":")[2])
            assert op.inputs[1].op.get_attr("value").int_val == [2], op.name
            if cpu < 2:  # replica 0's devices
                rows = op.inputs[0]
                scattered[cpu] += rows.shape.num_elements() * rows.dtype.size
    # (the rows of two shards each, every weight float32: twice what it keeps;
    # the embedding's slices, on stage 0, are gathered instead)
    sliced = sum(2 * -(-w.shape.num_elements() // 2) * 4 for layer in model.layers
                 if isinstance(layer, keras.layers.Embedding) for w in layer.trainable_weights)
    assert scattered == [2 * own[0] - sliced, 2 * own[1]], (scattered, own, sliced)
    assert sum(held.values()) // 2 == int(re.search(
        r"([\d,]+) B per replica", lines[[k for k, line in enumerate(lines)
                                          if line.startswith("zero=3 over")][0]]).group(1)
        .replace(",", ""))


def test_a_weight_two_stages_share_is_refused_with_pipeline_before_the_first_step():
    from test_tensor_blocks import lm_data as tokens
    from test_tied_embeddings import make_causal_lm

    strategy = tfdist.Strategy(data=2, pipeline=2, microbatches=2, remat=True, zero=3,
                               devices=devices(4))
    with strategy.scope():
        model = make_causal_lm()
    x, y = tokens("gpt2", n=32)
    with pytest.raises(NotImplementedError, match=r"`zero=3` with `pipeline` does not support "
                       r"a weight used by two stages in this version \(.*token_embedding"):
        model.fit(x, y, batch_size=16, verbose=0)
    assert model.optimizer.iterations.numpy() == 0


def make_gpt2_adam(seed=0):
    from test_tensor_blocks import make_gpt2

    model = make_gpt2(seed)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=model.loss, weighted_metrics=[])
    return model


@pytest.mark.parametrize("name, n, microbatches, tensor", [
    ("gpt2_adam", 2, 1, 1), ("gpt2", 4, 2, 1), ("causal_lm", 2, 1, 1), ("causal_lm", 2, 1, 2)])
def test_keras_hub_gpt2_matches_one_device(name, n, microbatches, tensor):
    from test_tensor_blocks import lm_data as hub_data
    from test_tensor_blocks import make_gpt2
    from test_tied_embeddings import EXAMPLES, make_causal_lm

    make = {"gpt2_adam": make_gpt2_adam, "gpt2": make_gpt2, "causal_lm": make_causal_lm}[name]
    x, y = hub_data("gpt2", n=EXAMPLES if name == "causal_lm" else 192)
    reference = trained_reference(make=make, x=x, y=y, batch_size=16)
    strategy = tfdist.Strategy(data=n, tensor=tensor, zero=3, microbatches=microbatches,
                               devices=devices(n * tensor))
    result = train(strategy, make=make, x=x, y=y, batch_size=16)
    assert_parity(result, reference, steps=12)
    # Each transformer block is a unit of its own; the tied embedding of the
    # causal LM is gathered by the first unit and by the last (its reverse call).
    units = [[layer.name for layer in unit.layers] for unit in plan_units(result[2])]
    blocks = [names for names in units if any(n.startswith("transformer_layer") for n in names)]
    assert blocks == [["transformer_layer_0"], ["transformer_layer_1"]]
    if name == "causal_lm":
        assert units[0] == ["token_embedding"] and units[-1] == ["token_embedding"]
    # What describe says each device keeps is what it holds (a tied table once).
    held = set(variable_bytes(result[2].trainable_weights).values())
    assert len(held) == 1
    (total,) = [line for line in strategy.describe(result[2]).splitlines()
                if line.startswith("zero=3 over")]
    assert total.endswith(f", {held.pop():,} B per device (the largest two units gathered "
                          f"at once)")
    if tensor > 1:  # the blocks' attention and MLP split over the tensor group
        split = strategy.describe(result[2]).split("zero=3 over")[1]
        assert re.search(r"transformer_layer_1/self_attention\s+\w+\s+heads", split)
        assert re.search(r"transformer_layer_1/feedforward_output_dense\s+\w+\s+row", split)


def _trained_uneven(n, zero):
    """test_zero's model whose variables do not split evenly into 4 shards,
    after a few steps with Adam."""
    from test_zero import make_uneven_model

    strategy = tfdist.Strategy(data=n, zero=zero, devices=devices(n))
    with strategy.scope():
        model = make_uneven_model(keras.optimizers.Adam(1e-3))
    model.fit(*data(64), batch_size=16, verbose=0)
    return model


def test_each_device_keeps_its_shard_of_the_parameters_and_their_state_and_updates_it_in_place():
    n = 4
    model = _trained_uneven(n, zero=3)
    # Adam without weight decay changes each shard with its own assign_add
    # and assign_sub: nothing writes a shard's value back to it (a copy of
    # every shard per step, and a write TensorFlow's graph optimiser walks
    # everything after).
    writes = [op.name for op in step_ops(_step_graph(model), "CPU:0")
              if op.type == "AssignVariableOp" and "/update/" in op.name]
    assert not writes, writes
    trainable = model.trainable_weights
    shard_elements = sum(-(-w.shape.num_elements() // n) for w in trainable)
    params = sum(w.shape.num_elements() for w in trainable)
    padding = n * shard_elements - params
    assert padding == 3 + 2 + 1  # biases of 5 and 7, the kernel of 70
    weights = variable_bytes(trainable)
    state = variable_bytes(model.optimizer.variables)
    for device in (f"CPU:{i}" for i in range(n)):
        # (params + padding) / n of parameters; Adam's m and v alike; its
        # iteration counter (int64) and learning rate (float32) whole.
        assert weights[device] == 4 * (params + padding) // n
        assert state[device] == 2 * 4 * (params + padding) // n + 8 + 4
    # zero=2 keeps every parameter whole on every device.
    assert variable_bytes(_trained_uneven(n, zero=2).trainable_weights) == {
        f"CPU:{i}": 4 * params for i in range(n)}


def _gathers_and_scatters(graph, replica_device):
    """(gather ops, all-to-all ops) of the replica on `replica_device`."""
    ops = step_ops(graph, replica_device)
    return ([op for op in ops if op.type == "CollectiveGatherV2"],
            [op for op in ops if op.type == "CollectiveAllToAllV2"])


def _ancestors(op):
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def test_a_step_gathers_at_most_two_units_at_once_and_sends_what_zero_says():
    n, microbatches = 4, 2
    x, y = lm_data(64)
    strategy = tfdist.Strategy(data=n, zero=3, microbatches=microbatches, devices=devices(n))
    with strategy.scope():
        model = lm("sgd")()
    model.fit(x, y, batch_size=16, verbose=0)
    graph = _step_graph(model)
    gathers, scatters = _gathers_and_scatters(graph, "CPU:0")
    # The embedding's sparse gradient: its slices gathered in each
    # microbatch (values and indices, as they are: the trace knows their
    # number), each replica keeping those inside its shard.
    slices = [op for op in gathers if "/gather/" not in op.name]
    assert len(slices) == 2 * microbatches
    assert all("/reduce_scatter/" in op.name for op in slices)
    gathers = [op for op in gathers if op not in slices]
    units = plan_units(model)
    unit_bytes = [4 * sum(w.shape.num_elements() for layer in unit.layers
                          for w in getattr(layer, "trainable_weights", ())) for unit in units]
    # One gather per unit in each forward and each backward of each
    # microbatch, but the last unit's backward: its forward's are kept.
    assert len(gathers) == (2 * len(units) - 1) * microbatches
    assert not [op for op in gathers if f"unit{len(units) - 1}/bwd/" in op.name]

    def action(op):  # (microbatch, position in the step's unit order)
        unit, kind, mb = re.search(r"unit(\d+)/(fwd|bwd)/mb(\d+)/", op.name).groups()
        u = int(unit)
        return int(mb), u if kind == "fwd" else 2 * len(units) - 1 - u

    gathers.sort(key=action)
    # A gather's parameters are alive until every op of its unit's work that
    # computes from them has run: the later gathers that do not wait for all
    # of those hold theirs at the same time.
    scope = {}
    for op in step_ops(graph, "CPU:0"):
        found = re.search(r"unit\d+/(fwd|bwd)/mb\d+/", op.name)
        if found:
            scope[op] = action(op)
    users = [{op for op in _descendants(gather) if scope.get(op) == action(gather)}
             for gather in gathers]
    largest = 0
    for k, gather in enumerate(gathers):
        before = _ancestors(gather)
        alive = [j for j in range(k) if not users[j] <= before]
        assert len(alive) <= 1, (gather.name, [gathers[j].name for j in alive])
        largest = max(largest, sum(_received_bytes(gathers[j], n) for j in alive + [k]))
    two_largest = sum(sorted(unit_bytes)[-2:])
    padded = sum(unit_bytes)
    assert largest <= two_largest + 4 * n * len(model.trainable_weights) < padded
    # Per microbatch: the parameters gathered twice (the last unit's once),
    # their gradients reduce-scattered once (dense ones; the embedding's
    # slices are gathered).
    embeddings = model.layers[1].embeddings
    gathered = sum(_received_bytes(op, n) for op in gathers)
    shard_bytes = sum(4 * -(-w.shape.num_elements() // n) for w in model.trainable_weights)
    last_bytes = sum(4 * -(-w.shape.num_elements() // n) for layer in units[-1].layers
                     for w in getattr(layer, "trainable_weights", ()))
    assert gathered == microbatches * n * (2 * shard_bytes - last_bytes)
    scattered = sum(_received_bytes(op, n) for op in scatters)
    dense_shards = sum(4 * -(-w.shape.num_elements() // n) for w in model.trainable_weights
                       if w is not embeddings)
    assert scattered == microbatches * n * dense_shards


@pytest.mark.parametrize("config, bound", [(dict(data=2), 16), (dict(data=2, tensor=2), 15)],
                         ids=["data2", "data2-tensor2"])
def test_a_step_holds_two_units_at_once_when_it_runs(config, bound):
    # The test above reads the step's graph. TensorFlow inlines the units'
    # shared functions before it runs a step, after which a control edge from
    # a function call waits only for its body's stateful ops: a unit's block
    # waiting for a pure forward's call would wait for nothing, and every
    # unit's packed shards were made at the step's start. And a replica's
    # units run in a function (one trace every replica calls), whose gradient
    # shards come out together at its end: each unit now updates its weights
    # inside (the program's `UPDATE`), so no shard waits for the others.
    # TensorFlow's own count of the step's tensors (all devices), 16 units of
    # 1 MiB, in units above the step's start: data=2 10-10.5 (about 5 per
    # device: a unit gathered, the next, a unit's gradient, what its
    # reduce-scatter receives and the activations), against 23.5 when the
    # blocks waited for the calls; data 2 x tensor 2 7.5, against 22.8 when
    # the shards waited for the step's update.
    width, layers = 512, 16
    unit = width * width * 4
    strategy = tfdist.Strategy(zero=3, devices=devices(2 * config.get("tensor", 1)), **config)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((width,))] + [
            keras.layers.Dense(width, activation="relu") for _ in range(layers)])
        model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).random((64, width)).astype("float32")
    held = step_peak_bytes(model, x, x, batch_size=32) / unit
    assert held < bound, held


def _received_bytes(op, n):
    """Bytes an all-gather or all-to-all of `n` replicas gives this replica
    (its own part included)."""
    data = op.inputs[0]
    factor = n if op.type == "CollectiveGatherV2" else 1  # all-to-all: (n, m) in and out
    return factor * data.shape.num_elements() * data.dtype.size


def _descendants(op):
    seen, todo = set(), [op]
    while todo:
        for child in [c for t in todo.pop().outputs for c in t.consumers()]:
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def test_describe_lists_the_units_and_the_bytes_each_device_keeps():
    strategy = tfdist.Strategy(data=4, zero=3, devices=devices(4))
    with strategy.scope():
        model = lm("sgd")()
    lines = strategy.describe(model).splitlines()
    params = sum(w.shape.num_elements() for w in model.trainable_weights)
    assert [re.sub(r"_\d+", "", line.split("layers: ")[1]) for line in lines[:-1]] == [
        "embedding", "multi_head_attention, add", "layer_normalization", "dense",
        "dense, add", "layer_normalization", "dense"]
    assert lines[1].startswith(f"unit 1  params {4 * 16 * 4 * 3 + 4 * 4 * 3 + 16 * 16 + 16:,}"
                               f"  gathered")
    assert lines[-1] == (f"zero=3 over 4 replicas: parameters {4 * params:,} B, "
                         f"{params:,} B per device (the largest two units gathered at once)")


def test_zero3_unit_params_joins_layers_into_units_and_keeps_parity():
    n, least = 2, 600
    strategy = tfdist.Strategy(data=n, zero=3, zero3_unit_params=least, devices=devices(n))
    with strategy.scope():
        model = lm("sgd")()
    units = plan_units(model, least)
    # The embedding (384) joins attention; each unit then holds >= 600 but the last.
    assert [unit.params >= least for unit in units] == [True] * (len(units) - 1) + [False]
    assert len(units) < len(plan_units(model))
    assert len(strategy.describe(model).splitlines()) == len(units) + 1
    assert_parity(lm_run(n, "sgd", zero=3, zero3_unit_params=least), zero0_lm_run(n, "sgd"),
                  rtol=1e-5, atol=1e-6)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        return self.dense(x)


@pytest.mark.parametrize("make, message", [
    (lambda: Subclassed(), r"`zero=3` gathers the parameters unit by unit along the "
                           r"model's graph of layer calls, which 'subclassed(_\d+)?' does not have "
                           r"before it runs \(a subclassed model"),
    (lambda: keras.Sequential([keras.Input((16,)), keras.layers.BatchNormalization(
        synchronized=True), keras.layers.Dense(4)]), r"BatchNormalization\(synchronized=True\)"),
    (lambda: keras.Sequential([keras.Input((16,)), keras.layers.Dense(
        4, kernel_regularizer="l2")]), r"'sequential.*/dense.*/kernel' has a regularizer"),
    (lambda: keras.Sequential([keras.Input((16,)), keras.layers.Dense(
        4, activity_regularizer="l2")]), r"'dense.*' has an activity regularizer"),
])
def test_what_zero3_cannot_shard_is_refused_before_the_first_step(make, message):
    strategy = tfdist.Strategy(data=2, zero=3, devices=devices(2))
    with strategy.scope():
        model = make()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(NotImplementedError, match=message):
        model.fit(*data(32), batch_size=16, verbose=0)


def test_large_weights_go_alone_and_large_reduce_scatters_in_pieces(monkeypatch):
    # Packing a unit's weights into one collective copies each into the pack
    # and out of it: at a large unit's gather, two more copies of the unit.
    # A weight of ALONE_BYTES or more has collectives of its own, and a
    # reduce-scatter receiving more than PIECE_BYTES goes in pieces of
    # columns, one after another (both lowered here, so that the LM's
    # kernels and embedding count as large and its reduce-scatters as wide).
    monkeypatch.setattr(collectives, "ALONE_BYTES", 1024)
    monkeypatch.setattr(collectives, "PIECE_BYTES", 256)
    monkeypatch.setattr(collectives, "PIECE_COLUMNS", 4)
    x, y = lm_data()
    result = lm_run(2, "adam", zero=3)
    assert_parity(result, trained_reference(make=lm("adam"), x=x, y=y, batch_size=16))
    graph = _step_graph(result[2])
    packed = []
    for op in step_ops(graph):
        if not re.search(r"/(gather|reduce_scatter)/", op.name):
            continue
        values = (op.inputs[:-1] if op.type == "ConcatV2" else
                  op.outputs if op.type in ("Split", "SplitV") else [])
        packed += [op.name for t in values if (t.shape.num_elements() or 0) * t.dtype.size >= 1024]
    assert not packed
    gathers, scatters = _gathers_and_scatters(graph, "CPU:0")
    assert max(op.inputs[0].shape.num_elements() * 4 for op in gathers) >= 1024  # alone
    # Pieces of 32 columns (2 rows of float32: 256 bytes), the last narrower.
    widths = [op.inputs[0].shape[1] for op in scatters if "/reduce_scatter/" in op.name
              and op.inputs[0].dtype == tf.float32]
    assert max(widths) == 32 and len(widths) > len(plan_units(result[2]))
