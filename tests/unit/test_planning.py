"""`tfdist.plan`: configurations enumerated, predicted and ranked; no training."""

import dataclasses
import functools

import keras
import pytest

import tfdist
from tfdist.config import ParallelConfig
from tfdist.engine import modes
from tfdist.pipeline.cost import node_cost
from tfdist.pipeline.graph import LayerGraph
from tfdist.planning import parse_quantity
from tfdist.sharding.peak import readable
from tfdist.step_time import Hardware, predict_step_time

HARDWARE = dict(device_flops=1e10, device_bandwidth="8GB", link_bandwidth="1Gbit")
DEVICES = [f"/device:CPU:{i}" for i in range(4)]


def _mlp(layers=6, width=256):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,))]
                             + [keras.layers.Dense(width, "relu") for _ in range(layers)]
                             + [keras.layers.Dense(10)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


# Wide enough that the weights, not the step's program, decide what fits.
_wide_mlp = functools.partial(_mlp, width=1024)


def _data_parallel_peak(model, devices=4, batch_size=32):
    plans = tfdist.plan(model, devices=devices, memory_per_device="1TiB",
                        batch_size=batch_size, **HARDWARE)
    return next(p for p in plans if p.config == ParallelConfig(data=devices)).peak.total


def test_plans_that_fit_are_ranked_by_time_and_the_others_say_why():
    model = _wide_mlp()
    limit = int(0.6 * _data_parallel_peak(model))
    plans = tfdist.plan(model, devices=4, memory_per_device=limit, batch_size=32, **HARDWARE)
    fitting = [p for p in plans if p.fits]
    over = [p for p in plans if not p.fits]
    assert fitting and over
    assert plans[:len(fitting)] == fitting  # every plan that fits comes first
    assert [p.time.total for p in fitting] == sorted(p.time.total for p in fitting)
    # 15% of the limit kept free for the prediction's error
    assert plans.usable == pytest.approx(0.85 * limit)
    assert all(p.peak.total <= plans.usable for p in fitting)
    assert all(p.peak.total > plans.usable and "peak" in p.reason for p in over)
    assert ParallelConfig(data=4) in [p.config for p in over]  # whole model and Adam
    assert plans.best is fitting[0]
    for p in plans:
        assert p.config.data * p.config.pipeline * p.config.tensor == 4
        p.config.validate(strategy="Strategy")
    table = str(plans)
    assert "rank" in table.splitlines()[0] and f"{len(fitting)} fit in" in table


def test_a_plans_peak_is_what_the_strategy_predicts_for_it():
    model = _mlp()
    plans = tfdist.plan(model, devices=4, memory_per_device="1TiB", batch_size=32, **HARDWARE)
    by_config = {p.config: p for p in plans}
    for config in (ParallelConfig(data=2, tensor=2, zero=1).resolve(4),
                   ParallelConfig(data=2, pipeline=2, microbatches=4, schedule="1f1b",
                                  remat=True).resolve(4),
                   ParallelConfig(data=4, zero=3).resolve(4)):
        strategy = tfdist.Strategy(config, devices=DEVICES)
        with strategy.scope():
            in_scope = _mlp()
            in_scope.optimizer.build(in_scope.trainable_variables)
        # the plan is for devices of their own (`device_flops` given), the
        # strategy's for this process's logical devices, which share its
        # memory: less what they do not hold at once (zero=1: at the gather
        # of its shards, split one device after another)
        assert by_config[config].peak == modes.planned_peak(config, in_scope, 32), config
        predicted = strategy.predicted_peak(in_scope, batch_size=32)
        assert predicted.total < by_config[config].peak.total, config
        assert predicted.not_at_once < 0 or config.zero == 1


def test_held_fields_stay_and_refusals_name_their_rule():
    model = _mlp()
    plans = tfdist.plan(model, devices=4, memory_per_device="1TiB", batch_size=32,
                        zero=3, **HARDWARE)
    assert plans and all(p.config.zero == 3 for p in plans)
    # zero=3 under pipeline needs remat: refused without it, with the rule's message
    assert any("needs `remat=True`" in error for _, error in plans.refused)
    assert not any(p.config.pipeline > 1 and not p.config.remat for p in plans)


def test_a_held_compression_counts_its_residuals_and_gathered_payloads():
    model = _mlp()
    parameters = sum(4 * w.shape.num_elements() for w in model.trainable_weights)
    weighed = {}
    for compression in ("none", "topk:0.01", "int8"):
        plans = tfdist.plan(model, devices=4, memory_per_device="1TiB", batch_size=32,
                            compression=compression, **HARDWARE)
        weighed[compression] = next(p.peak for p in plans if p.config.zero == 0)
    # Top-K keeps a residual of every weight on each replica; int8 keeps
    # none, but receives the 4 replicas' quarter-size payloads at once.
    assert weighed["topk:0.01"].replica_state == parameters
    assert weighed["int8"].replica_state == weighed["none"].replica_state == 0
    assert weighed["int8"].gradients - weighed["none"].gradients == int(4 * 0.26 * parameters)
    assert "replica state" in str(weighed["topk:0.01"]) and "replica" not in str(
        weighed["none"])


def test_the_headroom_is_what_a_plan_leaves_free_for_the_predictions_error():
    model = _wide_mlp()
    limit = int(0.6 * _data_parallel_peak(model))
    kept, spent = (tfdist.plan(model, devices=4, memory_per_device=limit, batch_size=32,
                               headroom=headroom, **HARDWARE) for headroom in (0.3, 0.0))
    between = [p for p in spent if p.fits and p.peak.total > 0.7 * limit]
    assert between  # plans that fit only without the headroom
    for plan in between:
        refused = next(p for p in kept if p.config == plan.config)
        assert not refused.fits and refused.reason == (
            f"peak {readable(plan.peak.total)} > {readable(int(0.7 * limit))}")
    assert "(30% of it kept free: " in kept.table()
    assert sum(p.fits for p in kept) < sum(p.fits for p in spent)


def test_no_plan_fits_says_the_smallest_peak():
    plans = tfdist.plan(_mlp(), devices=4, memory_per_device="1KiB", batch_size=32, **HARDWARE)
    with pytest.raises(ValueError, match=r"memory_per_device=1.00 KiB.*smallest predicted peak"):
        _ = plans.best


@pytest.mark.parametrize("kwargs, message", [
    (dict(memory_per_device="16Gb"), r"`memory_per_device` must be .*'16Gb'"),
    (dict(devices=6, hosts=4), r"`devices=6` must be a multiple of `hosts=4`"),
    (dict(batch_size=0), r"`batch_size` must be an int >= 1, got 0"),
    (dict(measure=2), r"`measure=2` builds the model again"),
    (dict(zero_stage=1), r"'zero_stage': not `ParallelConfig` fields"),
    (dict(headroom=1.0), r"`headroom` must be a number in \[0, 1\) .* got 1.0"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, message):
    args = dict(devices=4, memory_per_device="1GiB", batch_size=32, **HARDWARE)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        tfdist.plan(_mlp(), **args)


def test_quantities_take_binary_decimal_and_bit_units():
    assert parse_quantity("2GiB", "m") == 2 * 2**30
    assert parse_quantity("1.5GB", "m") == 1.5e9
    assert parse_quantity("100Mbit", "b") == 12.5e6
    assert parse_quantity(1024, "m") == 1024.0


def test_the_bubble_follows_the_schedule_and_shrinks_with_microbatches():
    model = _mlp(layers=8)
    hardware = Hardware(1e10, 8e9, 1.25e8)

    def time_of(**fields):
        return predict_step_time(ParallelConfig(**fields).resolve(4), model, 64, hardware)

    assert time_of(data=4).bubble == 0
    few = time_of(pipeline=4, microbatches=4, schedule="1f1b")
    many = time_of(pipeline=4, microbatches=16, schedule="1f1b")
    # GPipe / 1F1B: (stages - 1) / microbatches of the work is bubble
    assert few.bubble / few.compute == pytest.approx(3 / 4, rel=0.25)
    assert many.bubble / many.compute == pytest.approx(3 / 16, rel=0.25)
    assert time_of(pipeline=4, microbatches=4, schedule="zb1").bubble < few.bubble


def test_a_pass_runs_at_the_rate_measured_nearest_its_rows():
    model = _mlp(layers=8, width=512)
    # passes of 8 rows run at a quarter of the rate of passes of 32
    hardware = Hardware(1e10, 8e18, 1.25e18, collective_latency=0.0,
                        flops_at=((8, 1e9), (32, 4e9)))

    def compute(**fields):
        return predict_step_time(ParallelConfig(**fields).resolve(4), model, 32,
                                 hardware).compute

    # the same FLOPs a device: 8 rows of the whole model, or 32 rows of a quarter of it
    assert compute(data=4) == pytest.approx(4 * compute(data=1, tensor=4), rel=0.05)
    assert compute(data=1, tensor=4, microbatches=4) == pytest.approx(compute(data=4), rel=0.05)
    assert hardware.rate(12) == 1e9 and hardware.rate(20) == 4e9  # nearest by ratio


def test_zero3_replays_the_forward_of_every_unit_but_the_last():
    model = _mlp(layers=4, width=256)  # 5 Dense layers, 5 units: the last (10 classes) small
    hardware = Hardware(1e10, 8e9, 1.25e8)

    def compute(**fields):
        return predict_step_time(ParallelConfig(data=4, **fields).resolve(4), model, 32,
                                 hardware).compute

    forward = compute(zero=1) / 3  # forward 1x, backward 2x
    units = [node_cost(node, None) for node in LayerGraph(model).nodes]
    assert compute(zero=3) == pytest.approx(forward * (3 + sum(units[:-1]) / sum(units)))


def test_tensor_groups_split_the_compute_and_send_activations_not_gradients():
    model = _mlp(layers=8, width=512)
    hardware = Hardware(1e10, 8e9, 1.25e8, collective_latency=0.0)

    def time_of(batch_size, **fields):
        return predict_step_time(ParallelConfig(**fields).resolve(2), model, batch_size,
                                 hardware)

    data, tensor = time_of(64, data=2), time_of(64, data=1, tensor=2)
    assert tensor.compute == pytest.approx(data.compute, rel=0.1)  # both halve the work
    # a tensor group all-reduces activations (rows), a data group gradients (weights)
    assert time_of(640, data=1, tensor=2).communication == pytest.approx(
        10 * tensor.communication)
    assert time_of(640, data=2).communication == pytest.approx(data.communication)


def test_a_collectives_latency_grows_with_its_members_and_a_send_is_two_members():
    model = _mlp()
    free_bytes = dict(device_flops=1e10, device_bandwidth=1e18, link_bandwidth=1e18)
    flat = Hardware(**free_bytes, collective_latency=1e-4)
    ring = Hardware(**free_bytes, collective_latency=1e-4, member_latency=5e-5)

    def communication(hardware, **fields):
        config = ParallelConfig(**fields).resolve(8)
        return predict_step_time(config, model, 64, hardware).communication

    # 8 members: 6 beyond 2, each 5e-5 s more than 2 members' 1e-4 s
    assert communication(flat, data=8) > 0
    assert communication(ring, data=8) == pytest.approx(4 * communication(flat, data=8))
    pipelined = dict(data=2, pipeline=4, microbatches=4, schedule="1f1b")
    assert communication(ring, **pipelined) == pytest.approx(communication(flat, **pipelined))
    assert communication(flat, **pipelined) > 0


def test_latency_is_measured_over_this_processs_devices_and_not_mixed_with_defaults(monkeypatch):
    from tfdist import planning

    timed = {}  # members -> seconds per all-reduce, as measured
    measure = planning._all_reduce_seconds
    monkeypatch.setattr(planning, "_all_reduce_seconds",
                        lambda devices: timed.setdefault(devices, measure(devices)))
    model = _mlp(layers=2, width=32)
    measured = planning.measured_hardware(model, 4, pass_rows=(4, 16), device_bandwidth=1e10,
                                          link_bandwidth=1e9)
    assert [rows for rows, _ in measured.flops_at] == [4, 16]  # a rate at each
    rates = [rate for _, rate in measured.flops_at]
    assert all(rate > 0 for rate in rates) and rates == sorted(rates)  # never lower for more rows
    # both chains ran on this process's devices; their times, not defaults, are the latencies
    assert sorted(timed) == [2, 4] and None not in timed.values()
    assert measured.collective_latency == timed[2] != Hardware.collective_latency
    assert measured.member_latency == pytest.approx(max(0.0, timed[4] - timed[2]) / 2)
    # a step's own call, and each replica's share, call and update (stand-ins: a model given)
    assert measured.step_overhead > 0 and measured.replica_overhead > 0
    # more devices than this process has: 2 members measured, no growth guessed
    beyond = planning.measured_hardware(model, 64, device_bandwidth=1e10, link_bandwidth=1e9)
    assert beyond.collective_latency != Hardware.collective_latency
    assert beyond.member_latency == 0.0


def test_a_steps_own_call_is_paid_once_and_each_replicas_work_by_each_replica():
    model = _mlp()
    base = dict(device_flops=1e10, device_bandwidth=8e9, link_bandwidth=1.25e8)

    def added(field, **fields):
        """What 1 ms of `field` adds to the step, on devices of their own and on shared cores."""
        config = ParallelConfig(**fields).resolve(4)
        return [predict_step_time(config, model, 32, Hardware(**base, shared_cores=cores,
                                                              **{field: 1e-3})).total
                - predict_step_time(config, model, 32, Hardware(**base,
                                                                shared_cores=cores)).total
                for cores in (None, 2)]

    pipelined = dict(pipeline=4, microbatches=4, schedule="1f1b")
    for fields in (dict(data=4), dict(data=1, **pipelined), dict(data=2, tensor=2)):
        assert added("step_overhead", **fields) == pytest.approx([1e-3, 1e-3])
    # a copy of the model's calls: each data replica, each tensor rank; a pipeline's stages one
    assert added("replica_overhead", data=4) == pytest.approx([4e-3, 4e-3])
    assert added("replica_overhead", data=2, tensor=2) == pytest.approx([4e-3, 4e-3])
    assert added("replica_overhead", data=1, **pipelined) == pytest.approx([1e-3, 1e-3])
    assert added("replica_overhead", data=2, pipeline=2, microbatches=2,
                 schedule="1f1b") == pytest.approx([2e-3, 2e-3])


def test_each_replicas_work_is_what_real_steps_add_beyond_the_prediction(monkeypatch):
    from tfdist import plan_trials, planning

    made, rounds = [], []

    def trial(config, batch_size):
        made.append((config.data, config.microbatches, batch_size))

        def timed(steps):
            rounds.append(config.data)
            return {1: 0.010, 4: 0.016}[config.data]  # 6 ms more for 3 more replicas
        return timed

    model = _mlp(layers=2, width=32)
    hardware = planning.measured_hardware(model, 4, rows=8, trial=trial,
                                          device_bandwidth=1e10, link_bandwidth=1e9)
    # one device's 4 microbatches of 1 row against 4 replicas of 1 row: the same passes
    assert made == [(1, 4, 4), (4, 1, 4)]
    assert rounds == [1, 4] * (1 + planning.TRIAL_ROUNDS)  # a first round traces, alternately
    without = dataclasses.replace(hardware, replica_overhead=0.0)
    fewer, every = (predict_step_time(ParallelConfig(**fields).resolve(fields["data"]), model,
                                      4, without).total
                    for fields in (dict(data=1, microbatches=4), dict(data=4)))
    assert 0 < every - fewer < 0.006
    assert hardware.replica_overhead == pytest.approx((0.006 - (every - fewer)) / 3)
    # tfdist.plan and plan="auto" time the steps of a function building the model; of a
    # model, stand-ins
    build = functools.partial(_mlp, layers=2, width=32)
    for module in (plan_trials, planning):
        monkeypatch.setattr(module, "step_timer",
                            lambda strategy, build, batch_size, *rest: trial(strategy.config,
                                                                               batch_size))
    made.clear()
    tfdist.plan(build, devices=4, memory_per_device="1GiB", batch_size=32)
    assert made == [(1, 4, 4), (4, 1, 4)]
    made.clear()
    tfdist.Strategy(plan="auto", devices=DEVICES, model=build, memory_per_device="1GiB",
                    batch_size=32)
    assert made == [(1, 4, 4), (4, 1, 4)]
    made.clear()
    plans = tfdist.plan(build(), devices=4, memory_per_device="1GiB", batch_size=32)
    assert made == []
    # measured on this host's logical devices, which share its cores and
    # memory: each plan's peak is the mean of the process's over its devices
    # (or at zero 1 and 2's gather of their shards, split one device after another)
    assert plans.hardware.shared_cores and all(
        p.peak.not_at_once < 0 or (p.config.zero in (1, 2) and p.peak.gathered) for p in plans)


def test_the_replica_trials_fit_in_the_memory_per_device():
    from tfdist import planning

    model = _mlp(layers=2, width=32)
    model.optimizer.build(model.trainable_variables)  # (as tfdist.plan does: its slots count)
    peaks = {(c.data, c.microbatches): modes.planned_peak(c, model, 4).total
             for c in (ParallelConfig(data=d, microbatches=4 // d).resolve(d) for d in (1, 2, 4))}

    def chosen(memory):
        configs = planning.trial_configs(model, 4, memory=memory)
        return configs and [(c.data, c.microbatches) for c in configs]

    assert chosen(None) == [(1, 4), (4, 1)]
    # the fewest devices whose microbatches fit, against data parallelism over all
    for memory in sorted(peaks.values()):
        fitting = sorted(key for key, peak in peaks.items() if peak <= memory)
        expected = [fitting[0], (4, 1)] if (4, 1) in fitting and len(fitting) > 1 else None
        assert chosen(memory) == expected
    assert chosen(min(peaks.values()) - 1) is None


def test_hosts_put_the_data_groups_gradients_on_the_slower_link():
    model = _mlp()
    config = ParallelConfig(data=4).resolve(4)
    one_host = predict_step_time(config, model, 32, Hardware(1e10, 8e9, 1.25e8))
    two_hosts = predict_step_time(config, model, 32, Hardware(1e10, 8e9, 1.25e8,
                                                              devices_per_host=2))
    assert two_hosts.communication > 10 * one_host.communication


def test_plans_across_hosts_are_those_a_multi_worker_strategy_runs():
    plans = tfdist.plan(_mlp(), devices=4, memory_per_device="1GiB", batch_size=16,
                        hosts=2, **HARDWARE)
    assert any(p.config.pipeline == 2 for p in plans)
    assert not any(p.config.pipeline > 1 and p.config.zero == 3 for p in plans)
    assert any("`zero=3` with `pipeline=2` runs on one host" in error
               for _, error in plans.refused)


def test_a_model_tensor_groups_cannot_split_gets_no_tensor_plan():
    convnet = keras.Sequential([keras.Input((12, 12, 1)), keras.layers.Conv2D(8, 3),
                                keras.layers.Flatten(), keras.layers.Dense(4)])
    convnet.compile(optimizer="adam", loss="mse")
    plans = tfdist.plan(convnet, devices=4, memory_per_device="1GiB", batch_size=16,
                        **HARDWARE)
    assert plans and all(p.config.tensor == 1 for p in plans)
    assert any("tensor=2 splits no layer" in error for _, error in plans.refused)


def test_a_strategy_takes_the_best_plan_and_logs_why(caplog):
    model = _wide_mlp()
    limit = int(0.6 * _data_parallel_peak(model))
    plans = tfdist.plan(model, devices=4, memory_per_device=limit, batch_size=32, **HARDWARE)
    with caplog.at_level("INFO", logger="absl"):
        strategy = tfdist.Strategy(plan=plans, devices=DEVICES)
    assert strategy.config == plans.best.config != ParallelConfig(data=4).resolve(4)
    logged = caplog.text
    assert f"the plan chosen: {plans.best.summary()}; the fastest (predicted)" in logged
    assert f"next: {[p for p in plans if p.fits][1].summary()}" in logged
    third = [p for p in plans if p.fits][2]
    assert tfdist.Strategy(plan=third, devices=DEVICES).config == third.config


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(zero=1), ValueError, "Pass either `plan=` or a config"),
    (dict(devices=DEVICES[:2]), ValueError, "`plan` is for 4 devices"),
])
def test_a_strategy_refuses_a_plan_it_cannot_follow(kwargs, error, message):
    plans = tfdist.plan(_mlp(layers=2), devices=4, memory_per_device="1TiB", batch_size=32,
                        **HARDWARE)
    with pytest.raises(error, match=message):
        tfdist.Strategy(plan=plans, **{"devices": DEVICES, **kwargs})
    with pytest.raises(TypeError, match="`plan` must be what tfdist.plan returns"):
        tfdist.Strategy(plan="fastest", devices=DEVICES)


def test_a_strategy_plans_for_its_own_devices_with_plan_auto_and_trains(caplog):
    limit = int(0.9 * _data_parallel_peak(_wide_mlp()))
    arguments = dict(model=_wide_mlp, memory_per_device=limit, batch_size=32, **HARDWARE)
    with caplog.at_level("INFO", logger="absl"):
        strategy = tfdist.Strategy(plan="auto", devices=DEVICES, **arguments)
    plans = tfdist.plan(devices=4, **arguments)
    assert strategy.config == plans.best.config != ParallelConfig(data=4).resolve(4)
    assert "planning for 4 devices" in caplog.text
    assert f"the plan chosen: {plans.best.summary()}" in caplog.text
    held = tfdist.Strategy(plan="auto", devices=DEVICES[:2], zero=3, **arguments)
    assert (held.config.data, held.config.zero) == (2, 3)
    # measure=0 asks for the predictions alone, as "auto" plans
    assert tfdist.Strategy(plan="auto", devices=DEVICES, measure=0,
                           **arguments).config == strategy.config
    with strategy.scope():
        model = _wide_mlp()
    x = keras.random.normal((64, 64), seed=1)
    history = model.fit(x, keras.ops.arange(64) % 10, batch_size=32, epochs=2, verbose=0)
    assert all(loss == loss for loss in history.history["loss"])  # trained, no NaN


@pytest.mark.parametrize("kwargs, message", [
    (dict(memory_per_device="1GiB", batch_size=32), "missing: model"),
    (dict(model=_mlp, batch_size=32), "missing: memory_per_device"),
    (dict(model=_mlp, memory_per_device="1GiB", batch_size=32, config=ParallelConfig()),
     "not `config`"),
    (dict(model=_mlp, memory_per_device="1GiB", batch_size=32, measure=2),
     r"`measure=2` trains plans.*plan=tfdist.plan\(build_model, ..., measure=K\)"),
])
def test_plan_auto_names_what_it_plans_from_before_planning(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfdist.Strategy(plan="auto", devices=DEVICES, **kwargs)


def test_a_multi_worker_strategy_takes_its_plan_as_a_config_before_connecting():
    with pytest.raises(ValueError, match="MultiWorkerStrategy takes no `plan`.*--config"):
        tfdist.MultiWorkerStrategy(plan="auto")


def test_a_model_calling_keras_ops_between_its_layers_is_planned():
    # as keras-hub's classifiers take the first token: `x[:, 0]`, an op of no weights
    inputs = keras.Input((8, 16))
    hidden = keras.layers.Dense(64)(keras.layers.Dense(64)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4)(hidden[:, 0]))
    model.compile(optimizer="adam", loss="mse")
    plans = tfdist.plan(model, devices=4, memory_per_device="1GiB", batch_size=16,
                        sequence_length=8, **HARDWARE)
    assert any(p.config.tensor > 1 and p.time.communication > 0 for p in plans)
