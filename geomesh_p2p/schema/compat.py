"""The compatibility policy of the wire, the records and the plans, in code (docs/compat.md).

Versions are ``MAJOR.MINOR.PATCH`` (``geomesh_p2p.__version__``). Peers of the same ``MAJOR.MINOR`` train
together; a record of another one is dropped with the reason (:func:`same_series`, used by
``geomesh_p2p.dht.announce.check_compatible``). So a patch release may only add to what others read, never
change it:

* every model read from another peer (records, plans, round summaries) is a :data:`WIRE_MODEL`: a field it does
  not know is ignored, not refused (cardano hydra#1010: "additions are also breaking" when a parser forbids
  them). That is safe because what carries such a field is signed over the exact bytes received: a DHT record's
  signature covers its value bytes (``geomesh_p2p.dht.records``), a plan's head lists its chunks by SHA-256,
  an envelope signs its payload's hash; nothing is re-serialized from parsed fields and then checked;
* a field a patch adds has a default, and a peer that ignores it still computes the same round (a hint, a
  figure for the status page, an optional limit it may exceed); anything that changes what the round computes
  is a minor release (and a bump of ``PROTOCOL_VERSION`` or the schema's version);
* local files (run and node configs, hardware profiles) keep refusing unknown fields: there a typo must fail.
"""

from __future__ import annotations

from pydantic import ConfigDict

__all__ = ["WIRE_MODEL", "series", "same_series"]

#: ``model_config`` of every pydantic model parsed from another peer's bytes: unknown fields ignored (added by
#: a newer patch release), frozen, no NaN or Infinity.
WIRE_MODEL = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


def series(version: str) -> tuple[str, ...]:
    """The ``(MAJOR, MINOR)`` of ``version`` (``"0.1.3"`` -> ``("0", "1")``); a version without a dot is its
    own series. Peers of one series train together."""
    parts = version.split(".")
    return tuple(parts[:2]) if len(parts) >= 2 else (version,)


def same_series(a: str, b: str) -> bool:
    """True when versions ``a`` and ``b`` may train together: the same ``MAJOR.MINOR`` (the patch may differ)."""
    return series(a) == series(b)
