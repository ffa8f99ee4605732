"""The node's training state, built at start (lifecycle step 2 of :mod:`geomesh_p2p.node.peer`): data, model,
the start-up profile of this device, the inner trainer, the outer optimizer and the global state buffer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from geomesh_p2p.node.started import started
from geomesh_p2p.model import state as gstate  # module-qualified: tests replace gstate.load_latest_checkpoint
from geomesh_p2p.util.errors import StartInputError, UserFacingError
from geomesh_p2p.exchange.codec.feedback import PushFeedback

if TYPE_CHECKING:
    from geomesh_p2p.node.peer import PeerNode

from geomesh_p2p.node.data_load import load_training_data
from geomesh_p2p.model.profile import ProfileStopped, memory_in_use, profile_training, stateless_optimizer
from geomesh_p2p.model.device import detect_device
from geomesh_p2p.exchange.profile import measure_codec
from geomesh_p2p.model.memory import release_freed_memory
from geomesh_p2p.round.rules.undo import UNDO_ROUNDS
from geomesh_p2p.round.last_plan import record_ref
from geomesh_p2p.node import report
from geomesh_p2p.model.run_memory import (
    RunMemory,
    ShardChoice,
    choose_sharding,
    memory_budget_problem,
    run_memory_estimate,
    verified_work_on,
)
from geomesh_p2p.trust.verify_task import VerifyConfig
from geomesh_p2p.model.optim import OuterNesterov, SyncAdamW
from geomesh_p2p.model.rank_channel import RankChannel, RankFailure, rank_profile
from geomesh_p2p.model.rank_rounds import independent_ranks
from geomesh_p2p.model.ranks import RankedTrainer, load_sharding_modules
from geomesh_p2p.model.training import DEFAULT_INNER, InnerTrainer, lr_at
from geomesh_p2p.model.build import build_model, num_params
from geomesh_p2p.net.methods import LEVELS
from geomesh_p2p.node.joining import StoppedBeforeJoining

log = logging.getLogger("geomesh_p2p.node.peer")

__all__ = [
    "build_training",
    "trainer_kwargs",
    "record_capacity",
    "run_memory",
    "check_memory_budget",
    "choose_rank_training",
    "PUSH_FRAMING_BYTES",
    "PULL_REQUEST_BYTES",
]

#: Envelope, protobuf and codec headers around a pushed part (bytes): the push limit is 4 x numel + this.
PUSH_FRAMING_BYTES = 1 << 20
#: A PullPart request is a few ids and numbers (bytes).
PULL_REQUEST_BYTES = 16 << 10
#: Seconds the round's first inner step waits at most for the outer update's spill to let go of the gradients'
#: buffer (a 356 MB write at ``gpt2-124m``: ~0.1-0.6 s); past it the steps take a fresh buffer, as before.
SPILL_WAIT_S = 2.0


def trainer_kwargs(run, cfg) -> dict:
    """The :class:`InnerTrainer` arguments of a run config and node config besides model, data, device and peer
    id: the same on every rank of a multi-rank peer, so the ranks' inner optimizers step identically."""
    return dict(
        seq_len=run.seq_len,
        optimizer=run.inner_optimizer,
        lr=run.inner_lr,
        weight_decay=0.1,
        warmup_steps=run.warmup_steps,
        total_steps=run.total_inner_steps,
        seed=run.seed,
        speed_factor=cfg.speed_factor,
        amp=cfg.amp,
        steps_per_round=run.uniform_inner_steps,  # the inner LR follows the swarm's rounds (issue 14 #8)
    )


def record_capacity(node: PeerNode) -> dict:
    """The memory fields of this peer's record: ``memory_bytes`` (its device's budget; a multi-rank peer's
    sum over its ranks), and with several ranks ``ranks`` and ``rank_memory_bytes`` (one rank's budget)."""
    channel = getattr(node, "rank_channel", None)
    if channel is None or channel.world < 2:
        return {"memory_bytes": node.device_info.memory_bytes}
    per_rank = int(channel.rank_memory_bytes or node.device_info.memory_bytes)
    return {"memory_bytes": per_rank * channel.world, "ranks": channel.world, "rank_memory_bytes": per_rank}


