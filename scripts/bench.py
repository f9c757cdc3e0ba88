"""Side-by-side benchmark: fsdp_lite's strategies against a single process, DDP, FSDP1 and FSDP2.

One invocation launches ``--world-size`` gloo ranks once; on them every system trains the same
seeded GPT-like model on the same per-rank batches. By default every system of a precision is built
at once and they are stepped in turn, a barrier before each step, so that a change in machine load
falls on all of them alike; ``--sequential`` instead runs one system after another, each freed
before the next, in ``--rounds`` rounds (order reversed every other round), which holds less in
memory but lets drift in load skew the ratios (docs/performance.md). For each system and precision it reports the median and IQR of step time
(forward + backward + AdamW step, slowest rank per step), the ratio to native FSDP2 and to the
compute floor, the peak memory that torch's MemTracker sees, the bytes of params + grads + optimizer
state each rank holds against the ideal (single process's bytes / world size), and the bytes each
rank sends per step (ring algorithm: (g-1)/g of each buffer, twice for an all-reduce, g = group
size), counted from the c10d ops every system issues, against ZeRO's theory.

    python scripts/bench.py [--json out.json] [--plot out.png] [--world-size 2] [--steps 20]
        [--layers 6] [--d-model 384] [--vocab 4096] [--seq-len 128] [--batch 4] [--precision fp32,bf16]
        [--sequential [--rounds 2]]

The compute floor ("single") runs the unwrapped model with no process group calls on every rank at
once, each on its own per-rank batch, so it shares the cores as the distributed systems do.
benchmarks/ runs the same systems as pytest-benchmark cases through ``follow_rank0``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/bench.py` from a checkout that is not installed
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from conformance.models import Block, GPTConfig, TinyLM  # noqa: E402
from fsdp_lite.demo import storage_nbytes  # noqa: E402
from fsdp_lite.engine import collectives  # noqa: E402
from fsdp_lite.engine.unit import unit_owners  # noqa: E402
from fsdp_lite.tools.launch import leave_together  # noqa: E402

MiB = 1024**2
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=300)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
REFERENCE = "torch_fsdp2"  # the "x FSDP2" column
# FULL_SHARD with the backend's own all-gather and reduce-scatter, where fsdp_lite would send rows
COLLECTIVES_VARIANT = "fsdp_lite/FULL_SHARD/collectives"
# FULL_SHARD without the collective-order check (fsdp_lite/tools/order.py): what the check costs
NO_ORDER_CHECK = "fsdp_lite/FULL_SHARD/no_order_check"
# fsdp_lite's FSDP2 front, fully_shard per block and root: the same calls as torch_fsdp2's
LITE_FSDP2 = "fsdp_lite/fully_shard"
# The canonical reduction mode of each front (fsdp_lite.Canonical, docs/invariance.md)
CANONICAL = "fsdp_lite/FULL_SHARD/canonical"
CANONICAL_FSDP2 = "fsdp_lite/fully_shard/canonical"
FLOOR = "single"
# --baseline REF: fsdp_lite as of git REF, imported under this name (export_baseline)
BASELINE_PACKAGE = "fsdp_lite_baseline"

# ---- the systems ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    name: str  # what --systems selects and the table shows
    kind: str  # "single" | "ddp" | "fsdp1" | "fsdp2" | "lite" | "lite_fsdp2" | "deepspeed"
    strategy: str | None = None  # a ShardingStrategy member name for fsdp1 / lite; a ZeRO stage
    # Collectives per step in units of psi*(N-1)/N (all-gathers, reduce-scatters, all-reduces).
    theory: tuple[int, int, int] = (0, 0, 0)
    replicas: int = 1  # HYBRID_SHARD: the shard group is world_size / replicas ranks
    # On gloo fsdp_lite all-gathers and reduce-scatters by sending rows directly, where that is
    # faster (collectives.Transport.choose); True sets collectives.BACKEND on every unit, the backend's
    # own collectives, to measure both on one machine.
    backend_collectives: bool = False
    # fsdp_lite logs each collective and compares the ranks' logs when a wait stalls
    # (fsdp_lite/tools/order.py); False turns that off, to measure what it costs.
    order_check: bool = True
    # deepspeed: ZeRO-3's memory_efficient_linear (None: DeepSpeed's default, True)
    memory_efficient_linear: bool | None = None
    # lite, lite_fsdp2: the package to build with; BASELINE_PACKAGE is another commit's fsdp_lite
    # (--baseline), so that two versions train side by side in one run.
    package: str = "fsdp_lite"
    # fsdp_lite.Canonical with V = N (one micro-batch per rank, as the others): the
    # world-size-invariant reduction, to measure what it costs beside the default mode
    canonical: bool = False
    # "adamw" (AdamW on every parameter) or "muon": Muon on the 2-D weights but the embeddings
    # (fsdp_lite.Muon for fsdp_lite, torch.optim.Muon for torch), AdamW on the rest, as the
    # conformance suite's muon axis (conformance/training.py)
    optimizer: str = "adamw"


# Muon beside AdamW (docs/muon.md, "Cost beside AdamW and torch FSDP2"): fsdp_lite.Muon on both
# fronts, torch.optim.Muon on torch FSDP2's shards (runs, but is not Muon's math: docs/muon.md).
MUON_SYSTEMS = (
    SystemSpec("fsdp_lite/FULL_SHARD/muon", "lite", "FULL_SHARD", (2, 1, 0), optimizer="muon"),
    SystemSpec(f"{LITE_FSDP2}/muon", "lite_fsdp2", theory=(2, 1, 0), optimizer="muon"),
    SystemSpec(f"{REFERENCE}/muon", "fsdp2", theory=(2, 1, 0), optimizer="muon"),
)

# DeepSpeed ZeRO stages, when deepspeed is installed (the "deepspeed" extra). ZeRO-1 and -2
# reduce-scatter gradients and all-gather the stepped params (2 psi, arXiv 1910.02054); ZeRO-3
# all-gathers again in backward.
DEEPSPEED_SYSTEMS = (
    SystemSpec("deepspeed/ZeRO-0", "deepspeed", "0", (0, 0, 1)),
    SystemSpec("deepspeed/ZeRO-1", "deepspeed", "1", (1, 1, 0)),
    SystemSpec("deepspeed/ZeRO-2", "deepspeed", "2", (1, 1, 0)),
    SystemSpec("deepspeed/ZeRO-3", "deepspeed", "3", (2, 1, 0)),
    SystemSpec(
        "deepspeed/ZeRO-3/torch_linear", "deepspeed", "3", (2, 1, 0), memory_efficient_linear=False
    ),
)


def all_systems(world_size: int, baseline: bool = False) -> tuple[list[SystemSpec], dict[str, str]]:
    """The systems this world size and this fsdp_lite can run, and why any others are left out;
    with ``baseline``, also ``baseline/...``: the fsdp_lite systems of ``--baseline REF``."""
    import fsdp_lite

    left_out = {}
    specs = [
        SystemSpec(FLOOR, "single"),
        SystemSpec("ddp", "ddp", theory=(0, 0, 1)),
        SystemSpec("torch_fsdp1/FULL_SHARD", "fsdp1", "FULL_SHARD", (2, 1, 0)),
        SystemSpec("torch_fsdp1/SHARD_GRAD_OP", "fsdp1", "SHARD_GRAD_OP", (1, 1, 0)),
        SystemSpec(REFERENCE, "fsdp2", theory=(2, 1, 0)),
        SystemSpec("fsdp_lite/FULL_SHARD", "lite", "FULL_SHARD", (2, 1, 0)),
        SystemSpec(LITE_FSDP2, "lite_fsdp2", theory=(2, 1, 0)),
        SystemSpec(COLLECTIVES_VARIANT, "lite", "FULL_SHARD", (2, 1, 0), backend_collectives=True),
        SystemSpec(NO_ORDER_CHECK, "lite", "FULL_SHARD", (2, 1, 0), order_check=False),
        SystemSpec("fsdp_lite/SHARD_GRAD_OP", "lite", "SHARD_GRAD_OP", (1, 1, 0)),
        SystemSpec("fsdp_lite/NO_SHARD", "lite", "NO_SHARD", (0, 0, 1)),
        *MUON_SYSTEMS,
    ]
    if world_size & (world_size - 1) == 0:  # Canonical's V = N must be a power of two
        specs += [
            SystemSpec(CANONICAL, "lite", "FULL_SHARD", (2, 1, 0), canonical=True),
            SystemSpec(CANONICAL_FSDP2, "lite_fsdp2", theory=(2, 1, 0), canonical=True),
        ]
    else:
        left_out[CANONICAL] = left_out[CANONICAL_FSDP2] = (
            f"world size {world_size}: the canonical mode needs a power of two"
        )
    # fsdp_lite's ZeRO-1 all-reduces grads (every rank keeps them whole), then all-gathers the
    # stepped params: 3 psi, where the paper's ZeRO-1 reduce-scatters (2 psi); docs/zero1.md.
    if hasattr(fsdp_lite.ShardingStrategy, "SHARD_OPTIM"):
        specs.append(SystemSpec("fsdp_lite/SHARD_OPTIM", "lite", "SHARD_OPTIM", (1, 0, 1)))
    else:
        left_out["fsdp_lite/SHARD_OPTIM"] = "this fsdp_lite has no ShardingStrategy.SHARD_OPTIM"
    if world_size >= 4 and world_size % 2 == 0:
        specs.append(SystemSpec("fsdp_lite/HYBRID_SHARD", "lite", "HYBRID_SHARD", (2, 1, 0), 2))
    else:
        left_out["fsdp_lite/HYBRID_SHARD"] = (
            f"world size {world_size}: needs 2 replicas of at least 2 shards (an even world size >= 4)"
        )
    if baseline:
        specs += [
            dataclasses.replace(s, name=f"baseline/{s.name}", package=BASELINE_PACKAGE)
            for s in specs
            if s.kind in ("lite", "lite_fsdp2")
            and not s.backend_collectives
            and s.order_check
            and not s.canonical
            and s.optimizer == "adamw"
        ]
    if importlib.util.find_spec("deepspeed") is not None:
        specs += DEEPSPEED_SYSTEMS
    else:
        for spec in DEEPSPEED_SYSTEMS:
            left_out[spec.name] = "deepspeed is not installed (pip install '.[deepspeed]')"
    return specs, left_out


# bf16 keeps the systems whose comparison matters most, so the default run fits in 10 minutes.
DEFAULT_BF16 = (
    FLOOR,
    "ddp",
    REFERENCE,
    "fsdp_lite/FULL_SHARD",
    LITE_FSDP2,
    "fsdp_lite/SHARD_GRAD_OP",
)


@dataclasses.dataclass
class System:
    spec: SystemSpec
    model: nn.Module
    optim: torch.optim.Optimizer
    autocast: bool  # bf16 by torch.autocast (single, DDP) rather than by sharded mixed precision
    # deepspeed: the torch.nn.functional.linear its engine runs with (see deepspeed_linear)
    ds_linear: object = None
    # Muon systems: the Muon inside ``optim`` (a MatricesAndRest of Muon and AdamW)
    muon: torch.optim.Optimizer | None = None
    optim_seconds: list = dataclasses.field(default_factory=list)  # each optimizer step's time
    # Set to {} to count the c10d collectives of the next optimizer steps (CommDebugMode) into it
    optim_collectives: dict | None = None


def build_model(cfg: GPTConfig, seed: int) -> TinyLM:
    torch.manual_seed(seed)  # the same weights for every system, round and rank
    return TinyLM(cfg)


def build_system(
    spec: SystemSpec, precision: str, cfg: GPTConfig, seed: int, lr: float = 1e-3
) -> System:
    """Wrap a fresh seeded model as ``spec`` says: one unit per Block plus the root."""
    model = build_model(cfg, seed)
    dtype = PRECISIONS[precision]
    autocast = dtype is not None and spec.kind in ("single", "ddp")
    if spec.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif spec.kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
        from torch.distributed.fsdp import MixedPrecision as MixedPrecision1
        from torch.distributed.fsdp import ShardingStrategy as ShardingStrategy1
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as ModuleWrapPolicy1

        model = FSDP1(
            model,
            sharding_strategy=ShardingStrategy1[spec.strategy],
            auto_wrap_policy=ModuleWrapPolicy1({Block}),
            device_id=torch.device("cpu"),  # FSDP1 looks for an accelerator unless told
            mixed_precision=MixedPrecision1(param_dtype=dtype, reduce_dtype=torch.float32)
            if dtype
            else None,
        )
    elif spec.kind in ("fsdp2", "lite_fsdp2"):
        import torch.distributed.fsdp as torch_fsdp

        api = torch_fsdp if spec.kind == "fsdp2" else importlib.import_module(spec.package)
        mp_policy = api.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in model.blocks:
            api.fully_shard(block, mp_policy=mp_policy)
        api.fully_shard(model, mp_policy=mp_policy)
    elif spec.kind == "lite":
        fsdp_lite = importlib.import_module(spec.package)
        ModuleWrapPolicy = importlib.import_module(f"{spec.package}.wrap").ModuleWrapPolicy  # noqa: N806

        kwargs = {}
        if spec.strategy == "HYBRID_SHARD":
            from torch.distributed.device_mesh import init_device_mesh

            world_size = dist.get_world_size()
            kwargs["device_mesh"] = init_device_mesh(
                "cpu",
                (spec.replicas, world_size // spec.replicas),
                mesh_dim_names=("replicate", "shard"),
            )
        model = fsdp_lite.FullyShardedDataParallel(
            model,
            sharding_strategy=fsdp_lite.ShardingStrategy[spec.strategy],
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            mixed_precision=fsdp_lite.MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
            if dtype
            else None,
            **kwargs,
        )
    if spec.kind == "deepspeed":
        return build_deepspeed_system(spec, model, dtype, lr)
    if spec.backend_collectives:  # the /collectives variant: the backend's own collectives
        for owner in unit_owners(model):
            owner._unit.transport = collectives.BACKEND
    if not spec.order_check:
        importlib.import_module(spec.package).set_collective_order_check(model, False)
    if spec.canonical:
        importlib.import_module(spec.package).Canonical(
            model, virtual_batches=dist.get_world_size()
        )
    if spec.optimizer == "muon":
        return muon_system(spec, model, lr, autocast)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    return System(spec, model, optim, autocast)


def muon_system(spec: SystemSpec, model: nn.Module, lr: float, autocast: bool) -> System:
    """Muon on the 2-D weights but the embeddings (lr 0.02, match_rms_adamw, as
    scripts/bench_muon.py), AdamW (``lr``) on the rest, stepped as one optimizer."""
    from conformance.adapters.base import clean_name
    from conformance.training import MatricesAndRest, matrix_names

    if spec.kind == "fsdp2":
        muon_cls = torch.optim.Muon
    else:
        muon_cls = importlib.import_module(spec.package).Muon
    names = matrix_names(model)
    named = [(clean_name(n), p) for n, p in model.named_parameters()]
    matrices = [p for n, p in named if n in names]
    muon = muon_cls(matrices, lr=0.02, adjust_lr_fn="match_rms_adamw")
    rest = torch.optim.AdamW([p for n, p in named if n not in names], lr=lr)
    return System(spec, model, MatricesAndRest(muon, rest), autocast, muon=muon)


def build_deepspeed_system(
    spec: SystemSpec, model: nn.Module, dtype: torch.dtype | None, lr: float
) -> System:
    """``deepspeed.initialize`` at ZeRO stage ``spec.strategy``, torch's AdamW as the client
    optimizer (no JIT-built op), DeepSpeed's defaults otherwise but for gradient clipping (off, as
    for every other system here)."""
    import deepspeed

    # DeepSpeed insists on LOCAL_RANK, which torchrun sets and these spawned ranks (one host) lack.
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    zero = {"stage": int(spec.strategy)}
    if spec.memory_efficient_linear is not None:
        zero["memory_efficient_linear"] = spec.memory_efficient_linear
    config = {
        "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: the batches are fed here
        "zero_optimization": zero,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    if dtype is not None:
        config["bf16"] = {"enabled": True}  # bf16 params, fp32 master and gradient accumulation
    torch_linear = F.linear
    try:
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=list(model.parameters()),
            optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
            config=config,
            dist_init_required=False,
        )
        ds_linear = F.linear
    finally:
        # ZeRO-3 replaces F.linear for the whole process: the other systems keep torch's.
        F.linear = torch_linear
    # The torch AdamW inside DeepSpeed's wrapper (over ZeRO's flat partitions, if any): what
    # MemTracker and state_nbytes can read. The engine steps through its wrapper.
    return System(spec, engine, engine.basic_optimizer, autocast=False, ds_linear=ds_linear)


@contextlib.contextmanager
def deepspeed_linear(system: System):
    """Run with the F.linear DeepSpeed chose (ZeRO-3: memory_efficient_linear), then torch's."""
    torch_linear = F.linear
    F.linear = system.ds_linear
    try:
        yield
    finally:
        F.linear = torch_linear


