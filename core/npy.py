"""Reading a ``.npy`` header from untrusted bytes without trusting numpy's parser to fail cleanly.

numpy's header readers evaluate the header dict with ``ast.literal_eval`` and then build the
dtype from a string, and a hostile header escapes with whatever those raise: ``SyntaxError``
(a descr such as ``','`` goes through numpy's comma-string parser), ``tokenize.TokenError``
(the Python 2 fallback), ``TypeError``, ``RecursionError``, ``MemoryError`` ... Every reader of
untrusted ``.npy`` data (device updates, checkpoints) goes through :func:`read_npy_header`,
which turns all of them into one ``ValueError`` naming the problem.
"""

from __future__ import annotations

import tokenize
from typing import IO

import numpy as np

from fedge.archive import ZIP_READ_ERRORS

# What numpy's header parsing lets escape on hostile text (found by tests/test_fuzz_parsers.py).
_PARSE_ERRORS = (ValueError, SyntaxError, tokenize.TokenError, TypeError, KeyError, RecursionError, MemoryError,
                 OverflowError)
# What ``np.load`` of a damaged or hostile .npy/.npz file can raise: the parse errors above, plus
# the file's and the zip's own. Loaders of the user's files catch these to name the file.
UNREADABLE_FILE_ERRORS = (*_PARSE_ERRORS, *ZIP_READ_ERRORS)
_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def read_npy_header(stream: IO[bytes], *, max_header_size: int = 10_000) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Shape, Fortran order and dtype of the ``.npy`` whose bytes ``stream`` is at the start of.

    Leaves ``stream`` at the first data byte. Only format 1.0 and 2.0 headers (what
    ``np.save`` writes) of at most ``max_header_size`` bytes are read.

    Raises
    ------
    ValueError
        If the magic, the version or the header is malformed; the message says which.
    """
    version = np.lib.format.read_magic(stream)  # a ValueError naming the bad magic or the EOF
    if version not in _READERS:
        raise ValueError(f".npy format version {version} is not accepted (1.0 or 2.0, what np.save writes)")
    try:
        shape, fortran_order, dtype = _READERS[version](stream, max_header_size=max_header_size)
    except _PARSE_ERRORS as exc:  # the stream's own errors (OSError, a zip's bad CRC) pass through
        raise ValueError(f"unreadable .npy header ({type(exc).__name__}: {str(exc)[:200]})") from None
    if any(dim < 0 for dim in shape):
        raise ValueError(f"negative dimension in the .npy shape {shape}")
    return tuple(int(dim) for dim in shape), bool(fortran_order), dtype
