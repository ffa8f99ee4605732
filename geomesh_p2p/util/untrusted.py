"""Parsing bytes that another peer (or a user's file) may have built to hurt the parser.

``json.loads`` raises more than ``ValueError``: a value nested a few thousand levels deep (``[[[[...``: a few
hundred bytes once zlib-compressed) raises ``RecursionError``, which the callers' ``except ValueError`` did not
catch, so one signed plan, evidence or progress record of that shape stopped every peer that read it (review,
session 10). Every parser of untrusted JSON goes through :func:`json_loads`, whose every failure is a
``ValueError``."""

from __future__ import annotations

import json
import math
from typing import Any


def json_loads(data: bytes | bytearray | str, what: str) -> Any:
    """``json.loads(data)``, failing only with ValueError.

    Args:
        data: the JSON text (UTF-8 bytes or str), from the network or a file.
        what: what it is, for the message (e.g. ``"plan body"``).

    Raises:
        ValueError: ``"<what> is no JSON: ..."`` for malformed JSON, bytes that are not UTF-8, an integer of
            more than 4,300 digits (Python's int limit), or nesting deeper than the parser's recursion limit.
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{what} is no JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError and the int digit limit are all ValueErrors
        raise ValueError(f"{what} is no JSON: {e}") from None


def non_finite(value: Any) -> str | None:
    """Where ``value`` (parsed JSON: dicts, lists, numbers, strings...) holds a float that is not finite, as a path
    (``"inner_lr"``, ``"a[2].b"``), or None when it holds none. ``json.loads`` and pydantic's untyped fields (``dict``)
    take ``NaN``, ``Infinity`` and ``1e999`` (inf), which ``allow_inf_nan=False`` refuses in typed fields only (red
    team, session 16). Iterative: a deeply nested value does not recurse."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return path or "the value"
        if isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None
