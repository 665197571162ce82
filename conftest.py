"""Pytest set-up for tests/ and the docstring examples in tfdist/.

Makes 8 logical CPU devices before TensorFlow initialises, so every test tier
and every `>>>` example sees the same devices: `tfdist.Strategy(data=8)` works
anywhere in the suite.
"""

import contextlib
import functools
import gc
import importlib.util
import os
import shutil
import subprocess
import sys
import weakref

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The memory tests read the bytes TensorFlow's CPU allocator holds
# (`tf.config.experimental.get_memory_info`), which it counts only under
# oneDNN's allocator. TensorFlow turns oneDNN on by default on CPUs with
# AVX-512 only; elsewhere (an AMD EPYC with AVX2) it says "Allocator stats not
# available". On for this process and the workers its tests start.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.data.ops.iterator_ops import OwnedIterator  # noqa: E402

import tfdist  # noqa: E402
from helpers import REFERENCES_DIR  # noqa: E402  (tests/, on pytest's pythonpath)

NUM_DEVICES = 8
tfdist.use_virtual_devices(NUM_DEVICES)

# Grappler, TensorFlow's graph optimiser, rewrites a step's graph at its first
# call without changing what it computes, and is a third to a half of that
# call's time (docs/benchmarks.md): the suite's main cost. The tests of this
# process run without it, except those marked `grappler`; the cluster tier's
# workers (processes of their own), the examples and the benchmarks run with
# it, as a user's job does. TFDIST_TEST_GRAPPLER=1 turns it on for every test.
GRAPPLER_FOR_EVERY_TEST = os.environ.get("TFDIST_TEST_GRAPPLER") == "1"


def _set_grappler(on):
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": not on})


_set_grappler(GRAPPLER_FOR_EVERY_TEST)


@pytest.fixture(autouse=True)
def _grappler_for_marked_tests(request):
    """A test marked `grappler` runs with Grappler on, as a user's job does."""
    if GRAPPLER_FOR_EVERY_TEST or request.node.get_closest_marker("grappler") is None:
        yield
        return
    _set_grappler(True)
    try:
        yield
    finally:
        _set_grappler(False)

# The half million objects of TensorFlow's, Keras's and tfdist's imports live
# as long as the process: set aside from every later garbage collection
# (a full collection then takes about 0.1 s instead of 0.3-0.6 s).
gc.collect()
gc.freeze()


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    """`keras`, `np`, `tf` and `tfdist` are imported in every `>>>` example."""
    doctest_namespace.update(keras=keras, np=np, tf=tf, tfdist=tfdist)


# The TensorFlow Model Garden (the `model-garden` extra) is optional: where it
# is not installed, the files that import it are not collected and the tests
# marked `model_garden` (examples that train its models) are deselected, and
# the run's header says so. `make test` runs those in .venv, which has it, and
# every other test in .venv-core, which does not: Keras imports scikit-learn,
# matplotlib and SciPy in every process where they are installed, a third of
# each process's start (docs/development.md).
MODEL_GARDEN = importlib.util.find_spec("official") is not None
MODEL_GARDEN_FILES = ["tfdist/model_garden.py", "tests/parity/test_foreign_models.py",
                      "tests/parity/test_model_garden_trainer.py", "tests/parity/test_orbit.py",
                      "tests/parity/test_tf_keras_step.py"]
ROOT = os.path.dirname(os.path.abspath(__file__))


class _NeedsTheModelGarden(pytest.File):
    """A file that imports the Model Garden, where it is not installed: no tests."""

    def collect(self):
        return []


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    """Nothing from a file of MODEL_GARDEN_FILES where the Model Garden is not
    installed: neither its tests nor its docstring examples (both import it),
    whether it was named on the command line or found in a directory."""
    collected = yield
    if not MODEL_GARDEN and os.path.relpath(file_path, ROOT) in MODEL_GARDEN_FILES:
        return [_NeedsTheModelGarden.from_parent(parent, path=file_path)]
    return collected


def pytest_report_header(config):
    if not MODEL_GARDEN:
        return ("tfdist: the Model Garden is not installed here: "
                f"{', '.join(MODEL_GARDEN_FILES)} not collected and the tests marked "
                "`model_garden` deselected (`make test` runs them in .venv)")
    return None


def pytest_collection_modifyitems(config, items):
    if MODEL_GARDEN:
        return
    needing = [item for item in items if item.get_closest_marker("model_garden")]
    if needing:
        config.hook.pytest_deselected(items=needing)
        items[:] = [item for item in items if not item.get_closest_marker("model_garden")]


# The suite's bound on one test (docs/development.md); setup.cfg's
# faulthandler_timeout prints Python stacks at 120 s.
SLOW_TEST_SECONDS = 60
# A test's closing garbage collection (`_iterators_freed_by_their_test`)
# taking longer than this is a stall.
SLOW_COLLECTION_SECONDS = 10
STACKS_DIR = os.path.join(ROOT, ".pytest_cache", "native-stacks")


