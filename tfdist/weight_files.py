"""Weights files loaded under a tfdist strategy: one that cannot be read is named.

h5py reports a truncated or corrupt `.weights.h5` as an `OSError` that names
no file ("Unable to synchronously open file (truncated file: eof = 7800, ...)"),
and Python's zipfile a cut `.keras` archive as "File is not a zip file". Under
tfdist's strategies `model.load_weights` raises instead an `OSError` naming
the file and saying it is truncated or corrupt, the reader's error chained.
It is an `OSError` still, so Keras's `BackupAndRestore` falls back to its
previous backup on it as before. The file system's own errors (a missing
file, a directory) are left as they are: they name the file already.
"""

import zipfile

from tfdist._compat import patches


def name_unreadable_files(strategy_class):
    """Makes `model.load_weights(filepath)` of the models whose strategy is a
    `strategy_class` raise an `OSError` naming `filepath` when its content
    cannot be read (`.weights.h5`, `.weights.json` and its shards, `.keras`,
    legacy `.h5`).

    Example:

    ```python
    name_unreadable_files(tfdist.Strategy)   # every tfdist strategy does it
    model.load_weights("cut.weights.h5")
    # OSError: The weights file 'cut.weights.h5' is truncated or corrupt: ...
    ```
    """
    patches.install_for_strategy(patches.MODEL_LOAD_WEIGHTS, strategy_class, _load_weights)


def _load_weights(original, model, strategy, filepath, *args, **kwargs):
    try:
        return original(model, filepath, *args, **kwargs)
    except (OSError, zipfile.BadZipFile) as error:
        if getattr(error, "errno", None) is not None:  # the file system's: names the file
            raise
        shards = " (or a shard file it lists)" if str(filepath).endswith(".json") else ""
        raise OSError(
            f"The weights file {str(filepath)!r}{shards} is truncated or corrupt: it "
            f"cannot be read ({type(error).__name__}: {error}). Save the weights "
            f"again, or load a whole copy of the file.") from error
