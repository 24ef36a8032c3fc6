"""Building blocks shared by model plugins; each delegates its pluggable part."""
