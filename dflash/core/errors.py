"""One error shape for everything that names the field at fault."""

from __future__ import annotations


class FieldError(ValueError):
    """``field`` (a dotted path) is missing or invalid; the message starts with it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