def record_state(node: PeerNode) -> dict:
    """The state fields of this peer's record: ``round``, ``weights_digest`` (None while syncing), ``unled_until`` (the
    last round of the marks it holds on itself: ``Penalties.own_unled_until``), ``owner_bars`` (the owner penalties in
    force when it holds them all: ``Penalties.owner_bars``), ``unled_marks`` (its leader marks on the others, likewise:
    ``Penalties.unled_marks``), ``lead_from`` (``NodeRoundPolicy.lead_from``), ``activity``
    (:attr:`RoundDriver.activity <geomesh_p2p.round.driver.RoundDriver.activity>`) and ``last_plan``,
    the plan of round ``round - 1`` it obtained (:func:`~geomesh_p2p.round.last_plan.record_ref`: peers that did not
    obtain it take it by their voters' references), left out while it holds none or is syncing. A peer that ended
    alone on a state that is not the swarm's (:func:`~geomesh_p2p.node.report.disowned`) names neither: no fork's
    round is kept as the run's by a bootstrap, nor its plan voted for."""
    unsure = node.resync.syncing or report.disowned(node)
    ref = None if unsure else record_ref(getattr(node, "_round_driver", None), node.round)
    # its marks on itself: what a follower without the history reads instead of marks it lacks (session 50)
    pen = getattr(node, "penalties", None)
    unled = pen.own_unled_until() if pen is not None else None
    # the owner penalties it holds: what a peer planned out of one of their rounds takes from its voters (session 51)
    bars = None if unsure or pen is None or pen.state.round != node.round else pen.owner_bars()
    # the leader marks it holds on the others: what backs a peer's own unled_until for a joiner (session 52)
    marks = None if unsure or pen is None or pen.state.round != node.round else pen.unled_marks()
    # the first round it may lead again by the marks it lacks: the others take the next candidate's turn at once
    policy = getattr(node, "policy", None)
    gap = (
        policy.lead_from(node.round)
        if policy is not None and pen is not None and not unsure and pen.state.round == node.round
        else None
    )
    if policy is not None:
        kept = getattr(policy, "announced_lead_from", None)
        if getattr(policy, "announced_round", None) == node.round and type(kept) is int and kept > node.round:
            # one gap a round: the others test who may lead over it (round.planning.ungapped_leaders), and a record
            # re-stored without it (the owner vote closed it meanwhile) would give two reads two levels
            gap = kept if gap is None else max(gap, kept)
        policy.announced_lead_from = gap  # what it announces it keeps to (NodeRoundPolicy.leader_candidates)
        policy.announced_round = node.round
    return {
        "round": node.round,
        "weights_digest": None if unsure else node.digest,
        "last_plan": ref,
        "unled_until": unled,
        "owner_bars": bars,
        "unled_marks": marks,
        "lead_from": gap,
        # what its round loop does now, for the status views (RoundDriver.activity, fresh user 52)
        "activity": getattr(getattr(node, "_round_driver", None), "activity", None),
    }


def run_memory(run, cfg, n_params: int) -> RunMemory:
    """The static memory of this peer's run (:func:`~geomesh_p2p.model.run_memory.run_memory_estimate`) for
    ``n_params`` parameters under RunConfig ``run`` and NodeConfig ``cfg``: verified work when relay mode and a
    sign-compressed method; its kept contributions counted at ``max(2, --min-peers)`` contributors, for
    ``keep_rounds + 1`` rounds in memory (one held by the background check) and ``recheck_rounds + 1`` on disk
    (the older rounds kept re-checkable: their start weights and contributions)."""
    return run_memory_estimate(
        n_params,
        run.method,
        inner_optimizer=run.inner_optimizer,
        error_feedback=bool(run.error_feedback),
        verified_work=verified_work_on(run.method, run.mode),
        # the newest keep_rounds and the round of the check running in the background (issue 28); while more
        # checks wait, up to max_pending more rounds stay (rare: docs/security.md, "Verified work")
        keep_rounds=VerifyConfig().keep_rounds + 1,
        disk_rounds=max(VerifyConfig().keep_rounds, VerifyConfig().recheck_rounds) + 1,
        contributors=max(2, int(cfg.min_peers)),
        block_size=run.block_size,
        accountable=run.mode in ("accountable", "auto"),  # auto: its rounds of 5 or more are accountable
        eager=bool(run.eager),
        update_on_disk=True,  # the state server spills it (sync.server.UpdateLog, spill=True)
        # the exact undo's kept rounds (round.rules.undo; not with eager updates: OuterStepRule.for_node)
        undo_rounds=UNDO_ROUNDS if getattr(run, "undo_forged", False) and not run.eager else 0,
    )


