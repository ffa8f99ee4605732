"""The model side of a peer: building a model and its flat weights (:mod:`.build`), inner training
(:mod:`.training`), the outer optimizer (:mod:`.optim`), the global state with its digests and checkpoints
(:mod:`.state`), device profiling for the planner -- the device (:mod:`.device`), memory (:mod:`.memory`),
the start-up profile (:mod:`.profile`), the re-profiled capability figures (:mod:`.capability`) -- and
checkpoint export (:mod:`.export`).
"""
