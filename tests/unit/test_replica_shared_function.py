"""`ReplicaSharedFunction`: one trace for every replica of a `MirroredStrategy`,
each replica reading and writing its own copies of the variables; traces that
are not the same on every replica are each replica's own."""

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import devices
from tfdist._compat import tf_collectives
from tfdist._compat.tf_distribute import MirroredStrategyOfItsOwnKeys, current_local_replica_id
from tfdist._compat.tf_function import ReplicaSharedFunction


def _on_replicas(fn, strategy):
    """`fn(replica id as a float)` run on the strategy's replicas in one
    traced function; its local results."""
    ids = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(float(context.replica_id_in_sync_group)))
    step = tf.function(lambda: strategy.run(fn, args=(ids,)))
    return [float(t) for t in strategy.experimental_local_results(step())]


def test_one_trace_serves_every_replica_with_its_own_variables():
    traces = []
    with tf.distribute.MirroredStrategy(devices(4)).scope():
        counter = tf.Variable(1.0, synchronization=tf.VariableSynchronization.ON_READ,
                              aggregation=tf.VariableAggregation.SUM)

    def add(x):  # writes the replica's copy, then reads it
        traces.append(1)
        counter.assign_add(x)
        return counter.read_value() * 10.0

    results = _on_replicas(ReplicaSharedFunction(add), counter.distribute_strategy)
    assert len(traces) == 1
    assert results == [10.0, 20.0, 30.0, 40.0]
    np.testing.assert_array_equal([float(c) for c in counter.values], [1.0, 2.0, 3.0, 4.0])


def test_a_trace_that_reads_the_replica_id_is_each_replicas_own():
    traces = []

    def plus_id(x):
        traces.append(1)
        context = tf.distribute.get_replica_context()
        return x + tf.cast(context.replica_id_in_sync_group, tf.float32)

    results = _on_replicas(ReplicaSharedFunction(plus_id),
                           tf.distribute.MirroredStrategy(devices(4)))
    assert results == [0.0, 2.0, 4.0, 6.0]
    assert len(traces) == 5  # the first replica's trial, then each replica's own


def test_a_trace_with_collectives_gives_back_the_keys_it_took():
    # The first replica's trial trace, not used when it holds collectives,
    # must leave no collective key taken: every replica's collectives then
    # take the same keys in the same order (else they wait on each other
    # until the strategy's timeout).
    strategy = tfdist.Strategy(data=4, devices=devices(4))

    def summed(x):
        return tf_collectives.strategy_launcher(
            strategy.extended, current_local_replica_id()).all_reduce(x)

    shared = ReplicaSharedFunction(summed)
    assert _on_replicas(lambda x: summed(shared(x)), strategy) == [24.0] * 4


def test_tensor_group_collectives_take_each_callers_keys_in_one_trace():
    # Replicas 0, 1 and 2, 3 are two tensor groups. One trace serves all four:
    # its collectives' group key, instance keys and ordering token and the
    # tensor rank are inputs each replica's call gives (its own group's), so
    # each group sums its own values, each rank keeps its own slice, and a
    # second step takes fresh instance keys.
    strategy = tfdist.Strategy(data=2, tensor=2, devices=devices(4))
    mesh = strategy.tensor_mesh
    traces = []

    def in_groups(x):
        traces.append(1)
        weighted = x * tf.cast(mesh.rank() + 1, tf.float32)  # rank 0: x, rank 1: 2x
        halves = mesh.take_slice(tf.stack([x, 10.0 * x]), 0)  # the rank's own row
        return mesh.reduce(weighted) + mesh.gather_last(halves)[1]

    shared = ReplicaSharedFunction(in_groups)
    ids = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(float(context.replica_id_in_sync_group)))
    step = tf.function(lambda: strategy.run(shared, args=(ids,)))
    for _ in range(2):
        results = [float(t) for t in strategy.experimental_local_results(step())]
        # Group (0, 1): 0 + 2 * 1 = 2, plus rank 1's row 10 * 1; group (2, 3): 2 + 6 = 8, plus 30.
        assert results == [12.0, 12.0, 38.0, 38.0]
    assert len(traces) == 1
    graph = step.get_concrete_function().graph
    assert sum(op.type == "CollectiveReduceV2" for op in graph.get_operations()) == 0  # in the call