def check_memory_budget(run, cfg, n_params: int, device_type: str, in_use_bytes: int = 0) -> RunMemory:
    """:func:`run_memory` for ``n_params``, checked against ``--memory-budget-gb`` on ``device_type``
    (``"cpu"`` or ``"cuda"``), ``in_use_bytes`` held besides it (:func:`~geomesh_p2p.model.run_memory.
    memory_budget_problem`). Returns the estimate.

    Raises:
        UserFacingError: the static memory alone does not fit the budget (one line naming the flag, the
            estimate, its largest items and what to do).
    """
    est = run_memory(run, cfg, n_params)
    problem = memory_budget_problem(
        est,
        cfg.memory_budget_bytes,
        device_type,
        verified_work=verified_work_on(run.method, run.mode),
        in_use_bytes=in_use_bytes,
    )
    if problem is not None:
        raise UserFacingError(problem)
    return est


def choose_rank_training(node: PeerNode, est: RunMemory, ranks: int, rank_memory: int) -> ShardChoice:
    """A multi-rank peer's rank 0, before its profile: train a whole copy per rank (DDP) or sharded (FSDP2), by
    :func:`~geomesh_p2p.model.run_memory.choose_sharding` on what the profile counts (the memory in use now, the
    gradients and inner optimizer state, ``est``'s other items) against one rank's budget ``rank_memory``
    (bytes). ``--shard`` shards; without it sharding is turned on when only sharded fits (one INFO line, with
    the bytes). Raises StartInputError (the CLI exits 2) when not even sharded fits."""
    r, c = node.run_cfg, node.cfg
    load_sharding_modules()  # before the memory in use is read (their memory is not a step's)
    param_bytes = sum(p.numel() * p.element_size() for p in node.model.parameters() if p.requires_grad)
    try:
        choice = choose_sharding(
            memory_in_use(node.device),
            param_bytes,
            rank_memory,
            ranks,
            shard=c.shard,
            # fp32 state as the estimate counts it (0 for the ddp baseline, which takes no inner step)
            optimizer_bytes=sum(i.bytes for i in est.items if i.name == "inner optimizer state"),
            extra_bytes=est.profile_extra(node.device.type),
        )
    except ValueError as e:
        budget = (
            f"--memory-budget-gb {c.memory_budget_bytes / 2**30:.3g}"
            if c.memory_budget_bytes is not None and node.device.type == "cpu"
            else "the memory available"
        )
        raise StartInputError(
            f"cannot train {c.model_config_file or r.model} on {ranks} ranks here: {e}; {budget} is divided by the ranks sharing a "
            f"device: use a larger --memory-budget-gb, more ranks (--local-devices, torchrun --nproc-per-node) or "
            "a smaller --model"
        ) from None
    if choice.auto:
        log.info("%s", choice.describe())
    return choice


