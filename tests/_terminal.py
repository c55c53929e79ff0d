"""Run a command as in a terminal (a pseudo-terminal 100 columns wide on its
stderr) or redirected (stderr a pipe), for the tests of progress bars."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios
import time


def stderr_of(args: list[str], *, terminal: bool, env: dict[str, str] | None = None,
              timeout: float = 240) -> str:
    """The command's stderr (it must exit 0), written to a terminal or to a pipe."""
    if not terminal:
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=follower, env=env)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    while True:  # read as it writes: a full pseudo-terminal would block the command
        ready, _, _ = select.select([leader], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:  # a command that hangs fails the test instead of hanging it
            process.kill()
            raise AssertionError(f"{args} did not finish within {timeout} s: "
                                 f"{b''.join(chunks)[-3000:]!r}")
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the command closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert process.wait(timeout=timeout) == 0, b"".join(chunks)[-3000:]
    return b"".join(chunks).decode(errors="replace")
