"""A pipe that wakes an I/O thread blocked in zmq.Poller from another thread."""

from __future__ import annotations

import os


class Wakeup:
    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)

    def wake(self) -> None:
        try:
            os.write(self._write_fd, b"!")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is already pending

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self._write_fd)
