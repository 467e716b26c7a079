"""What the bench scripts (`gpu`, `soak`) share about the processes they start: each in a
process group of its own, so that what it starts goes with it, all killed at the end; a server
waited for until it listens; one line out of a failed command's log for a message."""

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

CHILDREN = []
"""Every process started, for `cleanup`."""


class BenchFailed(Exception):
    """A step that could not produce its figure; the message says why, in one line."""


def log(msg=""):
    print(msg, flush=True)


def one_line(text, limit=160):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def failure_reason(text, code):
    """One line out of a failed command's output: its error line, else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if re.match(r"(\S+: )?error\b", line, re.IGNORECASE) or line.startswith("Error"):
            return one_line(line)
    return one_line(lines[-1]) if lines else f"exit status {code}, no output"


def log_reason(path, code=None):
    """`failure_reason` of a log file."""
    try:
        return failure_reason(Path(path).read_text(errors="replace"), code)
    except OSError:
        return f"no log at {path}"


def spawn(cmd, log_path, env):
    """Starts `cmd` in a process group of its own, its output into `log_path`."""
    with open(log_path, "w") as f:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    CHILDREN.append(proc)
    return proc


def kill_group(proc, sig=signal.SIGKILL):
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def stop(proc, grace):
    """SIGTERM (a server drains), then after `grace` seconds SIGKILL to its whole group."""
    if proc.poll() is None:
        kill_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc)
    proc.wait()


def cleanup():
    """Kills every process started that is still running."""
    for proc in CHILDREN:
        if proc.poll() is None:
            kill_group(proc)
            proc.wait()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, proc, log_path, seconds):
    """Returns once 127.0.0.1:`port` accepts; BenchFailed if `proc` exits or `seconds` pass first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchFailed(f"the server exited with {proc.returncode}: {log_reason(log_path, proc.returncode)}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise BenchFailed(f"the server did not listen within {seconds:.0f} s: see {log_path}")
