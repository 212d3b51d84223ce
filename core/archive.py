"""Checking what a zip member claims about its sizes before reading it.

Python's ``zipfile`` trusts a member's declared sizes: reading a stored member asks the file
for ``compress_size`` bytes at once, and ``BufferedReader.read(n)`` allocates ``n`` bytes
before it finds that the file is shorter. A 1 kB archive whose central directory claims a
2 GiB member therefore costs 2 GiB of memory to read. Every reader of an archive that
arrives from elsewhere (bundles, training bundles, checkpoints) refuses such claims first;
``zipfile`` itself offers no limit.
"""

from __future__ import annotations

import lzma
import struct
import zipfile
import zlib

# What reading a damaged or forged zip can raise, from zipfile and the decompressors under it.
# Every reader of an archive from elsewhere catches these to name the file instead of crashing.
ZIP_READ_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, RuntimeError,
                   NotImplementedError, OverflowError, struct.error, zlib.error, lzma.LZMAError)
# Deflate cannot expand data more than ~1032 times: a member claiming more is lying.
MAX_DEFLATE_RATIO = 1032
_SLACK = 1024  # headers and rounding


def impossible_sizes(info: zipfile.ZipInfo, archive_size: int) -> str | None:
    """Why the sizes ``info`` declares cannot be true of an archive of ``archive_size`` bytes, or None.

    A member cannot hold more compressed bytes than the whole archive, and cannot unpack to
    more than its compression method allows (stored: its own size; deflate: 1032x).
    """
    if info.compress_size > archive_size:
        return (f"declares {info.compress_size} compressed bytes in an archive of {archive_size}; "
                "the archive is damaged or forged")
    ratio = 1 if info.compress_type == zipfile.ZIP_STORED else MAX_DEFLATE_RATIO
    if info.file_size > info.compress_size * ratio + _SLACK:
        return (f"declares {info.file_size} bytes unpacked from {info.compress_size}, more than its "
                "compression can hold; the archive is damaged or forged")
    return None