@functools.cache
def _stall_watcher():
    """This process's `tests/scripts/stall_watcher.py`: told where the
    process is, it records its native stacks (every thread, inside
    TensorFlow too: `py-spy dump --native`) when a span lasts too long, and
    the run's summary prints them: a stalled test's log says what it waits
    for. A process of its own: a collection stalled inside TensorFlow holds
    Python's lock, so no thread of this process could."""
    script = os.path.join(ROOT, "tests", "scripts", "stall_watcher.py")
    return subprocess.Popen([sys.executable, script, f"--pid={os.getpid()}",
                             f"--dir={STACKS_DIR}"], stdin=subprocess.PIPE, text=True)


@contextlib.contextmanager
def _watched(key, seconds, label):
    """Tells the stall watcher that span `key` (`seconds` long at most, named
    `label`) starts, and at the block's end that it ended."""
    watcher = _stall_watcher()
    watcher.stdin.write(f"start {key} {seconds} {label}\n")
    watcher.stdin.flush()
    try:
        yield
    finally:
        watcher.stdin.write(f"end {key}\n")
        watcher.stdin.flush()


@pytest.fixture(autouse=True)
def _native_stacks_of_a_slow_test(request):
    """A test still running after 60 s gets its process's native stacks recorded."""
    with _watched("test", SLOW_TEST_SECONDS,
                  f"{request.node.nodeid} still running after {SLOW_TEST_SECONDS} s"):
        yield


class _Iterators:
    """The tf.data iterators this process has made: every kind (a plain
    dataset's, a `MultiDeviceIterator`'s per device, a distributed dataset's)
    is or holds an `OwnedIterator`. `made` counts them; `autotuning` holds,
    weakly, those whose dataset has tf.data autotuning on, each with its
    number."""

    made = 0
    made_before_this_test = 0  # before its fixtures, of every scope
    autotuning = weakref.WeakKeyDictionary()

    @classmethod
    def autotuning_made_since(cls, made):
        """The numbers of the iterators with autotuning still alive that were
        made after the `made`-th."""
        return [n for n in cls.autotuning.values() if n > made]

    @classmethod
    def counting(cls, init):
        @functools.wraps(init)
        def counted(self, dataset=None, *args, **kwargs):
            cls.made += 1
            init(self, dataset, *args, **kwargs)
            if dataset is not None and dataset.options().autotune.enabled is not False:
                cls.autotuning[self] = cls.made
        return counted


OwnedIterator.__init__ = _Iterators.counting(OwnedIterator.__init__)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _Iterators.made_before_this_test = _Iterators.made


@pytest.fixture(autouse=True)
def _iterators_freed_by_their_test(request):
    """A test that leaves a tf.data iterator with autotuning alive ends with a
    garbage collection, so the iterator is destroyed then, young, not by
    whichever later test's allocation starts a collection; and fails if it
    is still alive after it (kept by a module's fixture, say). Destroying an
    iterator with autotuning on can wait for its autotuning thread's sleep
    (TensorFlow 2.20's missed wake-up, tfdist/input_options.py), a sleep that
    doubles with the iterator's age up to 60 s: plain Keras `fit`s'
    iterators, left to a later test, stalled it by a minute and more, and an
    iterator a module's fixture kept stalled the next file's first test
    (docs/development.md). Iterators without autotuning (every one tfdist's
    strategies make, and the references') have no such thread: Python's own
    collections free them, and a test that made only those pays for no
    collection of its own (a full one took 0.2-1.8 s, a tenth of the suite's
    test time)."""
    made = _Iterators.made_before_this_test
    yield
    if _Iterators.autotuning_made_since(made):
        with _watched("collection", SLOW_COLLECTION_SECONDS,
                      f"the garbage collection closing {request.node.nodeid} still running "
                      f"after {SLOW_COLLECTION_SECONDS} s"):
            gc.collect()
        kept = _Iterators.autotuning_made_since(made)
        assert not kept, (
            f"{len(kept)} tf.data iterator(s) with autotuning made by this test (or its "
            f"fixtures) outlive it: whichever later test frees one can wait up to a minute. "
            f"Make the dataset with `tfdist.input_options.without_autotuning`, or keep "
            f"results, not what iterates.")


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller, not an xdist worker
        shutil.rmtree(STACKS_DIR, ignore_errors=True)
        # The single-device references of this run's processes
        # (helpers.trained_reference): none from an earlier run, unless the
        # run is one of several sharing them (`make test`'s rounds, which
        # empty the directory once before the first).
        if not os.environ.get("TFDIST_TEST_KEEP_REFERENCES"):
            shutil.rmtree(REFERENCES_DIR, ignore_errors=True)


def pytest_unconfigure(config):
    """Ends this process's stall watcher, if it started one: the watcher ends
    when its stdin closes, after a dump under way (py-spy's, 120 s at most)."""
    if _stall_watcher.cache_info().currsize:
        watcher = _stall_watcher()
        watcher.stdin.close()
        watcher.wait(timeout=150)


def pytest_terminal_summary(terminalreporter):
    if not os.path.isdir(STACKS_DIR):
        return
    for name in sorted(os.listdir(STACKS_DIR)):
        with open(os.path.join(STACKS_DIR, name)) as f:
            terminalreporter.write_sep("-", "native stacks of a slow test")
            terminalreporter.write(f.read())
