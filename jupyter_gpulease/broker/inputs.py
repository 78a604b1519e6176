"""Untrusted input, bounded and parsed once: request bodies, query arguments, numbers.

Every number the broker reads from a caller goes through core's
:func:`~jupyter_gpulease.core.request.parse_number` (request bodies through
:func:`~jupyter_gpulease.core.request.parse_ask`, query arguments here), which takes JSON numbers
and plain ASCII decimal strings only: Unicode digits ("²", "٣"), doubled or unexpected signs
("--5", "+1"), booleans, NaN and infinities are refused with a message naming the field. Bodies are bounded in bytes and nesting depth, and
the free-form fields (``meta``, ``usage``, ``reason``) in size, so no caller can make the
broker hold or store megabytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..core.model import BadRequest, LeaseError
from ..core.request import parse_number  # the one number parser (core's), for query arguments too

DISCARD_BYTES = 64 * 1024 * 1024  # the largest too-large body read to its end (and dropped) before its 413


class TooLarge(LeaseError):
    status = 413


@dataclass(frozen=True)
class Limits:
    """Size limits of what callers send (bytes, characters, levels)."""

    body_bytes: int = 64 * 1024
    meta_bytes: int = 4096
    usage_bytes: int = 4096
    reason_chars: int = 1000
    json_depth: int = 16


def _shown(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:40] + "…"


def optional_number(body: dict, name: str, **kw) -> Any:
    """``parse_number`` of ``body[name]``; None when absent or null."""
    if name not in body or body[name] is None:
        return None
    return parse_number(body[name], name, **kw)


def _reject_constant(name: str):
    # NaN and Infinity are not JSON: stored, they would break browsers' JSON.parse and PostgreSQL
    raise ValueError(f"{name} is not a JSON number")


def depth(v: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value (stops counting past ``limit``)."""
    stack = [(v, 1)]
    deepest = 0
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            children = x.values()
        elif isinstance(x, list):
            children = x
        else:
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((c, d + 1) for c in children)
    return deepest


# one decoder for every body and one compact encoder for the sizes (json.loads or json.dumps
# with an option builds a new one per call)
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_COMPACT = json.JSONEncoder(separators=(",", ":"))  # ASCII out (ensure_ascii): its length is its size in bytes


def parse_body(raw: bytes, limits: Limits) -> dict[str, Any]:
    """A request body: a JSON object within the limits, or a 400/413 that says what is wrong."""
    if not raw or not raw.strip():
        return {}
    if len(raw) > limits.body_bytes:
        raise TooLarge(f"the request body is {len(raw)} bytes, over the limit of {limits.body_bytes}", field="body")
    if isinstance(raw, bytes):
        # as json.loads: UTF-8 unless a BOM or the NUL bytes of UTF-16/32 say otherwise ('{' then
        # a byte other than NUL is UTF-8 to json.detect_encoding too, without asking it)
        text = raw.decode("utf-8" if raw[:1] == b"{" and raw[1:2] != b"\x00" else json.detect_encoding(raw), "surrogatepass")
    else:
        text = raw
    try:
        body = _DECODER.decode(text)
    except RecursionError:
        raise BadRequest(f"the request body is nested too deeply (the limit is {limits.json_depth} levels)", field="body") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}", field="body") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", field="body")
    # nesting needs an opening bracket per level: a text with no more of them than the limit
    # cannot be nested deeper, and its parsed value need not be walked
    if text.count("{") + text.count("[") > limits.json_depth and depth(body, limits.json_depth) > limits.json_depth:
        raise BadRequest(f"the request body is nested too deeply (the limit is {limits.json_depth} levels)", field="body")
    return body


def json_object(body: dict, name: str, max_bytes: int) -> dict[str, Any]:
    """A free-form object field (``meta``, ``usage``), at most ``max_bytes`` as JSON."""
    v = body.get(name)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise BadRequest(f"'{name}' must be a JSON object", field=name)
    size = len(_COMPACT.encode(v))
    if size > max_bytes:
        raise TooLarge(f"'{name}' is {size} bytes as JSON, over the limit of {max_bytes}", field=name)
    return v


def short_text(body: dict, name: str, max_chars: int) -> str:
    v = body.get(name)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise BadRequest(f"'{name}' must be a string", field=name)
    if len(v) > max_chars:
        raise TooLarge(f"'{name}' is {len(v)} characters, over the limit of {max_chars}", field=name)
    return v


def flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be true or false, got {_shown(v)}", field=name)
    return v


def query_flag(value: str | None, name: str) -> bool:
    if value is None:
        return False
    v = value.strip().lower()
    if v in ("1", "true", "yes", ""):
        return True
    if v in ("0", "false", "no"):
        return False
    raise BadRequest(f"'{name}' must be true or false, got {_shown(value)}", field=name)
