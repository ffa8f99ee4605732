"""Record schemas shared by the DHT, the planner, the round protocol and the status page (pydantic,
versioned): :mod:`.peer` holds the peer record a node announces (capability, progress, addresses);
:mod:`.partition` the one rule that splits the flat vector among owners (plan and exchange both use it).

Pure data: imports no other layer of the project.
"""
