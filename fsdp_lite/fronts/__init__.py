"""The two public fronts over one engine: torch FSDP1's wrapper and FSDP2's ``fully_shard``."""
