"""Build tool of the hybrid-FA patched LMCache 0.5.3 wheel."""

# Bump when patches/series changes; it becomes the wheel's local version 0.5.3+hybridfa.N.
REVISION = 11
