"""Exclusive claims on run directories: a file lock that dies with its holder.

A claim is an exclusive ``flock`` on a file inside the directory. The kernel drops it
when the last descriptor of that open file closes, so a holder that exits, crashes or
is killed (SIGKILL included) never leaves a stale claim, and the next launcher simply
takes it. A child started with the claim's descriptor in ``pass_fds`` shares the claim:
it ends when both parent and child are gone, so a job keeps its claim when its launcher
is killed and runs to the end, and nobody starts it a second time meanwhile.

Several machines: on Linux, ``flock`` over NFS (v4, or v3 with lockd) is carried out as a
POSIX lock that the server arbitrates, so launchers on every machine that mounts the
sweep folder see each other's claims; Lustre needs its ``flock`` mount option, GPFS
supports it. (The ``filelock`` library offers the same lock but no way to hand it to a
child process, which is what keeps a job and its claim together.)
"""

from __future__ import annotations

import fcntl
import os


class Claim:
    """A held claim; :meth:`release` (or leaving the ``with`` block) gives it up."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path

    def fileno(self) -> int:
        return self.fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor drops the lock
            self.fd = -1

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def try_claim(directory: str, name: str) -> Claim | None:
    """Claims ``directory`` (creating it) through the lock file ``name``; None when another
    process holds the claim. Never waits."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return Claim(fd, path)


def is_claimed(directory: str, name: str) -> bool:
    """Whether some process (this one included) holds the claim right now."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
