"""FSDP2 semantics that torchtitan and torch's own tests rely on, each bitwise torch FSDP2's in the
same launch (runtime.py Note [Forward states], unit.py Note [Unsynced accumulation]).

- A ``fully_shard([norm, head])`` group whose head runs after the model's forward, once per
  sequence chunk with a backward each (torchtitan's default loss), with torchtitan's toggles
  (``set_reshard_after_forward/backward``, ``set_requires_gradient_sync(recurse=False)``,
  ``unshard()``, ``reshard()``): 1, 2 and 4 chunks, fp32 and bf16 params with fp32 reduction,
  with and without micro-batches accumulated, under activation checkpointing.
- Backwards without gradient sync under bf16 params and fp32 reduction: the FSDP2 front sums them
  in fp32 as torch FSDP2 does; the FSDP1 front's ``no_sync()`` in bf16 as native FSDP1 does.
- A step whose forward raises, caught by the loop: the next steps train as torch's do, with or
  without an explicit ``reset_iter_state()``.
- An int ``reshard_after_forward`` on a parent of sharded blocks (4 ranks).
- A ``channels_last`` conv weight, which torch refuses: trained as torch trains a contiguous copy.
- Dataclass, nested-dataclass and NamedTuple activations between units; a first forward inside
  ``torch.func.jvp`` (both found by torch's own mixed-precision tests, docs/fsdp2.md).
- ``set_reshard_after_backward(False)``: after each backward the module holds its unsharded params
  and their unreduced gradients, plain and tensor-parallel, with a zero-bubble schedule's split
  backward too; an optimizer step in between is gathered again (found by torch's own
  pending-gradient tests, docs/fsdp2.md).
- Post-accumulate-grad hooks on the sharded params run once the reduced gradient lands: an
  optimizer stepped from them trains as torch's (found by torch's own autograd tests).
- Gradient accumulation with sync off for the whole tree, the root alone or some units, kept
  unsharded or resharded between micro-batches, with CPU offload; HSDP with no sync or no
  all-reduce until the last micro-batch (4 ranks): the cases of torch's own
  ``test_gradient_accumulation``, whose collective counts need ``--backend-collectives``.
- ``model.to(torch.bfloat16)`` after ``fully_shard``, with and without a mixed-precision policy.
- A unit skipped by the synced backward after backwards without sync reduces its gradient there;
  under HSDP ``set_requires_gradient_sync(True)`` turns the all-reduce back on (4 ranks). Both
  silent differences found by torch's own pending-gradient tests, now fixed.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor

import fsdp_lite
from tests.ranks import run_checks, run_ranks

APIS = {"torch": torch_fsdp, "fsdp_lite": fsdp_lite}
VOCAB, DIM, SEQ = 50, 16, 8


class HeadApart(nn.Module):
    """Embedding, two blocks and a final norm; the head is applied by the caller (the issue's
    reproduction, torchtitan's ``_skip_lm_head``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.fail_in_block = -1  # a block whose forward raises (a step that fails)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for i, block in enumerate(self.blocks):
            if i == self.fail_in_block:
                raise ValueError("planted failure")
            h = torch.relu(block(h))
        return self.norm(h)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(
        0, VOCAB, (2, SEQ), generator=g
    )


def _head_apart(api, bf16: bool, checkpointed: bool = False) -> HeadApart:
    torch.manual_seed(0)
    model = HeadApart()
    kw = {}
    if bf16:
        kw["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for i, block in enumerate(model.blocks):
        if checkpointed:
            block = model.blocks[i] = checkpoint_wrapper(block)
        api.fully_shard(block, **kw)
    # As torchtitan groups them: not resharded after forward, the head runs right after.
    api.fully_shard([model.norm, model.head], reshard_after_forward=False, **kw)
    api.fully_shard(model, **kw)
    return model


def _chunked_step(model: HeadApart, x, y, chunks: int, sync: bool) -> None:
    """torchtitan's ChunkedLossWrapper: the head per chunk with its toggles, then the decoder."""
    model.set_requires_gradient_sync(sync)
    h = model(x)
    length = SEQ // chunks
    pieces = [c.detach().requires_grad_() for c in torch.split(h, length, dim=1)]
    head = model.head
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    grad = torch.zeros(h.shape, dtype=torch.float32)
    for c, piece in enumerate(pieces):
        if c == chunks - 1:
            head.set_requires_gradient_sync(sync, recurse=False)
        logits = head(piece).float()
        target = y[:, c * length : (c + 1) * length]
        (F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1)) / chunks).backward()
        grad[:, c * length : (c + 1) * length] = piece.grad
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    head.set_requires_gradient_sync(True, recurse=False)
    head.reshard()
    model.set_requires_gradient_sync(sync)
    h.backward(grad.to(h.dtype))


