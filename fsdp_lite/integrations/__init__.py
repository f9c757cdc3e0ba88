"""Where users train: fsdp_lite under HF Trainer and Accelerate, and Lightning (docs/integrations.md).

Each module imports its client library, so none is imported with fsdp_lite; install them with the
``hf`` or ``lightning`` extra.
"""
