"""Stats: the one accounting definition of hits, misses, bytes and times (standard library only)."""
