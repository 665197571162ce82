"""What every benchmark does with a result: one JSON line on stdout, and in `--out`.

Example:

    from results import emit
    emit({"bench": "ps", "workers": 2, "scaling": 1.001}, FLAGS.out)
"""

import json


def emit(record, out=None):
    """Prints `record` as one JSON line; also appends it to the file `out` if given."""
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