def test_with_one_body_every_call_runs_one_function_not_inlined_copies():
    # Each replica calls the trace twice in a step (as microbatches do). With
    # one_body the trace's body is the one branch of a Case TensorFlow does
    # not lower: the step holds one copy of the body, which every call runs
    # with its own group's keys (the second call takes fresh instance keys).
    strategy = tfdist.Strategy(data=2, tensor=2, devices=devices(4))
    mesh = strategy.tensor_mesh

    def in_groups(x):
        return mesh.reduce(x * tf.cast(mesh.rank() + 1, tf.float32)), None

    shared = ReplicaSharedFunction(in_groups, one_body=True)

    def twice(x):
        once, nothing = shared(x)
        assert nothing is None
        return shared(once)[0]

    ids = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(float(context.replica_id_in_sync_group)))
    step = tf.function(lambda: strategy.run(twice, args=(ids,)))
    for _ in range(2):
        results = [float(t) for t in strategy.experimental_local_results(step())]
        # Group (0, 1): 0 + 2 * 1 = 2, then 2 + 2 * 2 = 6; group (2, 3): 8, then 24.
        assert results == [6.0, 6.0, 24.0, 24.0]
    library = step.get_concrete_function().graph.as_graph_def().library.function
    bodies = [f for f in library if any(n.op == "CollectiveReduceV2" for n in f.node_def)]
    cases = [n for f in library for n in f.node_def if n.op == "Case"]
    assert len(bodies) == 1 and cases
    assert all(n.attr["_lower_using_switch_merge"].b is False for n in cases)
    assert {n.attr["branches"].list.func[0].name for n in cases} == {bodies[0].signature.name}
    with pytest.raises(ValueError, match="one_body=True cannot combine with jit_compile"):
        ReplicaSharedFunction(in_groups, one_body=True, jit_compile=True)


def test_a_function_that_synchronises_the_replicas_runs_in_their_own_traces():
    # A merge_call (here an all-reduce) is refused in a nested function:
    # each replica then runs the function in its own trace, as without the class.
    def total(x):
        return tf.distribute.get_replica_context().all_reduce("sum", x)

    # Collective keys of its own: two plain MirroredStrategy objects number
    # their collectives alike, and TensorFlow refuses a later one of another
    # shape under the same keys (test_parity.py's, in the same process).
    results = _on_replicas(ReplicaSharedFunction(total),
                           MirroredStrategyOfItsOwnKeys(devices(4)))
    assert results == [6.0] * 4


def test_a_tape_outside_the_function_differentiates_each_replicas_own_copy():
    traces = []
    with tf.distribute.MirroredStrategy(devices(4)).scope():
        weight = tf.Variable(2.0)

    def scaled(x):
        traces.append(1)
        return weight * x

    shared = ReplicaSharedFunction(scaled)

    def gradient(x):  # d(weight * x^2)/d weight on each replica: its x^2
        with tf.GradientTape() as tape:
            y = shared(x) * x
        return tape.gradient(y, weight)

    assert _on_replicas(gradient, weight.distribute_strategy) == [0.0, 1.0, 4.0, 9.0]
    assert len(traces) == 1


def test_with_one_copy_too_the_calls_of_one_replica_share_a_trace():
    traces = []

    def double(x):
        traces.append(1)
        return x * 2.0

    for one_copy_too, expected in ((False, 2), (True, 1)):
        traces.clear()
        shared = ReplicaSharedFunction(double, one_copy_too=one_copy_too)
        assert _on_replicas(lambda x, shared=shared: shared(shared(x) + 1.0),
                            tf.distribute.MirroredStrategy(devices(1))) == [2.0]
        assert len(traces) == expected


def test_a_trace_that_looks_up_variable_rows_is_not_shared_with_no_lookups():
    # A gradient taken outside the call gets a lookup's rows as IndexedSlices
    # whose indices cannot be traced to a fixed lookup (a position embedding).
    traces = []
    with tf.distribute.MirroredStrategy(devices(2)).scope():
        table = tf.Variable(tf.ones((4, 3)))

    def rows(x):
        traces.append(1)
        return tf.gather(table, tf.range(2)) * x

    for no_lookups, expected in ((False, 1), (True, 3)):
        traces.clear()
        shared = ReplicaSharedFunction(rows, no_lookups=no_lookups)
        _on_replicas(lambda x, shared=shared: tf.reduce_sum(shared(x)), table.distribute_strategy)
        assert len(traces) == expected  # shared; or the trial, then each replica's own
