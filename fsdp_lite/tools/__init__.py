"""What watches and launches a run: the trace, the collective-order check, the rank launcher."""
