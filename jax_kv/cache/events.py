"""GrowthEvent: what one `KvCache.ensure_capacity` did, and the reasons it can name."""

from __future__ import annotations

import dataclasses
import enum


class GrowthReason(enum.StrEnum):
    """Why the capacity changed (or did not); each value is the sentence the loop reports.

    A StrEnum: members compare, hash and format as their sentence, so a reason can be compared
    with, or printed as, a plain string.
    """

    NONE = "no growth: capacity suffices"
    SEQ_VMM = "seq-major VMM commit: pointers and shapes unchanged"
    HEAD_VMM = "head-major VMM re-stride: shape changed"
    EAGER = "eager regrow: new buffers"


REASON_NONE = GrowthReason.NONE
REASON_SEQ_VMM = GrowthReason.SEQ_VMM
REASON_HEAD_VMM = GrowthReason.HEAD_VMM
REASON_EAGER = GrowthReason.EAGER


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrowthEvent:
    """What one `ensure_capacity` did, and whether the compiled step survives it."""

    old_capacity: int
    new_capacity: int
    bytes_moved: int  # KV bytes relocated (live bytes on re-stride/regrow, 0 on VMM commit)
    granules_committed: int
    shape_changed: bool
    pointer_changed: bool
    keeps_compiled_step: bool
    reason: str  # a GrowthReason (any str is accepted: the loop's tests build their own)
    seconds: float = 0.0  # wall time of the event (host side, device work included)
    map_calls: int = 0
    set_access_calls: int = 0
    copy_calls: int = 0
    committed_bytes: int = 0  # the cache's committed KV bytes after the event

    @property
    def grew(self) -> bool:
        """Whether memory was committed or moved: a per-row growth of a short row leaves the
        capacity (the longest row's) as it was."""
        return self.reason != GrowthReason.NONE


__all__ = [
    "REASON_EAGER",
    "REASON_HEAD_VMM",
    "REASON_NONE",
    "REASON_SEQ_VMM",
    "GrowthEvent",
    "GrowthReason",
]
