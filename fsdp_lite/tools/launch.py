"""Start a ``python -m MODULE`` job on local ranks through torch's elastic launcher, as torchrun does.

The demo and the conformance suite both launch themselves this way when run without torchrun.
"""

from __future__ import annotations

import os
import sys
import uuid

__all__ = ["launch_module"]


def launch_module(module: str, argv: list[str], nproc: int) -> bool:
    """Run ``python -m module *argv`` on ``nproc`` local ranks; False if any rank failed.

    A failed rank's traceback has already been printed by the launcher when this returns.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"{module.replace('.', '_')}_{uuid.uuid4().hex[:8]}",
        # Port 0: the c10d rendezvous binds a free port itself (what torchrun --standalone does).
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,  # a failed rank fails the job; a restart would only fail again
        monitor_interval=0.1,
    )
    # Ranks inherit the environment: one thread each, or N ranks fight over the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        elastic_launch(config, sys.executable)("-m", module, *argv)
    except ChildFailedError as e:
        print(f"{module}: a rank failed (its traceback is above)\n{e}", file=sys.stderr)
        return False
    return True
