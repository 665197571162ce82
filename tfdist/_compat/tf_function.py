"""tf.function internals: variables made while a function is first traced,
without making the function trace itself again.

A `tf.function` whose first trace creates variables traces itself a second
time (the first trace's graph may initialise them; the second, which must
not create any, is the one it runs): the whole step's tracing, twice. It
notices them through a variable creator it puts on the graph it traces
(`variable_capturing_scope` in TensorFlow's polymorphic_function.py), which
every `tf.Variable` made during the trace passes through, even under
`tf.init_scope()`. tfdist readies a step's state (tensor slices, optimizer
shards) when the first trace reaches it, eagerly: that creator is set aside
there, so the function keeps its one trace.
"""

import contextlib
import copy
import functools
import itertools
import threading

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.eager import context as eager_context
from tensorflow.python.eager.polymorphic_function import function_type_utils
from tensorflow.python.framework import op_def_registry, ops
from tensorflow.python.ops import cond_v2

# The name of the creator a tf.function's first trace installs.
_CAPTURING_CREATOR = "variable_capturing_scope"


@contextlib.contextmanager
def eagerly_outside_the_trace():
    """`tf.init_scope()`, and variables made in it not counted as the
    enclosing `tf.function` trace's own.

    Example:

    ```python
    with eagerly_outside_the_trace():   # inside a first trace
        slot = tf.Variable(tf.zeros([4]))  # eager; no second trace
    ```
    """
    graph = tf.compat.v1.get_default_graph()
    stack = graph._variable_creator_stack
    kept = [(p, c) for p, c in stack if getattr(c, "__name__", "") != _CAPTURING_CREATOR]
    graph._variable_creator_stack = kept
    try:
        with tf.init_scope():
            yield
    finally:
        graph._variable_creator_stack = stack


class _CallerValue:
    """The key of an input of a shared trace that each caller gives: `resolve()`
    evaluated in the caller's own trace. Keys of one name are one input;
    `each_call`: a value each call takes anew (a collective's instance key)."""

    def __init__(self, name, resolve, each_call=False):
        self.name = name
        self.resolve = resolve
        self.each_call = each_call

    def __hash__(self):
        return hash((_CallerValue, self.name))

    def __eq__(self, other):
        return isinstance(other, _CallerValue) and other.name == self.name


_sharing = threading.local()  # .depth: shared traces this thread is tracing


def caller_value(name: str, resolve, dtype, each_call=False):
    """Inside a trace that `ReplicaSharedFunction` shares among replicas, an
    input of that trace (a scalar of `dtype`) whose value each caller gives:
    `resolve()`, evaluated in the caller's own trace, in its replica context
    (its collectives' keys and ordering token, its tensor rank). The inputs of
    one `name` in one trace are one input; with `each_call`, a value that
    each call takes anew (an instance key: a shared trace that calls another
    twice gives each call its own). None outside such traces: there, the
    caller's own value is used directly.

    Example:

    ```python
    rank = caller_value("tensor_rank", lambda: tf.constant(own_rank()), tf.int32)
    if rank is None:
        rank = own_rank()
    ```
    """
    if not sharing_a_trace():
        return None
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):  # as TensorFlow's launchers
        graph = graph.outer_graph
    return graph.capture_call_time_value(_given_by_the_caller, tf.TensorSpec([], dtype),
                                         key=_CallerValue(name, resolve, each_call))


def _resolved(key, dtype):
    """The value of a shared trace's input `key` (of `dtype`) in the calling
    trace: the caller's own, or, where the caller is itself a trace the
    replicas share (a pipeline's or ZeRO-3's program calling its layers'
    trace), an input of that trace, which its own callers give."""
    if not sharing_a_trace():
        return key.resolve()
    name = f"{key.name}/call{next(_CALLS)}" if key.each_call else key.name
    return caller_value(name, key.resolve, dtype, key.each_call)


_CALLS = itertools.count()  # names of the inputs an enclosing shared trace forwards


def sharing_a_trace() -> bool:
    """Whether this thread is tracing a function `ReplicaSharedFunction`
    shares among replicas (where `caller_value` gives inputs).

    Example:

    ```python
    launcher = CallerLauncher("tensor", own) if sharing_a_trace() else own()
    ```
    """
    return bool(getattr(_sharing, "depth", 0))


def _given_by_the_caller():
    raise AssertionError("a shared trace's caller gives this input itself")


