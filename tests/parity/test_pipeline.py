"""Pipeline parallelism: stages on their devices, both schedules at one-device parity."""

import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import (
    CLASSES,
    FEATURES,
    FLOAT16_CPU,
    assert_parity,
    data,
    devices,
    step_ops,
    step_peak_bytes,
    strategy_on_its_devices,
    trace_events,
    train,
    trained_reference,
)
from test_tensor_transformer import SEQ, VOCAB, WIDTH, block, compile_lm, lm_data
from test_zero import _step_graph
from tfdist.pipeline.placement import component_devices
from tfdist.pipeline.schedule import held_activations, stage_device, stage_orders


def residual_mlp(seed=0, optimizer=None):
    """An MLP whose residual (from the first block) crosses the stage boundary."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(32, activation="relu", name="in")(inputs)
    a = keras.layers.Dense(32, activation="tanh", name="a")(h)
    b = keras.layers.Dense(32, activation="tanh", name="b")(a)
    c = keras.layers.Dense(32, activation="tanh", name="c")(b)
    joined = keras.layers.Add(name="skip")([h, c])
    outputs = keras.layers.Dense(CLASSES, name="out")(joined)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def two_inputs(seed=0):
    """Two inputs: the second joins after the first stage."""
    keras.utils.set_random_seed(seed)
    left = keras.Input((FEATURES // 2,), name="left")
    right = keras.Input((FEATURES // 2,), name="right")
    h = keras.layers.Dense(32, activation="relu", name="l1")(left)
    h = keras.layers.Dense(32, activation="relu", name="l2")(h)
    r = keras.layers.Dense(32, activation="relu", name="r1")(right)
    joined = keras.layers.Concatenate(name="cat")([h, r])
    outputs = keras.layers.Dense(CLASSES, name="out")(joined)
    model = keras.Model([left, right], outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def nested_backbone(seed=0):
    """A task model calling a functional backbone (with a residual) as one
    layer, as keras-hub's task models do: the stages cut inside it."""
    keras.utils.set_random_seed(seed)
    inner = keras.Input((FEATURES,), name="features")
    h = keras.layers.Dense(32, activation="relu", name="in")(inner)
    a = keras.layers.Dense(32, activation="tanh", name="a")(h)
    b = keras.layers.Dense(32, activation="tanh", name="b")(a)
    backbone = keras.Model(inner, keras.layers.Add(name="skip")([h, b]), name="backbone")
    inputs = keras.Input((FEATURES,))
    outputs = keras.layers.Dense(CLASSES, name="out")(backbone(inputs))
    model = keras.Model(inputs, outputs, name="task")
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_cut_inside_a_nested_model_and_match_one_device(schedule):
    reference = trained_reference(make=nested_backbone)
    strategy = tfdist.Strategy(pipeline=2, microbatches=4, schedule=schedule,
                               stage_boundaries=["b"], devices=devices(2))
    result = train(strategy, make=nested_backbone)
    assert_parity(result, reference)
    first, second = strategy.describe(result[2]).splitlines()[:2]
    assert "layers: in, a" in first and "layers: b, skip, out" in second


# (schedule, virtual stages): every schedule tfdist has.
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb1", 1), ("interleaved", 2), ("zbv", 2)]


@pytest.mark.parametrize("schedule, virtual", SCHEDULES, ids=[s for s, _ in SCHEDULES])
@pytest.mark.parametrize("remat", [False, True])
def test_residual_mlp_matches_one_device(schedule, virtual, remat):
    reference = trained_reference(make=residual_mlp)
    strategy = tfdist.Strategy(pipeline=2, microbatches=4, schedule=schedule, remat=remat,
                               virtual_stages=virtual, devices=devices(2))
    assert_parity(train(strategy, make=residual_mlp), reference)


class _WithAnUnusedWeight(keras.layers.Layer):
    """A Dense that also keeps a weight its call never reads, as keras-hub's
    `ReversibleEmbedding` keeps its untied `reverse_embeddings` (Mistral):
    its gradient is None."""

    def build(self, shape):
        self.kernel = self.add_weight((shape[-1], 32), initializer="glorot_uniform")
        self.unused = self.add_weight((4,), initializer="ones")

    def call(self, x):
        return keras.ops.tanh(x @ self.kernel)


