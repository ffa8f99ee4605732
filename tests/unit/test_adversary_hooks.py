"""The red team (tests/adversary.py) attacks through hooks of the real node: a hook renamed or moved by a
refactoring silently stops being an override and the attack tests then test nothing (issue 24's move of the
round rules into objects did exactly that to ``rogue-leader``'s plan). These checks fail first."""

import ast
import inspect

import tests.adversary as adversary
from geomesh_p2p.exchange.client import CollectiveService
from geomesh_p2p.exchange.groups import GroupedCollective, _CrossService
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
    # a grouped round's levels (issue 26): the cross level's leader results, the whole exchange's aggregate
    assert _super_calls(adversary._ForgingCollective) == {"_build_result"}
    assert hasattr(_CrossService, "_build_result")
    assert _super_calls(adversary._RememberingExchange) == {"all_reduce"}
    assert hasattr(GroupedCollective, "all_reduce")


def test_the_adversary_mixes_into_every_level_of_a_grouped_exchange():
    """The red team reached only the one-level service until session 25: its flip never acted in a grouped round.
    Every service a grouped round pushes or serves on is mixed, each for this object alone."""
    src = inspect.getsource(adversary.AdversaryNode.start)
    for line in (
        "_mix(self.collective, _AdversarialCollective, self)",
        "_mix(self.grouped.group, _AdversarialCollective, self)",
        "_mix(self.grouped.cross, _ForgingCollective, self)",
        "_mix(self.grouped, _RememberingExchange, self)",
    ):
        assert line in src
    # GroupedCollective's stages are these attributes, and the flat exchange is the node's collective
    grouped_src = inspect.getsource(GroupedCollective.all_reduce)
    assert "self.group.all_reduce(" in grouped_src and "self.cross.all_reduce(" in grouped_src
    assert "self.flat.all_reduce(" in grouped_src

    class Base:
        def f(self):
            return "base"

    class Mixin:
        adversary = None

        def f(self):
            return "mixed " + super().f()

    a, b = Base(), Base()
    adversary._mix(a, Mixin, "ADV")
    assert (a.f(), b.f(), type(b)) == ("mixed base", "base", Base)  # one object's class, not the class
    assert a.adversary == "ADV" and isinstance(a, Base)


def test_the_rogue_leader_wraps_the_plan_rules_the_driver_calls():
    src = inspect.getsource(adversary.AdversaryNode.__init__)
    assert "self.planning.make_plan = " in src  # the policy's make_plan calls self.planning.make_plan
    assert hasattr(adversary.AdversaryNode, "_rig_plan")
    policy_src = inspect.getsource(__import__("geomesh_p2p.round.policy", fromlist=["x"]).NodeRoundPolicy.make_plan)
    assert "self.planning.make_plan(" in policy_src
