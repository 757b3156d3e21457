"""Files the store replaces whole, durably: after a crash either the old content or
the new one is there, never a mix.

`replace_file` writes a temporary file beside the target, fsyncs it, renames it over
the target and fsyncs the directory (the rename itself is then durable); `fsync_dir`
is that last step, for callers that create, rename or delete entries themselves.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(d: Path) -> None:
    """Make the entries of directory `d` (creations, renames, deletions) durable."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Replace `path` with `data` atomically (``<path>.tmp`` renamed over it); with
    `sync` the file and the directory are fsync'ed, so the new content survives a
    crash once this returns."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        fsync_dir(path.parent)