def _train_chunked(api, rank, chunks, bf16, micro_batches, checkpointed, steps=3):
    model = _head_apart(api, bf16, checkpointed)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record = []
    for step in range(steps):
        for micro in range(micro_batches):
            _chunked_step(model, *_batch(step, micro, rank), chunks, micro == micro_batches - 1)
        record.append(_step(model, optim))
    return record


def _step(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The step's whole gradients, then the parameters after the optimizer step."""
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
    optim.step()
    optim.zero_grad()
    return grads, {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


def _assert_bitwise(ours, theirs, what: str) -> None:
    for step, ((grads, params), (tgrads, tparams)) in enumerate(zip(ours, theirs)):
        for kind, mine, ref in (("grad", grads, tgrads), ("param", params, tparams)):
            assert mine.keys() == ref.keys(), what
            for name in ref:
                torch.testing.assert_close(
                    mine[name], ref[name], rtol=0, atol=0,
                    msg=lambda m, n=name, k=kind, s=step: f"{what} step {s} {k} {n}: {m}",
                )  # fmt: skip


CHUNKED = {
    f"{chunks}_chunks_{'bf16' if bf16 else 'fp32'}_{micro}_micro{'_ac' if ac else ''}": (
        chunks,
        bf16,
        micro,
        ac,
    )
    for chunks, bf16, micro, ac in [
        *((c, b, m, False) for c in (1, 2, 4) for b in (False, True) for m in (1, 2)),
        (2, False, 1, True),
        (2, True, 2, True),
    ]
}


def _check_chunked(rank: int, world_size: int, case: str) -> None:
    chunks, bf16, micro, ac = CHUNKED[case]
    runs = {name: _train_chunked(api, rank, chunks, bf16, micro, ac) for name, api in APIS.items()}
    _assert_bitwise(runs["fsdp_lite"], runs["torch"], case)


def _check_the_issues_reproduction(rank: int, world_size: int) -> None:
    """The issue's loop as written: the head per chunk, no toggles; 2 and 4 chunks."""

    def train(api, chunks):
        model = _head_apart(api, bf16=False)
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        record = []
        for step in range(3):
            x, y = _batch(step, 0, rank)
            h = model(x)
            hd = h.detach().requires_grad_()
            length = SEQ // chunks
            for c in range(chunks):
                part = slice(c * length, (c + 1) * length)
                logits = model.head(hd[:, part]).reshape(-1, VOCAB)
                (F.cross_entropy(logits, y[:, part].reshape(-1)) / chunks).backward()
            h.backward(hd.grad)
            record.append(_step(model, optim))
        return record

    for chunks in (2, 4):
        _assert_bitwise(train(fsdp_lite, chunks), train(torch_fsdp, chunks), f"{chunks} chunks")


def _check_unsynced_bf16_accumulation_fsdp2(rank: int, world_size: int) -> None:
    """Four micro-batches, three without gradient sync: torch FSDP2 sums them in fp32."""

    def train(api):
        model = _head_apart(api, bf16=True)
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        record = []
        for step in range(2):
            for micro in range(4):
                model.set_requires_gradient_sync(micro == 3)
                x, y = _batch(step, micro, rank)
                logits = model.head(model(x)).float()
                F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
            record.append(_step(model, optim))
        return record

    _assert_bitwise(train(fsdp_lite), train(torch_fsdp), "bf16 params, fp32 reduce, unsynced")


def _check_unsynced_bf16_accumulation_fsdp1(rank: int, world_size: int) -> None:
    """The FSDP1 front's no_sync() under MixedPrecision(bf16, fp32): native FSDP1's sums."""

    def train(fsdp_cls, mp_cls, extra):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.LayerNorm(DIM))
        model.append(nn.Linear(DIM, VOCAB))
        mp = mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        wrapped = fsdp_cls(model, mixed_precision=mp, use_orig_params=True, **extra)
        optim = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
        record = []
        for step in range(2):
            for micro in range(4):
                x, y = _batch(step, micro, rank)
                context = wrapped.no_sync() if micro < 3 else torch.enable_grad()
                with context:
                    logits = wrapped(x).float()
                    F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
            # Whole tensors: with use_orig_params a rank's local view may hold none of a param.
            with fsdp_cls.summon_full_params(wrapped, with_grads=True):
                grads = {n: p.grad.clone() for n, p in wrapped.named_parameters()}
            optim.step()
            optim.zero_grad()
            with fsdp_cls.summon_full_params(wrapped):
                record.append(
                    (grads, {n: p.detach().clone() for n, p in wrapped.named_parameters()})
                )
        return record

    native = train(
        torch_fsdp.FullyShardedDataParallel,
        torch_fsdp.MixedPrecision,
        {"device_id": torch.device("cpu")},
    )
    ours = train(fsdp_lite.FullyShardedDataParallel, fsdp_lite.MixedPrecision, {})
    # Native FSDP1's names keep its flat-parameter prefix in neither case with use_orig_params.
    _assert_bitwise(ours, native, "FSDP1 no_sync, bf16 params, fp32 reduce")


def _check_a_failed_forward_is_recovered(rank: int, world_size: int) -> None:
    """Step 2's forward raises in a block (after the next block's prefetch was issued); the loop
    catches it; steps 3 and 4 train as torch's, by themselves or after reset_iter_state()."""

    def train(api, explicit_reset):
        model = _head_apart(api, bf16=False)
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        record = []
        for step in range(4):
            x, y = _batch(step, 0, rank)
            model.fail_in_block = 1 if step == 1 else -1
            try:
                logits = model.head(model(x))
            except ValueError:
                if explicit_reset:
                    model.reset_iter_state()
                continue
            F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
            record.append(_step(model, optim))
        return record

    for explicit in (False, True):
        what = "after reset_iter_state()" if explicit else "by itself"
        _assert_bitwise(train(fsdp_lite, explicit), train(torch_fsdp, explicit), what)


def _check_channels_last_is_trained_as_a_contiguous_copy(rank: int, world_size: int) -> None:
    """torch refuses a non-contiguous (channels_last) parameter; fsdp_lite shards it as stored
    contiguous: the same training as torch FSDP2 on the contiguous model (docs/fsdp2.md)."""

    def train(api, memory_format):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(4, 6, 3), nn.ReLU(), nn.Conv2d(6, 2, 3))
        model = model.to(memory_format=memory_format)
        for conv in (model[0], model[2]):
            api.fully_shard(conv)
        api.fully_shard(model)
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        record = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            model(torch.randn(2, 4, 8, 8, generator=g)).square().mean().backward()
            record.append(_step(model, optim))
        return record

    with pytest.raises(NotImplementedError, match="non-contiguous parameters"):
        train(torch_fsdp, torch.channels_last)
    ours = train(fsdp_lite, torch.channels_last)
    _assert_bitwise(ours, train(torch_fsdp, torch.contiguous_format), "channels_last conv")


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Nested:
    inner: Pair
    z: torch.Tensor