def make_batch(
    cfg: GPTConfig, batch: int, seed: int, step: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) for ``step``: random tokens, the same for every system."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(system: System, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """One forward, backward and AdamW step; returns the loss."""
    if system.spec.kind == "deepspeed":  # the engine owns backward and the step
        with deepspeed_linear(system):
            logits = system.model(inputs)  # (batch, seq_len, vocab_size)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            system.model.backward(loss)
        system.model.step()  # steps and zeroes the gradients
        return loss.item()
    system.optim.zero_grad(set_to_none=True)
    cast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if system.autocast else contextlib.nullcontext()
    )
    with cast:
        logits = system.model(inputs)  # (batch, seq_len, vocab_size)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    if system.optim_collectives is None:
        start = time.perf_counter()
        system.optim.step()
        system.optim_seconds.append(time.perf_counter() - start)
    else:
        from scripts.bench_muon import counted_step

        seconds, counts = counted_step(system.optim)
        system.optim_seconds.append(seconds)
        for op, n in counts.items():
            system.optim_collectives[op] = system.optim_collectives.get(op, 0) + n
    return loss.item()


# ---- what a rank measures ------------------------------------------------------------------------

_COLLECTIVE_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "alltoall_base_": "all_to_all",
    "broadcast_": "broadcast",
    "send": "send",  # point to point: every byte of the tensor leaves this rank
}


def _tensors(arg) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, list | tuple):
        return [t for a in arg for t in _tensors(a)]
    return []


class CountCollectives(TorchDispatchMode):
    """Counts the bytes of every c10d collective issued inside the block, by whoever issues it.

    DDP's reducer, FSDP1, FSDP2 and fsdp_lite all reach gloo through the c10d ops of the dispatcher,
    so one counter serves every system. Each collective adds its ring volume for this rank:
    (g-1)/g of the full buffer (the all-gather output, the reduce-scatter input), twice that for an
    all-reduce, g being the size of the collective's group.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sent_nbytes: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _COLLECTIVE_KINDS.get(func._opname, "other") if func.namespace == "c10d" else None
        # A receive sends nothing; its bytes are counted as the peer's send.
        if kind is not None and func._opname not in ("barrier", "recv_", "recv_any_source_"):
            group_size = next(_group_size(a) for a in args if _is_process_group(a))
            # The full buffer: the output of an all-gather, the input of a reduce-scatter.
            # An all-to-all's input: (g-1)/g of it leaves this rank.
            buffer = args[1] if kind in ("reduce_scatter", "all_to_all") else args[0]
            nbytes = sum(t.numel() * t.element_size() for t in _tensors(buffer))
            factor = (2 if kind == "all_reduce" else 1) * (group_size - 1) / group_size
            if kind == "send":
                factor = 1.0
            self.sent_nbytes[kind] = self.sent_nbytes.get(kind, 0.0) + nbytes * factor
            self.calls[kind] = self.calls.get(kind, 0) + 1
        return func(*args, **(kwargs or {}))


