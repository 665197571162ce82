"""The allocator settings under which a task gives freed host memory back.

By default a TensorFlow process on CPU keeps the memory its tensors were freed
from: oneDNN's allocator pools it and never shrinks, and glibc keeps large
freed buffers in its heaps. A worker's resident peak is then its tensors' peak
plus what the pools kept. With these settings (`tfdist launch
--release_memory`, `tfdist tfjob --release_memory`) each large buffer is a
mapping of its own, returned when freed, so the resident peak follows the
tensors: in `tools/bench_memory.py` a model-parallel worker's peak fell from
0.47-0.56 to 0.33-0.40 of one process's, while its `fit` took up to 1.4 x as
long (the kernel maps and zeroes each large buffer anew). Host memory only: a
GPU's memory is TensorFlow's own allocator's.
"""

RELEASE_MEMORY_ENV = {
    # oneDNN's kernels take their memory from malloc, not a pool that never shrinks.
    "TF_ONEDNN_USE_SYSTEM_ALLOCATOR": "1",
    # Every allocation of 4 MiB or more is a mapping of its own, unmapped when
    # freed (setting it also stops glibc raising the threshold after each free).
    "MALLOC_MMAP_THRESHOLD_": str(4 << 20),
    # Fewer per-thread heaps holding freed small blocks.
    "MALLOC_ARENA_MAX": "2",
    # Those mappings in huge pages where the kernel allows (`madvise`): fewer
    # page faults for each new buffer.
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
}


def release_memory_env(environment) -> dict:
    """The settings of `RELEASE_MEMORY_ENV` that `environment` does not set
    already (a variable set by the user wins).

    Example:

    ```python
    env = {**os.environ, **release_memory_env(os.environ)}
    ```
    """
    return {name: value for name, value in RELEASE_MEMORY_ENV.items()
            if name not in environment}
