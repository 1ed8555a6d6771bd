"""A worker's replies, framed by `runners._frames`, read by the parent without ever waiting for the
rest of one: however the pipe cuts them up, they come out whole, in order, and only once whole."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from runners._frames import LONGEST_REPLY, Replies
from tests.unit.worker_replies import framed

PAYLOADS = [b"", b"a", bytes(range(256)) * 400, b"\x80\x05 the last"]  # 100 KB: many reads at most cuts


@pytest.mark.parametrize("cut", [1, 7, 8, 9, 4096, 65536])
def test_replies_cut_anywhere_by_the_pipe_come_out_whole_in_order_and_only_once_whole(cut):
    stream = framed(*PAYLOADS)
    read_end, write_end = socket.socketpair()
    with read_end, write_end:
        replies = Replies(read_end.fileno())
        out: list[bytes] = []
        for start in range(0, len(stream), cut):
            write_end.sendall(stream[start : start + cut])
            out += [bytes(reply) for reply in replies.read()]
            assert out == PAYLOADS[: len(out)]
        assert out == PAYLOADS and replies.partial() is None
        write_end.close()
        with pytest.raises(EOFError):
            replies.read()


def test_a_reply_cut_short_says_how_much_of_it_came():
    stream = framed(bytes(1000))
    read_end, write_end = socket.socketpair()
    with read_end, write_end:
        replies = Replies(read_end.fileno())
        write_end.sendall(stream[:3])
        assert replies.read() == [] and replies.partial() == "3 of its 8-byte length received"
        write_end.sendall(stream[3:108])
        assert replies.read() == [] and replies.partial() == "100 of 1000 bytes received"


def test_whole_replies_read_before_the_pipe_fails_are_handed_out_and_the_failure_comes_next():
    """A worker that dies with an item unread in its pipe resets it: the read after its last bytes
    fails with ConnectionResetError, not end of file. The whole replies read just before, in the
    same call, were lost with the error (their items then re-run or failed as crashed); they come
    out, and the next call finds the end of the pipe."""
    stream = framed(b"whole", bytes(1000))
    read_end, write_end = socket.socketpair()
    with read_end:
        read_end.sendall(b"an item the worker never read")
        write_end.sendall(stream[:-500])
        write_end.close()
        replies = Replies(read_end.fileno())
        assert replies.read() == [b"whole"]
        assert replies.partial() == "500 of 1000 bytes received"
        with pytest.raises(EOFError):
            replies.read()


def test_a_reply_longer_than_one_read_comes_out_in_one_call_once_the_pipe_holds_all_of_it():
    """One read takes at most 64 KiB: a reply longer than that, all of it in the pipe, came out
    only on a second call, costing the reader a wake-up of its own; a call reads on while the
    pipe holds more of a reply not yet whole."""
    stream = framed(*PAYLOADS)
    read_end, write_end = socket.socketpair()
    with read_end, write_end:
        write_end.sendall(stream)  # 100 KB: within what a socket pair holds
        assert Replies(read_end.fileno()).read() == PAYLOADS


def test_a_length_no_reply_can_have_is_reported_at_once_after_the_whole_replies_before_it():
    """Text written to a worker's reply descriptor (a progress line meant for a log) was read as a
    reply's length, 2**59 bytes or more, and waited for: every later reply of the worker with it.
    The whole replies before it come out, the length is reported, and nothing after it is read."""
    read_end, write_end = socket.socketpair()
    with read_end, write_end:
        write_end.sendall(framed(b"whole") + b"progress: 50%\n" + framed(b"later"))
        replies = Replies(read_end.fileno())
        assert replies.read() == [b"whole"]
        assert replies.overlong == int.from_bytes(b"progress", "big") > LONGEST_REPLY
        assert replies.partial() is None


def test_a_length_as_long_as_a_reply_can_be_is_waited_for():
    read_end, write_end = socket.socketpair()
    with read_end, write_end:
        write_end.sendall(LONGEST_REPLY.to_bytes(8, "big") + b"the start of it")
        replies = Replies(read_end.fileno())
        assert replies.read() == [] and replies.overlong is None
        assert replies.partial() == f"15 of {LONGEST_REPLY} bytes received"


def test_what_an_exited_worker_left_is_read_and_nothing_a_process_still_holding_its_pipe_writes_after():
    """Once its worker has exited, a pipe is read for what it held then: a process the worker forked
    that still holds it and writes on (here a writer blocked on the full pipe, which goes on the
    moment the reader makes room) is never read, however long it writes."""
    read_end, write_end = socket.socketpair()
    with read_end, write_end:
        left = framed(b"one", b"two", bytes(1_000_000))
        write_end.setblocking(False)
        sent = 0
        try:
            while sent < len(left):
                sent += write_end.send(left[sent:])
        except BlockingIOError:  # full: what the worker wrote before it died
            pass
        assert 11 + 11 < sent < len(left)
        write_end.setblocking(True)
        def write_on():
            with contextlib.suppress(OSError):  # until the reader closes its end
                write_end.sendall(framed(b"later") * 100_000)

        later = threading.Thread(target=write_on, daemon=True)
        later.start()
        replies = Replies(read_end.fileno())
        assert replies.read_left() == [b"one", b"two"]
        assert replies.partial() == f"{sent - 30} of 1000000 bytes received"
        read_end.close()  # as the reader does once the worker is retired: the writer's send fails
        later.join(10)
        assert not later.is_alive()


def test_what_an_exited_worker_left_after_a_reply_begun_in_an_earlier_read_comes_out_whole():
    """A worker that finished a reply the reader had begun reading, answered one more item and
    died partway through a third reply: the part read earlier joins the rest, both whole replies
    come out of the one call, and the third is told as cut short."""
    first, second, third = bytes(range(256)) * 400, b"second", bytes(5000)
    stream = framed(first, second, third)[:-1000]
    read_end, write_end = socket.socketpair()
    with read_end, write_end:
        replies = Replies(read_end.fileno())
        write_end.sendall(stream[:70_000])  # more than one read takes: the reader holds a part
        assert replies.read() == [] and replies.partial() == f"{70_000 - 8} of {len(first)} bytes received"
        write_end.sendall(stream[70_000:])  # the rest of it, and more, written before the exit
        assert replies.read_left() == [first, second]
        assert replies.partial() == "4000 of 5000 bytes received"
        assert replies.read_left() == []