def _is_process_group(arg) -> bool:
    # c10d ops take the group as a TorchScript object, not as the Python ProcessGroup.
    return (
        isinstance(arg, torch.ScriptObject)
        and arg._type().qualified_name() == "__torch__.torch.classes.c10d.ProcessGroup"
    )


def _group_size(arg) -> int:
    return dist.ProcessGroup.unbox(arg).size()


def trace_sent_nbytes(records, group_sizes: dict[str, int]) -> dict[str, float]:
    """Ring volume per kind from fsdp_lite.trace records, which hold this rank's input numel."""
    sent: dict[str, float] = {}
    for r in records:
        group_size = group_sizes[r.kind]
        ring = (group_size - 1) / group_size
        if r.kind == "all_gather":  # the output is group_size inputs
            nbytes = r.nbytes * group_size * ring
        else:
            nbytes = r.nbytes * (2 if r.kind == "all_reduce" else 1) * ring
        sent[r.kind] = sent.get(r.kind, 0.0) + nbytes
    return sent


def state_nbytes(system: System) -> dict[str, int]:
    """Bytes of the storages behind params, grads and optimizer state on this rank, padding included."""
    params = list(system.model.parameters())
    optim = system.optim
    if system.spec.kind == "deepspeed":
        # ZeRO-3 keeps each rank's partition in ds_tensor (the parameter itself is empty); the
        # torch optimizer steps fp32 masters of its own (ZeRO's flat partitions), counted as
        # params. DeepSpeed's gradient buffers are its own and are not counted.
        params = [getattr(p, "ds_tensor", p) for p in params]
        params += [p for group in optim.param_groups for p in group["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    optim_state = [
        t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    counted = {
        "params": storage_nbytes(params),
        "grads": storage_nbytes(grads),
        "optim": storage_nbytes(optim_state),
    }
    counted["total"] = sum(counted.values())
    return counted


def tracked_peak_nbytes(system: System, batches: list) -> dict[str, int]:
    """Peak of what torch's MemTracker sees over the last of ``batches``, after one step to settle:
    ``Total``, and MemTracker's own split of its peak snapshot (Parameter, Gradient, Optstate,
    Activation, Temp, ...)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(system.model, *getattr(system.optim, "optimizers", [system.optim]))
    with tracker:
        for i, (inputs, targets) in enumerate(batches):
            if i == len(batches) - 1:
                tracker.reset_mod_stats()
            train_step(system, inputs, targets)
    split: dict[str, int] = {}
    for device, per_device in tracker.get_tracker_snapshot("peak").items():
        if torch.device(device).type == "meta":  # shapes only: no memory behind them
            continue
        for kind, nbytes in per_device.items():
            name = kind if isinstance(kind, str) else kind.value
            split[name] = split.get(name, 0) + int(nbytes)
    return split


def run_system(spec: SystemSpec, precision: str, args, cfg: GPTConfig, measure: bool) -> dict:
    """Train one system from the seed for warm-up + timed steps on this rank; return what it saw."""
    rank = dist.get_rank()
    system = build_system(spec, precision, cfg, args.seed)
    seconds, losses, optim_seconds = [], [], []
    timed = math.ceil(args.steps / args.rounds)
    for step in range(args.warmup + timed):
        inputs, targets = make_batch(cfg, args.batch, args.seed, step, rank)
        start = time.perf_counter()
        loss = train_step(system, inputs, targets)
        if step >= args.warmup:
            seconds.append(time.perf_counter() - start)
            losses.append(loss)
            optim_seconds.append(system.optim_seconds[-1] if system.optim_seconds else 0.0)
    out = {"seconds": seconds, "losses": losses, "optim_seconds": optim_seconds}
    if measure:
        out.update(measure_system(system, args, cfg, args.warmup + timed))
    del system
    dist.barrier()  # the next system starts on every rank together
    return out


def run_interleaved(names: list[str], specs: dict, precision: str, args, cfg: GPTConfig) -> dict:
    """All ``names`` built at once and stepped in turn, step by step, so that a change in machine
    load falls on every system alike; a barrier lines the ranks up before each timed step."""
    rank = dist.get_rank()
    systems = [build_system(specs[name], precision, cfg, args.seed) for name in names]
    outs = {name: {"seconds": [], "losses": [], "optim_seconds": []} for name in names}
    for step in range(args.warmup + args.steps):
        inputs, targets = make_batch(cfg, args.batch, args.seed, step, rank)
        turn = step % len(systems)  # who goes first rotates, so no system always follows another
        for name, system in zip(names[turn:] + names[:turn], systems[turn:] + systems[:turn]):
            dist.barrier()
            start = time.perf_counter()
            loss = train_step(system, inputs, targets)
            if step >= args.warmup:
                outs[name]["seconds"].append(time.perf_counter() - start)
                outs[name]["losses"].append(loss)
                last = system.optim_seconds[-1] if system.optim_seconds else 0.0
                outs[name]["optim_seconds"].append(last)  # 0: DeepSpeed steps inside its engine
        if rank == 0:
            label = "warm-up" if step < args.warmup else "timed"
            say(f"  {precision} step {step + 1}/{args.warmup + args.steps} ({label}) done")
    for name, system in zip(names, systems):
        outs[name].update(measure_system(system, args, cfg, args.warmup + args.steps))
    del systems
    dist.barrier()
    return outs


def measure_system(system: System, args, cfg: GPTConfig, next_step: int) -> dict:
    """State bytes now, sent bytes over one more step, tracked peak over two more."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    spec = system.spec
    out: dict = {"state_nbytes": state_nbytes(system)}  # after a step: grads are allocated
    batch = make_batch(cfg, args.batch, args.seed, next_step, rank)
    counter = CountCollectives()
    trace = contextlib.nullcontext()
    if spec.kind in ("lite", "lite_fsdp2"):
        from fsdp_lite.trace import record_collectives

        trace = record_collectives(system.model, system.muon)  # Muon: its exchanges too
    system.optim_collectives = {}
    with trace as records, counter:
        train_step(system, *batch)
    out["optim_collectives"], system.optim_collectives = system.optim_collectives, None
    out["sent_nbytes"] = counter.sent_nbytes
    out["collective_calls"] = counter.calls
    if records is not None and system.muon is not None:
        from scripts.bench_muon import exchange_row

        matrices = [p for group in system.muon.param_groups for p in group["params"]]
        out["muon_exchange"] = exchange_row(system.muon, matrices, records.records, 1, rank)
    if records is not None:
        # HYBRID_SHARD gathers and scatters in a shard group, all-reduces across replicas.
        shard_size = world_size // spec.replicas
        group_sizes = {"all_gather": shard_size, "reduce_scatter": shard_size}
        group_sizes["all_to_all"] = shard_size
        group_sizes["all_reduce"] = spec.replicas if spec.replicas > 1 else world_size
        sent = trace_sent_nbytes(records.records, group_sizes)
        # Done by sends on gloo (collectives.Transport): the same bytes, counted as sends.
        for kind in ("all_gather", "reduce_scatter"):
            if kind in sent and kind not in counter.sent_nbytes and "send" in counter.sent_nbytes:
                sent["send"] = sent.get("send", 0.0) + sent.pop(kind)
        out["trace_sent_nbytes"] = sent
    extra = [make_batch(cfg, args.batch, args.seed, 10_000 + i, rank) for i in range(2)]
    out["peak_tracked_split"] = tracked_peak_nbytes(system, extra)
    out["peak_tracked_nbytes"] = out["peak_tracked_split"]["Total"]
    return out


# ---- theory --------------------------------------------------------------------------------------


def model_numels(cfg: GPTConfig, world_size: int) -> dict[str, int]:
    """Psi (distinct params), Psi with each param's dim 0 padded to a multiple of world_size (the
    per-parameter sharding fsdp_lite and FSDP2 use), and the root unit's share (params outside
    every Block, which the root keeps from forward to backward instead of gathering them again)."""
    with torch.device("meta"):  # shapes only
        params = dict(TinyLM(cfg).named_parameters())
    padded = {
        name: math.ceil(p.shape[0] / world_size) * world_size * (p.numel() // p.shape[0])
        for name, p in params.items()
    }
    is_root = {name: not name.startswith("blocks.") for name in params}
    return {
        "params": len(params),
        "psi": sum(p.numel() for p in params.values()),
        "psi_padded": sum(padded.values()),
        "root": sum(p.numel() for n, p in params.items() if is_root[n]),
        "root_padded": sum(padded[n] for n in params if is_root[n]),
    }


def theory_nbytes(spec: SystemSpec, precision: str, cfg: GPTConfig, world_size: int) -> dict | None:
    """ZeRO's bytes per rank per step (3 psi (N-1)/N for ZeRO-3, 2 psi for ZeRO-2 and DDP), each
    collective in its own dtype: all-gathers in the param dtype, reductions in fp32 here.

    HYBRID_SHARD runs ZeRO-3 within a shard group of S = N / R ranks and all-reduces each 1/S
    gradient shard across the R replicas: 3 psi (S-1)/S + 2 (psi/S) (R-1)/R.
    """
    if spec.kind == "single":
        return None
    param_itemsize = 2 if precision == "bf16" and spec.kind != "ddp" else 4
    reduce_itemsize = 4
    replicas = spec.replicas
    shard_size = world_size // replicas
    numels = model_numels(cfg, shard_size)
    shard_ring = (shard_size - 1) / shard_size
    all_gathers, reduce_scatters, all_reduces = spec.theory
    # Bytes per element of psi that move in sharded form (padded) and whole (not padded).
    sharded = (all_gathers * param_itemsize + reduce_scatters * reduce_itemsize) * shard_ring
    sharded += 2 * reduce_itemsize / shard_size * (replicas - 1) / replicas
    whole = 2 * all_reduces * reduce_itemsize * (world_size - 1) / world_size
    # A root that keeps its params after forward skips its backward all-gather.
    root_kept = numels["root"] * param_itemsize * shard_ring if all_gathers == 2 else 0.0
    out = {
        "theory": (sharded + whole) * numels["psi"],
        "root_kept": root_kept,
        "padding": sharded * (numels["psi_padded"] - numels["psi"]),
        # fsdp_lite's reductions carry one fp32 "had a gradient" count per parameter (unit.py,
        # Note [Unused parameters]): (N - 1) of them per parameter leave each rank in a ring.
        "flags": 4 * numels["params"] * (world_size - 1)
        if spec.kind in ("lite", "lite_fsdp2")
        else 0,
    }
    return out


# ---- pytest-benchmark: rank 0 in pytest, the others follow its commands ----------------------------


def follow_rank0(rank: int, world_size: int, init_method: str, threads: int) -> None:
    """Body of a non-zero rank under benchmarks/: run what rank 0 broadcasts until it says stop.

    A command is ``(precision, system name, GPTConfig, batch, seed, num_steps)``; this rank builds
    that system and trains it ``num_steps`` steps beside rank 0, whose steps pytest-benchmark times.
    """
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=PROCESS_GROUP_TIMEOUT,
    )
    try:
        specs = {s.name: s for s in all_systems(world_size)[0]}
        while (command := broadcast_command(None)) is not None:
            precision, name, cfg, batch, seed, num_steps = command
            system = build_system(specs[name], precision, cfg, seed)
            for step in range(num_steps):
                train_step(system, *make_batch(cfg, batch, seed, step, rank))
            del system
            dist.barrier()
        leave_together()  # after rank 0's stop (benchmarks/conftest.py)
    finally:
        dist.destroy_process_group()


def broadcast_command(command: tuple | None) -> tuple | None:
    """Rank 0's command (None: stop) on every rank."""
    box = [command]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- one rank ------------------------------------------------------------------------------------


def run_rank(rank: int, args: argparse.Namespace, init_method: str, plan: list) -> None:
    if args.baseline_dir:
        sys.path.insert(0, args.baseline_dir)
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=args.world_size,
        timeout=PROCESS_GROUP_TIMEOUT,
    )
    try:
        cfg = model_config(args)
        specs = {s.name: s for s in all_systems(args.world_size, bool(args.baseline_dir))[0]}
        raw: dict[tuple[str, str], list[dict]] = {}
        started = time.perf_counter()
        if args.interleave:
            for i, precision in enumerate(dict.fromkeys(p for p, _ in plan)):
                names = [n for p, n in plan if p == precision]
                outs = run_interleaved(names, specs, precision, args, cfg)
                for name in names:
                    everyone = [None] * args.world_size
                    dist.all_gather_object(everyone, outs[name])
                    raw[(precision, name)] = [everyone]
                if rank == 0:
                    say(
                        f"[{i + 1}] {precision}: {len(names)} systems interleaved, "
                        f"{args.steps} steps each ({time.perf_counter() - started:.0f} s elapsed)"
                    )
        else:
            runs = [
                (r, item)
                for r in range(args.rounds)
                for item in (plan if r % 2 == 0 else list(reversed(plan)))
            ]
            for i, (r, (precision, name)) in enumerate(runs):
                out = run_system(specs[name], precision, args, cfg, measure=(r == 0))
                everyone = [None] * args.world_size
                dist.all_gather_object(everyone, out)
                raw.setdefault((precision, name), []).append(everyone)
                if rank == 0:
                    step_s = [max(ts) for ts in zip(*(o["seconds"] for o in everyone))]
                    say(
                        f"[{i + 1}/{len(runs)}] round {r + 1}/{args.rounds} {precision} {name:<26} "
                        f"median {statistics.median(step_s):.3f} s/step over {len(step_s)} steps "
                        f"({time.perf_counter() - started:.0f} s elapsed)"
                    )
        if rank == 0:
            report = summarize(raw, args, cfg, specs)
            say(format_table(report))
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
                say(f"wrote {args.json}")
            if args.plot:
                plot(report, args.plot)
        leave_together()
    finally:
        dist.destroy_process_group()


def export_baseline(ref: str) -> str:
    """fsdp_lite as of git ``ref``, exported into a new temporary directory as the package
    ``fsdp_lite_baseline`` (its own imports renamed), so that it imports beside today's."""
    import io
    import re
    import subprocess
    import tarfile

    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref, "fsdp_lite"],
        capture_output=True,
        check=True,
    ).stdout
    directory = Path(tempfile.mkdtemp(prefix="bench_baseline_"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    package = directory / BASELINE_PACKAGE
    (directory / "fsdp_lite").rename(package)
    for path in package.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\bfsdp_lite\b(?!::)", BASELINE_PACKAGE, text))
    return str(directory)


def say(line: str) -> None:
    print(line, flush=True)


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        d_ff=4 * args.d_model,
        tie_embeddings=False,
    )


# ---- the report ----------------------------------------------------------------------------------


def quantiles(values: list[float]) -> dict:
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {
        "median": median,
        "q1": q1,
        "q3": q3,
        "iqr": q3 - q1,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarize(raw: dict, args: argparse.Namespace, cfg: GPTConfig, specs: dict) -> dict:
    """Merge every rank's runs into one row per (precision, system), with ratios and targets."""
    world_size = args.world_size
    numels = model_numels(cfg, world_size)
    rows = []
    for (precision, name), rounds in raw.items():
        spec = specs[name]
        # One step's time is the slowest rank's: that is what training waits for.
        step_s = [max(ts) for everyone in rounds for ts in zip(*(o["seconds"] for o in everyone))]
        first = rounds[0]
        row = {
            "system": name,
            "precision": precision,
            "step_s": quantiles(step_s),
            "step_s_per_round": [
                statistics.median(max(ts) for ts in zip(*(o["seconds"] for o in e))) for e in rounds
            ],
            "final_loss_rank0": first[0]["losses"][-1],
            "peak_tracked_nbytes": [o["peak_tracked_nbytes"] for o in first],
            "peak_tracked_split_rank0": first[0]["peak_tracked_split"],
            "state_nbytes": [o["state_nbytes"] for o in first],
            "sent_nbytes": [o["sent_nbytes"] for o in first],
            "collective_calls": first[0]["collective_calls"],
            "optimizer": spec.optimizer,
            "optim_step_s": quantiles(
                [
                    max(ts)
                    for everyone in rounds
                    for ts in zip(*(o["optim_seconds"] for o in everyone))
                ]
            ),
            "optim_collectives_per_step": first[0]["optim_collectives"],
        }
        if "muon_exchange" in first[0]:
            row["muon_exchange"] = [o["muon_exchange"] for o in first]
        if "trace_sent_nbytes" in first[0]:
            row["trace_sent_nbytes"] = [o["trace_sent_nbytes"] for o in first]
        row["sent_nbytes_total"] = max(sum(s.values()) for s in row["sent_nbytes"])
        theory = theory_nbytes(spec, precision, cfg, world_size)
        if theory is not None:
            row["theory_nbytes"] = theory
            if theory["theory"]:  # at one rank nothing need move
                row["sent_vs_theory"] = row["sent_nbytes_total"] / theory["theory"]
        rows.append(row)
    by_key = {(r["precision"], r["system"]): r for r in rows}
    for row in rows:
        for label, ref in (("vs_fsdp2", REFERENCE), ("vs_floor", FLOOR), ("vs_ddp", "ddp")):
            other = by_key.get((row["precision"], ref))
            if other is not None:
                row[label] = row["step_s"]["median"] / other["step_s"]["median"]
        floor = by_key.get((row["precision"], FLOOR))
        if floor is not None:
            ideal = floor["state_nbytes"][0]["total"] / world_size
            row["ideal_state_nbytes"] = ideal
            row["state_vs_ideal"] = max(s["total"] for s in row["state_nbytes"]) / ideal
    return {
        "command": "python scripts/bench.py " + " ".join(shlex.quote(a) for a in args.argv),
        "config": {
            "world_size": world_size,
            "model": dataclasses.asdict(cfg),
            "params": numels["psi"],
            "params_padded": numels["psi_padded"],
            "batch_per_rank": args.batch,
            "steps": args.steps
            if args.interleave
            else args.rounds * math.ceil(args.steps / args.rounds),
            "warmup_per_round": args.warmup,
            "rounds": 1 if args.interleave else args.rounds,
            "interleaved": args.interleave,
            "optimizer": "AdamW lr 1e-3; /muon systems: Muon lr 0.02 (match_rms_adamw) on the 2-D "
            "weights but the embeddings, AdamW lr 1e-3 on the rest",
            "threads_per_rank": args.threads,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "definitions": {
            **DEFINITIONS,
            "step_s": DEFINITIONS["step_s"]
            + (
                "; --interleave: all systems of a precision built at once and stepped in turn, "
                "a barrier before each step"
                if args.interleave
                else ""
            ),
        },
        "left_out": args.left_out,
        "results": rows,
        "targets": targets(by_key),
    }


DEFINITIONS = {
    "step_s": "forward + backward + AdamW step (/muon: Muon on the 2-D weights but the "
    "embeddings, AdamW on the rest), per step the slowest rank, after warm-up; median, quartiles "
    "over all rounds",
    "optim_step_s": "the optimizer step alone, timed as step_s; optim_collectives_per_step: the "
    "c10d collectives torch's CommDebugMode sees in one optimizer step; muon_exchange: per rank, "
    "the bytes fsdp_lite.Muon hands its all_to_all exchanges in one step (fsdp_lite's trace) "
    "against docs/muon.md's formula 2 x (its elements of every matrix + the matrices it owns)",
    "single": "the unwrapped model on every rank at once, its per-rank batch, no communication",
    "bf16": "FSDP1 / fsdp_lite MixedPrecision(param_dtype=bf16, reduce_dtype=fp32), FSDP2 "
    "MixedPrecisionPolicy(the same); single and DDP: torch.autocast('cpu', bf16), fp32 params "
    "and fp32 all-reduce",
    "peak_tracked_nbytes": "per rank, torch.distributed._tools.mem_tracker.MemTracker peak over "
    "one step after one settling step (params, grads, optimizer state, activations, temporaries)",
    "state_nbytes": "per rank, storages behind params + grads + optimizer state after a step, "
    "padding included; ideal = the single process's total / world size",
    "sent_nbytes": "per rank per step, ring volume of every c10d collective (g-1)/g x buffer "
    "bytes, x2 for all-reduce; counted by a TorchDispatchMode in one extra step",
    "theory_nbytes": "ZeRO: 3 psi (N-1)/N (ZeRO-3), 2 psi (N-1)/N (ZeRO-2, DDP), 3 psi (N-1)/N "
    "(fsdp_lite's ZeRO-1: all-reduce + all-gather) in the communicated dtypes; root_kept: the "
    "root's backward all-gather that FSDP1, FSDP2 and fsdp_lite skip (they keep the root's params "
    "from forward); padding: what per-parameter dim-0 padding to a multiple of N adds; flags: "
    "fsdp_lite's one fp32 had-a-gradient count per parameter per reduction; send: on gloo "
    "fsdp_lite all-gathers and reduce-scatters by sending each row to its rank (faster there, "
    "the same bytes); the /collectives variant runs gloo's own all-gather and reduce-scatter",
}


def targets(by_key: dict) -> list[dict]:
    """The fp32 targets for fsdp_lite FULL_SHARD, each met or missed by how much."""
    lite = by_key.get(("fp32", "fsdp_lite/FULL_SHARD"))
    lite_coll = by_key.get(("fp32", COLLECTIVES_VARIANT))
    fsdp2 = by_key.get(("fp32", REFERENCE))
    ddp = by_key.get(("fp32", "ddp"))
    if lite is None:
        return []
    checks = []

    def check(name: str, value: float | None, limit: float | None) -> None:
        if value is None or limit is None:
            checks.append({"target": name, "status": "not measured (system not run)"})
            return
        met = value <= limit
        checks.append(
            {
                "target": name,
                "value": value,
                "limit": limit,
                "met": met,
                "status": "met"
                if met
                else f"missed by {100 * (value / limit - 1):.4g}% ({value - limit:.4g} over)",
            }
        )

    check(
        "median step <= 0.9 x torch_fsdp2",
        lite["step_s"]["median"],
        0.9 * fsdp2["step_s"]["median"] if fsdp2 else None,
    )
    check(
        "median step <= 1.1 x ddp",
        lite["step_s"]["median"],
        1.1 * ddp["step_s"]["median"] if ddp else None,
    )
    front = by_key.get(("fp32", LITE_FSDP2))
    check(
        f"{LITE_FSDP2} median step <= 0.9 x torch_fsdp2",
        front["step_s"]["median"] if front else None,
        0.9 * fsdp2["step_s"]["median"] if fsdp2 else None,
    )
    check(
        f"{LITE_FSDP2} peak tracked memory <= torch_fsdp2's",
        max(front["peak_tracked_nbytes"]) if front else None,
        max(fsdp2["peak_tracked_nbytes"]) if fsdp2 else None,
    )
    check("state bytes <= 1.01 x ideal", lite.get("state_vs_ideal"), 1.01)
    check(
        "peak tracked memory <= torch_fsdp2's",
        max(lite["peak_tracked_nbytes"]),
        max(fsdp2["peak_tracked_nbytes"]) if fsdp2 else None,
    )
    # Bytes against ZeRO-3's 3 psi, with gloo's collectives and with fsdp_lite's sends.
    for row, name in ((lite_coll, COLLECTIVES_VARIANT), (lite, "fsdp_lite/FULL_SHARD")):
        if row is None:
            check(f"{name} sent bytes <= theory", None, None)
            continue
        theory = row["theory_nbytes"]
        check(
            f"{name} sent bytes <= theory - root kept + padding + flags",
            row["sent_nbytes_total"],
            theory["theory"] - theory["root_kept"] + theory["padding"] + theory["flags"],
        )
    return checks


def format_table(report: dict) -> str:
    cfg = report["config"]
    columns = [
        ("system", "<", 26),
        ("prec", "<", 4),
        ("median s", ">", 8),
        ("IQR s", ">", 6),
        ("xFSDP2", ">", 6),
        ("xfloor", ">", 6),
        ("xDDP", ">", 5),
        ("peak MiB", ">", 8),
        ("state MiB", ">", 9),
        ("xideal", ">", 6),
        ("sent MiB", ">", 8),
        ("xtheory", ">", 7),
        ("loss r0", ">", 8),
    ]

    def row(cells: list[str]) -> str:
        return "  ".join(f"{c:{a}{w}}" for c, (_, a, w) in zip(cells, columns)).rstrip()

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    header = row([name for name, _, _ in columns])
    lines = [
        "",
        f"world size {cfg['world_size']}, {cfg['params']:,} params, batch {cfg['batch_per_rank']} x "
        f"{cfg['model']['seq_len']} per rank, {cfg['steps']} timed steps in {cfg['rounds']} round(s) "
        f"after {cfg['warmup_per_round']} warm-up, torch {cfg['torch']}, {cfg['threads_per_rank']} "
        "thread(s) per rank",
        header,
        "-" * len(header),
    ]
    for r in report["results"]:
        lines.append(
            row(
                [
                    r["system"],
                    r["precision"],
                    f"{r['step_s']['median']:.3f}",
                    f"{r['step_s']['iqr']:.3f}",
                    ratio(r.get("vs_fsdp2")),
                    ratio(r.get("vs_floor")),
                    ratio(r.get("vs_ddp")),
                    f"{max(r['peak_tracked_nbytes']) / MiB:.1f}",
                    f"{max(s['total'] for s in r['state_nbytes']) / MiB:.1f}",
                    ratio(r.get("state_vs_ideal")),
                    f"{r['sent_nbytes_total'] / MiB:.1f}",
                    ratio(r.get("sent_vs_theory")),
                    f"{r['final_loss_rank0']:.4f}",
                ]
            )
        )
    lines.append("")
    lines.append("optimizer step (median s; c10d collectives in one step; Muon: bytes per rank):")
    for r in report["results"]:
        line = (
            f"  {r['system']:<26} {r['precision']:<4} {r['optimizer']:<5} "
            f"{r['optim_step_s']['median']:.3f} s  {r['optim_collectives_per_step'] or '-'}"
        )
        for rank, ex in enumerate(r.get("muon_exchange", [])):
            line += (
                f"  r{rank} {ex['bytes_handed_to_all_to_all_per_step']:,.0f} "
                f"(formula {ex['formula_bytes']:,})"
            )
        lines.append(line)
    lines.append("")
    lines += [f"{k}: {v}" for k, v in report["definitions"].items()]
    for name, reason in report["left_out"].items():
        lines.append(f"left out: {name}: {reason}")
    if report["targets"]:
        lines.append("")
        lines.append("targets (fp32, fsdp_lite/FULL_SHARD):")
        for t in report["targets"]:
            lines.append(f"  {t['target']}: {t['status']}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Step time (median, IQR bars) and memory per system, one bar group per precision."""
    try:
        import matplotlib
    except ImportError:
        say(f"--plot {path}: matplotlib is not installed (pip install '.[plot]'); no chart written")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [f"{r['system']}\n{r['precision']}" for r in rows]
    fig, (ax_time, ax_mem) = plt.subplots(2, 1, figsize=(max(8, len(rows) * 0.9), 8))
    medians = [r["step_s"]["median"] for r in rows]
    errors = [
        [r["step_s"]["median"] - r["step_s"]["q1"] for r in rows],
        [r["step_s"]["q3"] - r["step_s"]["median"] for r in rows],
    ]
    colors = ["tab:orange" if r["system"].startswith("fsdp_lite") else "tab:blue" for r in rows]
    ax_time.bar(range(len(rows)), medians, yerr=errors, color=colors, capsize=3)
    ax_time.set_ylabel("s / step (median, IQR)")
    cfg = report["config"]
    ax_time.set_title(
        f"world size {cfg['world_size']}, {cfg['params'] / 1e6:.1f}M params, gloo on CPU"
    )
    width = 0.4
    x = range(len(rows))
    ax_mem.bar(
        [i - width / 2 for i in x],
        [max(r["peak_tracked_nbytes"]) / MiB for r in rows],
        width,
        label="peak tracked",
    )
    ax_mem.bar(
        [i + width / 2 for i in x],
        [max(s["total"] for s in r["state_nbytes"]) / MiB for r in rows],
        width,
        label="params+grads+AdamW",
    )
    ax_mem.set_ylabel("MiB per rank")
    ax_mem.legend()
    for ax in (ax_time, ax_mem):
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    say(f"wrote {path}")


# ---- command line and launch ---------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python scripts/bench.py", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add("--json", help="write the results as JSON to this path")
    add("--plot", help="write a PNG chart to this path (needs matplotlib, the 'plot' extra)")
    add("--world-size", type=int, default=2, help="ranks (default 2)")
    add(
        "--steps", type=int, default=20, help="timed steps per system, over all rounds (default 20)"
    )
    add(
        "--warmup", type=int, default=2, help="untimed steps before each round's timing (default 2)"
    )
    add(
        "--sequential",
        action="store_true",
        help="one system after another, in --rounds rounds, instead of all at once stepped in "
        "turn (holds one system in memory at a time; drift in machine load skews the ratios)",
    )
    add("--rounds", type=int, default=2, help="rounds over all systems with --sequential (2)")
    # The default since the interleaved schedule proved steadier; kept so old commands still run.
    add("--interleave", action="store_true", help=argparse.SUPPRESS)
    add("--layers", type=int, default=6, help="transformer blocks (default 6)")
    add("--d-model", type=int, default=384, help="model width (default 384)")
    add("--heads", type=int, default=6, help="attention heads (default 6)")
    add("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    add("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    add("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    add("--precision", default="fp32,bf16", help="comma list of fp32, bf16 (default both)")
    add("--systems", default="all", help="comma list of system names for every precision")
    add(
        "--bf16-systems",
        default=",".join(DEFAULT_BF16),
        help="systems run in bf16 ('all' for every one); default: a subset that keeps the run "
        "within 10 minutes",
    )
    add("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    add(
        "--baseline",
        metavar="REF",
        help="also the fsdp_lite systems of git REF (a commit of this repo), as baseline/..., "
        "built and stepped beside today's in the same run",
    )
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.sequential and args.interleave:
        parser.error("--sequential and --interleave exclude each other")
    args.interleave = not args.sequential
    for name in ("world_size", "steps", "rounds", "layers", "d_model", "heads", "vocab"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if args.sequential and math.ceil(args.steps / args.rounds) < 2:
        parser.error("need at least 2 timed steps per round: raise --steps or lower --rounds")
    args.baseline_dir = export_baseline(args.baseline) if args.baseline else None
    specs, args.left_out = all_systems(args.world_size, bool(args.baseline_dir))
    names = [s.name for s in specs]
    precisions = args.precision.split(",")
    for p in precisions:
        if p not in PRECISIONS:
            parser.error(f"--precision {p!r}: choose from {', '.join(PRECISIONS)}")
    wanted = names if args.systems == "all" else args.systems.split(",")
    bf16_wanted = names if args.bf16_systems == "all" else args.bf16_systems.split(",")
    for name in wanted + bf16_wanted:
        if name not in names and name not in args.left_out:
            parser.error(f"unknown system {name!r}: choose from {', '.join(names)}")
    args.plan = []
    for precision in precisions:
        for name in names:
            if name not in wanted:
                continue
            if precision == "bf16" and name not in bf16_wanted:
                args.left_out[f"{name} bf16"] = (
                    "not in --bf16-systems (trimmed so the default run fits 10 minutes)"
                )
                continue
            args.plan.append((precision, name))
    for name in wanted:
        if name in args.left_out and name not in names:
            parser.error(f"{name}: {args.left_out[name]}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    say(
        f"bench: {len(args.plan)} runs "
        + ("interleaved" if args.interleave else f"x {args.rounds} rounds")
        + f" on {args.world_size} ranks: "
        + ", ".join(f"{p} {n}" for p, n in args.plan)
    )
    for name, reason in args.left_out.items():
        say(f"left out: {name}: {reason}")
    return 1 if launch(args) else 0


def launch(args: argparse.Namespace) -> list[int]:
    """Run ``run_rank`` on ``args.world_size`` fresh processes; returns the ranks that failed."""
    ctx = multiprocessing.get_context("spawn")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{tmp}/rendezvous"
        procs = [
            ctx.Process(target=run_rank, args=(rank, args, init_method, args.plan))
            for rank in range(args.world_size)
        ]
        for p in procs:
            p.start()
        failed: list[int] = []
        try:
            while any(p.is_alive() for p in procs) and not failed:
                for rank, p in enumerate(procs):
                    p.join(timeout=0.2)
                    if p.exitcode not in (None, 0):
                        failed.append(rank)
        finally:
            for p in procs:
                if failed and p.is_alive():
                    p.kill()  # a peer died: this rank would wait in gloo until its timeout
                p.join()
        failed += [
            r for r, p in enumerate(procs) if p.exitcode not in (0, None) and r not in failed
        ]
        if failed:
            say(f"bench: rank(s) {failed} failed; their tracebacks are above")
        return failed


if __name__ == "__main__":
    sys.exit(main())
