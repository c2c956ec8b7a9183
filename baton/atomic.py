"""Writing output files so that a failure never leaves half a file (or a lost old one) behind."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: str | Path, text: str) -> None:
    """Write via a temporary file and rename, so a failure never leaves half a file behind."""
    write_atomically_with(path, lambda fh: fh.write(text.encode()))


def write_atomically_with(path: str | Path, write) -> None:
    """``write(binary file)`` into a temporary file beside ``path``, then rename it into place.

    An OS error of the temporary file's (it cannot be made, the disk is full, the rename fails) names
    ``path``: the user never asked for '.plan.json.x1y2.tmp' and would not find it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # its errors name the directory at fault
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _naming(exc, path) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename in (None, tmp):
            raise _naming(exc, path) from None
        raise


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` as the same kind of error (PermissionError, ...) about ``path``."""
    return exc if exc.errno is None else OSError(exc.errno, exc.strerror, str(path))
