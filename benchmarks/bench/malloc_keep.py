"""glibc's allocator kept from giving memory back: the environment of ``--malloc keep`` (the
default of run.py and plan_check.py, one dict for both).

No mmap for large blocks (each fresh mmap'd page faults in as it is first written, ~1 ms per MiB
here), no trimming of the heap's top, 256 MiB extra on each sbrk, so a step's large buffers reuse
pages that earlier steps faulted in. Measured (2026-11-25, benchmarks/bench/run.py under both settings):
fresh mmap'd buffers were 10-17% of a GPT step and the IQR of the step times 6-16%; 3-6% with
these. No torch import: the launchers read it before any rank starts.
"""

MALLOC_KEEP = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(16 * 1024**3),
    "MALLOC_TOP_PAD_": str(256 * 1024**2),
}
