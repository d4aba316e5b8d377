"""First touch of fresh memory on this VM: 1 GiB calloc'd and written one byte a page,
three times in one process (the second and third map memory the first just freed)."""

import time

import numpy as np

for _ in range(3):
    block = np.zeros(1 << 30, dtype=np.uint8)
    started = time.perf_counter()
    block[::4096] = 1
    first = time.perf_counter() - started
    started = time.perf_counter()
    block[::4096] = 2
    again = time.perf_counter() - started
    print(f"first touch 1 GiB: {first:.2f} s ({1 / first:.2f} GiB/s), again {again * 1e3:.1f} ms")
    del block
