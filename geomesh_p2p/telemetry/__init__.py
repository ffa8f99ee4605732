"""What a node tells its operator: structured events (:mod:`.events`), per-round metrics, JSON lines and
Prometheus gauges (:mod:`.metrics`), log-once keys (:mod:`.logonce`) and the event-loop lag monitor
(:mod:`.looplag`).

Imports only :mod:`geomesh_p2p.util`.
"""
