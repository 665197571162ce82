"""The step engine: one all-reduce per step, loss-scale skips, refusals."""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import (
    assert_parity,
    data,
    devices,
    executed_op_counts,
    make_model,
    step_ops,
    strategy_on_its_devices,
    train,
    trained_reference,
)
from test_zero import _step_graph
from tfdist.engine.step import TrainStep
from tfdist.pipeline.compute import StagedCompute, _Run
from tfdist.pipeline.program import FORWARD, GATHER, OPS, REDUCE_SCATTER


def collective_ops(counts):
    return {op: n for op, n in counts.items() if op.startswith("Collective")}


@pytest.mark.parametrize("microbatches", [1, 2, 4, 8])
def test_exactly_one_gradient_all_reduce_per_step(microbatches):
    strategy = tfdist.Strategy(data=4, microbatches=microbatches, devices=devices(4))
    _, _, model = train(strategy)
    counts = executed_op_counts(model)
    # Each of the 4 replicas issues, whatever the number of microbatches, one
    # packed all-reduce of every gradient with the metric states, and one of
    # the batch's row count (before the forward).
    assert collective_ops(counts) == {"CollectiveReduceV2": 2 * 4}
    # The microbatch loop really ran: k forward passes of the 3 Dense layers.
    assert counts["MatMul"] >= 4 * microbatches * 3


def test_a_microbatch_waits_for_the_previous_sum_through_one_edge_per_op():
    # Each op of microbatch i runs after microbatch i-1's gradients are summed,
    # through one grouped op, not one control edge per gradient: every op
    # without inputs of its own (each constant) carried them all, and the
    # step's graph grew with the square of the model's depth (0.26 GiB per
    # microbatch on an 8-block GPT-2). One device, as each worker of a
    # multi-worker job on CPU. The third microbatch: the sum it waits for
    # is one op per gradient (the first's gradients are one call's outputs).
    strategy = tfdist.Strategy(data=1, microbatches=4, devices=devices(1))
    _, _, model = train(strategy)
    assert len(model.trainable_variables) >= 6
    third = [op for op in _step_graph(model).get_operations() if "microbatch2/" in op.name]
    (gate,) = [op for op in third  # the sum's gradients grouped
               if op.type == "NoOp" and len(op.control_inputs) >= 6]
    assert sum(gate in op.control_inputs for op in third) > 1
    constants = [op for op in third if op.type == "Const"]
    assert constants and all(len(op.control_inputs) <= 1 for op in constants)


def components(model):
    """{variable path: [per-device numpy values]} for every model variable."""
    return {
        v.path: [c.numpy() for c in v.value.values] for v in model.weights
    }


def test_non_finite_gradient_on_one_replica_skips_the_step_everywhere():
    strategy = tfdist.Strategy(data=4, precision="mixed_float16", devices=devices(4))
    with strategy.scope():
        model = make_model()
    x, y = data(32)
    # Global batch 32 -> replica 1 gets rows 8..15; 1e6 overflows float16.
    x[8:16] = 1e6
    before = components(model)
    assert all(len(values) == 4 for values in before.values())
    scale_before = float(model.optimizer.scale_loss(1.0))
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    after = components(model)
    for path, values in before.items():
        for device, (old, new) in enumerate(zip(values, after[path])):
            np.testing.assert_array_equal(old, new, err_msg=f"{path} on replica {device}")
    assert float(model.optimizer.scale_loss(1.0)) == scale_before / 2
    # The next, finite step applies normally on every replica.
    clean_x, clean_y = data(32, seed=1)
    model.fit(clean_x, clean_y, batch_size=32, epochs=1, verbose=0)
    changed = components(model)
    kernel = model.weights[0].path
    assert not np.array_equal(changed[kernel][0], before[kernel][0])
    for value in changed[kernel][1:]:
        np.testing.assert_array_equal(value, changed[kernel][0])


def test_keras_gradient_accumulation_steps_points_to_microbatches():
    strategy = tfdist.Strategy(data=4, devices=devices(4))
    with strategy.scope():
        model = make_model(optimizer=keras.optimizers.Adam(gradient_accumulation_steps=2))
    x, y = data(64)
    with pytest.raises(ValueError, match=r"microbatches=2"):
        model.fit(x, y, batch_size=32, verbose=0)
    assert model.optimizer.iterations.numpy() == 0


