"""Slice kinds: whole GPUs, shares of one GPU, MIG instances — one class each, one interface.

``slice_type(request)`` gives the object that knows the request's kind; see :mod:`.base`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..model import SliceKind
from .base import SliceType, share_need
from .mig import MIG
from .share import SHARE
from .whole import WHOLE

if TYPE_CHECKING:
    from ..request import Request

KINDS: dict[SliceKind, SliceType] = {SliceKind.GPU: WHOLE, SliceKind.SHARE: SHARE, SliceKind.MIG: MIG}


def slice_type(req: Request) -> SliceType:
    return KINDS[req.kind]


__all__ = ["KINDS", "SliceType", "share_need", "slice_type"]
