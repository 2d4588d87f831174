"""The table file on disk: sealed, written durably, set aside when broken (docs/tables.md,
"When a table is broken: healing and set-aside"; docs/design.md, "Tables"). ``set_aside``
renames, never deletes.
"""

import datetime
import fcntl
import hashlib
import logging
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("lamport_head")

SEAL = "# lamport-head table, sealed:"
_SEAL = re.compile(re.escape(SEAL) + r" sha256 ([0-9a-f]{64}) of the (\d+) bytes after this line$")
SET_ASIDE = ".broken-"


class TornTable(ValueError):
    """A sealed table whose bytes do not match its seal (the message says how)."""


def seal(text: str) -> str:
    body = text.encode("utf-8")
    return (f"{SEAL} sha256 {hashlib.sha256(body).hexdigest()} of the {len(body)} bytes "
            f"after this line\n{text}")


def check_seal(text: str) -> str:
    """The text after the seal line, or ``text`` when it has no seal; ``TornTable`` when it
    begins like a sealed table and does not match its seal."""
    first, newline, rest = text.partition("\n")
    if not first.startswith(SEAL):
        # an empty file, or one cut inside the seal line, is a sealed table cut short
        if not newline and SEAL.startswith(first):
            raise TornTable(f"torn: {len(text.encode('utf-8'))} bytes, cut inside the seal line")
        return text
    match = _SEAL.match(first)
    if not match or not newline:
        raise TornTable("torn: its seal line is cut")
    want, size = match.group(1), int(match.group(2))
    body = rest.encode("utf-8")
    if len(body) != size:
        raise TornTable(f"torn: the writer sealed {size} bytes after the seal line, "
                        f"{len(body)} are there (cut short by a crash or a full disk?)")
    if hashlib.sha256(body).hexdigest() != want:
        raise TornTable("torn: its bytes do not match the seal (edited by hand or damaged; a "
                        "table edited by hand drops the seal line)")
    return rest


@contextmanager
def locked(path):
    """An exclusive ``flock`` beside ``path``: concurrent writers lose no section, and a
    set-aside never moves a table another group has just written whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.stem}.lock"), "a") as lock:  # kept: locks need a file
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it; set back at once
    os.umask(mask)
    return mask


def _fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path, text: str):
    """Replace ``path`` by ``text``: a crash leaves the old file or the new one whole."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would lock other users out
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(path.parent)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def set_aside(path) -> Path:
    """Rename ``path`` beside itself with a UTC timestamp, durably; the new path."""
    path = Path(path)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    aside = path.with_name(f"{path.name}{SET_ASIDE}{now}")
    os.rename(path, aside)
    _fsync_dir(path.parent)
    return aside


def aside_line(path, aside, why, then):
    return (f"lamport-head: the user table {path} could not be read ({why}); set aside as "
            f"{aside}; {then}")


def kept_line(path, why, detail, then):
    return (f"lamport-head: the user table {path} could not be read ({why}) nor set aside "
            f"({detail}): every rank ignores it, on every start until it is fixed or "
            f"removed; {then}")


_said = set()  # (path, why, detail) of the kept lines said in this process: one each


def healing_line(path, why, kind, detail, then):
    """The WARNING line for this host's ``set_aside_agreed`` outcome, or None: "gone", or a
    kept copy this process said already (every install of a start meets it: one line)."""
    if kind == "aside":
        return aside_line(path, detail, why, then)
    if kind != "kept" or (str(path), why, detail) in _said:
        return None
    _said.add((str(path), why, detail))
    return kept_line(path, why, detail, then)