def with_an_unused_weight(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    h = _WithAnUnusedWeight(name="unused_in")(inputs)
    h = keras.layers.Dense(32, activation="tanh", name="a")(h)
    h = _WithAnUnusedWeight(name="unused_late")(h)
    outputs = keras.layers.Dense(CLASSES, name="out")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("schedule", ["1f1b", "zb1"])
def test_a_weight_without_gradient_stays_and_the_rest_match_one_device(schedule):
    reference = trained_reference(make=with_an_unused_weight)
    strategy = tfdist.Strategy(pipeline=2, microbatches=2, schedule=schedule,
                               devices=devices(2))
    result = train(strategy, make=with_an_unused_weight)
    assert_parity(result, reference)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_inputs_data_parallel_matches_one_device(schedule):
    x, y = data()
    x = [x[:, :FEATURES // 2], x[:, FEATURES // 2:]]
    reference = trained_reference(make=two_inputs, x=x, y=y)
    strategy = tfdist.Strategy(data=2, pipeline=2, microbatches=2, schedule=schedule,
                               devices=devices(4))
    assert_parity(train(strategy, make=two_inputs, x=x, y=y), reference)


@pytest.mark.parametrize("data_size, stages", [(2, 2), (1, 4)])
def test_each_stage_lives_on_its_devices(data_size, stages, caplog):
    mesh = devices(data_size * stages)
    strategy = tfdist.Strategy(data=data_size, pipeline=stages, microbatches=stages,
                               devices=mesh)
    _, _, model = train(strategy, make=lambda: residual_mlp(
        optimizer=keras.optimizers.Adam(1e-3)))
    step = strategy.train_step(model)

    def where(variable):
        return {d.split("device:")[-1] for d in component_devices(variable)}

    mesh = [d.split("device:")[-1] for d in mesh]
    for stage in step.compute.pipeline.stages:
        wanted = {mesh[r * stages + stage.index] for r in range(data_size)}
        for variable in stage.variables:
            assert where(variable) == wanted, variable.path
    slots = [v for v in model.optimizer.variables if len(v.shape)]
    assert slots
    stage_of = {id(v): s.index for s in step.compute.pipeline.stages for v in s.variables}
    for slot, variable in zip(model.optimizer._momentums, model.optimizer._trainable_variables):
        wanted = {mesh[r * stages + stage_of[id(variable)]] for r in range(data_size)}
        assert where(slot) == wanted, slot.path
    if data_size > 1:
        # The data all-reduce takes each gradient alone (tf.distribute packs
        # only the values of one device, and a replica's are on its stages'):
        # what the predicted peak counts (`ParallelConfig.all_reduce_pack`).
        reduced = [op.inputs[0].shape.num_elements() for op in
                   step_ops(_step_graph(model), "CPU:0", scope="tfdist/reduce")
                   if op.type == "CollectiveReduceV2"]
        weights = sorted(w.shape.num_elements() for w in model.trainable_weights)
        assert sorted(reduced)[-len(weights):] == weights, sorted(reduced)
        # tfdist asks for them one by one: tf.distribute logs nothing about it
        assert "Efficient batch_reduce" not in caplog.text


@pytest.mark.parametrize("schedule, microbatches", [("gpipe", 8), ("1f1b", 8), ("zb1", 8)])
def test_activations_held_per_stage(schedule, microbatches):
    stages = 4
    strategy = tfdist.Strategy(pipeline=stages, microbatches=microbatches,
                               schedule=schedule, devices=devices(stages))
    _, _, model = train(strategy, make=residual_mlp)
    held = strategy.train_step(model).compute.pipeline.peak_held
    assert held == held_activations(stage_orders(schedule, stages, microbatches))
    if schedule == "gpipe":
        assert held == [microbatches] * stages
    elif schedule == "1f1b":
        assert held == [stages - s for s in range(stages)]
    else:  # until its W: up to 1F1B's first stage's on every stage
        assert held == [stages] * stages


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_virtual_stages_live_on_their_devices(schedule):
    """Interleaved: stages 0, 1, 2, 3 on devices 0, 1, 0, 1; ZB-V's V: 0, 1, 1, 0."""
    strategy = tfdist.Strategy(pipeline=2, microbatches=4, schedule=schedule,
                               virtual_stages=2, devices=devices(2))
    _, _, model = train(strategy, make=residual_mlp)
    pipeline = strategy.train_step(model).compute.pipeline
    mesh = [d.split("device:")[-1] for d in devices(2)]
    assert len(pipeline.stages) == 4
    for stage in pipeline.stages:
        wanted = mesh[stage_device(schedule, stage.index, 2)]
        for variable in stage.variables:
            assert {d.split("device:")[-1] for d in component_devices(variable)} == {wanted}
    assert pipeline.peak_held == held_activations(stage_orders(schedule, 2, 4, 2))


def downstream(ops, start):
    """Every op that runs after `start` (data or control), `start` excluded."""
    consumers = {}
    for op in ops:
        for source in [t.op for t in op.inputs] + list(op.control_inputs):
            consumers.setdefault(source, []).append(op)
    seen, pending = set(), list(consumers.get(start, []))
    while pending:
        op = pending.pop()
        if op not in seen:
            seen.add(op)
            pending.extend(consumers.get(op, []))
    return seen


def test_zb1_weight_gradients_wait_for_their_w_and_input_gradients_do_not():
    strategy = tfdist.Strategy(pipeline=2, microbatches=2, schedule="zb1", devices=devices(2))
    _, _, model = train(strategy, make=residual_mlp, x=data(64)[0], y=data(64)[1])
    step = strategy.train_step(model)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(data(32)).batch(32))))
    ops = tf.function(lambda b: strategy.run(step, args=(b,))).get_concrete_function(
        batch).graph.get_operations()
    # Device 1 runs 1F0 1B0 1F1 1B1 1W0 1W1: stage 0's B1 reads 1B1's input
    # gradients, which must not wait for the W after them.
    start = next(op for op in ops if op.name.endswith("stage1/bwd_weight/mb1/start"))
    after = downstream(ops, start)
    assert not [op.name for op in after if "stage0/bwd_input/mb1/" in op.name]
    # What it releases: stage 1's kernel-gradient matmuls of microbatch 1
    # (gradient ops are named after the forward op they differentiate).
    released = sorted(op.name for op in after if op.type == "MatMul")
    assert released and all("stage1/fwd/mb1/" in name for name in released)
    assert all(name.endswith("/MatMul_1") for name in released)  # d(kernel), not d(input)