@contextlib.contextmanager
def _tracing_shared():
    _sharing.depth = getattr(_sharing, "depth", 0) + 1
    try:
        yield
    finally:
        _sharing.depth -= 1


class ReplicaSharedFunction:
    """A function traced once for all the local copies of a `tf.distribute`
    strategy's variables: its replicas, or the devices of an update.

    Under a `MirroredStrategy` every replica traces its step on its own (a
    `tf.function` of the step's traces again for each device: its cache is
    keyed by the device), reading its own copy of each variable; with 4
    replicas, 4 traces of the same Python. Here the first caller traces `fn`
    into a function (its ops have no device: they run on the device of each
    call) and every caller, in replica context or in a variable update on one
    device, calls that trace with its captured inputs swapped for its own:
    each variable's copy for the caller's, and the inputs each caller gives
    (`caller_value`: a tensor group's collective keys, ordering token and
    rank) its own. A trace that is not the same for every caller (one with
    other collectives, one that reads the replica's id or two
    copies of one variable, one that captures a tensor of the caller's own
    graph, one whose variables' copies differ in shape), or that cannot be
    traced on its own (a `merge_call`, as tf_keras's BatchNormalization makes,
    is refused inside a function), is not shared: each caller then runs `fn`
    as it would without this class (or `unshared`). A shared trace may call
    another (a ZeRO-3 program its layers'): the inner trace's inputs that
    callers give become the outer trace's, which its own callers give.
    Outside a traced function, or with one local copy (unless
    `one_copy_too`), `fn` is just called (compiled with XLA when `jit_compile`).

    Args:
        fn: the Python function, called with tensors (nests of them) and None.
        jit_compile: compile the function with XLA.
        one_copy_too: share the trace among the calls of a strategy with one
            local copy too (a pipeline's microbatches and remat replays).
        no_lookups: do not share a trace that looks up rows of a variable
            (an embedding), for a caller that differentiates the call: the
            rows' `IndexedSlices` then come out of the call with indices that
            `sparse_gradients.sum_fixed_lookups` cannot trace back to a
            fixed lookup (a position embedding's), and Adam would update its
            duplicate rows one by one, not summed as on one device.
        unshared: what a caller that cannot share the trace calls instead
            (default: `fn` in the caller's own trace, compiled with XLA under
            `jit_compile`).
        one_body: run the trace's body as one function every call runs on
            its caller's device, not inlined into the step at each call
            (`in_one_body`): for a function each replica calls several times
            (a microbatch's forward and backward), which no tape outside it
            differentiates. Not with `jit_compile`.

    Example:

    ```python
    forward_backward = ReplicaSharedFunction(forward_backward)
    strategy.run(forward_backward, args=(batch,))   # one trace, not one per replica
    ```
    """

    def __init__(self, fn, jit_compile=False, one_copy_too=False, no_lookups=False,
                 unshared=None, one_body=False):
        if one_body and jit_compile:
            raise ValueError("ReplicaSharedFunction: one_body=True cannot combine with "
                             "jit_compile=True (XLA compiles the body with its call).")
        self._fn = fn
        self._no_lookups = no_lookups
        self._copies_needed = 1 if one_copy_too else 2

        @functools.wraps(fn)
        def in_a_root_scope(*args):
            # A function's graph starts with no name scope, and a first scope
            # must match ^[A-Za-z0-9.]: a Keras layer named "_x" called first
            # (a pipeline stage's) would fail to trace.
            with tf.name_scope("replica"):
                return in_one_body(fn, *args) if one_body else fn(*args)

        self._function = tf.function(in_a_root_scope, autograph=False,
                                     jit_compile=jit_compile or None, reduce_retracing=jit_compile)
        self._unshared_fn = unshared or (self._function if jit_compile else fn)
        self._shared = {}  # id(concrete function) -> whether its callers may share it
        self._unshared = False  # set once `fn` could not be traced on its own

    def experimental_get_tracing_count(self) -> int:
        """How many times `fn` was traced as a function (the shared traces,
        and each caller's own under `jit_compile`), as `tf.function` says."""
        return self._function.experimental_get_tracing_count()

    def with_unshared(self, unshared):
        """This function, its traces shared with it, for callers that call
        `unshared` where they cannot share them.

        Example:

        ```python
        runs = [shared.with_unshared(tf.function(step)) for _ in range(2)]
        ```
        """
        other = copy.copy(self)
        other._unshared_fn = unshared
        return other

    def _own(self, *args):
        """What a caller that does not share the trace calls."""
        return self._unshared_fn(*args)

    def __call__(self, *args):
        if self._unshared or not _local_copies_at_least(self._copies_needed):
            return self._own(*args)
        try:
            with eager_context.context().device(None), _tracing_shared():  # no device in the key
                concrete = self._function.get_concrete_function(*args)
        except Exception:  # e.g. a `merge_call` (not allowed in a function): as before
            self._unshared = True
            return self._own(*args)
        if not self._shareable(concrete):
            return self._own(*args)  # as without this class
        captures = _local_captures(concrete)
        if captures is None:
            return self._own(*args)
        bound = function_type_utils.canonicalize_function_inputs(
            args, {}, concrete.function_type)
        return concrete._call_flat(concrete.function_type.unpack_inputs(bound),
                                   captured_inputs=captures)

    def _shareable(self, concrete):
        key = id(concrete)
        if key not in self._shared:
            self._shared[key] = _replica_independent(concrete, self._no_lookups)
            if self._shared[key]:
                _callers_give_the_gradient_inputs(concrete)
        return self._shared[key]


