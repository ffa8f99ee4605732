"""Round plans: the plan schema (:mod:`.schema`), adaptive workload balancing (:mod:`.awb`) and the uniform
baseline (:mod:`.uniform`) on one per-peer time model (:mod:`.cost`) and one way to assign parts
(:mod:`.assign`), the bounds on untrusted records (:mod:`.bounds`), the entry points and a follower's
checks (:mod:`.planner`), and agreement on one plan per round -- leader election, the signed plan in the
DHT, digest agreement (:mod:`.agree`). DESIGN.md "Round r".
"""
