"""Opening model files without trusting what the path points at.

A path named `model.gguf` may be a FIFO, a character device or a socket: a plain `open()`
of a FIFO for reading waits forever for a writer, and a device may never end. Every model
file is therefore checked to be a regular file before it is read, and opened with
O_NONBLOCK so that even a path swapped for a FIFO after the check cannot block the open
(csrc/mapfile.c does the same for the memory maps).
"""
from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .._native._core import MappedFile
from .errors import FormatError

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _not_regular(mode: int) -> str:
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "not a regular file"


def regular_file_size(path: str | Path) -> int:
    """The size of `path` (symlinks followed); FormatError if it is missing or not a
    regular file. Only stat() is called, which never blocks."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise FormatError(path, f"cannot open: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(path, f"cannot open: it is {_not_regular(st.st_mode)}, not a regular file")
    return st.st_size


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (a JSON side file of a model:
    an index, a tokenizer). FormatError if it is not a regular file or is larger."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FormatError(path, f"cannot open: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(path, f"cannot open: it is {_not_regular(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise FormatError(path, f"is {st.st_size} bytes, more than the {limit} allowed for it")
        data = f.read(st.st_size + 1)  # (read(limit) would allocate the whole limit at once)
    if len(data) != st.st_size:
        raise FormatError(path, "changed size while being read")
    return data


class MappedFileChanged(RuntimeError):
    """A model file this process has mapped was written to in place since it was loaded."""


@dataclass(frozen=True)
class FileFingerprint:
    """What a mapped file looked like when it was opened: a later stat() of the same path
    that finds the same inode with another size or modification time means the bytes
    under the mapping were rewritten (the model would silently compute with a mix of old
    and new weights). A file replaced by a new one (a new inode: `mv`, `ellm pull`) is not
    a change: the mapping keeps the old file's bytes."""
    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | Path) -> FileFingerprint:
        st = os.stat(path)
        return cls(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def changed(self) -> str | None:
        """None while the file is as it was; else what changed (one stat(), a few µs)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None   # removed: the mapping still holds the bytes it had
        if (st.st_dev, st.st_ino) != (self.device, self.inode):
            return None
        if st.st_size != self.size:
            return f"its size went from {self.size} to {st.st_size} bytes"
        if st.st_mtime_ns != self.mtime_ns:
            return "it was written to (its modification time changed)"
        return None


def check_unchanged(fingerprints: Iterable[FileFingerprint]) -> None:
    """Raises MappedFileChanged naming the first file that changed in place."""
    for fp in fingerprints:
        what = fp.changed()
        if what is not None:
            raise MappedFileChanged(f"the model file {fp.path} changed on disk while it was in use ({what}); "
                                    "its weights can no longer be trusted: restart to load the new file "
                                    "(replace model files with a new file and a rename, not in place)")


THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages() -> bool:
    """Whether the kernel gives 2 MiB pages to memory that asks (Linux THP "always" or
    "madvise", not "never")."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


MEMINFO = Path("/proc/meminfo")
HUGE_PAGES_SWITCH = "ELLM_HUGE_PAGES"   # "0" keeps the weights on the file's pages


def room_for_a_private_copy(file_size: int, meminfo: str) -> bool:
    """Whether a private copy of `file_size` bytes leaves at least as much memory again
    available (MemAvailable in /proc/meminfo's text). The moved weights are anonymous memory,
    which the kernel cannot drop under pressure as it drops file pages: a model that only
    just fits stays on the file's pages rather than risk the OOM killer."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            try:
                available = int(fields[1]) * 1024   # kB
            except (IndexError, ValueError):
                return False
            return 2 * file_size <= available
    return False


def huge_pages_refused_by_user() -> bool:
    return os.environ.get(HUGE_PAGES_SWITCH, "").strip().lower() in ("0", "off", "false", "no")


def _move_at_low_priority(mapped: MappedFile) -> None:
    try:   # this thread only (Linux: a thread's nice value is its own), below the kernels'
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
    mapped.move_to_huge_pages()


class MappedModelFile:
    """A model file memory-mapped read-only, refused unless it is a regular file, and
    checked once, before its first tensor is read, for having been cut short since."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        regular_file_size(self.path)  # a FIFO or device is refused before open() could block
        try:
            self._map = MappedFile(str(self.path))
        except OSError as e:
            raise FormatError(self.path, f"cannot open: {e.strerror or e}") from None
        self._buf = memoryview(self._map)
        self._mover: threading.Thread | None = None
        self.fingerprint = FileFingerprint.of(self.path)   # to notice a rewrite in place later
        self._size_checked = False

    @property
    def file_size(self) -> int:
        return len(self._buf)

    def check_size(self) -> None:
        """FormatError if the file on disk is now shorter than the map (truncated since it
        was opened): reading the missing pages would kill the process with SIGBUS."""
        try:
            now = regular_file_size(self.path)
        except FormatError as e:
            raise FormatError(self.path, f"changed since it was opened: {e.problem}") from None
        if now < self.file_size:
            raise FormatError(self.path, f"was truncated to {now} bytes since it was mapped "
                                         f"({self.file_size}); reading it would crash the process")

    def move_onto_huge_pages(self) -> threading.Thread | None:
        """Starts moving the file's bytes, 2 MiB at a time, onto memory on 2 MiB pages, in
        place and at the lowest priority (csrc/mapfile.h ellm_map_move_to_huge_pages):
        views keep reading the same bytes throughout, so the model runs meanwhile. A CPU
        decode reads all its weights from DRAM each token; on 4 KiB file pages a core reads
        them 8% slower. Resident memory stays one copy of the file. Returns the thread
        doing it (join() to wait), or None where the kernel gives no such pages, where
        ELLM_HUGE_PAGES=0 says not to (processes that share one file's page cache, say),
        or where the copy would take more than half of the memory available."""
        if self._mover is not None:
            return self._mover
        if huge_pages_refused_by_user() or not transparent_huge_pages():
            return None
        try:
            meminfo = MEMINFO.read_text()
        except OSError:
            return None
        if not room_for_a_private_copy(self.file_size, meminfo):
            return None
        self._first_use()   # a file cut short since it was mapped is refused before the copy reads it
        self._mover = threading.Thread(target=_move_at_low_priority, args=(self._map,), daemon=True,
                                       name=f"ellm huge pages {self.path.name}")
        self._mover.start()
        return self._mover

    def _first_use(self) -> None:
        if not self._size_checked:  # one stat() per file, before the first tensor is read
            self.check_size()
            self._size_checked = True
