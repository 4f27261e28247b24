"""Bulk bytes from an upstream socket into the door stream without passing them through Python: splice(2).

A download through the egress door is the one path where every byte crosses the host: read from the upstream TCP
socket and written into the door stream as DATA frames. With recv_into and sendmsg each byte is copied twice (kernel to
a Python buffer, back to the kernel) by a thread that competes for the CPU with the box's own agent and client. Here
the upstream socket's pages are spliced into a pipe and from the pipe into the door socket: the header of each frame is
written as usual, its payload moves between kernel buffers only. The frame is the same one `send_data` writes, so the
box sees no difference. Where splice is missing (not Linux, Python < 3.10) or refused for these file descriptors, the
caller keeps the copying path.
"""

from __future__ import annotations

import fcntl
import os

from tkbox_nb.guest import protocol as p

PIPE_SIZE = 1 << 20   # room for a whole frame's payload even when it arrives as many small socket buffers


class SplicePipe:
    """One pipe per relayed connection, always drained between two frames."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_CLOEXEC)
        try:
            fcntl.fcntl(self.w, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_SIZE)
        except OSError:  # past /proc/sys/fs/pipe-max-size for this user: the default pipe still works, in less
            pass
        self.held = 0     # bytes in the pipe, not yet passed on

    @staticmethod
    def usable() -> bool:
        return hasattr(os, "splice")

    def fill(self, fd: int, most: int) -> int:
        """Up to `most` bytes from the socket `fd` into the pipe, waiting for the first; 0 at the socket's end."""
        n = os.splice(fd, self.w, min(most, p.MAX_PAYLOAD - 1))
        self.held += n
        return n

    def drain(self, fd: int, n: int) -> None:
        """Exactly `n` of the held bytes into `fd` (a blocking socket), in as many splices as it takes."""
        if n > self.held:
            raise ValueError("draining more than the pipe holds")
        while n:
            moved = os.splice(self.r, fd, n)
            if moved <= 0:
                raise BrokenPipeError("the door took no bytes")
            n -= moved
            self.held -= moved

    def close(self) -> None:
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass
