"""Shared pieces of the parity tests: one model, one data set, one recorder.

Parity (docs/architecture.md): the same model, initial weights, data order and
optimizer, trained once on a single device and once under the mode under test.
"""

import collections
import contextlib
import functools
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist.cluster.liveness import probe
from tfdist.input_options import without_autotuning

FEATURES, CLASSES = 16, 4
TFDIST = [sys.executable, "-m", "tfdist.cli"]  # the `tfdist` command of this checkout
# A task that prints the TF_CONFIG `tfdist launch` gave it.
PRINT_TF_CONFIG = [sys.executable, "-c", "import os; print(os.environ['TF_CONFIG'])"]


# The start of a `python -c` task of a launched MultiWorkerStrategy job: its
# `index`, the strategy, and a tiny compiled `model` (4 features -> 2).
TINY_TASK = """
import json, os, sys
import keras, numpy as np
import tfdist
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
strategy = tfdist.MultiWorkerStrategy(timeout_seconds=60)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
"""


def run_tfdist(*args, timeout=120, env=None):
    """Runs the `tfdist` command with `args` (in `env`, default this process's
    environment); its output is captured as text."""
    return subprocess.run([*TFDIST, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def output_tail(output, chars=4000):
    """The last `chars` of a subprocess's `output`, for a failure message,
    without the list of extension modules Python prints after a fatal
    error's stacks (a few thousand characters that would hide them); after a
    fatal error, first its next 40 lines (the stack of the thread that
    failed), which the tail may not reach."""
    output = re.sub(r"\nExtension modules: [^\n]*", "", output)
    start = output.find("Fatal Python error")
    if start < 0 or start >= len(output) - chars:
        return output[-chars:]
    head = "\n".join(output[output.rfind("\n", 0, start) + 1:].splitlines()[:40])
    return head + "\n[...]\n" + output[-chars:]


def wait_until_answering(address, process, seconds=60.0):
    """Waits until the TensorFlow server at `address`, started by `process`,
    answers a probe; fails naming it if `process` ends first or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while probe(address, timeout=1.0) != "ok":
        assert process.poll() is None, (f"the server at {address} ended before answering: "
                                        + (process.stdout.read() if process.stdout else ""))
        assert time.monotonic() < deadline, (
            f"the server at {address} did not answer within {seconds:g} s")
        time.sleep(0.2)


def devices(n):
    """The first `n` logical CPU device names."""
    return [d.name for d in tf.config.list_logical_devices("CPU")[:n]]


def strategy_on_its_devices(**config):
    """A `tfdist.Strategy` of `config` on the first data x pipeline x tensor
    devices (each field 1 where `config` leaves it out)."""
    used = config.get("data", 1) * config.get("pipeline", 1) * config.get("tensor", 1)
    return tfdist.Strategy(devices=devices(used), **config)


def data(n=640, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x[:, :CLASSES] + 0.3 * rng.normal(size=(n, CLASSES))).argmax(-1)
    return x, y.astype("int32")


def make_model(optimizer=None, seed=0, compile_kwargs=None):
    """A small MLP with dropout-free deterministic init, compiled."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(CLASSES),
        ]
    )
    model.compile(
        optimizer=optimizer or keras.optimizers.SGD(0.05, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **(compile_kwargs or {}),
    )
    return model


class StepLosses(keras.callbacks.Callback):
    """Records the loss Keras reports after every training step."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def train(strategy=None, *, epochs=1, batch_size=32, make=make_model, fit_kwargs=None,
          x=None, y=None, **make_kwargs):
    """Builds the model (in `strategy`'s scope if given) and fits it in order.

    Returns (per-step reported losses, final weights as numpy, model).
    """
    if x is None:
        x, y = data()
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = make(**make_kwargs)
    recorder = StepLosses()
    fit_kwargs = dict(fit_kwargs or {})
    if strategy is None:  # the same batches, without tf.data autotuning
        x, y = _batches(x, y, batch_size, fit_kwargs.pop("sample_weight", None)), None
        batch_size = None
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[recorder], **fit_kwargs)
    return recorder.losses, [w.numpy() for w in model.weights], model


def _batches(x, y, batch_size, sample_weight=None):
    """The batches Keras's `fit(x, y, batch_size=..., shuffle=False)` reads, as a
    dataset without tf.data autotuning. Destroying an iterator with autotuning
    on can wait up to a minute for its autotuning thread (TensorFlow 2.20's
    missed wake-up: tfdist/input_options.py), and Python drops a finished
    `fit`'s iterator at a later garbage collection, in whatever test runs then:
    the single-device references were the suite's last such iterators.
    """
    def as_keras_reads(a):  # floats as floatx, as Keras's array adapter casts them
        floating = isinstance(a, np.ndarray) and np.issubdtype(a.dtype, np.floating)
        return a.astype(keras.config.floatx()) if floating else a

    arrays = tuple(tuple(a) if isinstance(a, list) else a  # a list of inputs: not stacked
                   for a in (x, y, sample_weight) if a is not None)
    arrays = tf.nest.map_structure(as_keras_reads, arrays)
    return without_autotuning(tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size))


def traced_train_function(model):
    """The `tf.function` `fit` traced for `model` (Keras keeps it in a closure)."""
    cells = [c.cell_contents for c in model.train_function.__closure__]
    (traced,) = [c for c in cells if hasattr(c, "get_concrete_function")]
    return traced


def executed_op_counts(model, by_device=False):
    """Op types in the graph of the training function `fit` ran, with those
    of the functions it calls at each call (replicas share some: one trace).
    With `by_device`, (op type, device) pairs: a function's op without a
    device of its own runs on its caller's."""
    counts = collections.Counter()
    for concrete in traced_train_function(model)._list_all_concrete_functions():
        graph_def = concrete.graph.as_graph_def()
        library = {f.signature.name: f.node_def for f in graph_def.library.function}
        counts.update(_op_counts(graph_def.node, library, "" if by_device else None))
    return counts


def _op_counts(nodes, library, device=None):
    """Op types of `nodes`, each function they call (or run as a loop's or a
    branch's body) counted once per node that calls it; with a `device` (not
    None), (op type, device) pairs, `device` that of the ops without one."""
    counts = collections.Counter()
    for node in nodes:
        where = None if device is None else node.device or device
        counts[node.op if where is None else (node.op, where)] += 1
        for attr in node.attr.values():
            for function in [attr.func, *attr.list.func]:
                if function.name in library:
                    counts.update(_op_counts(library[function.name], library, where))
    return counts


def step_ops(graph, device=None, caller_device="", scope=None):
    """The ops of a traced step's `graph` and of the functions its ops call
    (function calls, not a branch's or a loop's body), each function's once
    per op that calls it; with `device`, only those that run there: a
    function's ops without a device of their own run on the calling op's
    (the replicas share one trace of a ZeRO-3 program, whose ops have none).
    With `scope`, only the ops whose names hold it, and all the ops of the
    functions those call (a shared trace's ops are named in its own graph)."""
    found = []
    for op in graph.get_operations():
        where = op.device or caller_device
        if device is not None and not where.endswith(device):
            continue
        inside = scope is None or scope in op.name
        if inside:
            found.append(op)
        if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
            body = _function_graph(graph, op.get_attr("f").name)
            if body is not None:
                found += step_ops(body, device, where, None if inside else scope)
    return found


def _function_graph(graph, name):
    """The graph of the function `name` that `graph` (or a graph it is
    nested in) holds, or None."""
    while graph is not None:
        function = graph._functions.get(name) if name else None
        if function is not None:
            return getattr(function, "graph", None)
        graph = getattr(graph, "outer_graph", None)
    return None


_REFERENCES = {}
# Single-device references shared by the processes of one pytest run (xdist
# workers, the rounds of `make test` start fresh ones): the controller empties
# it at the session's start (conftest.py), so a run never reads an older run's.
REFERENCES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              ".pytest_cache", "tfdist-references")
_STABLE_TYPES = (str, int, float, bool, type(None), bytes)


def _stable(value):
    """Whether `value`'s repr is the same in every process (no addresses)."""
    if isinstance(value, (tuple, list)):
        return all(_stable(v) for v in value)
    if isinstance(value, dict):
        return all(_stable(k) and _stable(v) for k, v in value.items())
    return isinstance(value, _STABLE_TYPES)


def recipe_text(make):
    """A text that stands for the recipe `make` in any process: its module,
    qualified name and source (and a `functools.partial`'s arguments, a nested
    function's closed-over values and defaults), or None when there is no such
    text: a lambda (several can share a line of source), a callable without
    source, a closure over or default of an object whose repr is not stable.

    Example:

    ```python
    recipe_text(make_model)              # "helpers.make_model () (0, None, None), None)\ndef ..."
    recipe_text(lambda: make_model())    # None
    ```
    """
    if isinstance(make, functools.partial):
        inner = recipe_text(make.func)
        if inner is None or not (_stable(make.args) and _stable(make.keywords)):
            return None
        return f"partial({inner}, *{make.args!r}, **{sorted(make.keywords.items())!r})"
    if not inspect.isfunction(make) or make.__name__ == "<lambda>":
        return None
    cells = tuple(cell.cell_contents for cell in make.__closure__ or ())
    defaults = (make.__defaults__, make.__kwdefaults__)
    if not (_stable(cells) and _stable(defaults)):
        return None
    try:
        source = inspect.getsource(make)
    except (OSError, TypeError):
        return None
    return f"{make.__module__}.{make.__qualname__} {cells!r} {defaults!r}\n{source}"


def _digest(arrays):
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str} {array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def reference_key(*, make=make_model, x=None, y=None, **train_kwargs):
    """The on-disk key of `trained_reference(make=make, x=x, y=y,
    **train_kwargs)`: a hash of everything that decides its result (the
    recipe's `recipe_text`, the data, the other arguments of `train`, the
    global dtype policy, the TensorFlow and Keras versions), or None when the
    recipe or the arguments have no text that is the same in every process.
    """
    recipe = recipe_text(make)
    if recipe is None or not _stable(train_kwargs):
        return None
    if x is None:
        x, y = data()
    parts = (recipe, _digest(tf.nest.flatten((x, y))), repr(sorted(train_kwargs.items())),
             keras.config.dtype_policy().name, tf.__version__, keras.__version__)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _read_reference(key):
    try:
        with np.load(os.path.join(REFERENCES_DIR, f"{key}.npz"), allow_pickle=False) as f:
            count = int(f["count"])
            return [float(v) for v in f["losses"]], [f[f"w{i}"] for i in range(count)], None
    except (OSError, KeyError, ValueError):  # not there (yet), or emptied meanwhile
        return None


def _write_reference(key, losses, weights):
    if any(np.asarray(w).dtype.isbuiltin != 1 for w in weights):  # bfloat16: not npz-able
        return
    try:
        os.makedirs(REFERENCES_DIR, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=REFERENCES_DIR, suffix=".tmp",
                                         delete=False) as f:
            temporary = f.name
            np.savez(f, count=len(weights), losses=np.asarray(losses, "float64"),
                     **{f"w{i}": w for i, w in enumerate(weights)})
        os.replace(temporary, os.path.join(REFERENCES_DIR, f"{key}.npz"))  # atomic
    except OSError:  # the directory emptied by another run's start: not kept
        with contextlib.suppress(OSError, NameError):
            os.unlink(temporary)


def cached_reference(parts, arrays, compute):
    """(losses, weights, None) of `compute()` (which returns losses and
    weights first), trained once per pytest run: read from disk if another
    process of the run wrote it. For references `trained_reference` does not
    make (tf_keras models under orbit). `parts` are texts (`recipe_text` of
    each function involved, constants) and `arrays` the inputs (initial
    weights) that decide the result; the TF and Keras versions are added.

    Example:

    ```python
    cached_reference([recipe_text(train), recipe_text(bert_classifier), str(STEPS)],
                     initial, lambda: train(None, initial))
    ```
    """
    if any(part is None for part in parts):
        raise ValueError(f"Every part of a reference's key needs a stable text: {parts}")
    key = hashlib.sha256(repr((tuple(parts), _digest(arrays), tf.__version__,
                               keras.__version__)).encode()).hexdigest()
    if key not in _REFERENCES:
        found = _read_reference(key)
        if not found:
            losses, weights = compute()[:2]
            found = (losses, weights, None)
            _write_reference(key, losses, weights)
        _REFERENCES[key] = found
    return _REFERENCES[key]


def trained_reference(*, make=make_model, x=None, y=None, **train_kwargs):
    """`train()` without a strategy: a recipe's single-device reference, trained
    once per pytest run and shared by every test that compares against it.

    The recipe is `make` (a function: a lambda is a new recipe each time), the
    data (an array or a list of arrays), the other arguments of `train` and the
    global dtype policy. The result is (losses, weights, None): the model is
    not kept, so that a test process does not hold every reference model and
    its traced steps (gigabytes over a tier).

    A reference is kept in the process, and on disk (`REFERENCES_DIR`) for
    the run's other processes when the recipe has a stable text
    (`reference_key`): a module-level or nested function, not a lambda.

    Example:

    ```python
    assert_parity(train(tfdist.Strategy(data=4)), trained_reference())
    ```
    """
    if x is None:
        x, y = data()
    arrays = tuple(np.asarray(a).tobytes() for a in tf.nest.flatten((x, y)))
    key = (make, arrays, repr(sorted(train_kwargs.items())), keras.config.dtype_policy().name)
    if key not in _REFERENCES:
        on_disk = reference_key(make=make, x=x, y=y, **train_kwargs)
        found = on_disk and _read_reference(on_disk)
        if not found:
            losses, weights, _ = train(make=make, x=x, y=y, **train_kwargs)
            found = (losses, weights, None)
            if on_disk:
                _write_reference(on_disk, losses, weights)
        _REFERENCES[key] = found
    return _REFERENCES[key]


def _cpu_has_float16_arithmetic():
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_fp16" in f.read()
    except OSError:
        return False


# On CPUs with float16 arithmetic, oneDNN's float16 kernels round by what
# TensorFlow's graph optimiser fuses, which a stage boundary or a zero=3 unit
# changes: float16 runs that are bit-equal elsewhere (and here with
# TF_ENABLE_ONEDNN_OPTS=0) differ by rounding, which Adam then amplifies.
FLOAT16_CPU = _cpu_has_float16_arithmetic()


def assert_parity(result, reference, rtol=1e-4, atol=1e-6, steps=20):
    losses, weights, _ = result
    ref_losses, ref_weights, _ = reference
    assert len(losses) >= steps and len(losses) == len(ref_losses)
    np.testing.assert_allclose(losses[:steps], ref_losses[:steps], rtol=rtol)
    assert len(weights) == len(ref_weights)
    for w, r in zip(weights, ref_weights):
        np.testing.assert_allclose(w, r, rtol=rtol, atol=atol)


def layout_map(entries, shape=(1, 2), names=("batch", "model")):
    """A `keras.distribution.LayoutMap` of `entries` ({path regex: axes})
    over a mesh of `shape` with axes `names`."""
    count = int(np.prod(shape))
    mesh = keras.distribution.DeviceMesh(shape, names, [f"cpu:{i}" for i in range(count)])
    found = keras.distribution.LayoutMap(mesh)
    for key, axes in entries.items():
        found[key] = axes
    return found


# Megatron's layouts for keras-hub's LlamaBackbone as LayoutMap entries: the
# plan tfdist finds on its own (attention by heads, the gated MLP column ->
# row, the untied embedding tables by vocabulary).
LLAMA_MEGATRON_LAYOUT = {
    "token_embedding/embeddings": ("model", None),
    "token_embedding/reverse_embeddings": (None, "model"),
    "transformer_layer.*self_attention.*(query|key|value).kernel": (None, "model", None),
    "transformer_layer.*attention_output.kernel": ("model", None, None),
    "transformer_layer.*feedforward_(intermediate|gate)_dense.kernel": (None, "model"),
    "transformer_layer.*feedforward_output_dense.kernel": ("model", None),
}


def trace_events(xplane_path):
    """One host's trace-viewer events, as TensorBoard's profile plugin converts them."""
    from xprof.convert import raw_to_tool_data  # only the profiler tests pay for xprof

    text, _ = raw_to_tool_data.xspace_to_tool_data([str(xplane_path)], "trace_viewer", {})
    assert text is not None, f"xprof could not convert {xplane_path}"
    return json.loads(text)["traceEvents"]


def alive(pid):
    """Whether a process with this pid exists (tests check for orphans)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def step_peak_bytes(model, x, y, batch_size):
    """The most bytes of tensors (TensorFlow's own count, every device: one
    CPU allocator) a `fit` epoch held above its start, after a first `fit`
    that traces the step and places what it places."""
    model.fit(x, y, batch_size=batch_size, verbose=0)
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model.fit(x, y, batch_size=batch_size, verbose=0)
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - start
