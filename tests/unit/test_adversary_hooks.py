"""The red team (tests/adversary.py) attacks through hooks of the real node: a hook renamed or moved by a
refactoring silently stops being an override and the attack tests then test nothing (issue 24's move of the
round rules into objects did exactly that to ``rogue-leader``'s plan). These checks fail first."""

import ast
import inspect

import tests.adversary as adversary
from geomesh_p2p.exchange.client import CollectiveService
from geomesh_p2p.node.peer import PeerNode


def _super_calls(cls) -> set[str]:
    """Names ``cls``'s methods reach through ``super().NAME``."""
    tree = ast.parse(inspect.getsource(cls))
    out = set()
    for n in ast.walk(tree):
        if (
            isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Call)
            and isinstance(n.value.func, ast.Name)
            and n.value.func.id == "super"
        ):
            out.add(n.attr)
    return out


def test_every_super_call_of_the_adversary_reaches_a_real_method():
    node_hooks = _super_calls(adversary.AdversaryNode)
    assert {"__init__", "start", "_build_training", "my_record"} <= node_hooks
    assert [h for h in sorted(node_hooks) if not hasattr(PeerNode, h)] == []
    coll_hooks = _super_calls(adversary._AdversarialCollective)
    assert coll_hooks == {"all_reduce", "_build_result"}
    assert [h for h in sorted(coll_hooks) if not hasattr(CollectiveService, h)] == []


def test_the_rogue_leader_wraps_the_plan_rules_the_driver_calls():
    src = inspect.getsource(adversary.AdversaryNode.__init__)
    assert "self.planning.make_plan = " in src  # the policy's make_plan calls self.planning.make_plan
    assert hasattr(adversary.AdversaryNode, "_rig_plan")
    policy_src = inspect.getsource(__import__("geomesh_p2p.round.policy", fromlist=["x"]).NodeRoundPolicy.make_plan)
    assert "self.planning.make_plan(" in policy_src
