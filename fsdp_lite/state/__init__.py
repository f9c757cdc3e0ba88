"""State dicts, optimizer state dicts and checkpoints of sharded models, over the engine."""
