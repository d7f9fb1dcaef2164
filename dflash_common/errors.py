"""Typed errors. Every expected failure is one of these; the CLI prints `str(err)` as one line."""


class DFlashError(Exception):
    """Base class for expected, user-facing errors (one line: problem, value, fix)."""


class ConfigError(DFlashError):
    """An option or config value is invalid."""


class BadRowError(DFlashError):
    """A corpus row cannot be used; the message names file, row and problem."""

    def __init__(self, path: str, row: int, problem: str):
        self.path, self.row, self.problem = path, row, problem
        super().__init__(f"{path} row {row}: {problem} (fix the row, or pass --on-bad-row skip)")


class CacheError(DFlashError):
    """A cache is missing, incompatible, incomplete or corrupt."""


class TeacherError(DFlashError):
    """The teacher model cannot be loaded or produced unusable outputs."""


class OutputError(DFlashError):
    """An output folder cannot be written safely: a symlink where dflash writes or deletes, or
    another process writing the same folder."""


class TrainingError(DFlashError):
    """Training cannot go on: its loss or weights stopped being finite."""


class DiskFullError(OutputError):
    """A write found its disk (or the user's quota) full. ``path`` is what was being written,
    ``safe`` what is intact (the last good checkpoint, the committed shards), ``fix`` how to go on
    once there is space; the message is those three in one line."""

    def __init__(self, path: str, safe: str, fix: str):
        self.path, self.safe, self.fix = str(path), safe, fix
        super().__init__(f"no space left on the disk while writing {self.path}; {safe}: free space on that disk "
                         f"(or its quota), then {fix}")



QUOTED_CHARS = 80
"""The most characters of a value a message quotes from a file it did not write."""

_ITEMS = 6


def quoted(value: object, limit: int = QUOTED_CHARS) -> str:
    """``repr(value)`` for a one-line message, within about ``limit`` characters: a manifest's 50 MB
    name or a million-item list is quoted by its start and its size, never whole (reprlib cuts
    long strings and containers before it builds their text)."""
    import reprlib

    short = reprlib.Repr()
    short.maxstring = short.maxother = limit
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = _ITEMS
    short.maxlevel = 3
    try:
        text = short.repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = f"<{type(value).__name__}>"
    if len(text) > limit:  # items each within bounds can still add up
        text = text[:limit - 3] + "..."
    if isinstance(value, (str, bytes)) and len(value) > limit - 2:
        text += f" ({len(value):,} {'characters' if isinstance(value, str) else 'bytes'})"
    elif isinstance(value, (list, tuple, dict, set)) and len(value) > _ITEMS:
        text += f" ({len(value):,} items)"
    return text


def shown(value: object, limit: int = QUOTED_CHARS) -> str:
    """A value read from a file, as a line shows it: a short printable string as it is, anything
    else (long, with control characters, of another type) ``quoted``."""
    if isinstance(value, str) and len(value) <= limit and value.isprintable():
        return value
    return quoted(value, limit)
