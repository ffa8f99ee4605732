"""The whole run's static memory, estimated at start and itemized (issue 27: ``--memory-budget-gb`` bounds the
whole run, not only the start-up profile's batch).

"Static": the buffers of the model's size a peer holds for the run whatever its batch, fp32 (4 bytes per
element; ``P`` parameters): the model's weights, gradients and inner optimizer state (on the training
device), and besides them the global weights and outer state, the round's pseudo-gradient (delta) and
aggregate buffers (none beyond the gradients' place, except with eager updates), the newest outer update the
state server keeps for peers that fell behind, the error-feedback residual when on, and what a verified-work
check holds (on the device) and the contributions it keeps (host). Verified work's kept start weights are
files, not memory (:mod:`geomesh_p2p.trust.kept_weights`): listed with ``where="disk"``, counted in no total.
Not included: activations (the profile measures them per sequence), a robust read's temporaries, the
process's own ~0.5 GiB (Python, torch, the data set) -- docs/real-size.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, Optional

from geomesh_p2p.config.method import COMPRESSED_METHODS
from geomesh_p2p.model.memory import INNER_OPTIMIZER_STATE_COPIES, OUTER_STATE_COPIES

__all__ = [
    "MemoryItem",
    "RunMemory",
    "run_memory_estimate",
    "memory_budget_problem",
    "verified_work_on",
    "ShardChoice",
    "choose_sharding",
]

#: the items the start-up profile counts itself (the model it measures, its gradients and AdamW state)
PROFILED_ITEMS = ("weights", "gradients", "inner optimizer state")

_GIB = float(2**30)

#: Accountable mode: the most a validator holds of one part's inputs at once (the exchange's
#: ``partition.VALIDATION_BYTES``, repeated: this layer does not import the exchange).
ACCOUNTABLE_VALIDATION_BYTES = 256 << 20


@dataclass(frozen=True)
class MemoryItem:
    """One thing of the model's size a peer holds: ``name``, ``bytes`` and ``where`` it lives: ``"device"``
    (the training device's memory: CPU RAM, or GPU memory on CUDA), ``"host"`` (CPU RAM always) or
    ``"disk"`` (a file: in no memory total)."""

    name: str
    bytes: int
    where: Literal["device", "host", "disk"]


@dataclass(frozen=True)
class RunMemory:
    """The itemized static memory of a run (:func:`run_memory_estimate`); ``n_params`` = P."""

    n_params: int
    items: tuple[MemoryItem, ...]

    def in_memory(self, device_type: str = "cpu") -> list[MemoryItem]:
        """The items in the memory a ``--memory-budget-gb`` bounds on ``device_type``: every item but the
        files on ``"cpu"``; the device's items on a GPU (``"cuda"``)."""
        return [i for i in self.items if i.where == "device" or (device_type == "cpu" and i.where == "host")]

    def total(self, device_type: str = "cpu") -> int:
        """Bytes of :meth:`in_memory`."""
        return sum(i.bytes for i in self.in_memory(device_type))

    def profile_extra(self, device_type: str = "cpu") -> int:
        """Bytes the start-up profile must leave free besides what it measures and counts itself (the
        model, its gradients and AdamW state): its ``extra_bytes``."""
        return sum(i.bytes for i in self.in_memory(device_type) if i.name not in PROFILED_ITEMS)

    def largest(self, n: int = 3, device_type: str = "cpu") -> list[MemoryItem]:
        """The ``n`` largest items of :meth:`in_memory`, largest first (ties: in item order)."""
        items = [i for i in self.in_memory(device_type) if i.bytes > 0]
        return sorted(items, key=lambda i: -i.bytes)[:n]

    def describe(self, device_type: str = "cpu") -> str:
        """One line: the total in GiB and every non-zero item with its bytes, files marked as such."""
        parts = [
            f"{i.name} {i.bytes / _GIB:.3f} GiB{' (files, not memory)' if i.where == 'disk' else ''}"
            for i in self.items
            if i.bytes > 0
        ]
        where = "the device" if device_type != "cpu" else "RAM"
        return (
            f"{self.total(device_type) / _GIB:.2f} GiB of {where} for {self.n_params:,} parameters before "
            f"activations: {', '.join(parts)}"
        )


def verified_work_on(method: str, mode: str) -> bool:
    """Whether a peer of ``method`` in exchange ``mode`` runs verified work: a sign-compressed method
    (``COMPRESSED_METHODS``) in relay mode (it checks the relayed contributions), accountable mode (its checks and
    screens fetch the committed contributions they draw, :mod:`geomesh_p2p.trust.verify_commit`) or auto (relay or
    accountable rounds). Not in reencode mode: nobody but a part's owner sees a contribution there.

    Accountable mode was left out before session 32, so ``--memory-budget-gb`` did not count the check's model
    copy and the kept rounds of a peer that runs them in every accountable round
    (:meth:`~geomesh_p2p.round.rules.verified.VerifiedWork.verify_round`)."""
    return mode in ("relay", "auto", "accountable") and method in COMPRESSED_METHODS


def run_memory_estimate(
    n_params: int,
    method: str = "geomesh",
    *,
    inner_optimizer: str = "adamw",
    error_feedback: bool = False,
    verified_work: bool = False,
    keep_rounds: int = 3,
    contributors: int = 2,
    block_size: int = 2048,
    bytes_per_element: int = 4,
    accountable: bool = False,
    eager: bool = False,
    catch_up_update: bool = True,
    disk_rounds: Optional[int] = None,
    update_on_disk: bool = False,
    undo_rounds: int = 0,
) -> RunMemory:
    """The static memory of a peer of ``method`` training ``n_params`` (P) parameters, itemized, in bytes
    (``p = P x bytes_per_element``):

    * ``weights``, ``gradients``: p each (device);
    * ``inner optimizer state``: AdamW 2p, Lion p; 0 for ``ddp`` (no inner step) (device);
    * ``global weights + outer state``: p x (1 + outer copies: Nesterov 1, ``ddp``'s AdamW 2) (host);
    * ``delta + aggregate buffers``: 0, or 2p with ``eager`` (host). The pseudo-gradient is written into the
      gradients' own buffer once the inner steps are over (:mod:`.grad_buffer`); the collective writes the
      aggregate into it, part by part once pushed (issue 27). With eager updates the next round's steps (and
      gradients) run during the exchange and read the pseudo-gradient: both are buffers of their own then;
    * ``newest outer update``: p with ``catch_up_update`` (host): the state server keeps the last round's
      aggregate as it is for peers that fell behind (:class:`~geomesh_p2p.sync.server.UpdateLog`), through
      the next round; on ``disk`` with ``update_on_disk`` (the node since session 18: written to a file once
      sealed, early in the next round, unless a peer is catching up: then it stays in memory to be encoded);
    * ``error-feedback residual``: p when ``error_feedback`` and the method pushes signs (host);
    * with ``verified_work``: ``verified work: a check's weights + gradients`` 2p (device) while a check
      runs, nothing between checks: on the CPU its model's parameters are views of the checked round's kept
      weights (the file's pages, resident while the check reads them) and a gradient pass adds the gradients,
      the loss-gain test's second pass copies of the parameters the contribution moves
      (:mod:`geomesh_p2p.trust.check_model`); on a GPU a whole model copy and its gradients.
      ``verified work: kept contributions`` ``keep_rounds x contributors x
      (ceil(P / 8) + 4 x ceil(P / block_size))`` (host: sign bits and block scales of each contributor's
      packets), and ``verified work: kept start weights`` ``keep_rounds x p`` on disk (``disk_rounds x p`` when
      given: the rounds kept re-checkable in all, and then ``verified work: kept contributions on disk`` for the
      ``disk_rounds - keep_rounds`` older ones, the same bytes per round as in memory);
    * with ``undo_rounds`` (``--undo-forged``, issue 26's exact undo: :mod:`geomesh_p2p.round.rules.undo`):
      ``exact undo: kept rounds`` ``undo_rounds x p x (2 + outer copies)`` on disk (each round's start weights,
      outer state and applied aggregate);
    * with ``accountable`` (``--mode accountable``, issue 26): ``accountable: one validation's inputs`` (host:
      one part's signed inputs while a validator re-checks it, about one sign packet of the vector, at most
      256 MiB). The signed contributions an owner serves to validators are the ones every mode keeps for the
      kept rounds (not counted here, as in the other modes); receipts are ~250 B per part.

    Raises:
        ValueError: an unknown method or inner optimizer, ``n_params < 0``, ``keep_rounds < 0``,
            ``contributors < 0`` or ``block_size < 1``.
    """
    if method not in OUTER_STATE_COPIES:
        raise ValueError(f"unknown method {method!r} (known: {', '.join(OUTER_STATE_COPIES)})")
    if inner_optimizer not in INNER_OPTIMIZER_STATE_COPIES:
        raise ValueError(f"unknown inner optimizer {inner_optimizer!r}")
    if n_params < 0 or keep_rounds < 0 or contributors < 0 or block_size < 1:
        raise ValueError(
            f"need n_params >= 0 ({n_params}), keep_rounds >= 0 ({keep_rounds}), contributors >= 0 "
            f"({contributors}) and block_size >= 1 ({block_size})"
        )
    n = int(n_params)
    p = n * int(bytes_per_element)
    inner = 0 if method == "ddp" else INNER_OPTIMIZER_STATE_COPIES[inner_optimizer] * p
    items = [
        MemoryItem("weights", p, "device"),
        MemoryItem("gradients", p, "device"),
        MemoryItem("inner optimizer state", inner, "device"),
        MemoryItem("global weights + outer state", (1 + OUTER_STATE_COPIES[method]) * p, "host"),
        MemoryItem("delta + aggregate buffers", 2 * p if eager else 0, "host"),
        MemoryItem("newest outer update", p if catch_up_update else 0, "disk" if update_on_disk else "host"),
        MemoryItem("error-feedback residual", p if error_feedback and method in COMPRESSED_METHODS else 0, "host"),
    ]
    if verified_work:
        packet = math.ceil(n / 8) + 4 * math.ceil(n / block_size)
        items += [
            MemoryItem("verified work: a check's weights + gradients", 2 * p, "device"),
            MemoryItem("verified work: kept contributions", keep_rounds * contributors * packet, "host"),
            MemoryItem(
                "verified work: kept start weights", (keep_rounds if disk_rounds is None else disk_rounds) * p, "disk"
            ),
        ]
        if disk_rounds is not None:
            older = max(0, int(disk_rounds) - keep_rounds)
            items.append(MemoryItem("verified work: kept contributions on disk", older * contributors * packet, "disk"))
    if undo_rounds:
        items.append(
            MemoryItem("exact undo: kept rounds", int(undo_rounds) * (2 + OUTER_STATE_COPIES[method]) * p, "disk")
        )
    if accountable:
        packet = math.ceil(n / 8) + 4 * math.ceil(n / block_size)
        items.append(
            MemoryItem("accountable: one validation's inputs", min(packet, ACCOUNTABLE_VALIDATION_BYTES), "host")
        )
    return RunMemory(n, tuple(items))


def memory_budget_problem(
    est: RunMemory,
    budget_bytes: Optional[int],
    device_type: str = "cpu",
    *,
    verified_work: bool = False,
    in_use_bytes: int = 0,
) -> Optional[str]:
    """Why ``--memory-budget-gb`` (``budget_bytes``) cannot hold this run, in one line, or None (no budget,
    or the static memory fits): the budget, the estimate and its three largest items, and what to do (a
    larger budget, a smaller model, and ``--mode reencode`` when ``verified_work``: verified work runs
    in relay, accountable and auto mode, not in reencode). ``in_use_bytes``: memory the process holds already
    besides the estimate's items (bytes; the CLI's check at start passes its RSS on a CPU, Python and torch,
    which the start-up profile counts as in use: a budget of 0.1 GiB passed that check and was refused 18 s
    later by the profile, fresh-user trial, session 45)."""
    if budget_bytes is None:
        return None
    need = est.total(device_type) + max(0, int(in_use_bytes))
    if need < budget_bytes:
        return None
    items = [(i.name, i.bytes) for i in est.largest(3, device_type)]
    if in_use_bytes > 0:
        items = sorted(items + [("in use already (Python, torch)", int(in_use_bytes))], key=lambda x: -x[1])[:3]
    top = ", ".join(f"{name} {n / _GIB:.2f} GiB" for name, n in items)
    fixes = "a larger --memory-budget-gb or a smaller --model"
    if verified_work:
        vw = sum(i.bytes for i in est.in_memory(device_type) if i.name.startswith("verified work"))
        # a run's setting (every peer's), and for trusted peers only (docs/security.md): not one volunteer's choice
        fixes += f", or a run of trusted peers in --mode reencode (no verified work: {vw / _GIB:.2f} GiB less)"
    # the start line ("static memory of this run") gives the estimate alone: say both when the process adds to it
    # (fresh user 54b read 2.75 GiB there and 3.23 GiB here for one config)
    amount = (
        f"{need / _GIB:.2f} GiB"
        if in_use_bytes <= 0
        else f"{est.total(device_type) / _GIB:.2f} GiB ({need / _GIB:.2f} GiB with the {in_use_bytes / _GIB:.2f} GiB "
        f"this process holds already)"
    )
    return (
        f"--memory-budget-gb {budget_bytes / _GIB:.3g}: this run's static memory alone is "
        f"{amount} for {est.n_params:,} parameters before any activation (largest: {top}); use {fixes}"
    )


@dataclass(frozen=True)
class ShardChoice:
    """How one rank of a K-rank peer trains, whole copy (DDP) or sharded (FSDP2), and what each needs of the
    rank's budget, in bytes (:func:`choose_sharding`; issue 30, docs/multi-rank.md "Sharded").

    Both needs count what the start-up profile counts before any activation
    (:func:`geomesh_p2p.model.profile.profile_training`, its static part): ``in_use_bytes`` (the memory in use
    now: the process's RSS on a CPU, the allocator's bytes on CUDA; rank 0's whole model is in it) + the
    training state + ``extra_bytes`` (the rest of the run's static memory,
    :meth:`RunMemory.profile_extra`). The training state of a whole copy, ``whole_state_bytes``: gradients +
    inner optimizer state, ``param_bytes + optimizer_bytes``; sharded, ``sharded_state_bytes``: the rank's 1/K
    of the trained parameters, gradients and optimizer state, ``ceil((2 x param_bytes + optimizer_bytes) / K)``
    (rank 0 trains a sharded copy besides its whole model). ``shard``: train sharded; ``auto``: sharding was turned on
    here because a whole copy does not fit (not by ``--shard``)."""

    ranks: int
    budget_bytes: int
    in_use_bytes: int
    extra_bytes: int
    whole_state_bytes: int
    sharded_state_bytes: int
    shard: bool
    auto: bool = False

    @property
    def whole_bytes(self) -> int:
        """Bytes a rank needs with a whole copy: in use + gradients and optimizer state + the rest."""
        return self.in_use_bytes + self.whole_state_bytes + self.extra_bytes

    @property
    def sharded_bytes(self) -> int:
        """Bytes a rank needs sharded over the ranks: in use + its shard of the state + the rest."""
        return self.in_use_bytes + self.sharded_state_bytes + self.extra_bytes

    @property
    def state_bytes(self) -> int:
        """The training state the chosen way counts besides the memory in use (the profile's ``state_bytes``)."""
        return self.sharded_state_bytes if self.shard else self.whole_state_bytes

    def describe(self) -> str:
        """One line for the log: why sharding was turned on, with the bytes."""
        return (
            f"a whole copy needs {self.whole_bytes / _GIB:.3f} GiB per rank ({self.whole_bytes:,} bytes), a rank's "
            f"budget is {self.budget_bytes / _GIB:.3f} GiB ({self.budget_bytes:,} bytes): training sharded over "
            f"{self.ranks} ranks (FSDP2), {self.sharded_bytes / _GIB:.3f} GiB per rank ({self.sharded_bytes:,} "
            "bytes) before activations"
        )


def choose_sharding(
    in_use_bytes: int,
    param_bytes: int,
    budget_bytes: int,
    ranks: int,
    *,
    shard: bool = False,
    optimizer_bytes: Optional[int] = None,
    extra_bytes: int = 0,
) -> ShardChoice:
    """Whole copy (DDP) or sharded (FSDP2) for a rank with ``budget_bytes`` of memory, at start ("DDP for models
    that fit one device; FSDP when ``--shard`` is given or the model does not fit", issue 30). Bytes throughout;
    ``param_bytes``: the model's parameters (fp32: 4 x P), ``optimizer_bytes``: the inner optimizer's state for
    a whole copy (default ``2 x param_bytes``, AdamW's two moments; Lion ``param_bytes``; 0 for a method that
    takes no inner step: :func:`run_memory_estimate`'s ``inner optimizer state``); the needs are
    :class:`ShardChoice`'s. A need fits when it is below the budget (the profile refuses one that reaches it).

    * ``shard`` (``--shard``): sharded, when that fits;
    * else a whole copy when it fits; else, with ``ranks >= 2``, sharded when that fits (``auto``);
    * a one-rank peer is never sharded (nothing to shard over).

    Raises:
        ValueError: neither way fits (the message gives the budget and both needs, bytes and what they
            count), ``shard`` with fewer than 2 ranks, or a negative size, ``ranks < 1`` or
            ``budget_bytes <= 0``.
    """
    opt = 2 * int(param_bytes) if optimizer_bytes is None else int(optimizer_bytes)
    if ranks < 1 or budget_bytes <= 0 or min(in_use_bytes, param_bytes, extra_bytes, opt) < 0:
        raise ValueError(
            f"need ranks >= 1 ({ranks}), budget_bytes > 0 ({budget_bytes}) and no negative size (in use "
            f"{in_use_bytes}, parameters {param_bytes}, extra {extra_bytes}, optimizer state {opt})"
        )
    if shard and ranks < 2:
        raise ValueError(f"sharding needs >= 2 ranks, this peer has {ranks}")
    choice = ShardChoice(
        ranks=int(ranks),
        budget_bytes=int(budget_bytes),
        in_use_bytes=int(in_use_bytes),
        extra_bytes=int(extra_bytes),
        whole_state_bytes=int(param_bytes) + opt,
        sharded_state_bytes=-(-(2 * int(param_bytes) + opt) // int(ranks)),
        shard=bool(shard),
    )
    if not shard and choice.whole_bytes < budget_bytes:
        return choice
    if ranks >= 2 and choice.sharded_bytes < budget_bytes:
        return replace(choice, shard=True, auto=not shard)
    parts = (
        f"({choice.in_use_bytes:,} in use + {{state:,}} {{what}} + {choice.extra_bytes:,} the rest of the run's "
        "static memory)"
    )
    whole = f"a whole copy needs {choice.whole_bytes:,} " + parts.format(
        state=choice.whole_state_bytes, what="gradients and optimizer state"
    )
    budget = f"a rank's memory budget of {budget_bytes / _GIB:.3f} GiB ({budget_bytes:,} bytes)"
    if ranks < 2:
        raise ValueError(f"{budget} cannot hold training this model before any activation: {whole}")
    sharded = f"sharded over {ranks} ranks it needs {choice.sharded_bytes:,} " + parts.format(
        state=choice.sharded_state_bytes, what="its shard of the parameters, gradients and optimizer state"
    )
    raise ValueError(
        f"{budget} cannot hold training this model before any activation, not even sharded: {sharded}"
        + ("" if shard else f"; {whole}")
    )
