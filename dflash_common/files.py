"""Durable local writes: fsync, and a file replaced whole or not at all; what in a folder a
command that replaces or deletes its contents did not write; no write or delete that follows a
symlink; and one writer per output folder.

Every file and folder a command writes or deletes inside its output (a run folder, a drafter
export, regenerate's OUT.parts) goes through `write_atomic`, `append_line`, `remove_file` or
`remove_tree` with the output as `root`: they refuse a symlink at the path or at any folder
between `root` and it, so a link planted in an output never sends a write or a delete outside it.
`root` itself may be a link: it is the folder the user named."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import BinaryIO

from dflash_common.errors import DFlashError, DiskFullError, OutputError


def file_kind(mode: int) -> str:
    """What a file of this st_mode is, in words (for "X is a FIFO, not a regular file")."""
    for test, kind in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO (reading it would wait for a writer forever)"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return kind
    return "special file"


def fsync_path(path: str | os.PathLike) -> None:
    """fsync one local file, or a folder (which makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file under a local folder. A shard is ~150 files and each fsync waits for a
    device flush, so they run on a few threads (measured: 0.82 s -> 0.25 s for a 614 MB shard)."""
    from concurrent.futures import ThreadPoolExecutor

    files = [os.path.join(d, n) for d, _, names in os.walk(path) for n in names]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(fsync_path, files))


def refuse_links(path: str | os.PathLike, root: str | os.PathLike | None = None) -> None:
    """Raise OutputError when `path`, or a folder between `root` (not included) and it, is a
    symlink; with no `root`, only `path` itself is looked at. One lstat per component."""
    path = os.fspath(path)
    parts = [path]
    if root is not None:
        relative = os.path.relpath(path, root or os.curdir)
        if relative != "." and not relative.startswith(".."):
            names = relative.split(os.sep)
            parts = [os.path.join(root, *names[: i + 1]) for i in range(len(names))]
    for part in parts:
        if os.path.islink(part):
            kind = "folder" if os.path.isdir(part) else "file"
            raise OutputError(f"{part} is a symlink (to {os.readlink(part)}); dflash writes and deletes only real files "
                              f"and folders in its output and never follows a link out of it, so nothing was written "
                              f"or deleted: replace the link with a real {kind} (or remove it), or choose another output folder")


def regular_file_inside(folder: str | os.PathLike, name: str, what: str, error: type[DFlashError] = OutputError,
                        fix: str = "replace it with the file it stands for") -> str:
    """The path of `name` in `folder` for reading, refused in one line (`error`: `what`, which
    names the folder, then the file and why, then `fix`) unless it is a regular file inside the folder: no link leading
    out of it (a link to another file of the folder is fine), no FIFO (its reader blocks until
    someone writes), device (/dev/zero never ends), socket or folder. Checked before the reader
    opens it, so a file given by someone else is never read outside the folder it came in."""
    path = os.path.join(folder, name)
    root = os.path.realpath(folder)
    target = os.path.realpath(path)
    if os.path.islink(path) and os.path.commonpath([root, target]) != root:
        raise error(f"{what}: {name} is a symlink to {target}, outside the folder; dflash reads only the folder's own "
                    f"files: {fix}")
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        raise error(f"{what}: {name} is missing, so it cannot be read; {fix}") from None
    except OSError as err:
        raise error(f"{what}: {name} cannot be read ({err.strerror}); {fix}") from None
    if not stat.S_ISREG(mode):
        link = f" (a symlink to {target})" if os.path.islink(path) else ""
        raise error(f"{what}: {name}{link} is a {file_kind(mode)}, not a regular file, so it was not read; {fix}")
    return path


def write_file_atomic(path: str | os.PathLike, data: bytes, root: str | os.PathLike | None = None) -> None:
    """Write `data` to `path` whole (see write_atomic)."""
    write_atomic(path, lambda f: f.write(data), root)


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object], root: str | os.PathLike | None = None) -> None:
    """Make `path` whole with `write(file)`: into a temporary sibling (".NAME.tmp-XXXXXXXX"),
    fsynced, renamed over `path`, and the folder fsynced, so a crash leaves the old file or the new
    one; when `write` raises, the sibling is removed and the error goes on. A symlink at `path` or
    between `root` and it is refused (refuse_links), and the temporary is created new
    (O_EXCL | O_NOFOLLOW), so nothing is written through a link."""
    refuse_links(path, root)
    folder, name = os.path.split(os.fspath(path))
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_path(folder or ".")


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How writers that do not raise OSError name the errno: safetensors (Rust) says "(os error 28)".
_DISK_FULL_TEXTS = tuple(f"os error {n})" for n in DISK_FULL_ERRNOS) + ("No space left on device", "Disk quota exceeded")


def is_disk_full(err: BaseException) -> bool:
    """Whether `err`, or an error it was raised from or while handling, is a write that found its
    disk or quota full: an OSError of ENOSPC/EDQUOT, or a library's wrapping of one (safetensors
    raises SafetensorError naming "os error 28")."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS:
            return True
        if not isinstance(err, OSError) and any(text in str(err) for text in _DISK_FULL_TEXTS):
            return True
        err = err.__cause__ or err.__context__
    return False


