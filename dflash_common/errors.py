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
