"""Build tool of the hybrid-FA patched LMCache wheels (bases 0.5.3 and 0.5.6)."""

# Bump when the series changes the patched lmcache/ tree; it becomes the wheel's local
# version 0.5.3+hybridfa.N. A split or reorder that leaves the tree byte-identical keeps it.
# The 0.5.6 base keeps its own revision in bases/0.5.6/REVISION.
REVISION = 22