def test_microbatches_must_divide_a_static_per_replica_batch():
    strategy = tfdist.Strategy(data=4, microbatches=3, devices=devices(4))
    with strategy.scope():
        model = make_model()
    x, y = data(64)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)
    message = r"`microbatches=3` must divide the per-replica batch size, which is 8"
    with pytest.raises(ValueError, match=message):
        model.fit(dataset, verbose=0, shuffle=False)
    assert model.optimizer.iterations.numpy() == 0


def test_microbatches_refuse_a_sum_reduced_loss():
    strategy = tfdist.Strategy(data=2, microbatches=2, devices=devices(2))
    with strategy.scope():
        model = make_model(compile_kwargs={})
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(reduction="sum"))
    x, y = data(64)
    with pytest.raises(ValueError, match=r"reduction='sum'"):
        model.fit(x, y, batch_size=32, verbose=0)


def test_model_whose_policy_contradicts_precision_is_refused():
    strategy = tfdist.Strategy(data=2, precision="mixed_bfloat16", devices=devices(2))
    with strategy.scope():
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
        keras.config.set_dtype_policy("float32")  # the user's code forces float32
        model = make_model()
    assert keras.config.dtype_policy().name == "float32"  # scope restored it
    message = r"'float32' but the strategy has `precision='mixed_bfloat16'`"
    with pytest.raises(ValueError, match=message):
        model.fit(*data(64), batch_size=32, verbose=0)
    assert model.optimizer.iterations.numpy() == 0


class CustomStepModel(keras.Model):
    """A model overriding train_step the way the Keras guide shows."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return self.compute_metrics(x, y, y_pred)


def make_custom(**kwargs):
    plain = make_model(**kwargs)
    model = CustomStepModel(plain.inputs, plain.outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_overridden_train_step_gets_correct_data_parallelism():
    reference = train(make=make_custom)
    result = train(tfdist.Strategy(data=4, devices=devices(4)), make=make_custom)
    assert_parity(result, reference)


@pytest.mark.parametrize("field, value", [("microbatches", 2), ("zero", 1),
                                          ("compression", "bf16")])
def test_overridden_train_step_refuses_what_only_tfdists_step_does(field, value):
    strategy = tfdist.Strategy(data=2, devices=devices(2), **{field: value})
    with strategy.scope():
        model = make_custom()
    with pytest.raises(ValueError, match=rf"overrides `train_step`.*{field}={value!r}"):
        model.fit(*data(64), batch_size=32, verbose=0)


def test_several_strategies_of_different_sizes_in_one_process():
    # Plain MirroredStrategy fails this on CPU: a 2-device collective group
    # reusing the key of an earlier 4-device group.
    reference = trained_reference()
    for n in (4, 2, 8, 4, 2):
        assert_parity(train(tfdist.Strategy(data=n, devices=devices(n))), reference)


@pytest.mark.parametrize("fields", [{"microbatches": 2}, {"pipeline": 2, "microbatches": 2}])
def test_microbatches_refuse_losses_that_do_not_average(fields):
    def make():
        model = make_model()
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum"))
        return model

    with pytest.raises(ValueError, match=r"`microbatches=2` needs losses that average over "
                                         r"the batch .* has reduction='sum'"):
        train(tfdist.Strategy(devices=devices(2), **fields), make=make)


class _CountsTraces(keras.layers.Layer):
    """Passes its input through; counts the Python calls of its `call` (one
    per trace of a step that calls the model, on each replica)."""

    calls = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True  # passes a mask through too

    def call(self, x):
        _CountsTraces.calls += 1
        return x


def _traced_model_calls(config, run="fit"):
    """How often the first `run` ("fit", "evaluate" or "predict") under
    `config` (or a strategy) called the model's layers' Python code (its
    step's traces, on every replica)."""
    strategy = config if isinstance(config, tf.distribute.Strategy) else (
        strategy_on_its_devices(**config))
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(32), _CountsTraces(), keras.layers.Dense(4)])
        model.compile(optimizer="adam", loss="mse")
    before = _CountsTraces.calls
    x, y = np.ones((8, 16), "float32"), np.ones((8, 4), "float32")
    getattr(model, run)(*((x,) if run == "predict" else (x, y)), batch_size=4, verbose=0)
    return _CountsTraces.calls - before


@pytest.mark.parametrize("config", [dict(tensor=2), dict(data=2, zero=1), dict(data=2, zero=2),
                                    dict(pipeline=2, microbatches=2)], ids=str)
