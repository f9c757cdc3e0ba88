"""fsdp_lite's FSDPModule is torch's for isinstance checks, and none of torch's FSDP code runs on it.

Client code (Accelerate's FSDP2 path, HF Trainer, Lightning Fabric, torch's pipelining) decides by
``isinstance(m, torch.distributed.fsdp.FSDPModule)``; fsdp_lite/fronts/interop.py makes that hold. The
price would be torch's methods running on modules they know nothing of, so: every method torch's
class defines is fsdp_lite's own, and a training step, a state dict, and torch's own
``register_fsdp_forward_method`` and ``.to()`` run no function from torch's FSDP package.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.fsdp as torch_fsdp

import fsdp_lite
from tests.parity import build_model, loss_fn, rank_batch
from tests.ranks import run_ranks

TORCH_FSDP_DIR = str(Path(torch_fsdp.__file__).parent)


def test_every_method_of_torchs_fsdpmodule_is_fsdp_lites_own():
    torch_names = [
        name
        for name, value in vars(torch_fsdp.FSDPModule).items()
        if callable(value) or isinstance(value, (staticmethod, classmethod, property))
    ]
    assert "reshard" in torch_names and "_get_fsdp_state" in torch_names
    missing = [n for n in torch_names if n not in vars(fsdp_lite.FSDPModule)]
    assert not missing, f"torch's FSDPModule methods fsdp_lite does not define: {missing}"


def _interop_rank(rank: int, world_size: int) -> list[str]:
    model = build_model("lm_untied")
    for block in model.blocks:
        fsdp_lite.fully_shard(block)
    fsdp_lite.fully_shard(model)
    assert isinstance(model, torch_fsdp.FSDPModule) and isinstance(model, fsdp_lite.FSDPModule)
    assert isinstance(model.blocks[0], torch_fsdp.FSDPModule)
    assert type(model.blocks[:1]).__name__ == "ModuleList", "slicing kept the FSDP class"
    model.plain_forward = model.forward  # a second forward method, as Trainer registers generate
    torch_fsdp.register_fsdp_forward_method(model, "plain_forward")
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ran: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(TORCH_FSDP_DIR):
            ran.add(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        for step in range(2):
            x, y = rank_batch("lm", step, rank, world_size)
            forward = model if step == 0 else model.plain_forward
            loss_fn("lm", forward(x), y).backward()
            optim.step()
            optim.zero_grad()
            model.set_requires_gradient_sync(True)
            model.reshard()
            model.to(torch.device("cpu", 0))  # nn.Module._apply, as Trainer calls it
        model.state_dict()
        # fully_shard.state(m), ours and torch's lookup alike: one state object per call, fsdp_lite's
        states = [fsdp_lite.fully_shard.state(m) for m in (model, *model.blocks)]
        assert states == [torch_fsdp.fully_shard.state(m) for m in (model, *model.blocks)]
        assert len({id(s) for s in states}) == len(states) and None not in states
        assert fsdp_lite.fully_shard.state(model.tok) is None  # not a fully_shard call's module
    finally:
        sys.setprofile(None)
    # register_fsdp_forward_method's own wrapper is torch's code calling ours; nothing else.
    return sorted(ran - {"_fully_shard.py:wrapped_method"})


def test_no_torch_fsdp_code_runs_on_fsdp_lite_modules(tmp_path):
    for rank, ran in enumerate(run_ranks(_interop_rank, 2, tmp_path, timeout=120)):
        assert not ran, f"rank {rank}: torch FSDP functions ran: {ran}"
