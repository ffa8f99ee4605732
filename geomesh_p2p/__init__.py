"""GeoMesh-P2P: volunteer LLM training with adaptive workload balancing and sign-compressed sync.

Method: GeoMesh (arXiv 2609.18388). Architecture and protocol: DESIGN.md.
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1