def in_one_body(fn, *args):
    """`fn(*args)` in a traced function, as the one branch of a `Case` that
    TensorFlow does not lower into the graph: the branch is a function of
    the library that each device instantiates once and every call runs,
    where a function call is inlined at each call site before the step's
    first run. A function traced once and called k times per replica (a
    microbatch's forward and backward) is then instantiated and optimised
    once per device, not k times: the step's first call costs what one call
    per replica would. Outputs as `fn`'s (nests, None, `IndexedSlices`).
    Under a parameter-server strategy, whose variables live on other tasks
    (a branch run as a function takes inputs on its own device only), `fn`
    is called inline.

    Example:

    ```python
    loss, grads = in_one_body(forward_backward, x, y)   # in a tf.function
    ```
    """
    if isinstance(tf.distribute.get_strategy(), tf.distribute.experimental.ParameterServerStrategy):
        return fn(*args)
    return cond_v2.indexed_case(tf.constant(0), [lambda: fn(*args)],
                                lower_using_switch_merge=False)


def _local_copies_at_least(count: int) -> bool:
    """In a traced function, in replica context or a variable update, of a
    strategy with at least `count` local devices."""
    if not tf.compat.v1.get_default_graph().building_function:
        return False
    in_update = distribute_lib.get_update_replica_id() is not None
    if tf.distribute.get_replica_context() is None and not in_update:
        return False
    try:
        return len(tf.distribute.get_strategy().extended.worker_devices) >= count
    except NotImplementedError:  # a strategy that does not say: not shared
        return False


def _replica_independent(concrete, no_lookups=False) -> bool:
    """Whether a trace made on one replica serves every replica: no tensor
    captured from the caller's graph, no replica id, and no collective but
    those whose keys are inputs each caller gives (`caller_value`).

    Read without `concrete.captured_inputs`, which evaluates the captures
    taken at each call (a collective's instance key): in the caller's graph
    that takes one more key for the caller's device, which its peers'
    collectives would then never meet."""
    captures = concrete.graph.function_captures
    if not all(isinstance(key, _CallerValue) for key in captures.by_ref_external):
        return False  # values taken at each call that the caller cannot give: TensorFlow's keys
    by_value = list(captures.by_val_external.values())
    if any(not isinstance(t, ops.EagerTensor) for t in by_value):
        return False
    containers = [id(c()) for t in by_value
                  if (c := getattr(t, "_distributed_container", None)) is not None]
    if len(set(containers)) < len(containers):  # two copies of one variable: not the replica's own
        return False
    if no_lookups and _looks_up_variable_rows(concrete.graph):
        return False
    if _collectives_with_fixed_keys(concrete.graph):
        return False
    graph_def = concrete.graph.as_graph_def()
    if any(_keys_fixed_inside(f) for f in graph_def.library.function):
        return False
    nested = [n for f in graph_def.library.function for n in f.node_def]
    return not any(
        n.op == "Const" and n.name.rsplit("/", 1)[-1].startswith("replica_id_in_sync_group")
        for n in [*graph_def.node, *nested])


