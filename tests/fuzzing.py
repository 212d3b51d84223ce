"""Shared settings for the parser fuzz tests (hypothesis).

The default suite runs a few thousand cases per parser; set ``FEDGE_FUZZ_EXAMPLES``
(for example ``FEDGE_FUZZ_EXAMPLES=50000 make test-fast``) to run more.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ_EXAMPLES = int(os.environ.get("FEDGE_FUZZ_EXAMPLES", "2000"))


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