def test_describe_lists_stages_with_devices():
    strategy = tfdist.Strategy(pipeline=2, microbatches=2, devices=devices(2))
    with strategy.scope():
        model = residual_mlp()
    lines = strategy.describe(model).splitlines()
    assert len(lines) == 2 + 1 + 7   # stages, schedule, grid (header and 6 steps)
    assert lines[0].startswith("stage 0  [CPU:0]") and "layers: in" in lines[0]
    assert lines[1].startswith("stage 1  [CPU:1]") and "out" in lines[1]


def test_describe_ends_with_the_schedule_grid():
    strategy = tfdist.Strategy(pipeline=2, microbatches=2, schedule="1f1b", devices=devices(2))
    with strategy.scope():
        model = residual_mlp()
    lines = strategy.describe(model).splitlines()
    assert lines[2:] == ["schedule 1f1b, 2 microbatches:",
                         "step  stage 0  stage 1",
                         "0     F0       .",
                         "1     F1       F0",
                         "2     .        B0",
                         "3     B0       F1",
                         "4     .        B1",
                         "5     B1       ."]


def test_manual_boundaries():
    strategy = tfdist.Strategy(pipeline=2, microbatches=2, stage_boundaries=["c"],
                               devices=devices(2))
    with strategy.scope():
        model = residual_mlp()
    first, second = strategy.describe(model).splitlines()[:2]
    assert "layers: in, a, b" in first and "layers: c, skip, out" in second


@pytest.mark.parametrize("kwargs, error, message", [
    ({"pipeline": 8, "stage_boundaries": None}, ValueError,
     r"`pipeline=8` needs at least 8 layers to split, but .* has 6"),
    ({"pipeline": 2, "stage_boundaries": ["nope"]}, ValueError,
     r"`stage_boundaries`: no layer named 'nope'"),
])
def test_bad_stages(kwargs, error, message):
    strategy = tfdist.Strategy(microbatches=8, devices=devices(kwargs["pipeline"]), **kwargs)
    with strategy.scope():
        model = residual_mlp()
    with pytest.raises(error, match=message):
        strategy.describe(model)