class PairT(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def _wrap(kind: str, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None = None):
    if kind == "nested":
        return Nested(Pair(x, y), z)
    return Pair(x, y) if kind == "dataclass" else PairT(x, y)


def _parts(c) -> list[torch.Tensor]:
    return [c.inner.x, c.inner.y, c.z] if isinstance(c, Nested) else [c.x, c.y]


class ToStructure(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor):
        return _wrap(self.kind, x, x.clone(), x.clone())


class StructuredLinear(nn.Module):
    """A Linear applied to every tensor of the structure it gets; returns the same structure."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(DIM, DIM)

    def forward(self, c):
        parts = [self.lin(t) for t in _parts(c)]
        return _wrap(self.kind, *parts)


def _check_structured_activations(rank: int, world_size: int) -> None:
    """Dataclasses, nested dataclasses and NamedTuples of activations between sharded modules,
    fp32 and bf16 params / fp32 reduce: torch FSDP2 walks them for its backward hooks and casts
    (engine/structures.py); a dataclass was one opaque leaf here, its backward found no params."""

    def train(api, kind, bf16):
        torch.manual_seed(0)
        model = nn.Sequential(ToStructure(kind), StructuredLinear(kind), StructuredLinear(kind))
        mp = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )
        for block in (model[1], model[2]):
            api.fully_shard(block, mp_policy=mp)
        api.fully_shard(model, mp_policy=mp)
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        record = []
        for step in range(2):
            g = torch.Generator().manual_seed(10 * step + rank)
            sum(
                t.float().square().mean() for t in _parts(model(torch.randn(2, DIM, generator=g)))
            ).backward()
            record.append(_step(model, optim))
        return record

    for kind in ("dataclass", "nested", "namedtuple"):
        for bf16 in (False, True):
            what = f"{kind} activations, {'bf16/fp32' if bf16 else 'fp32'}"
            _assert_bitwise(train(fsdp_lite, kind, bf16), train(torch_fsdp, kind, bf16), what)


def _check_first_forward_inside_jvp(rank: int, world_size: int) -> None:
    """A unit's first forward (its all-gather) inside torch.func.jvp: torch FSDP2 sets the
    transforms aside around unshard and reshard; so does the unit (unit.py outside_functorch)."""

    def run(api, bf16):
        torch.manual_seed(0)
        lin = nn.Linear(DIM, 4, bias=False)
        mp = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
        api.fully_shard(lin, reshard_after_forward=not bf16, mp_policy=mp)
        dtype = torch.bfloat16 if bf16 else torch.float32
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(DIM, generator=g).to(dtype)
        primal, tangent = (
            torch.randn(4, generator=g).to(dtype),
            torch.randn(4, generator=g).to(dtype),
        )
        return torch.func.jvp(lambda unused: lin(x), (primal,), (tangent,))

    for bf16 in (False, True):
        ours, theirs = run(fsdp_lite, bf16), run(torch_fsdp, bf16)
        for mine, ref in zip(ours, theirs):
            torch.testing.assert_close(mine, ref, rtol=0, atol=0)


def _after_each_backward(model: nn.Module, x: torch.Tensor, backward) -> list:
    """Three backwards under ``set_reshard_after_backward(False)``, the first two without gradient
    sync: after each, what the module holds (type, shape) and its whole gradient; then, resharded,
    the reduced gradient."""
    model.set_reshard_after_backward(False)
    record = []
    for step in range(3):
        model.set_requires_gradient_sync(step == 2)
        model.set_is_last_backward(step == 2)
        backward(model, x * (step + 1))
        grad = model.weight.grad
        record.append(
            (type(model.weight).__name__, model.weight.shape, None if grad is None else _full(grad))
        )
    model.reshard()
    record.append(_full(model.weight.grad))
    return record


def _full_backward(model, x) -> None:
    model(x).sum().backward()


def _split_backward(model, x) -> None:
    """A zero-bubble pipeline schedule's backward: inputs' gradients first, weights' after."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    x = x.detach().requires_grad_(True)
    out = model(x)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
    stage_backward_weight(model.parameters(), groups)


def _check_unsharded_after_backward(rank: int, world_size: int) -> None:
    """``set_reshard_after_backward(False)``: torch FSDP2 leaves the module on its unsharded params,
    their ``.grad`` the unreduced sum so far; a zero-bubble schedule's weight backward finds the
    params its input backward saw. Plain and tensor-parallel (dp 1 x tp 2) parameters, found by
    torch's test_fully_shard_pending_grad.py (docs/fsdp2.md; unit.py Note [Unsharded after
    backward])."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh_2d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(rank))

    def run(api, tp, backward):
        torch.manual_seed(0)
        model = nn.Linear(DIM, DIM, bias=False)
        mesh = None
        if tp:
            model = parallelize_module(model, mesh_2d["tp"], ColwiseParallel())
            mesh = mesh_2d["dp"]
        api.fully_shard(model, mesh=mesh, reshard_after_forward=False)
        return _after_each_backward(model, x, backward)

    # (torch's stage_backward_input detaches the stage output in place, which a TP local view
    # refuses: split backward is for plain parameters only.)
    for tp, backward in ((False, _full_backward), (False, _split_backward), (True, _full_backward)):
        what = f"tp={tp}, {backward.__name__}"
        ours, theirs = run(fsdp_lite, tp, backward), run(torch_fsdp, tp, backward)
        assert len(ours) == len(theirs), what
        for i, (mine, ref) in enumerate(zip(ours, theirs)):
            if isinstance(ref, tuple):
                assert mine[:2] == ref[:2], f"{what}, backward {i}: {mine[:2]} != {ref[:2]}"
                mine, ref = mine[2], ref[2]
            assert (mine is None) == (ref is None), f"{what}, backward {i}: grad {mine}, {ref}"
            if ref is not None:
                torch.testing.assert_close(mine, ref, rtol=0, atol=0, msg=what)


def _check_stale_unsharded_copy_is_gathered_again(rank: int, world_size: int) -> None:
    """Kept unsharded after backward, then an optimizer step: fsdp_lite's next forward gathers
    the new shards (torch's would run on the stale copy; an extension, Note [Unsharded after
    backward])."""
    torch.manual_seed(0)
    model = nn.Linear(DIM, DIM)
    fsdp_lite.fully_shard(model, reshard_after_forward=False)
    model.set_reshard_after_backward(False)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    assert not isinstance(model.weight, DTensor)  # unsharded, as torch leaves it
    optim.step()
    optim.zero_grad()
    weight, bias = (_full(p.detach()) for p in optim.param_groups[0]["params"])
    torch.testing.assert_close(model(x), F.linear(x, weight, bias), rtol=0, atol=0)


def _check_post_accumulate_grad_hooks_run_on_sharded_params(rank: int, world_size: int) -> None:
    """torch FSDP2 runs a sharded parameter's post-accumulate-grad hooks once its reduced gradient
    lands: once per synced backward, none without sync; an optimizer stepped from the hook trains
    as torch's (found by torch's test_fully_shard_autograd.py, docs/fsdp2.md)."""

    def train(api):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM), nn.LayerNorm(DIM)
        )
        for module in (model[0], model[2], model):
            api.fully_shard(module)
        calls = {n: 0 for n, _ in model.named_parameters()}
        optims = {p: torch.optim.AdamW([p], lr=0.01, foreach=False) for p in model.parameters()}

        def hook(name, param):
            calls[name] += 1
            optims[param].step()
            optims[param].zero_grad()

        for name, param in model.named_parameters():
            param.register_post_accumulate_grad_hook(lambda p, n=name: hook(n, p))
        counts, params = [], []
        for step in range(2):
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1)
                g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                model(torch.randn(4, DIM, generator=g)).square().mean().backward()
                counts.append(dict(calls))
            params.append({n: _full(p.detach()).clone() for n, p in model.named_parameters()})
        return counts, params

    (ours, our_params), (theirs, their_params) = train(fsdp_lite), train(torch_fsdp)
    assert ours == theirs, f"hook calls: fsdp_lite {ours}, torch {theirs}"
    assert all(n == 2 for n in ours[-1].values()), ours[-1]
    for mine, ref in zip(our_params, their_params):
        for name in ref:
            torch.testing.assert_close(mine[name], ref[name], rtol=0, atol=0, msg=name)


def _check_all_gather_extension_is_refused(rank: int, world_size: int) -> None:
    """torch FSDP2 calls a shard's fsdp_pre/post_all_gather (float8's extension); fsdp_lite does
    not, so it refuses at the next all-gather, before the collective, rather than gather the plain
    data (torch's test_all_gather_extensions_monkey_patch pattern)."""
    linear = nn.Linear(DIM, DIM, bias=False)
    fsdp_lite.fully_shard(linear)
    local = linear.weight._local_tensor
    local.fsdp_pre_all_gather = lambda *args, **kwargs: ((local,), None)
    with pytest.raises(NotImplementedError, match="defines fsdp_pre_all_gather"):
        linear(torch.randn(2, DIM))
    linear.reset_iter_state()


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


# Which units skip gradient sync (and, where reshard_after_backward is False, stay unsharded)
# until the last micro-batch, the whole tree, the root alone or two of three blocks; then
# reshard_after_forward, reshard_after_backward, CPU offload. The cases torch's own
# test_gradient_accumulation (test_fully_shard_training.py) runs.
GRAD_ACC = {
    "all_units": ("all", True, True, False),
    "all_units_kept_unsharded": ("all", False, False, False),
    "root_only": ("root_only", True, True, False),
    "root_only_kept_unsharded": ("root_only", False, False, False),
    "some_units_reshard_2": ("some", 2, True, False),
    "all_units_cpu_offload": ("all", True, True, True),
}


def _train_accumulating(api, rank, case, mesh=None, all_reduce_only=False) -> list:
    """3 steps of 3 micro-batches, the first two without sync by ``case``; Adam, and
    ``zero_grad`` alternating ``set_to_none``. Each micro-batch's loss, then each step's gradients
    and parameters."""
    mode, reshard_after_forward, reshard_after_backward, offload = GRAD_ACC[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), _MLP(), _MLP(), _MLP())
    kw = {"reshard_after_forward": reshard_after_forward, "mesh": mesh}
    if offload:
        kw["offload_policy"] = api.CPUOffloadPolicy(pin_memory=False)
    for block in model[1:]:
        api.fully_shard(block, **kw)
    api.fully_shard(model, **kw)  # the root holds the first linear
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    targets = {"all": [model], "root_only": [model], "some": list(model[1:3])}[mode]
    recurse = mode != "root_only"
    g = torch.Generator().manual_seed(rank + 1)
    record = []
    for step in range(3):
        for micro in range(3):
            last = micro == 2
            for module in targets:
                if all_reduce_only:
                    module.set_requires_all_reduce(last, recurse=recurse)
                else:
                    module.set_requires_gradient_sync(last, recurse=recurse)
                if not reshard_after_backward:
                    module.set_reshard_after_backward(last, recurse=recurse)
            loss = model(torch.randn(2, DIM, generator=g)).sum()
            loss.backward()
            record.append(loss.detach())
        record += [_full(p.grad).clone() for p in model.parameters()]
        optim.step()
        optim.zero_grad(set_to_none=bool(step % 2))
        record += [_full(p.detach()).clone() for p in model.parameters()]
    return record


