"""The one partition rule: how many elements of the flat parameter vector each owner gets.

Both the round plan's parts (:func:`geomesh_p2p.plan.assign.partition`) and the collective's
``make_partition`` (:mod:`geomesh_p2p.exchange.partition`) take their sizes from :func:`part_sizes`, so it
lives below both. Contiguous parts go to the peers that accept connections, sized by bandwidth with
hivemind's ``load_balance_peers`` (the butterfly all-reduce LP: an owner of a fraction ``f`` moves
``(1 + (N - 2) f)`` vectors); client-only peers own nothing. No owner gets more than
:func:`max_owner_units` (about ``OWNER_SHARE_FACTOR / n`` of the vector, ``n`` the peers that accept
connections): the LP alone hands a peer with twice the others' bandwidth the whole vector as soon as
``N = 3``. Pure and deterministic (no torch; hivemind is imported on first use).
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Callable, Optional, Sequence

logger = logging.getLogger(__name__)


#: no owner gets more than ~OWNER_SHARE_FACTOR / n of the vector (n: participants that accept
#: connections): twice the fair share; the partition enforces it (:func:`max_owner_units`).
OWNER_SHARE_FACTOR = 2.0


def max_owner_units(units: int, n_owners: int) -> int:
    """The most partition units (multiples of ``part_align`` elements) one owner may get:
    ``max(1, ceil(OWNER_SHARE_FACTOR * units / n_owners))``. ``n_owners``: peers that accept
    connections (>= 1). Always leaves room for all ``units`` (``n_owners * cap >= units``)."""
    return max(1, math.ceil(OWNER_SHARE_FACTOR * units / max(1, n_owners)))


_load_balance_peers: Optional[Callable] = None


def _hivemind_load_balance(vector_size: int, bandwidths: list[float], min_size: int) -> tuple[int, ...]:
    global _load_balance_peers
    if _load_balance_peers is None:  # importing hivemind takes seconds: only when needed
        from hivemind.averaging.load_balancing import load_balance_peers

        _load_balance_peers = load_balance_peers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy's "interior-point is deprecated"
        return tuple(int(x) for x in _load_balance_peers(vector_size, bandwidths, min_size))


def _proportional(total: int, weights: list[float]) -> list[int]:
    """Largest-remainder split of ``total`` in proportion to ``weights`` (deterministic)."""
    wsum = sum(weights)
    exact = [total * w / wsum for w in weights]
    sizes = [int(math.floor(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def _cap_sizes(sizes: list[int], weights: list[float], cap: int) -> list[int]:
    """``sizes`` (units) with none above ``cap``: the excess goes to the uncapped peers of positive
    weight in proportion to their weights, again until nobody is over (deterministic). Needs
    ``cap * (peers of positive weight) >= sum(sizes)``."""
    sizes = list(sizes)
    for _ in range(len(sizes) + 1):  # each pass saturates at least one more peer, or ends
        excess = sum(max(0, x - cap) for x in sizes)
        if excess == 0:
            return sizes
        sizes = [min(x, cap) for x in sizes]
        room = [i for i, (x, w) in enumerate(zip(sizes, weights)) if w > 0 and x < cap]
        for i, extra in zip(room, _proportional(excess, [weights[i] for i in room])):
            sizes[i] += extra
    raise AssertionError(f"could not cap parts at {cap} units: {sizes}")  # unreachable when cap*n >= total


def part_sizes(
    numel: int,
    bandwidths: Sequence[Optional[float]],
    *,
    align: int = 1,
    min_size: int = 0,
    equal: bool = False,
    share_among: Optional[int] = None,
) -> list[int]:
    """THE partition rule (the planner's :func:`partition` and the collective's ``make_partition``
    both call it): how many elements of ``[0, numel)`` each peer gets, in the order given.

    ``bandwidths[i]``: peer i's bandwidth (bytes/s, any common unit: only ratios matter); ``0`` =
    client-only (gets nothing); ``None`` = unknown (the mean of the positive ones; all unknown:
    equal shares). Sizes come from hivemind's ``load_balance_peers`` (which may give a slow peer
    nothing; a failure falls back to shares in proportion to bandwidth), or equal shares with
    ``equal=True``. Every size is a multiple of ``align`` elements except the last non-empty one;
    ``min_size``: a peer that would get fewer elements gets none (load_balance_peers' rule). No
    peer gets more than :func:`max_owner_units` units: the excess goes to the others in proportion
    to bandwidth; with ``share_among`` (a count over the owners: the participants a follower counts as
    possible owners, ``plan.bounds.follower_owner_count``) no more than ``max_owner_units(units, share_among)``
    where the owners can hold every unit at that cap (else the owners' own cap). The sizes sum to ``numel``.

    Raises ValueError for ``numel < 0``, ``align < 1``, no peers, a negative or non-finite
    bandwidth, or no peer with a positive (or unknown) bandwidth.
    """
    if numel < 0:
        raise ValueError(f"numel={numel} must be >= 0")
    if align < 1:
        raise ValueError(f"align={align} must be >= 1")
    if not bandwidths:
        raise ValueError("no peers to partition among")
    if any(b is not None and not (math.isfinite(b) and b >= 0) for b in bandwidths):
        raise ValueError(f"bandwidths must be finite and >= 0, got {list(bandwidths)}")
    known = [float(b) for b in bandwidths if b is not None and b > 0]
    unknown = known and sum(known) / len(known) or 1.0
    bw = [unknown if b is None else float(b) for b in bandwidths]
    n_owners = sum(1 for b in bw if b > 0)
    if n_owners == 0:
        raise ValueError("no peer accepts connections (all client-only): nobody can own a part")

    units = -(-numel // align)
    if units == 0:
        sizes = [0] * len(bw)
    elif equal:
        sizes = _proportional(units, [1.0 if b > 0 else 0.0 for b in bw])
    elif n_owners == 1:
        sizes = [units if b > 0 else 0 for b in bw]
    else:
        try:
            sizes = list(_hivemind_load_balance(units, bw, -(-min_size // align) if min_size else 0))
        except Exception as e:  # noqa: BLE001 - a solver failure must not stop the round
            logger.warning("load_balance_peers failed (%s); splitting in proportion to bandwidth", e)
            sizes = []
        if (
            len(sizes) != len(bw)
            or sum(sizes) != units
            or any(x < 0 for x in sizes)
            or any(x > 0 for x, b in zip(sizes, bw) if b == 0)
        ):
            if sizes:
                logger.warning("load_balance_peers gave an unusable split %s; using bandwidth-proportional", sizes)
            sizes = _proportional(units, bw)
    if units:
        cap = max_owner_units(units, n_owners)
        if share_among is not None and share_among > n_owners:
            # the bound of a follower that counts more possible owners than own a part (session 53: a resumed peer
            # that did not hold the leader's owner bar refused its plan), where the owners can meet it
            tighter = max_owner_units(units, share_among)
            cap = tighter if tighter * n_owners >= units else cap
        sizes = _cap_sizes(sizes, [1.0 if b > 0 else 0.0 for b in bw] if equal else bw, cap)

    sizes = [x * align for x in sizes]
    excess = sum(sizes) - numel
    if excess:
        last = max(i for i, x in enumerate(sizes) if x > 0)
        sizes[last] -= excess  # excess < align <= sizes[last]
    return sizes