def _callers_give_the_gradient_inputs(concrete):
    """Makes the backward function TensorFlow builds for a shared trace (when
    a tape outside it differentiates a call) take each caller's own inputs
    too: it is built as a shared trace is (`caller_value` gives inputs: its
    collectives' keys and ordering token), and at each call TensorFlow
    evaluates its captured inputs in the calling replica's trace, where each
    of those inputs is resolved as the caller's own."""
    rewrites = concrete._delayed_rewrite_functions  # the gradient of a call in a graph
    build = rewrites._construct_forward_backward

    def construct_forward_backward(num_doutputs):
        with _tracing_shared():
            forward, backward = build(num_doutputs)
        fixed = _collectives_with_fixed_keys(backward.graph)
        if fixed:
            raise NotImplementedError(
                f"The gradient of a trace the replicas share has collectives whose keys "
                f"its callers do not give ({', '.join(fixed)}): they would all be the "
                f"first caller's. Make them through the caller's launcher "
                f"(tfdist._compat.tf_collectives.CallerLauncher).")
        captures = backward.graph.function_captures
        backward._captured_inputs = backward.graph.external_captures + [
            functools.partial(_resolved, key, captures.by_ref_internal[key].dtype)
            if isinstance(key, _CallerValue) else closure
            for key, closure in captures.by_ref_external.items()]
        return forward, backward

    rewrites._construct_forward_backward = construct_forward_backward


def _collectives_with_fixed_keys(graph) -> list:
    """The names of `graph`'s collectives whose group or instance key is not
    an input its callers give (`caller_value`)."""
    given = {t.op.name for key, t in graph.function_captures.by_ref_internal.items()
             if isinstance(key, _CallerValue)}
    return [op.name for op in graph.get_operations()
            if op.type.startswith(_COLLECTIVE_OPS) and not _keys_given(op, given)]


def _keys_fixed_inside(function_def) -> bool:
    """Whether a function of a trace's library (a shared trace it calls, a
    `tf.cond`'s branch) has a collective whose group or instance key is a
    constant of its own. Its other keys are its inputs: the trace's own
    keys, which `_collectives_with_fixed_keys` checks, or a shared trace's
    inputs its caller gives (`_resolved`)."""
    nodes = {n.name: n for n in function_def.node_def}
    for node in function_def.node_def:
        if not node.op.startswith(_COLLECTIVE_OPS):
            continue
        names = [arg.name for arg in op_def_registry.get(node.op).input_arg]
        if "group_key" not in names or "instance_key" not in names:
            return True  # keys in attributes (NCCL's, v1 collectives'): fixed
        for key in ("group_key", "instance_key"):
            source = nodes.get(node.input[names.index(key)].split(":")[0])
            while source is not None and source.op == "Identity":
                source = nodes.get(source.input[0].split(":")[0])
            if source is not None and source.op == "Const":
                return True
    return False


def _keys_given(op, given) -> bool:
    """Whether collective `op` takes its group and instance keys from inputs
    its callers give."""
    names = [arg.name for arg in op.op_def.input_arg]
    return all(key in names and op.inputs[names.index(key)].op.name in given
               for key in ("group_key", "instance_key"))


def _looks_up_variable_rows(graph) -> bool:
    """Whether `graph` gathers rows of a variable's value (an embedding's
    lookup, reading the variable directly or through casts)."""
    for op in graph.get_operations():
        if op.type == "ResourceGather":
            return True
        if op.type == "GatherV2":
            params = op.inputs[0].op
            while params.type in ("Identity", "Cast") and params.inputs:
                params = params.inputs[0].op
            if params.type == "ReadVariableOp":
                return True
    return False


# Op types that exchange tensors between replicas.
_COLLECTIVE_OPS = ("Collective", "Nccl")


def _local_captures(concrete):
    """The function's captured inputs for the calling replica: each
    distributed variable's copy replaced by the caller's, each input the
    caller gives (`caller_value`) resolved in the caller's trace; None if a
    copy of the caller's has another shape than the one traced (a variable
    split unevenly)."""
    captures = []
    function_captures = concrete.graph.function_captures
    for t in function_captures.by_val_external.values():
        container = getattr(t, "_distributed_container", None)  # set on a copy's handle
        if container is None:
            captures.append(t)
            continue
        variable = container()
        local = variable._get_on_device_or_primary()
        if local.shape != next(c for c in variable._values if c.handle is t).shape:
            return None
        captures.append(local.handle)
    return captures + [_resolved(key, function_captures.by_ref_internal[key].dtype)
                       for key in function_captures.by_ref_external]
