"""``fsdp_lite.sharded_grad_scaler``, torch's ``torch.distributed.fsdp.sharded_grad_scaler`` path
for the one-import switch; the code is fsdp_lite/optim/grad_scaler.py."""

from fsdp_lite.optim.grad_scaler import *  # noqa: F403
from fsdp_lite.optim.grad_scaler import __all__  # noqa: F401
