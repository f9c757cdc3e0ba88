"""Conformance suite (planned): fsdp_lite checked against torch FSDP, step by step."""
