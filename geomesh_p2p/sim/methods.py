"""Method names of the simulator (the same as the real swarm's modes) and their variants.

Base methods (DESIGN.md "Baselines as modes of the same engine"):

========  ============================  ====================  =========================
name      plan                          exchange              source
========  ============================  ====================  =========================
ddp       same batch, 1 step per sync   fp32 mean every step  data-parallel baseline
diloco    same batch and H for all      fp32 mean             Douillard et al. 2023
awb       AWB (per-peer batch and H)    fp32 token-weighted   GeoMesh (balancing only)
css       same batch and H for all      sign, reencode        GeoMesh (compression only)
geomesh   AWB                           sign, reencode        GeoMesh arXiv 2609.18388
async     same batch and H, no barrier  fp32, applied on      async DiLoCo with staleness
                                        arrival               (HALoS-like baselines)
========  ============================  ====================  =========================

Variants: ``base+mod+mod...`` with modifiers

* ``ef`` — worker-side error feedback on the sign contributions (css/geomesh);
* ``relay`` / ``reencode`` / ``accountable`` — how owners serve parts (css/geomesh; default reencode;
  accountable adds one validation per part: docs/collective.md, "Accountable mode");
* ``sign`` / ``int8`` / ``fp16`` — encoding of the re-encoded aggregate (default sign);
* ``mean`` / ``meanmed`` / ``vote`` — aggregation rule of the sign contributions (css/geomesh; default
  ``mean``, the paper's token-weighted mean; the swarm's default is ``meanmed``, see
  :mod:`geomesh_p2p.exchange.robust` and docs/security.md);
* ``lion`` / ``adamw`` — inner optimizer (Lion uses the profile's ``train.lion_lr``);
* ``lr=X`` — inner peak learning rate; ``outer_lr=X`` — outer Nesterov lr;
* ``window=share`` / ``window=match`` — AWB window rule (awb/geomesh): comm is ``comm_share``
  of T, or the group trains DiLoCo's tokens per round;
* ``eager`` — eager updates (diloco/awb/css/geomesh; issue 17): the exchange of round r overlaps the inner
  steps of round r+1, following "Eager Updates for Overlapped Communication and Computation in DiLoCo"
  (Kale, Douillard, Donchev, 2025); the update equations are in
  :meth:`geomesh_p2p.sim.engine.Simulator._run_sync`. ``geomesh-eager`` is an alias of ``geomesh+eager``.

Examples: ``geomesh+ef``, ``geomesh+relay``, ``geomesh+int8``, ``geomesh+lion+lr=3e-4``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, cast

from geomesh_p2p.util.errors import UserFacingError
from geomesh_p2p.plan.schema import Method, Mode

__all__ = ["BASE_METHODS", "MethodSpec", "MethodError", "parse_method", "parse_methods"]

BASE_METHODS = ("ddp", "diloco", "awb", "css", "geomesh", "async")
_COMPRESSED = ("css", "geomesh")
_BALANCED = ("awb", "geomesh")
# the planner's method of each base: async plans as DiLoCo (same batch and H), without the barrier
_PLANNER_METHOD: dict[str, Method] = {
    "ddp": "ddp",
    "diloco": "diloco",
    "awb": "awb",
    "css": "css",
    "geomesh": "geomesh",
    "async": "diloco",
}


class MethodError(UserFacingError, ValueError):
    """An unknown method or modifier; the message is one line naming it."""


@dataclass(frozen=True)
class MethodSpec:
    """A method and its options. ``label`` is what the tables and JSON call it."""

    label: str
    base: str
    balanced: bool
    contribution: str  # "fp32" | "sign"
    mode: Mode = "reencode"
    aggregate: str = "fp32"  # "fp32" | "sign" | "int8" | "fp16"
    error_feedback: bool = False
    inner: str = "adamw"
    inner_lr: Optional[float] = None
    outer_lr: Optional[float] = None
    window: Optional[str] = None  # "comm_share" | "match_diloco" | None (profile's rule)
    rule: str = "mean"  # aggregation rule of sign contributions (geomesh_p2p.exchange.robust.RULES)
    eager: bool = False  # eager updates: round r's exchange overlaps round r+1's inner steps

    @property
    def compressed(self) -> bool:
        return self.contribution == "sign"

    @property
    def planner_method(self) -> Method:
        """The :class:`~geomesh_p2p.plan.schema.PlanConfig` method that plans this base (async: diloco)."""
        return _PLANNER_METHOD[self.base]


def _float(label: str, key: str, val: str) -> float:
    try:
        x = float(val)
    except ValueError:
        raise MethodError(f"method {label!r}: {key}={val!r} is not a number") from None
    if not (math.isfinite(x) and x > 0):  # float("inf") and float("nan") parse (red team, session 16)
        raise MethodError(f"method {label!r}: {key} must be a finite number > 0, got {val}")
    return x


def parse_method(label: str) -> MethodSpec:
    """``"geomesh+ef+int8"`` -> MethodSpec. Raises MethodError naming the unknown part."""
    label = label.strip()
    parts = [p.strip() for p in label.split("+")]
    if parts[0].lower().endswith("-eager"):  # "geomesh-eager" = "geomesh+eager"
        parts = [parts[0][: -len("-eager")], "eager"] + parts[1:]
    base = parts[0].lower()
    if base not in BASE_METHODS:
        raise MethodError(
            f"unknown method {parts[0]!r} (known: {', '.join(BASE_METHODS)};"
            " variants as geomesh+ef, geomesh+relay, geomesh+int8, geomesh+lion)"
        )
    spec = MethodSpec(
        label=label,
        base=base,
        balanced=base in _BALANCED,
        contribution="sign" if base in _COMPRESSED else "fp32",
        aggregate="sign" if base in _COMPRESSED else "fp32",
    )
    for mod in parts[1:]:
        key, _, val = mod.partition("=")
        key = key.lower()
        if (
            key in ("ef", "relay", "reencode", "accountable", "sign", "int8", "fp16", "mean", "meanmed", "vote")
            and not spec.compressed
        ):
            raise MethodError(f"method {label!r}: modifier {mod!r} applies to css/geomesh only")
        if key == "ef":
            spec = replace(spec, error_feedback=True)
        elif key in ("relay", "reencode", "accountable"):
            spec = replace(spec, mode=cast(Mode, key))
        elif key in ("sign", "int8", "fp16"):
            spec = replace(spec, aggregate=key)
        elif key in ("mean", "meanmed", "vote"):
            spec = replace(spec, rule=key)
        elif key in ("lion", "adamw"):
            spec = replace(spec, inner=key)
        elif key == "lr" and val:
            spec = replace(spec, inner_lr=_float(label, key, val))
        elif key == "outer_lr" and val:
            spec = replace(spec, outer_lr=_float(label, key, val))
        elif key == "eager" and not val:
            if base not in ("diloco", "awb", "css", "geomesh"):
                raise MethodError(
                    f"method {label!r}: eager applies to the synchronous methods diloco, awb, css, geomesh"
                )
            spec = replace(spec, eager=True)
        elif key == "window" and val in ("share", "match", "comm_share", "match_diloco"):
            if not spec.balanced:
                raise MethodError(f"method {label!r}: window= applies to awb/geomesh only")
            spec = replace(spec, window="comm_share" if val in ("share", "comm_share") else "match_diloco")
        else:
            raise MethodError(
                f"method {label!r}: unknown modifier {mod!r} (ef, relay, reencode, accountable, sign,"
                " int8, fp16, mean, meanmed, vote, lion, adamw, lr=X, outer_lr=X, window=share|match, eager)"
            )
    return spec


def parse_methods(text: str) -> list[MethodSpec]:
    """Comma-separated labels -> specs (duplicates refused)."""
    labels = [x.strip() for x in text.split(",") if x.strip()]
    if not labels:
        raise MethodError("no method given (e.g. --methods diloco,awb,css,geomesh,async)")
    specs = [parse_method(x) for x in labels]
    seen = set()
    for s in specs:
        if s.label in seen:
            raise MethodError(f"method {s.label!r} given twice")
        seen.add(s.label)
    return specs
