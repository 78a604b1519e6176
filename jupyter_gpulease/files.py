"""Files written whole: a reader sees the old content or the new, never half of it.

:func:`write_atomically` is the one way the package replaces a file that another process reads
(the server's learnt idle gaps, the hub's outbox of lease ends, the DCGM exporter's job map, the
simulated GPUs' state and their simulated checkpoints).
"""

from __future__ import annotations

import os
import tempfile


def write_atomically(path: str | os.PathLike[str], data: str | bytes, *, mode: int = 0o644, fsync: bool = False) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) in one step.

    The content goes to a temporary file with a name of its own in the same folder (so that two
    writers, even in two processes, never share one), which is given ``mode`` (readers may be
    other users), flushed to disk when ``fsync`` (a crash then leaves the old file or the new),
    and renamed over ``path``. The folder is created when missing. On any error the temporary
    file is removed and the error raised; ``path`` is left as it was.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


__all__ = ["write_atomically"]