def _check_grad_accumulation(rank: int, world_size: int, case: str) -> None:
    """Gradient accumulation with sync toggled per unit, bitwise torch FSDP2's."""
    ours, theirs = (
        _train_accumulating(fsdp_lite, rank, case),
        _train_accumulating(torch_fsdp, rank, case),
    )
    assert len(ours) == len(theirs) == 3 * (3 + 2 * 14), (len(ours), len(theirs))
    for i, (mine, ref) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(mine, ref, rtol=0, atol=0, msg=f"{case}, record {i}")


def _check_dtype_conversion_after_fully_shard(rank: int, world_size: int) -> None:
    """``model.to(torch.bfloat16)`` after ``fully_shard``, before the first forward, with and
    without a mixed-precision policy (a frozen bias too): the sharded params, their gradients and
    3 AdamW steps are torch FSDP2's (what torch's test_fully_shard_conversion.py covers, most of
    which reads torch's private state)."""

    def train(api, mixed: bool) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))
        model[2].bias.requires_grad_(False)
        kw = {}
        if mixed:
            kw["mp_policy"] = api.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        api.fully_shard(model[0], **kw)
        api.fully_shard(model, **kw)
        model.to(torch.bfloat16)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        record = []
        for _ in range(3):
            out = model(torch.randn(2, DIM, generator=g).to(torch.bfloat16))
            out.sum().backward()
            record.append(out.detach())
            for p in model.parameters():
                record.append(torch.tensor(p.requires_grad))
                record.append(_full(p.grad).clone() if p.grad is not None else torch.tensor(-1))
            optim.step()
            optim.zero_grad()
            record += [_full(p.detach()).clone() for p in model.parameters()]
        return record

    for mixed in (False, True):
        ours, theirs = train(fsdp_lite, mixed), train(torch_fsdp, mixed)
        assert len(ours) == len(theirs) == 3 * (1 + 2 * 4 + 4), (len(ours), len(theirs))
        for i, (mine, ref) in enumerate(zip(ours, theirs)):
            assert mine.dtype == ref.dtype, f"mixed={mixed}, record {i}: {mine.dtype} {ref.dtype}"
            torch.testing.assert_close(mine, ref, rtol=0, atol=0, msg=f"mixed={mixed}, {i}")