def test_the_step_is_traced_once(config, monkeypatch):
    # Preparing the step (splitting layers over the tensor group, the
    # optimizer's state into shards, the stages onto their devices) creates
    # variables when the first trace reaches it: TensorFlow then traced the
    # whole step a second time (tensor=2 called the model 2x as often as
    # data=2, its first step cost 1.8x data=4's: docs/benchmarks.md).
    calls = []
    step = TrainStep.__call__
    monkeypatch.setattr(TrainStep, "__call__",
                        lambda self, data: calls.append(1) or step(self, data))
    strategy = strategy_on_its_devices(**config)
    _traced_model_calls(strategy)
    assert len(calls) == strategy.num_replicas_in_sync  # one trace on each replica


def _masked_tagger(seed=0):
    """Tags each token of a padded sequence: its predictions carry the
    padding mask, which its accuracy metric reads."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(12, 8, mask_zero=True)(tokens)
    hidden = _CountsTraces()(keras.layers.Dense(8, activation="relu")(hidden))
    model = keras.Model(tokens, keras.layers.Dense(3)(hidden))
    model.compile(optimizer="adam", metrics=["sparse_categorical_accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_replicas_share_one_trace_of_their_forward_backward_and_updates(monkeypatch):
    # Each replica traced the same forward and backward, and each device the
    # same optimizer update of its copy of each variable: 4 traces of one
    # Python function at data=4. Now the first replica's trace serves all,
    # each calling it with its own copies of the variables, and the
    # predictions keep their Keras mask out of the shared function.
    updates = []
    update_step = keras.optimizers.Adam.update_step
    monkeypatch.setattr(keras.optimizers.Adam, "update_step",
                        lambda *args: updates.append(1) or update_step(*args))
    rng = np.random.default_rng(0)
    x = rng.integers(1, 12, (160, 6)).astype("int32")
    x[::2, 3:] = 0  # padding
    y = rng.integers(0, 3, (160, 6)).astype("int32")
    before = _CountsTraces.calls
    reference = train(make=_masked_tagger, x=x, y=y, batch_size=16, epochs=2)
    one_device_calls, before, updates[:] = _CountsTraces.calls - before, _CountsTraces.calls, []
    result = train(tfdist.Strategy(data=4, devices=devices(4)), make=_masked_tagger,
                   x=x, y=y, batch_size=16, epochs=2)
    model = result[2]
    assert _CountsTraces.calls - before == one_device_calls  # not + 3 replicas
    assert len(updates) == len(model.trainable_variables)  # each once, not once per device
    assert_parity(result, reference)
    accuracy = model.get_metrics_result()["sparse_categorical_accuracy"]
    np.testing.assert_allclose(
        accuracy, reference[2].get_metrics_result()["sparse_categorical_accuracy"], rtol=1e-6)
    for variable in model.variables + model.optimizer.variables:  # every copy alike
        for copy in variable.value.values[1:]:
            np.testing.assert_array_equal(copy.numpy(), variable.value.values[0].numpy())


@pytest.mark.parametrize("config", [dict(pipeline=2, microbatches=2),
                                    dict(data=2, pipeline=2, microbatches=2, remat=True),
                                    dict(tensor=2, pipeline=2, microbatches=2),
                                    dict(data=2, tensor=2, zero=3)],
                         ids=str)
def test_pipeline_stages_and_zero3_units_trace_their_layers_once_for_every_replica(config):
    # Each replica traced each stage's layers for each microbatch, and again
    # for remat's replay (9 calls of the model's Python at data 2 x pipeline 2
    # x microbatches 2 with remat, 3 with one replica); now as often as
    # data-parallel replicas, which share one trace. Under tensor too (they
    # were traced per replica: their gradients' collectives would have been
    # the first caller's; now each call gives its own keys to the backward
    # too). The counting layer's name ("_counts_traces") is not a valid first
    # name scope of a function: the shared trace opens one of its own.
    assert _traced_model_calls(config) == _traced_model_calls(dict(data=4))


@pytest.mark.parametrize("config", [dict(pipeline=2, microbatches=2),
                                    dict(pipeline=2, microbatches=2, schedule="zb1"),
                                    dict(data=2, zero=3, microbatches=2),
                                    dict(data=2, tensor=2, zero=3),
                                    dict(data=2, pipeline=2, microbatches=2, remat=True, zero=3)],
                         ids=str)
def test_pipeline_schedules_and_zero3_units_are_programs_one_executor_runs(config, monkeypatch):
    # Pipeline stages and ZeRO-3's units are both a `Program` (pure data)
    # run by one executor (`StagedCompute`'s `_Run`): every instruction, in
    # the program's order, for each replica (ZeRO-3's units, every block on
    # the replica's one device: in one trace every replica calls, its `local`
    # None); and the step's ops are built in
    # that order (first appearance of each block's name scope in replica 0's
    # ops; a block whose ops are all gradients named after the forward they
    # differentiate names none of its own).
    ran = []  # (local replica, instruction)

    def recording(run):
        def record(self, instruction):
            ran.append((self.local, instruction))
            return run(self, instruction)
        return record

    for op in OPS:
        monkeypatch.setattr(_Run, op, recording(getattr(_Run, op)))
    strategy = strategy_on_its_devices(**config)
    x, y = data(64)
    model = train(strategy, x=x, y=y)[2]
    step = strategy.train_step(model)
    compute = step.compute.pipeline
    assert isinstance(compute, StagedCompute)
    program = compute.program(config.get("microbatches", 1), step.update)
    shared = config.get("zero") == 3 and "pipeline" not in config
    runs = {None} if shared else set(range(config.get("data", 1)))
    assert {local for local, _ in ran} == runs
    for replica in runs:
        assert [i for local, i in ran if local == replica] == list(program.instructions)
    scopes = [program.lead(block).scope(program.name) for block in program.blocks()]
    pattern = re.compile(rf"(?:^|/)({program.name}\d+/\w+(?:/mb\d+)?)(?:/|$)")
    built = []
    for op in step_ops(_step_graph(model)):
        found = pattern.search(op.name)
        if found and not op.name.startswith("replica_") and found.group(1) not in built:
            built.append(found.group(1))
    assert built == [scope for scope in scopes if scope in built], (built, scopes)
    forwards = [i.scope(program.name) for i in program.instructions if i.op == FORWARD]
    assert set(forwards) <= set(built)
    ops = {instruction.op for instruction in program.instructions}
    assert (REDUCE_SCATTER in ops) == (GATHER in ops) == (config.get("zero") == 3)


@pytest.mark.parametrize("config", [dict(tensor=4), dict(data=2, tensor=2, microbatches=2)],
                         ids=str)
def test_tensor_groups_trace_their_forward_and_backward_once_for_every_replica(config):
    # Each replica traced its forward and backward on its own (its tensor
    # group's collectives were its own), and with microbatches once per
    # microbatch: now one trace serves every replica and microbatch, each
    # call giving its own group's collective keys and rank.
    assert _traced_model_calls(config) == _traced_model_calls(dict(data=4))


def test_microbatches_on_one_device_trace_the_model_once():
    # As on a multi-worker job's CPU worker (one device each): every
    # microbatch was one more trace of the model, inline (GPT-2 82M at 4
    # microbatches: first step 19-24 -> 13-14 CPU s, docs/benchmarks.md); now
    # the microbatches call one trace, as replicas do.
    one_device = tfdist.Strategy(data=1, microbatches=4, devices=devices(1))
    assert _traced_model_calls(one_device) == _traced_model_calls(dict(data=4))


def _autograph_converted_tfdist_code():
    """The tfdist functions AutoGraph has converted so far in this process
    (the code objects in its transpiler's cache)."""
    from tensorflow.python.autograph.impl import api as autograph_api
    package = os.path.dirname(tfdist.__file__)
    return {code for code in list(autograph_api._TRANSPILER._cache._cache)
            if code.co_filename.startswith(package)}


@pytest.mark.parametrize("config", [dict(tensor=2, microbatches=2),
                                    dict(tensor=2, pipeline=2, microbatches=2)], ids=str)
def test_the_step_is_traced_without_autograph(config):
    # tfdist's step is plain Python control flow, traced as written. The
    # functions tensor x microbatches and tensor x pipeline trace per
    # microbatch / replica had AutoGraph convert every tfdist function they
    # called: a quarter of data=2 x tensor=2 x zero=3 x microbatches=2's first
    # step (docs/benchmarks.md).
    converted = _autograph_converted_tfdist_code()
    _traced_model_calls(config)
    assert _autograph_converted_tfdist_code() - converted == set()


@pytest.mark.parametrize("run", ["evaluate", "predict"])
def test_evaluate_and_predict_before_fit_are_traced_once(run):
    # Before a first fit, `tensor` makes whole again the layers it keeps whole,
    # when the first trace of the evaluation or prediction reaches it.
    assert _traced_model_calls(dict(tensor=2), run) == _traced_model_calls(dict(data=2), run)
