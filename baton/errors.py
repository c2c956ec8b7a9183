"""User-facing errors: one line naming the file and the field that is wrong."""
from __future__ import annotations


class BatonError(Exception):
    """A problem with what the user gave us (a file, a flag, a plan), not a bug in Baton.

    The CLI prints ``str(error)`` on one line and exits with code 2.
    """

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.message = message
        self.source = source
        self.field = field
        super().__init__(self._render())

    def _render(self) -> str:
        where = ""
        if self.source and self.field:
            where = f"{self.source}: field '{self.field}': "
        elif self.source:
            where = f"{self.source}: "
        elif self.field:
            where = f"field '{self.field}': "
        return where + self.message


def require(condition: bool, message: str, *, source: str | None = None, field: str | None = None) -> None:
    """Raise a BatonError unless ``condition`` holds."""
    if not condition:
        raise BatonError(message, source=source, field=field)
