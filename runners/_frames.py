"""How a worker's replies are framed on its pipe: an 8-byte big-endian length, then that many bytes.

The worker writes each reply whole, blocking (`send_reply`). The parent reads without ever waiting
for the rest of one (`Replies`): it reads what the pipe holds when its selector says there is
something, keeps a reply that has not fully arrived, and hands out only whole ones.
`multiprocessing`'s `Connection.recv_bytes`, which the parent used, blocks until the whole message
has come: a worker that died partway through a reply (SIGKILL from the OOM killer, a crash in a C
extension) while a process it forked still held the pipe's write end never let that read end, and
the parent's one reader thread, every other worker's replies, its exit watch and
`task_timeout_s`, waited behind it for ever.

A length no reply can have (`LONGEST_REPLY`: more than the system's memory) is not waited for: it
is what a stage function that wrote to the worker's reply descriptor left there (a progress line
meant for a log: eight bytes of text read as a length are 2**59 bytes or more), and the reader
waited for its payload, the worker's every later reply held behind it. The whole replies before it
are handed out, and `overlong` says what it was, for the reader to retire the worker.

Once a worker has exited, `read_left` takes only the bytes its pipe holds at that moment: a process
it forked that still holds the pipe may write on, for ever, and none of that is the worker's.

Requests, parent to worker, keep `multiprocessing`'s framing (`Connection.send_bytes` and
`recv_bytes`): the worker has nothing else to wait for, and the parent's sends are bounded by
`close`.

Thread-safety: a `Replies` belongs to the one thread that reads its pipe (the reader thread).
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import sys
import termios

__all__ = ["LONGEST_REPLY", "Replies", "send_reply"]

_LENGTH = struct.Struct("!Q")
_QUEUED = struct.Struct("i")  # what FIONREAD fills in: the bytes a pipe holds, unread


def _memory_bytes() -> int:
    """The system's memory, RAM and swap (`/proc/meminfo`); `sys.maxsize`, the most any bytes
    object may hold, where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            fields = dict(line.split(b":", 1) for line in meminfo)
        return sum(int(fields[name].split()[0]) * 1024 for name in (b"MemTotal", b"SwapTotal"))
    except (OSError, KeyError, ValueError, IndexError):
        return sys.maxsize


# The longest a reply can be. A reply is one bytes object the worker built in its own memory (the
# pickle stream, which carries everything but the buffers that go through shared memory: small
# arrays, text, any object pickled in-band, of any size), so it is never longer than the memory the
# system has, RAM and swap. Nothing tighter holds: a non-contiguous array of a few GiB is pickled
# into the stream. Text read as a length is at least 2**59 bytes, far beyond it.
LONGEST_REPLY = _memory_bytes()

# The most one read takes from a pipe, into a buffer each worker's `Replies` keeps: a reply is a
# pickle stream of a few hundred bytes to tens of KiB (a text chunk's: ~50 KiB). Reading into a
# new bytes object of 256 KiB instead cost 20 us per reply against 5 (glibc maps an allocation that
# large afresh each time).
_READ_BYTES = 64 * 1024


def send_reply(fd: int, payload: bytes) -> None:
    """Write one reply to the pipe `fd`, blocking until all of it is written; OSError once the
    reader is gone. Length and payload go in one system call, the payload not copied to join
    them."""
    length = _LENGTH.pack(len(payload))
    written = os.writev(fd, (length, payload))
    if written < len(length):
        _write_all(fd, length[written:])
        written = len(length)
    _write_all(fd, memoryview(payload)[written - len(length) :])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Replies:
    """The replies arriving on one worker's pipe, read without waiting for the rest of one."""

    __slots__ = ("_buffer", "_fd", "_held", "_poll", "overlong")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = bytearray(_READ_BYTES)
        self._held = bytearray()  # the start of a reply not yet whole
        self._poll = select.poll()  # holds no descriptor of its own
        self._poll.register(fd, select.POLLIN)
        # The length, more than `LONGEST_REPLY`, the pipe carried where a reply's was due; None
        # while it has carried none. Nothing after it is read: the pipe is no longer framed.
        self.overlong: int | None = None

    def read(self) -> list[bytes]:
        """The replies made whole by what the pipe holds; EOFError at end of file, OSError where
        reading fails (a worker that dies with an item unread resets its pipe).

        Called once the pipe has been seen readable, it reads once, and again only while a reply
        is not yet whole and the pipe has more, so it never blocks. Two pipelined text replies
        (~50 KiB each) do not fit one read: a third of them were split, and each split cost the
        reader a wake-up of its own. A reply not yet whole is kept for the next call, grown in
        place (a reply of many reads is copied once more, not once per read)."""
        replies = self._read_once()
        while self._held and self._poll.poll(0):
            try:
                replies += self._read_once()
            except (EOFError, OSError):
                if not replies:
                    raise
                break  # the next call finds the end of the pipe: whole replies are never dropped
        return replies

    def read_left(self) -> list[bytes]:
        """The replies made whole by the bytes the pipe holds now, and none written later: called
        once the worker has exited, it takes what the worker wrote, and never what a process it
        forked, still holding the pipe, writes after (it may write for ever, and the reader read
        on as long as it did). A read that fails (the pipe reset) ends it with what came before."""
        queued = _QUEUED.unpack(fcntl.ioctl(self._fd, termios.FIONREAD, bytes(_QUEUED.size)))[0]
        replies: list[bytes] = []
        with memoryview(self._buffer) as buffer:
            while queued > 0 and self.overlong is None:
                try:
                    size = os.readv(self._fd, (buffer[: min(queued, _READ_BYTES)],))
                except OSError:
                    break
                if not size:
                    break
                queued -= size
                replies += self._taken(size)
        return replies

    def _read_once(self) -> list[bytes]:
        size = os.readv(self._fd, (self._buffer,))
        if not size:
            raise EOFError
        return self._taken(size)

    def _taken(self, size: int) -> list[bytes]:
        """The replies made whole by the `size` bytes just read into the buffer."""
        with memoryview(self._buffer) as buffer:
            if not self._held:
                return self._whole(buffer[:size])
            self._held += buffer[:size]
        with memoryview(self._held) as held:
            replies = self._whole(held)
        return replies

    def _whole(self, data: memoryview) -> list[bytes]:
        """The whole replies at the start of `data`; what follows them becomes the part held."""
        replies = []
        start, end = 0, len(data)
        while end - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(data, start)
            stop = start + _LENGTH.size + length
            if stop > end:
                if length > LONGEST_REPLY:  # checked only here: a length that long is never whole
                    self.overlong = length
                    self._held = bytearray()
                    return replies
                break
            replies.append(data[start + _LENGTH.size : stop].tobytes())
            start = stop
        if start == end:
            if self._held:
                self._held = bytearray()
        elif start or not self._held:
            self._held = bytearray(data[start:])
        return replies

    def partial(self) -> str | None:
        """What has come of a reply not yet whole ("N of M bytes received"); None when there is none."""
        if not self._held:
            return None
        received = len(self._held)
        if received < _LENGTH.size:
            return f"{received} of its {_LENGTH.size}-byte length received"
        (length,) = _LENGTH.unpack_from(self._held)
        return f"{received - _LENGTH.size} of {length} bytes received"
