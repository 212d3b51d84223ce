"""Shared settings for the parser fuzz tests (hypothesis).

The default suite runs a few thousand cases per parser; set ``FEDGE_FUZZ_EXAMPLES``
(for example ``FEDGE_FUZZ_EXAMPLES=50000 make test-fast``) to run more.
"""

from __future__ import annotations

import os
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ_EXAMPLES = int(os.environ.get("FEDGE_FUZZ_EXAMPLES", "2000"))
# Claims far beyond anything a device, a bundle or a checkpoint may make us allocate, and a
# generous time bound (a case takes milliseconds).
MAX_ALLOCATION = 64 * 2**20
MAX_SECONDS = 10.0


def fuzz(examples: int | None = None) -> settings:
    """Hypothesis settings for a fuzz test: ``examples`` cases (default :data:`FUZZ_EXAMPLES`), no deadline."""
    return settings(max_examples=examples or FUZZ_EXAMPLES, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


@st.composite
def mutated(draw: st.DrawFn, original: bytes, max_ops: int = 4, *, interesting: Sequence[bytes] = (),
            inserts: Sequence[bytes] = ()) -> bytes:
    """``original`` after 1..``max_ops`` random edits: flip a bit, overwrite, insert, delete,
    truncate, repeat a run; with ``interesting`` also overwrite an aligned field with one of
    those values (NaN, Inf, huge counts...), with ``inserts`` also insert one of those tokens."""
    data = bytearray(original)
    ops = ["flip", "overwrite", "insert", "delete", "truncate", "repeat"] + (["interesting"] if interesting else [])
    inserted = st.binary(min_size=1, max_size=16)
    if inserts:
        inserted = st.one_of(inserted, st.sampled_from(list(inserts)))
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(ops))
        pos = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            data[min(pos, len(data) - 1)] ^= 1 << draw(st.integers(0, 7))
        elif op == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=8))
            data[pos:pos + len(chunk)] = chunk
        elif op == "interesting":
            pos -= pos % draw(st.sampled_from([1, 2, 4]))  # fields are 1, 2 or 4 bytes, aligned
            chunk = draw(st.sampled_from(list(interesting)))
            data[pos:pos + len(chunk)] = chunk
        elif op == "insert":
            data[pos:pos] = draw(inserted)
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[pos:]
        elif op == "repeat":
            data[pos:pos] = data[pos:pos + draw(st.integers(1, 64))] * draw(st.integers(1, 4))
    return bytes(data)


@contextmanager
def bounded(*, memory: bool = True) -> Iterator[None]:
    """Fail if the block runs longer than :data:`MAX_SECONDS` or (with ``memory``) allocates
    more than :data:`MAX_ALLOCATION` (numpy arrays included), whether it returns or raises:
    a rejection after a huge allocation fails too."""
    if memory:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] if memory else 0
        if memory:
            tracemalloc.stop()
        assert peak <= MAX_ALLOCATION, f"allocated {peak / 2**20:.0f} MiB"
        assert elapsed <= MAX_SECONDS, f"took {elapsed:.1f} s"