class _TwoUnits(nn.Module):
    """Two sibling linears, each its own unit; the second used only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, use_second: bool = True) -> torch.Tensor:
        y = self.first(x)
        return y + self.second(x) if use_second else y


def _two_units(api, rank: int, reshard_after_backward: bool, mesh=None) -> _TwoUnits:
    torch.manual_seed(0)
    model = _TwoUnits()
    for module in (model.first, model.second):
        api.fully_shard(module, mesh=mesh, reshard_after_forward=False)
    api.fully_shard(model, mesh=mesh, reshard_after_forward=False)
    model.set_reshard_after_backward(reshard_after_backward)
    return model


def _grads(model: nn.Module) -> list:
    return [None if p.grad is None else _full(p.grad).clone() for p in model.parameters()]


def _assert_same_records(ours: list, theirs: list, what: str) -> None:
    assert len(ours) == len(theirs), what
    for i, (mine, ref) in enumerate(zip(ours, theirs)):
        assert len(mine) == len(ref), f"{what}, record {i}"
        for j, (a, b) in enumerate(zip(mine, ref)):
            assert (a is None) == (b is None), f"{what}, record {i}, param {j}: {a} vs {b}"
            if b is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{what}, {i}, {j}")


def _check_unsynced_grads_of_a_unit_the_synced_backward_skips(rank: int, world_size: int) -> None:
    """A unit that accumulated without sync and is not used by the next, synced, forward and
    backward: torch FSDP2's final callback reduces its gradient there, so the step after sees it. fsdp_lite
    reduced it only at a later backward that used the unit: the step in between read the
    gradient of before the accumulation, silently."""

    def run(api, reshard_after_backward: bool) -> list:
        model = _two_units(api, rank, reshard_after_backward)
        g = torch.Generator().manual_seed(rank)
        record = []
        for sync, use_second in ((True, True), (False, True), (True, False)):
            model.set_requires_gradient_sync(sync)
            model(torch.randn(2, DIM, generator=g), use_second).sum().backward()
            record.append(_grads(model))
        for module in (model, model.first, model.second):
            module.reshard()
        record.append(_grads(model))
        return record

    for reshard_after_backward in (True, False):
        _assert_same_records(
            run(fsdp_lite, reshard_after_backward),
            run(torch_fsdp, reshard_after_backward),
            f"reshard_after_backward={reshard_after_backward}",
        )


def _check_replicate_over_units_given_as_ignored_modules(rank: int, world_size: int) -> None:
    """torch's composable ``replicate`` over a root whose blocks are fsdp_lite units: torch's
    ``replicate`` finds its own ``fully_shard`` units in a registry fsdp_lite does not write
    (docs/fsdp2.md), so the user names ours in ``ignored_modules``; that trains bitwise torch's
    ``replicate`` over torch's units."""
    from torch.distributed._composable.replicate import replicate

    def train(api) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM), nn.Linear(DIM, 4)
        )
        api.fully_shard(model[0])
        api.fully_shard(model[2])
        replicate(model, ignored_modules=[model[0], model[2]] if api is fsdp_lite else None)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        record = []
        for _ in range(3):
            model(torch.randn(4, DIM, generator=g)).sum().backward()
            optim.step()
            optim.zero_grad()
            record.append([_full(p.detach()).clone() for p in model.parameters()])
        return record

    _assert_same_records(train(fsdp_lite), train(torch_fsdp), "replicate over units")


