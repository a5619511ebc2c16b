"""What the caches share about their life: a construction that fails part-way closes what it
built and raises its own error."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def closed_on_failure(owner: Any, name: str) -> Iterator[None]:
    """Closes a partly built `owner` when the body raises. The body's error is what the caller
    sees; a failure to close is a note on it, never its replacement."""
    try:
        yield
    except BaseException as error:
        try:
            owner.close()
        except Exception as close_error:
            error.add_note(f"and closing the partly built {name} failed: {close_error}")
        raise