def test_bad_config():
    with pytest.warns(UserWarning, match=r"`microbatches=2` < `pipeline=4`: .*bubble"):
        tfdist.Strategy(pipeline=4, microbatches=2, devices=devices(4))
    with pytest.raises(ValueError, match=r"`stage_boundaries` and `remat` apply to pipeline"):
        tfdist.Strategy(remat=True, devices=devices(2))
    # The count of boundaries is a config rule: refused before any model exists.
    with pytest.raises(ValueError, match=r"`stage_boundaries` must name 1 layer\(s\) for "
                                         r"2 stages"):
        tfdist.Strategy(pipeline=2, stage_boundaries=["a", "b"], devices=devices(2))
    strategy = tfdist.Strategy(pipeline=2, microbatches=4, devices=devices(2))
    x, y = data()
    with strategy.scope():
        model = residual_mlp()
    with pytest.raises(ValueError, match=r"`microbatches=4` must divide the per-replica batch"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(30, drop_remainder=True),
                  epochs=1, verbose=0, shuffle=False)


def two_block_lm(seed=0):
    """Embedding, two Transformer blocks, a vocabulary classifier."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((SEQ,), dtype="int32")
    x = block(block(keras.layers.Embedding(VOCAB, WIDTH)(tokens)))
    return compile_lm(keras.Model(tokens, keras.layers.Dense(VOCAB)(x)))


@pytest.mark.parametrize("schedule, virtual, remat", [
    ("gpipe", 1, False), ("1f1b", 1, False), ("zb1", 1, False), ("zb1", 1, True),
    ("interleaved", 2, False), ("interleaved", 2, True), ("zbv", 2, False), ("zbv", 2, True)])
@pytest.mark.grappler  # every schedule's step as a user's job runs it (conftest.py)
def test_transformer_lm_matches_one_device(schedule, virtual, remat):
    x, y = lm_data()
    reference = trained_reference(make=two_block_lm, x=x, y=y, batch_size=16)
    strategy = tfdist.Strategy(pipeline=2, microbatches=4, schedule=schedule,
                               virtual_stages=virtual, remat=remat, devices=devices(2))
    result = train(strategy, make=two_block_lm, x=x, y=y, batch_size=16)
    assert_parity(result, reference)
    stages = strategy.train_step(result[2]).compute.pipeline.stages
    assert len(stages) == 2 * virtual
    attention = [any(isinstance(layer, keras.layers.MultiHeadAttention) for layer in stage.layers)
                 for stage in stages]
    assert attention.count(True) == 2 and (virtual > 1 or attention == [True, True])


@pytest.mark.parametrize("schedule", ["1f1b", "zb1", "zbv"])
def test_trace_shows_each_stage_unit(tmp_path, schedule):
    stages = 4 if schedule == "zbv" else 2
    strategy = tfdist.Strategy(pipeline=2, microbatches=2, schedule=schedule,
                               virtual_stages=stages // 2, devices=devices(2))
    with strategy.scope():
        model = residual_mlp()
    profiler = tfdist.callbacks.Profiler(tmp_path, steps=(2, 4))
    x, y = data(32 * 6)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[profiler])
    units = set()
    for event in trace_events(profiler.trace_path):
        # TensorFlow names gradient ops after the forward ops they differentiate.
        found = re.search(r"(gradient_tape/)?tfdist/stage(\d)/(fwd|bwd\w*)/mb(\d)",
                          event.get("args", {}).get("long_name", ""))
        if found:
            kind = "bwd" if found.group(1) else found.group(3)
            units.add(f"stage{found.group(2)}/{kind}/mb{found.group(4)}")
    every = {f"stage{s}/{kind}/mb{i}" for s in range(stages) for kind in ("fwd", "bwd")
             for i in range(2)}
    if schedule == "1f1b":
        assert units == every
    else:  # and the second W's addition to the stage's gradient totals
        assert units >= every | {f"stage{s}/bwd_weight/mb1" for s in range(stages)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stages_microbatch_gradients_are_summed_as_they_come(schedule):
    # Each backward's weight gradients are added into the stage's totals
    # before the device's next block runs: the step's peak (TensorFlow's own
    # count, in layers of weights) grows little with the microbatches.
    # Measured: 2.4-3.3 layers at 1 microbatch; at 8, 6.2 (the two stages'
    # totals, a backward's gradients and their sum), and 27-30 when every
    # microbatch's gradients were held until the additions caught up.
    width, peaks = 1024, {}
    layer = width * width * 4
    for microbatches in (1, 8):
        strategy = strategy_on_its_devices(pipeline=2, microbatches=microbatches,
                                           schedule=schedule)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((width,))]
                                     + [keras.layers.Dense(width) for _ in range(4)])
            model.compile(optimizer="sgd", loss="mse")
        x = np.ones((64, width), "float32")
        peaks[microbatches] = step_peak_bytes(model, x, x, batch_size=64)
    assert peaks[8] < peaks[1] + 8 * layer, {m: p / layer for m, p in peaks.items()}


@pytest.mark.parametrize("config", [dict(data=1, pipeline=2), dict(data=2, zero=3)],
                         ids=["pipeline", "zero3"])
def test_a_block_waits_for_the_earlier_ones_through_one_grouped_op(config):
    # A program's block (a stage's microbatch; a ZeRO-3 unit's) waits for the
    # block before it through one grouped op. Without it, each op the block
    # makes without inputs of its own (every constant) carried a control edge
    # per result of that block: the step's graph grew with the square of the
    # model's depth (as microbatches did, tests/parity/test_engine.py).
    _, _, model = train(tfdist.Strategy(microbatches=4, devices=devices(2), **config))
    constants = [op for op in step_ops(_step_graph(model)) if op.type == "Const"]
    waiting = [op for op in constants if op.control_inputs]
    assert waiting, "no block waited for the one before it"
    assert all(len(op.control_inputs) == 1 for op in waiting), \
        sorted({len(op.control_inputs) for op in waiting})
    assert {c.type for op in waiting for c in op.control_inputs} == {"NoOp"}


def test_remat_lowers_peak_memory():
    # Activations that dwarf the weights (elementwise layers), TensorFlow's
    # own count of the step's tensors, in one microbatch's activation of one
    # layer (256 KiB). GPipe without remat holds every microbatch's output of
    # every tanh until its backward (measured 129 units); with remat each
    # stage holds its microbatches' inputs and replays one microbatch at a
    # time (measured 24).
    width, rows, microbatches, layers = 512, 128, 8, 8
    activation = rows * width * 4
    peaks = {}
    for remat in (False, True):
        strategy = strategy_on_its_devices(pipeline=2, microbatches=microbatches,
                                           schedule="gpipe", remat=remat,
                                           stage_boundaries=["stage1"])
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((16,)), keras.layers.Dense(width),
                *[keras.layers.Activation("tanh") for _ in range(layers)],
                keras.layers.Activation("tanh", name="stage1"),
                *[keras.layers.Activation("tanh") for _ in range(layers - 1)],
                keras.layers.Dense(4)])
            model.compile(optimizer="sgd", loss="mse")
        batch = rows * microbatches
        x, y = np.ones((batch, 16), "float32"), np.ones((batch, 4), "float32")
        peaks[remat] = step_peak_bytes(model, x, y, batch) / activation
    assert peaks[False] >= microbatches * 2 * layers, peaks
    assert peaks[True] <= microbatches + 2 * layers + 2, peaks


@functools.cache
def mixed_float16_one_device_run():
    """The residual MLP under mixed_float16 on one device with 4 microbatches,
    trained once for every schedule that compares against it (only read)."""
    return train(tfdist.Strategy(microbatches=4, precision="mixed_float16", devices=devices(1)),
                 make=residual_mlp)


@pytest.mark.parametrize("schedule, virtual", SCHEDULES[1:], ids=[s for s, _ in SCHEDULES[1:]])
def test_mixed_float16_matches_one_device_with_the_same_microbatches(schedule, virtual):
    reference = mixed_float16_one_device_run()
    strategy = tfdist.Strategy(pipeline=2, microbatches=4, schedule=schedule,
                               virtual_stages=virtual, precision="mixed_float16",
                               devices=devices(2))
    result = train(strategy, make=residual_mlp)
    assert isinstance(result[2].optimizer, keras.optimizers.LossScaleOptimizer)
    if FLOAT16_CPU:  # stages fuse differently (helpers.FLOAT16_CPU): measured
        # 5.4e-5 relative in the first loss, 2.9e-4 in weights after 20 steps
        assert_parity(result, reference, rtol=1e-3, atol=5e-4)
    else:
        assert_parity(result, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule, virtual", SCHEDULES[1:], ids=[s for s, _ in SCHEDULES[1:]])
def test_xla_compiles_each_stage_and_keeps_parity(schedule, virtual):
    reference = trained_reference(make=residual_mlp)
    strategy = tfdist.Strategy(pipeline=2, microbatches=4, schedule=schedule, xla=True,
                               virtual_stages=virtual, devices=devices(2))
    result = train(strategy, make=residual_mlp)
    assert_parity(result, reference)
    compiled = [runner._call for runner in strategy.train_step(result[2]).compute.pipeline.runners]
    assert all(run.experimental_get_tracing_count() >= 1 for run in compiled)


def residual_mlp_adam():
    return residual_mlp(optimizer=keras.optimizers.Adam(1e-2))


@functools.cache
def unsharded_pipeline_run():
    """The residual MLP with Adam at data=2 x pipeline=2 (GPipe) without ZeRO,
    trained once for every ZeRO case that compares against it (only read)."""
    return train(tfdist.Strategy(data=2, pipeline=2, microbatches=2, devices=devices(4)),
                 make=residual_mlp_adam)


@pytest.mark.parametrize("zero, schedule, virtual", [
    (1, "gpipe", 1), (2, "gpipe", 1), (1, "interleaved", 2), (2, "zb1", 1), (2, "zbv", 2)])
def test_zero_matches_unsharded_pipeline(zero, schedule, virtual):
    reference = unsharded_pipeline_run()
    strategy = tfdist.Strategy(data=2, pipeline=2, microbatches=2, zero=zero,
                               schedule=schedule, virtual_stages=virtual,
                               devices=devices(4))
    result = train(strategy, make=residual_mlp_adam)
    assert_parity(result, reference, rtol=1e-5)
    # Each data replica holds half of every slot, where its copy of the weight is.
    optimizer = result[2].optimizer
    for variable, slot in zip(optimizer._trainable_variables, optimizer._momentums):
        shards = slot.value.values
        assert len(shards) == 2 and shards[0].shape[0] * 2 >= slot.numpy().size
        assert [s.device for s in shards] == component_devices(variable)


def dropout_and_batch_norm(seed=0):
    """Dropout and BatchNormalization in both stages: remat must replay the same
    masks and update the statistics once."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(32, activation="relu"), keras.layers.Dropout(0.3),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(32, activation="relu", name="second"), keras.layers.Dropout(0.3),
        keras.layers.BatchNormalization(), keras.layers.Dense(CLASSES),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_remat_replays_dropout_and_updates_statistics_once():
    results = []
    for remat in (False, True):
        strategy = tfdist.Strategy(pipeline=2, microbatches=4, stage_boundaries=["second"],
                                   remat=remat, devices=devices(2))
        results.append(train(strategy, make=dropout_and_batch_norm))
    assert_parity(results[1], results[0], rtol=1e-6)


def test_evaluate_predict_and_weight_files_after_pipelined_fit(tmp_path):
    strategy = tfdist.Strategy(data=2, pipeline=2, microbatches=2, devices=devices(4))
    _, _, model = train(strategy, make=residual_mlp)
    model.save_weights(tmp_path / "pipelined.weights.h5")
    plain = residual_mlp(seed=1)
    plain.optimizer.build(plain.trainable_weights)
    plain.load_weights(tmp_path / "pipelined.weights.h5")
    for mine, theirs in zip(model.optimizer.variables, plain.optimizer.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    x, y = data(128, seed=1)
    np.testing.assert_allclose(model.predict(x, verbose=0), plain.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0),
                               rtol=1e-5)


def test_model_summary_ends_with_the_stages():
    strategy = tfdist.Strategy(pipeline=2, microbatches=2, devices=devices(2))
    with strategy.scope():
        model = residual_mlp()
    lines = []
    model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
    at = lines.index("Pipeline stages:")
    assert lines[at + 1:] == strategy.describe(model).splitlines()
    plain = residual_mlp()
    others = []
    plain.summary(print_fn=lambda line, *args, **kwargs: others.append(line))
    assert "Pipeline stages:" not in others and "Total params" in "".join(others)
