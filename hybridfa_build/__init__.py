"""Build tool of the hybrid-FA patched LMCache 0.5.3 wheel."""

# Bump when the series changes the patched lmcache/ tree; it becomes the wheel's local
# version 0.5.3+hybridfa.N. A split or reorder that leaves the tree byte-identical keeps it.
REVISION = 15
