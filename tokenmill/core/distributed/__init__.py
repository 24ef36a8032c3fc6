"""Running one model over several ranks: process groups, the driver-worker protocol, workers."""
