"""Global state for late joiners and re-syncing peers: the state server, download and catch-up
(:mod:`.transfer`) and a syncing peer's measured progress (:mod:`.progress`). DESIGN.md "Late joiners and
restarts".
"""
