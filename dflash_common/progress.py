"""How long work reports progress without printing: the CLI passes an implementation that draws
a bar; library callers get silence."""

from __future__ import annotations


class Progress:
    """Receives progress of long work. This base class ignores everything."""

    def start(self, total: int | None, desc: str, unit: str) -> None:
        """Work of ``total`` units (None when unknown) begins."""

    def advance(self, n: int, **stats) -> None:
        """``n`` more units are done; ``stats`` are short values worth showing (tokens/s, MB)."""

    def message(self, text: str) -> None:
        """A line worth telling the user (resume point, padding fraction, skipped rows)."""

    def close(self) -> None:
        """The work ended."""
