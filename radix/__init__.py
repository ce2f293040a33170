"""weft.radix: the radix-tree prefix cache (pure CPU data structure)."""