class _SomeUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused, self.rank0_only = (nn.Linear(DIM, DIM) for _ in range(3))

    def forward(self, x: torch.Tensor, rank: int, with_rank0_only: bool) -> torch.Tensor:
        y = self.used(x)
        return y + self.rank0_only(x) if with_rank0_only and rank == 0 else y


def _check_unused_params_under_set_reduce_scatter_unused_params(rank: int, world_size: int) -> None:
    """set_reduce_scatter_unused_params: True gives a parameter no rank used a zero gradient and
    reduces one that only rank 0 used with zeros from the others, as torch's; False (torch's
    default) leaves the unused one None. Only True lets ranks differ in torch."""

    def run(api, flag: bool, with_rank0_only: bool) -> list:
        torch.manual_seed(0)
        model = _SomeUnused()
        api.fully_shard(model.used)
        api.fully_shard(model)  # unused and rank0_only: the root's
        model.set_reduce_scatter_unused_params(flag)
        g = torch.Generator().manual_seed(rank)
        record = []
        for _ in range(2):
            model(torch.randn(2, DIM, generator=g), rank, with_rank0_only).sum().backward()
            record.append(_grads(model))
        return record

    for flag, with_rank0_only in ((True, True), (True, False), (False, False)):
        _assert_same_records(
            run(fsdp_lite, flag, with_rank0_only),
            run(torch_fsdp, flag, with_rank0_only),
            f"set_reduce_scatter_unused_params({flag}), rank0_only used: {with_rank0_only}",
        )


