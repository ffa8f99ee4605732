"""The collective's spec of a round's plan (:func:`collective_spec`): the owners' parts (cut to what one gRPC
message carries), the participants' token budgets and the run's aggregation settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from geomesh_p2p import exchange as collective
from geomesh_p2p.config.method import MethodRule
from geomesh_p2p.trust import probation as pb

if TYPE_CHECKING:
    from geomesh_p2p.config.models import RunConfig

__all__ = ["collective_spec", "PULL_SHARE_OF_EXCHANGE"]

#: The pushes close this share of the exchange before its deadline: the last part is left to the pulls.
PULL_SHARE_OF_EXCHANGE = 0.25


def collective_spec(plan, run_cfg: RunConfig, numel: int, max_message_bytes: int) -> collective.CollectiveSpec:
    """The collective's spec for ``plan`` (``numel``: P, the model's parameters; ``max_message_bytes``: the
    transport's largest gRPC message). Raises ValueError when the plan cannot be executed."""
    r = plan.round
    rule = MethodRule.from_run(run_cfg)
    push, agg = rule.push_encoding, rule.aggregate_encoding
    # Owners' addresses come from the plan (the leader's view), so every peer dials the same ones.
    addresses = {x.peer_id: x.address for x in plan.assignments}
    owners = [
        collective.PartOwner(peer_id=pid, address=addresses.get(pid) or "", start=start, end=end)
        for pid, start, end in plan.owners()
    ]
    # A part too big for one gRPC message (fp32 baselines of large models) is cut into several.
    owners = collective.split_owners(
        owners,
        collective.max_part_elements(
            push_encoding=push,
            mode=plan.mode,
            aggregate_encoding=agg,
            n_participants=len(plan.assignments),
            block_size=run_cfg.block_size,
            max_message_bytes=max_message_bytes,
        ),
    )
    return collective.CollectiveSpec(
        run_id=run_cfg.run_id,
        round=r,
        participants={x.peer_id: x.token_budget for x in plan.assignments},
        owners=owners,  # type: ignore[arg-type]  # split_owners' list, as the spec always got
        numel=numel,
        mode=plan.mode,
        aggregate_encoding=agg,
        push_encoding=push,
        block_size=run_cfg.block_size,
        clip_k=run_cfg.clip_k,
        rule=rule.rule,
        weight_cap=run_cfg.weight_cap,
        min_agreement=run_cfg.min_agreement,
        min_support=run_cfg.min_support,
        quorum=run_cfg.quorum,
        probation=plan.probation(),
        grace_s=pb.early_close_grace_s(plan.window_s),
        validators_per_part=run_cfg.validators_per_part,
        deadline=plan.exchange_deadline - PULL_SHARE_OF_EXCHANGE * (plan.exchange_deadline - plan.train_deadline),
        pull_deadline=plan.exchange_deadline,
    )
