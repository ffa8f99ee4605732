"""Record schemas shared by the DHT, the planner, the round protocol and the status page (pydantic,
versioned): :mod:`.peer` holds the peer record a node announces (capability, progress, addresses).

Pure data: imports no other layer of the project.
"""