def _check_reductions_in_flight_under_set_reduce_scatter_max_input_buffers(
    rank: int, world_size: int
) -> None:
    """set_reduce_scatter_max_input_buffers(2): each unit's reduce-scatter is still in flight
    when the next one is issued and landed before the one after; by default it lands before the
    next is issued. Set on one unit only (recurse=False), the units share one pipeline whose
    depth is the largest any unit asks for (torch's resolution to the max). The gradients are
    the same bits every way, and torch's."""
    from fsdp_lite.trace import record_collectives

    def run(api, buffers: int | None, first_only: bool = False) -> tuple[list, list]:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(4)))
        for layer in model:
            api.fully_shard(layer)
        api.fully_shard(model)
        if first_only:
            model[0].set_reduce_scatter_max_input_buffers(buffers, recurse=False)
        elif buffers is not None:
            model.set_reduce_scatter_max_input_buffers(buffers)
        g = torch.Generator().manual_seed(rank)
        record, spans = [], []
        for _ in range(2):
            x = torch.randn(2, DIM, generator=g)
            if api is fsdp_lite:
                with record_collectives(model) as trace:
                    model(x).sum().backward()
                spans.append([r for r in trace.records if r.kind == "reduce_scatter"])
            else:
                model(x).sum().backward()
            record.append(_grads(model))
        return record, spans

    reference, _ = run(torch_fsdp, 2)
    for buffers, first_only in ((None, False), (2, False), (2, True)):
        record, spans = run(fsdp_lite, buffers, first_only)
        _assert_same_records(record, reference, f"max_input_buffers={buffers} {first_only=}")
        for rs in spans:
            assert len(rs) == 4, rs  # the root holds no parameters
            for i in range(len(rs) - 1):
                kept = rs[i].end > rs[i + 1].start
                assert kept == (buffers == 2), (buffers, i, rs)
                if i + 2 < len(rs):
                    assert rs[i].end <= rs[i + 2].start, (buffers, i, rs)


CHECKS = {
    "all_gather_extension_refused": _check_all_gather_extension_is_refused,
    "structured_activations": _check_structured_activations,
    "first_forward_inside_jvp": _check_first_forward_inside_jvp,
    "channels_last_accepted": _check_channels_last_is_trained_as_a_contiguous_copy,
    "the_issues_reproduction": _check_the_issues_reproduction,
    "unsynced_bf16_fsdp2": _check_unsynced_bf16_accumulation_fsdp2,
    "unsynced_bf16_fsdp1": _check_unsynced_bf16_accumulation_fsdp1,
    "failed_forward_recovered": _check_a_failed_forward_is_recovered,
    "unsharded_after_backward": _check_unsharded_after_backward,
    "stale_unsharded_copy_gathered_again": _check_stale_unsharded_copy_is_gathered_again,
    "post_accumulate_grad_hooks": _check_post_accumulate_grad_hooks_run_on_sharded_params,
    "dtype_conversion_after_fully_shard": _check_dtype_conversion_after_fully_shard,
    "unsynced_grads_of_a_skipped_unit": _check_unsynced_grads_of_a_unit_the_synced_backward_skips,
    "replicate_over_units": _check_replicate_over_units_given_as_ignored_modules,
    "unused_params": _check_unused_params_under_set_reduce_scatter_unused_params,
    "reductions_in_flight": _check_reductions_in_flight_under_set_reduce_scatter_max_input_buffers,
}


