"""The model side of a peer: inner training (:mod:`.training`), the outer optimizer (:mod:`.optim`), the
global state with its digests and checkpoints (:mod:`.state`), device profiling for the planner
(:mod:`.capability`) and checkpoint export (:mod:`.export`).
"""