def build_training(node: PeerNode) -> None:
    """Data, model, start-up profile, inner trainer, outer optimizer and the global state buffer
    (worker thread). The profile (:func:`capability.profile_training`) runs on the model itself
    (weights restored bit-identical, no copy) before anything else of the model's size is
    allocated, so its measured peaks are the process's and ``--memory-budget-gb`` binds the batch.

    Raises:
        UserFacingError: the memory budget (``--memory-budget-gb``, else the memory available) cannot
            hold training this model (the profile's one-line reason).
    """
    r, c = node.run_cfg, node.cfg
    # No release_freed_memory(configure=True) (a 1 MiB mmap threshold): every inner step then mapped and
    # faulted in its activations and gradients afresh. Freed memory goes back by trims instead: after
    # the profile (below) and after each round's inner steps (InnerTrainer.run).
    # Start-up says what it is doing: data, tokenizer and model take seconds to minutes (issue 14 #10).
    if not c.checkpoint_dir:  # said once joined (a start-up error stays the only line): Ctrl+C then saves nothing
        log.info("no --checkpoint-dir: this peer saves no checkpoint (its state lives only in the swarm)")
    load_training_data(node)  # loaded already by PeerNode.start, before its proof of work (fresh user 47)
    log.info("building the model and profiling this device (a few timed steps)...")
    node._stop_point("after loading the data")
    # A multi-rank peer (issue 30, geomesh_p2p.node.ranks): rank 0 trains on its rank's device; the profile
    # below measures this one rank within its share of the device's memory, and the record states the peer's
    # sum (rank_profile).
    channel: RankChannel | None = getattr(node, "rank_channel", None)
    ranks = channel.world if channel is not None else 1
    share = max(1, int(getattr(node, "rank_device_share", 1)))  # ranks on rank 0's device (CPU: all of them)
    node.device_info = detect_device(str(channel.device) if channel is not None else c.device, c.memory_budget_bytes)
    if channel is not None:
        device = str(channel.device)
    else:
        device = (
            "cuda"
            if node.device_info.kind == "cuda" and c.device == "auto"
            else (c.device if c.device != "auto" else "cpu")
        )
    node.device = torch.device(device)
    rank_memory = node.device_info.memory_bytes // share
    if channel is not None:
        channel.rank_memory_bytes = rank_memory  # announced by record_capacity
    node.model = build_model(
        r.model if not c.model_config_file else None,
        config_file=c.model_config_file,
        vocab_size=node.dataset.vocab_size,
        seed=r.seed,
    ).to(node.device)
    node.numel = num_params(node.model)
    # Outer optimizer state: Nesterov's momentum [P], or the ddp baseline's AdamW moments [2P].
    rule = node.method_rule
    node.state_numel = node.numel * rule.outer_state_slots
    # The whole run's static memory (issue 27): refused at once when --memory-budget-gb cannot hold it, and
    # what the profile leaves free besides the model, its gradients and AdamW state, so that the batch it
    # picks leaves room for the round (exchange buffers, verified work), not only for the inner steps.
    if ranks > 1:  # checked per rank below (choose_rank_training), whole copy or sharded
        est = run_memory(r, c, node.numel)
    else:
        est = check_memory_budget(r, c, node.numel, node.device.type)
    log.info("static memory of this run: %s", est.describe(node.device.type))
    # A multi-rank peer shards (FSDP2) with --shard or when a whole copy does not fit a rank (issue 30); the
    # profile then counts the rank's shard of the training state, and measures with no optimizer state.
    choice = choose_rank_training(node, est, ranks, rank_memory) if channel is not None else None
    shard = choice is not None and choice.shard
    if shard and independent_ranks(c.rank_sync, int(getattr(node, "rank_device_share", 1)), False):
        log.info(
            "sharded, the ranks meet at every inner step (--rank-sync %s would have them meet once a round, which "
            "needs a whole model per rank)",
            c.rank_sync,
        )
    # Profile first: the inner optimizer and the global state are not allocated yet, so the profile's
    # static estimate (gradients + optimizer state + the estimate's other items) is what the node adds.
    try:
        prof = profile_training(
            node.model,
            r.seq_len,
            node.device,
            rank_memory,
            vocab_size=node.dataset.vocab_size,
            batch_sizes=c.profile_batches,
            speed_factor=c.speed_factor,
            amp=c.amp,
            limit=256,
            extra_bytes=est.profile_extra(node.device.type),
            logger=log,
            should_stop=node._stop.is_set,
            state_bytes=choice.state_bytes if choice is not None else None,
            optimizer_factory=stateless_optimizer if shard else None,
        )
    except ValueError as e:  # the budget (stated or the memory available) cannot hold this model
        raise UserFacingError(f"cannot train {r.model} here: {e}") from None
    except ProfileStopped as e:
        raise StoppedBeforeJoining(str(e)) from None
    node.profiled_tps, node.max_batch = rank_profile(prof.tokens_per_s, prof.max_batch, ranks)
    release_freed_memory()
    node._stop_point("after the profile")
    # The exchange's CPU cost per element (encode, sign, verify, aggregate): the exchange window of this
    # peer's plans grows with the model by it (planner.exchange_cpu_s); each exchange then refines it.
    node.codec_s_per_element = measure_codec(
        block_size=r.block_size,
        push_encoding=rule.push_encoding,
        rule=rule.rule,
        weight_cap=r.weight_cap,
        min_agreement=r.min_agreement,
        min_support=r.min_support,
        clip_k=r.clip_k,
    )
    log.info(
        "device %s%s%s: %s tokens/s per batch, max batch %d (%.1fs to measure, peak %.2f GiB, budget %.2f GiB%s); "
        "exchange CPU %.1f ns per element pass",
        node.device_info.name,
        # the peer's figures: rank 0's profile of batch b at K x the batch and K x the tokens/s (rank_profile)
        f" x {ranks} ranks (the peer's batches and tokens/s: {ranks} x rank 0's profile)" if ranks > 1 else "",
        " (sharded, FSDP2)" if shard else "",
        {b: round(t) for b, t in node.profiled_tps.items()},
        node.max_batch,
        prof.seconds,
        max(prof.peak_bytes.values()) / 2**30,
        prof.memory_bytes / 2**30,
        " per rank" if ranks > 1 else "",
        node.codec_s_per_element * 1e9,
    )
    # No legitimate push exceeds one fp32 copy of the vector (the fp32 baselines' largest part) plus
    # framing: a larger one is refused from its length prefix, before it is read (issue 12).
    transport = node._started_transport()
    for level in LEVELS:  # the one-level exchange and both levels of a grouped round
        transport.set_payload_limit(
            level.push, min(transport.config.max_message_bytes, 4 * node.numel + PUSH_FRAMING_BYTES)
        )
        transport.set_payload_limit(level.pull, PULL_REQUEST_BYTES)
    if channel is not None:  # the followers build theirs when rank 0's SETUP arrives (node/ranks.py)
        try:
            node.trainer = RankedTrainer(
                node.model,
                node.dataset,
                channel=channel,
                shard=shard,  # --shard, or turned on above; the followers learn it from SETUP
                independent=independent_ranks(c.rank_sync, int(getattr(node, "rank_device_share", 1)), shard),
                device=node.device,
                peer_id=node.me,
                **trainer_kwargs(r, c),
            )
        except RankFailure as e:  # a follower died or timed out while building its model: before joining
            raise UserFacingError(f"{e} (--local-devices / torchrun)") from None
    else:
        node.trainer = InnerTrainer(
            node.model, node.dataset, device=node.device, peer_id=node.me, **trainer_kwargs(r, c)
        )
    if rule.exchanges_gradient:
        # Data-parallel baseline: the "outer" step is AdamW on the swarm's mean gradient.
        node.outer = SyncAdamW(
            lambda rnd: lr_at(rnd, lr=r.inner_lr, warmup_steps=r.warmup_steps, total_steps=r.total_inner_steps),
            betas=DEFAULT_INNER["adamw"]["betas"],
            weight_decay=0.1,
            decay_mask=node.trainer.decay_mask(),
        )
    else:
        node.outer = OuterNesterov(
            lr=r.outer_lr,
            momentum=r.outer_momentum,
            # the momentum clip bounds by the codec's blocks: sign-compressed pushes only (RunConfig)
            momentum_clip=r.outer_momentum_clip if rule.push_encoding == "sign" else 0.0,
            block_size=r.block_size,
        )
    # The global state in one buffer [(1 + k) * P]: theta and the outer optimizer's state are views of it,
    # stepped in place (no copies of the model per round), hashed in place (state.GlobalState).
    node.gstate = gstate.GlobalState(node.numel, rule.outer_state_slots)
    node.theta = node.gstate.theta
    node.outer.buf = node.gstate.opt_state
    started(node.state_server).serve(
        started(node.gstate)
    )  # served by byte range from the buffer itself (no snapshot copies)
    # The outer update's spill starts at the commit's seal (off the outer step's and the digest's core) and reads the
    # aggregate, the gradients' buffer: the next steps wait for it rather than take a second [P] (issue 27, session 45)
    if isinstance(node.trainer, InnerTrainer) and node.trainer.grads.enabled:  # a ranked trainer has no such buffer
        updates = started(node.state_server).updates
        node.trainer.grads.wait_release = lambda: updates.wait_spilled(SPILL_WAIT_S)
        node.verified.before_early_write = node.trainer.grads.wait_release  # verified work's start weights: after it
    # --error-feedback: the residual [P] fp32 of this peer's sign pushes (fp32 pushes lose nothing).
    node.feedback = (
        PushFeedback(node.numel, r.block_size) if r.error_feedback and rule.push_encoding == "sign" else None
    )