def _semantics_rank(rank: int, world_size: int) -> dict[str, str]:
    failures = run_checks(CHECKS, list(CHECKS), rank, world_size)
    chunked = {name: (lambda r, w, n=name: _check_chunked(r, w, n)) for name in CHUNKED}
    failures.update(run_checks(chunked, list(chunked), rank, world_size))
    grad_acc = {
        f"grad_accumulation_{name}": (lambda r, w, n=name: _check_grad_accumulation(r, w, n))
        for name in GRAD_ACC
    }
    failures.update(run_checks(grad_acc, list(grad_acc), rank, world_size))
    return failures


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_semantics_rank, 2, tmp_path_factory.mktemp("semantics"), timeout=300)


@pytest.mark.parametrize(
    "check", [*CHECKS, *CHUNKED, *(f"grad_accumulation_{name}" for name in GRAD_ACC)]
)
def test_fsdp2_semantics_are_torchs_bitwise(results, check):
    for rank, failures in enumerate(results):
        assert check not in failures, f"rank {rank}:\n{failures[check]}"


# ---- 4 ranks -------------------------------------------------------------------------------------


class HeadInside(HeadApart):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(idx))


def _nested_int_reshard_rank(rank: int, world_size: int) -> None:
    def train(api):
        torch.manual_seed(0)
        model = HeadInside()
        for block in model.blocks:
            api.fully_shard(block, reshard_after_forward=2)
        api.fully_shard(model, reshard_after_forward=2)
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        record = []
        for step in range(2):
            x, y = _batch(step, 0, rank)
            logits = model(x)
            F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
            record.append(_step(model, optim))
        return record

    _assert_bitwise(train(fsdp_lite), train(torch_fsdp), "reshard_after_forward=2, nested")


def test_int_reshard_after_forward_on_a_parent_of_sharded_blocks_at_4_ranks(tmp_path):
    run_ranks(_nested_int_reshard_rank, 4, tmp_path, timeout=180)


def _hsdp_grad_accumulation_rank(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for case in ("all_units", "root_only", "some_units_reshard_2"):
        for all_reduce_only in (False, True):
            what = f"{case}, all_reduce_only={all_reduce_only}"
            ours, theirs = (
                _train_accumulating(api, rank, case, mesh, all_reduce_only)
                for api in (fsdp_lite, torch_fsdp)
            )
            assert len(ours) == len(theirs) == 3 * (3 + 2 * 14), what
            for i, (mine, ref) in enumerate(zip(ours, theirs)):
                torch.testing.assert_close(mine, ref, rtol=0, atol=0, msg=f"{what}, record {i}")


def test_hsdp_grad_accumulation_at_4_ranks(tmp_path):
    """HSDP (2 x 2) accumulation, without sync or with reduce-scatter but no all-reduce
    (``set_requires_all_reduce``) until the last micro-batch: bitwise torch FSDP2's."""
    run_ranks(_hsdp_grad_accumulation_rank, 4, tmp_path, timeout=600)


def _all_reduce_back_on_with_gradient_sync_rank(rank: int, world_size: int) -> None:
    """HSDP: ``set_requires_all_reduce(False)``, then ``set_requires_gradient_sync(False)`` and
    ``(True)``: torch's ``set_requires_gradient_sync`` sets the all-reduce too, so the synced
    backward all-reduces and the gradients land. fsdp_lite set only the sync flag: the all-reduce
    stayed off and no gradient landed again, silently. Units called on their own in between
    (torch's test_native_partial_ownership pattern, whose own checks expect rules newer than
    torch 2.13's)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def run(api, reshard_after_backward: bool) -> list:
        model = _two_units(api, rank, reshard_after_backward, mesh)
        g = torch.Generator().manual_seed(rank)
        record = []
        model(torch.randn(2, DIM, generator=g)).sum().backward()
        record.append(_grads(model))
        model.set_requires_all_reduce(False)
        for module in (model.first, model.second):
            module(torch.randn(2, DIM, generator=g, requires_grad=True)).sum().backward()
        record.append(_grads(model))
        model.set_requires_gradient_sync(False)
        model.first(torch.randn(2, DIM, generator=g, requires_grad=True)).sum().backward()
        record.append(_grads(model))
        model.set_requires_gradient_sync(True)
        for use_second in (False, True):
            model(torch.randn(2, DIM, generator=g), use_second).sum().backward()
            for module in (model, model.first, model.second):
                module.reshard()
            record.append(_grads(model))
        return record

    for reshard_after_backward in (True, False):
        _assert_same_records(
            run(fsdp_lite, reshard_after_backward),
            run(torch_fsdp, reshard_after_backward),
            f"reshard_after_backward={reshard_after_backward}",
        )


def test_gradient_sync_turns_the_all_reduce_back_on_at_4_ranks(tmp_path):
    run_ranks(_all_reduce_back_on_with_gradient_sync_rank, 4, tmp_path, timeout=600)
