"""``fsdp_lite.sharded_grad_scaler``: torch FSDP's module path for ShardedGradScaler, kept for the
one-import switch; the code is fsdp_lite/optim/grad_scaler.py."""

from fsdp_lite.optim.grad_scaler import *  # noqa: F403
from fsdp_lite.optim.grad_scaler import __all__  # noqa: F401
