"""The project's POSIX shared-memory segments: named after their creator, swept when it dies.

A segment is named ``nrr-<pid namespace>-<creator pid>-<random>``. Its creator removes
it on ``close`` (``engine/staging.py``); when the creator dies first, two things remove
it instead:

* the creator's ``multiprocessing`` resource tracker, which unlinks what it registered
  when *it* exits — at once for a process that started its own tracker (a Ray or vLLM
  worker), but only when the parent exits for a child that shares its parent's tracker
  (``multiprocessing`` / ``torch.multiprocessing`` children do);
* :func:`sweep_orphans`, which every new segment's creator runs first (and a driver may
  run after its children exit): it removes each project segment whose creator is not
  running, so a long-lived parent does not hold the dead child's bytes until it exits.

A segment is only ever swept by a process in its creator's pid namespace (the namespace
is in the name): a process in another container that shares ``/dev/shm`` cannot judge
whether that pid is alive. A creator's pid reused by a new process keeps its segment
until a later sweep (the sweep errs on keeping).
"""

from __future__ import annotations

import os
import secrets

PREFIX = "nrr"
SHM_DIR = "/dev/shm"  # where Linux lists POSIX shared memory


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:  # no /proc (not Linux): one namespace
        return "0"


def new_segment_name(pid: int | None = None) -> str:
    """A fresh segment name that records its creator (``pid``: this process)."""
    pid = os.getpid() if pid is None else pid
    return f"{PREFIX}-{_pid_namespace()}-{pid}-{secrets.token_hex(6)}"


def segment_creator(name: str) -> tuple[str, int] | None:
    """``(pid namespace, creator pid)`` of one of the project's segment names, else None."""
    parts = name.split("-")
    if len(parts) != 4 or parts[0] != PREFIX or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[1], int(parts[2])


def pid_running(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, dead but not reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: running
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc to ask: kill(0) said it exists
    return state not in ("Z", "X")


def project_segments(pid: int | None = None) -> list[str]:
    """The project's segments now in ``/dev/shm`` (those of creator ``pid`` if given)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(
        n for n in names if (c := segment_creator(n)) is not None and (pid is None or c[1] == pid)
    )


def sweep_orphans() -> list[str]:
    """Remove the project's segments whose creator (in this pid namespace) is not
    running; the names removed."""
    namespace, removed = _pid_namespace(), []
    for name in project_segments():
        creator = segment_creator(name)
        assert creator is not None
        if creator[0] != namespace or pid_running(creator[1]):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:  # its tracker or another sweep was first
            continue
        removed.append(name)
    return removed


__all__ = [
    "PREFIX",
    "new_segment_name",
    "pid_running",
    "project_segments",
    "segment_creator",
    "sweep_orphans",
]