@contextmanager
def disk_full_stops(path: str | os.PathLike, safe: str | Callable[[], str], fix: str) -> Iterator[None]:
    """Turn a full disk met in the block into one DiskFullError naming `path` (what was being
    written), `safe` (what is intact; a callable is asked only then, e.g. for the newest checkpoint)
    and `fix`. A DiskFullError raised inside keeps its own path: it knows the file."""
    try:
        yield
    except DiskFullError as err:
        raise DiskFullError(err.path, safe() if callable(safe) else safe, fix) from err
    except Exception as err:
        if not is_disk_full(err):
            raise
        raise DiskFullError(os.fspath(path), safe() if callable(safe) else safe, fix) from err


def disk_full_at(path: str | os.PathLike) -> AbstractContextManager[None]:
    """A full disk in the block is a DiskFullError naming `path`, the file being written; what is
    kept and the fix are for the caller that knows them to add (disk_full_stops around it)."""
    return disk_full_stops(path, "", "")


class _WholeWrites:
    """A write-only file over a descriptor whose ``write`` writes every byte or raises. torch.save
    to a path hides the errno of a failed write (it ends in "unexpected pos N vs M"), and to a
    Python file it ignores a short write's count; through this it gets OSError(ENOSPC) itself."""

    def __init__(self, fd: int):
        self.fd = fd

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            view = view[os.write(self.fd, view):]
        return total

    def flush(self) -> None:
        pass


def write_new_file(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Create `path` new (O_EXCL | O_NOFOLLOW) and fill it with `write(file)`, each write whole or
    an OSError (a full disk raises ENOSPC, never a torn file that looks written), then fsync it. For
    the files of a folder that is made under a temporary name and renamed whole (a checkpoint)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        write(_WholeWrites(fd))  # type: ignore[arg-type]
        os.fsync(fd)
    finally:
        os.close(fd)


def give_plain_mode(path: str | os.PathLike) -> None:
    """Give `path` the permissions a plain new file in its folder gets (0o666 & ~umask). Some
    writers create their file mode 600 (safetensors does), which a serving engine run as another
    user, or a shared model folder, cannot read. The umask is read from a probe file created new
    beside `path`, not with os.umask, which would change it for every thread for a moment."""
    folder = os.path.dirname(os.fspath(path)) or "."
    probe = os.path.join(folder, f".mode-probe-{uuid.uuid4().hex[:8]}")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        mode = os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        os.remove(probe)
    os.chmod(path, mode)


def open_append(path: str | os.PathLike, root: str | os.PathLike | None = None) -> int:
    """A descriptor appending to `path` (created when missing), for a log a child process writes
    too. A log is appended, not rewritten (a rename per line would cost the whole file each time),
    so the final link is refused by O_NOFOLLOW as well as by refuse_links: a link made after the
    check still fails (as OutputError)."""
    refuse_links(path, root)
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            refuse_links(path)
        raise


def append_line(path: str | os.PathLike, line: str, root: str | os.PathLike | None = None) -> None:
    """Append `line` (and a newline) to `path`, created when missing (see open_append)."""
    with os.fdopen(open_append(path, root), "a", encoding="utf-8") as f:
        f.write(line + "\n")


def remove_file(path: str | os.PathLike, root: str | os.PathLike | None = None, missing_ok: bool = False) -> None:
    """Delete one file of an output (refusing links on the way, see refuse_links)."""
    refuse_links(path, root)
    try:
        os.remove(path)
    except FileNotFoundError:
        if not missing_ok:
            raise


def remove_tree(path: str | os.PathLike, root: str | os.PathLike | None = None, ignore_errors: bool = False) -> None:
    """Delete a folder of an output and everything in it. A link at `path` or above it up to
    `root` is refused (deleting "in" it would delete another folder's files); links inside are
    removed as links by shutil.rmtree, never followed."""
    refuse_links(path, root)
    shutil.rmtree(path, ignore_errors=ignore_errors)


LOCK_FILE = ".dflash.lock"


@contextmanager
def one_writer(folder: str | os.PathLike, what: str, fix: str, name: str = LOCK_FILE) -> Iterator[None]:
    """Hold an exclusive OS lock (flock) on `folder`/`name` while the block runs: a second process
    asking for it gets an OutputError naming the holder (its pid and host, which the holder writes
    into the file) and `fix`. The kernel releases the lock when its process ends however it ends
    (SIGKILL included), so a crash never leaves a stale lock; the file stays. `folder` is created.
    Local file systems only (NFS v4 honours flock across hosts); object stores have no such lock."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    refuse_links(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 400, 0).decode("utf-8", "replace").strip() or "a process that has not written its name yet"
            raise OutputError(f"{folder} is being written by another {what} ({holder}); two writers would mix their "
                              f"files: {fix}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def foreign_entries(folder: str | os.PathLike, ours: Callable[[os.DirEntry], bool]) -> list[str]:
    """The sorted names in `folder` that `ours` does not claim ([] when there is no such folder):
    what a command about to replace or delete the folder's contents must refuse to touch. Hidden
    names come last: a refusal names the first, and a user's own files say more about a folder
    than a lock or a temporary does."""
    try:
        with os.scandir(folder) as entries:
            return sorted((entry.name for entry in entries if not ours(entry)), key=lambda name: (name.startswith("."), name))
    except (FileNotFoundError, NotADirectoryError):
        return []


def holds(names: Sequence[str]) -> str:
    """How a refusal names what a folder holds: "'a.txt'", or "'a.txt' and 3 more"."""
    return repr(names[0]) + (f" and {len(names) - 1} more" if len(names) > 1 else "")
