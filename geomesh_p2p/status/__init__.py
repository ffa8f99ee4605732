"""What the swarm looks like from outside: the view behind the status page and ``geomesh-peer status``
(:mod:`.swarm`) and the bootstrap's read-only HTTP status page (:mod:`.http`, assets in ``static/``).
"""
