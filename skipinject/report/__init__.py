"""What a run tells its user about the cache as a whole: its start lines, misses explained, its summary."""
