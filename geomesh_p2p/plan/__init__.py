"""Round plans: adaptive workload balancing and the uniform baseline with the plan schema and its checks
(:mod:`.planner`), and agreement on one plan per round -- leader election, the signed plan in the DHT,
digest agreement (:mod:`.agree`). DESIGN.md "Round r".
"""
