"""The bug catalog: planted bugs the suite must catch, each a small patch of fsdp_lite's source.

Each ``Bug`` is modelled on a class of bug that shipped in torch FSDP1/FSDP2, DeepSpeed, FairScale
or a framework on top of them (``upstream`` names the issue or pull request). It is a list of
``Patch``es, each an exact snippet of a file of the fsdp_lite package and its replacement; the
self-test (selftest.py) applies them to a scratch copy of the package and runs the matrix on it.
Patches are source text, not monkey-patches, so an entry survives any refactoring that keeps its
snippet, and one whose snippet is gone fails loudly, by name ("stale"), to be re-anchored.

``first`` lists case patterns (as ``--only`` takes them) that are likely to catch the bug; the
self-test runs those cases first and stops at the first failing case. ``world_size`` is the one
number of ranks at which the entry is judged (bugs that show only at 3 or 4 ranks say so).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CATALOG", "Bug", "Patch"]


@dataclass(frozen=True)
class Patch:
    """Replace ``anchor``, which must occur exactly once in ``file``, by ``replacement``."""

    file: str  # relative to the fsdp_lite package, e.g. "engine/unit.py"
    anchor: str
    replacement: str


@dataclass(frozen=True)
class Bug:
    """One planted bug: what it breaks, where it comes from, and the patches that plant it."""

    name: str
    bug_class: str  # the classes: "divide factors", "dtypes", "padding", ...
    what: str  # one line: what the planted code does wrong
    upstream: str  # the real bug it is modelled on ("" where none was found)
    patches: tuple[Patch, ...]
    first: tuple[str, ...] = ()  # case patterns to run first
    world_size: int = 2
    impl: str = "fsdp_lite"  # the adapter that runs the matrix: the front the bug is in


def _bug(
    name, bug_class, what, upstream, *patches, first=(), world_size=2, impl="fsdp_lite"
) -> Bug:
    return Bug(name, bug_class, what, upstream, tuple(patches), tuple(first), world_size, impl)


P = Patch
CATALOG: tuple[Bug, ...] = (
    # ---- divide factors -------------------------------------------------------------------------
    _bug(
        "divide_post_factor_doubled",
        "divide factors",
        "the post-reduction divide factor is twice N / pre: every gradient is half the average",
        "facebookresearch/fairscale#565; pytorch/pytorch#80456",
        P(
            "engine/collectives.py",
            "    return float(pre), world_size / pre\n",
            "    return float(pre), 2 * world_size / pre  # planted\n",
        ),
        first=("*/SHARD_GRAD_OP/fp32/plain/lm_untied/*",),
    ),
    _bug(
        "divide_odd_world_size",
        "divide factors",
        "the post factor is N // pre: exact at 2 and 4 ranks, 1 instead of 1.5 at 3",
        "pytorch/pytorch#80456 (world_size 3: predivide 2, postdivide 1.5)",
        P(
            "engine/collectives.py",
            "    return float(pre), world_size / pre\n",
            "    return float(pre), float(world_size // pre)  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/lm_untied/*",),
        world_size=3,
    ),
    _bug(
        "hsdp_divide_ignores_replicas",
        "divide factors",
        "HYBRID_SHARD divides by the shard group's size, not shard x replicate",
        "pytorch/pytorch#155903 (divide factor inconsistent between FSDP and HSDP)",
        P(
            "engine/unit.py",
            "        self._divide_factors = collectives.grad_divide_factors(self.world_size * replicas)\n",
            "        self._divide_factors = collectives.grad_divide_factors(self.world_size)  # planted\n",
        ),
        first=("*/HYBRID_SHARD/fp32/plain/*",),
    ),
    _bug(
        "hsdp_post_divide_skipped_at_four_ranks",
        "divide factors",
        "HYBRID_SHARD skips the post-divide, which is 1 at 2 ranks and 2 at 4 (2 x 2 mesh)",
        "pytorch/pytorch#125484 (HSDP divide factors computed at runtime)",
        P(
            "engine/unit.py",
            "        if pending.post_divide != 1.0:\n            output.div_(pending.post_divide)\n",
            "        if pending.post_divide != 1.0 and self.replicate_group is None:  # planted\n            output.div_(pending.post_divide)\n",
        ),
        first=("*/HYBRID_SHARD/fp32/plain/*",),
        world_size=4,
    ),
    _bug(
        "hsdp_replicas_not_all_reduced",
        "divide factors",
        "HYBRID_SHARD never all-reduces across replicas: each keeps its shard group's sum",
        "verl-project/verl#7493 (fsdp_size=1 silently disables gradient sync); "
        "pytorch/pytorch#154888 (HYBRID_SHARD on an (n, 1) mesh)",
        P(
            "engine/unit.py",
            '        with self._queued_on(streams.reduce if streams is not None else None):\n            op = self._issue("all_reduce", "backward", output, self.replicate_group)\n            with collectives.failing_as(op):\n                result = collectives.all_reduce(output, self.replicate_group, async_op=True)\n        return dataclasses.replace(pending, result=result, op=op, across_replicas=True)\n',
            "        self._land(output, pending)  # planted: no all-reduce across replicas\n        return None\n",
        ),
        first=("*/HYBRID_SHARD/fp32/plain/*",),
    ),
    # ---- reduce / param / buffer dtypes ---------------------------------------------------------
    _bug(
        "reduce_dtype_ignored",
        "dtypes",
        "gradients are reduced in the param dtype whatever MixedPrecision.reduce_dtype says",
        "pytorch/pytorch#190626 (FSDP2 reduce_dtype not applied to the TP all-reduce); "
        "allenai/OLMo#280",
        P(
            "engine/unit.py",
            "        reduce_dtype = self.precision.reduce_dtype or filled[0].dtype\n",
            "        reduce_dtype = filled[0].dtype  # planted\n",
        ),
        first=("*/bf16r32/*",),
    ),
    _bug(
        "unsynced_grads_in_param_dtype",
        "dtypes",
        "FSDP2 front: backwards without gradient sync sum in bf16, not the fp32 reduce dtype",
        "fsdp_lite issue 23 item 2 (torch FSDP2 sums them in the reduce dtype; "
        "the rounding was 2.1e-4 on half a gradient's elements)",
        P(
            "fronts/fsdp2.py",
            "    unit.settings.unsynced_grads_in_reduce_dtype = True\n",
            "    unit.settings.unsynced_grads_in_reduce_dtype = False  # planted\n",
        ),
        first=("fsdp_lite_fsdp2/*/bf16r32/no_sync/*",),
        impl="fsdp_lite_fsdp2",
    ),
    _bug(
        "param_dtype_ignored",
        "dtypes",
        "sharded units gather and compute in full precision under MixedPrecision.param_dtype",
        "verl-project/verl#6150 (honor mixed_precision.param_dtype)",
        P(
            "engine/param.py",
            "            else torch.empty(self.padded_numel, dtype=compute_dtype or data.dtype, device=compute)\n",
            "            else torch.empty(self.padded_numel, dtype=data.dtype, device=compute)  # planted\n",
        ),
        first=("*/FULL_SHARD/bf16/plain/lm_untied/*",),
    ),
    _bug(
        "buffers_not_cast_to_buffer_dtype",
        "dtypes",
        "floating buffers keep their dtype under MixedPrecision.buffer_dtype",
        "pytorch/pytorch#143900 (FSDP mixed precision ignores buffer_dtype)",
        P(
            "fronts/construct.py",
            "        cast_buffers(m, config.precision.buffer_dtype, skip=(), recurse=False)\n",
            "        pass  # planted\n",
        ),
        first=("*/FULL_SHARD/bf16/plain/bufnet/*", "*/bf16/plain/hf_llama/*"),
    ),
    _bug(
        "buffer_dtype_lost_in_state_dict",
        "dtypes",
        "state dicts save buffers in MixedPrecision.buffer_dtype, not their own dtype",
        "facebookresearch/fairscale#704; pytorch/pytorch#93391",
        P(
            "state/state_dict.py",
            "    dtypes = wrapper._unit.buffer_dtypes\n",
            "    dtypes = {}  # planted\n",
        ),
        first=("*/bf16/*/bufnet/*",),
    ),
    _bug(
        "low_precision_grads_kept",
        "dtypes",
        "sharded gradients stay in the reduce dtype (as keep_low_precision_grads) unasked",
        "pytorch/pytorch#82513 (FSDP casts gradients back to full precision for the step)",
        P(
            "engine/param.py",
            "        local = offload.to_device(local, self.sharded_flat.device)\n"
            "        if not keep_dtype:\n",
            "        local = offload.to_device(local, self.sharded_flat.device)\n"
            "        keep_dtype = True  # planted\n"
            "        if not keep_dtype:\n",
        ),
        first=("*/FULL_SHARD/bf16/plain/lm_untied/*",),
    ),
    # ---- padding, uneven shards, numel < world size ---------------------------------------------
    _bug(
        "local_rows_negative_on_last_rank",
        "padding",
        "a rank's row count is not clamped at 0: a 5-row tensor at 4 ranks gives rank 3 -1 rows",
        "tinygrad/tinygrad#5131 (size 2 over 4 shards is (1, 1, 0, 0))",
        P(
            "engine/param.py",
            "        self.local_rows = max(0, min(self.shard_rows, rows - rank * self.shard_rows))\n",
            "        self.local_rows = min(self.shard_rows, rows - rank * self.shard_rows)  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/mlp/*",),
        world_size=4,
    ),
    _bug(
        "rank_without_rows_gets_no_grad",
        "padding",
        "a rank that holds no rows of a parameter (numel < world size) leaves its grad None",
        "pytorch/pytorch#95315 / #94835 (clip_grad_norm_ when a rank has no local gradients)",
        P(
            "engine/unit.py",
            "            if used > 0 or self.settings.lands_unused_grads:\n                self.reduction.land(p, output[offset : offset + numel], keep_dtype)\n",
            "            if used > 0 and p.is_sharded and p.local_numel == 0:  # planted\n                offset += numel\n                continue\n            if used > 0 or self.settings.lands_unused_grads:\n                self.reduction.land(p, output[offset : offset + numel], keep_dtype)\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/mlp/*",),
        world_size=4,
    ),
    _bug(
        "full_state_dict_last_rows_from_wrong_rank",
        "padding",
        "a full state dict fills an uneven tensor's last rows from the previous rank's shard",
        "pytorch/pytorch#136228 (full state dict with dim 0 not divisible by the DP size)",
        P(
            "engine/param.py",
            "            out_rows[whole_ranks * self.shard_rows :].copy_(blocks[whole_ranks, :rest])\n",
            "            out_rows[whole_ranks * self.shard_rows :].copy_(blocks[whole_ranks - 1, :rest])"
            "  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/lm_untied/*",),
    ),
    _bug(
        "load_full_state_dict_wrong_rows",
        "padding",
        "loading a full state dict cuts rank r's rows at r * local_rows, wrong on uneven tensors",
        "pytorch/pytorch#136336 (loading a full state dict into sharded parameters)",
        P(
            "state/state_dict.py",
            "    start = p.rank * p.shard_rows\n",
            "    start = p.rank * p.local_rows  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/lm_untied/*",),
    ),
    _bug(
        "grad_slices_by_full_numel",
        "padding",
        "landing a reduce-scatter output strides by each parameter's full numel, not its shard's",
        "",
        P(
            "engine/unit.py",
            "            offset += numel\n",
            "            offset += p.numel  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/mlp/*",),
    ),
    # ---- collectives ----------------------------------------------------------------------------
    _bug(
        "reduce_scatter_sends_own_row",
        "collectives",
        "the 2-rank reduce-scatter by sends sends each rank's own row instead of its peer's",
        "",
        P(
            "engine/collectives.py",
            "    works = [sends.send([rows[peer]], peer, tag), sends.recv([received], peer, tag)]\n",
            "    works = [sends.send([rows[rank]], peer, tag), sends.recv([received], peer, tag)]"
            "  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/mlp/*",),
    ),
    _bug(
        "all_gather_receives_into_own_row",
        "collectives",
        "the all-gather by sends receives each peer's shards into this rank's own row",
        "",
        P(
            "engine/collectives.py",
            "        works += [sends.recv([rows[r]], r, tag) for r in peers]\n",
            "        works += [sends.recv([rows[rank]], r, tag) for r in peers]  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/mlp/*",),
    ),
    # ---- clip norms -----------------------------------------------------------------------------
    _bug(
        "clip_inf_norm_summed",
        "clip norms",
        "clip_grad_norm_(norm_type=inf) sums the ranks' max norms instead of taking their max",
        "meta-pytorch/torchrec#3199 (inf-norm clipping wrong for FSDP2)",
        P(
            "fronts/fsdp1.py",
            "        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM\n",
            "        op = dist.ReduceOp.SUM  # planted\n",
        ),
        first=("*/clip_grad_norm_inf/*",),
    ),
    _bug(
        "clip_norm_not_reduced",
        "clip norms",
        "clip_grad_norm_ uses each rank's norm of its own shards",
        "areal-project/AReaL#312; pytorch/torchtitan#766 (grad norm not reduced across ranks)",
        P(
            "fronts/fsdp1.py",
            "        dist.all_reduce(local, op=op, group=self._config.group)\n",
            "        pass  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/clip_grad_norm/lm_untied/*",),
    ),
    _bug(
        "clip_norm_counts_replicated_per_rank",
        "clip norms",
        "replicated (NO_SHARD) gradients enter the all-reduced sum, so they count N + 1 times",
        "ByteDance-Seed/VeOmni#184 (HSDP grad norm reduced over the wrong group)",
        P(
            "fronts/fsdp1.py",
            "        local = _partial_norm(sharded, norm_type, device)\n",
            "        local = _partial_norm(sharded + replicated, norm_type, device)  # planted\n",
        ),
        first=("*/NO_SHARD/fp32/clip_grad_norm/lm_untied/*",),
    ),
    _bug(
        "clip_coef_not_clamped",
        "clip norms",
        "the clip coefficient is not clamped at 1: gradients below max_norm are scaled up",
        "",
        P(
            "fronts/fsdp1.py",
            "        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)\n",
            "        clip_coef = max_norm / (total + 1e-6)  # planted\n",
        ),
        first=("*/clip_grad_norm_inf/*",),
    ),
    # ---- no_sync and accumulation ---------------------------------------------------------------
    _bug(
        "no_sync_drops_first_micro_batch",
        "no_sync",
        "a backward under no_sync() drops the unsharded gradients it accumulated",
        "huggingface/transformers#34645 (FSDP grad accumulation fix); instructlab/training#414",
        P(
            "engine/runtime.py",
            "                unit.keep_unsynced_grads()\n                self._unreduced.add(unit)\n",
            "                unit.keep_unsynced_grads()\n                self._unreduced.add(unit)\n                for p in unit.trainable:  # planted\n                    p.drop_unsharded_grad()\n",
        ),
        first=("*/FULL_SHARD/fp32/no_sync/lm_untied/*",),
    ),
    _bug(
        "accumulation_outside_no_sync_overwrites",
        "no_sync",
        "a second synced backward before the step replaces the sharded grad instead of adding",
        "pytorch/pytorch#73535 (FSDP grad accumulation without no_sync); instructlab/training#414",
        P(
            "engine/param.py",
            "        grad = self._to_dtensor(local)\n        if self.sharded_param.grad is None:\n            self.sharded_param.grad = grad\n        else:\n            self.sharded_param.grad += grad\n",
            "        grad = self._to_dtensor(local)\n        self.sharded_param.grad = grad  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/accumulate/*",),
    ),
    # ---- ZeRO-1/2 staleness, prefetch, read-before-wait races ------------------------------------
    _bug(
        "zero1_kept_params_never_refreshed",
        "stale parameters",
        "SHARD_OPTIM reuses its kept unsharded params after the optimizer changed the shards",
        "deepspeedai/DeepSpeed#966 (ZeRO stages 0-3 produce different results)",
        P(
            "engine/unit.py",
            "        return self._gathered_versions is not None and self._gathered_versions == "
            "self._versions()\n",
            "        return self._gathered_versions is not None  # planted\n",
        ),
        P(
            "engine/unit.py",
            "    for unit in list(_KEEPING):\n        unit._gathered_versions = STALE\n",
            "    for unit in list(_KEEPING):\n        pass  # planted: an optimizer step changes nothing\n",
        ),
        first=("*/SHARD_OPTIM/fp32/plain/*",),
    ),
    _bug(
        "zero1_stale_after_foreach_step",
        "stale parameters",
        "SHARD_OPTIM trusts the shards' version counters alone, which a foreach optimizer step "
        "does not move: the next forward runs on the pre-step params",
        "fsdp_lite 259cc7b (found by the canonical mode's tests: AdamW(foreach=True), the default "
        "on accelerators, left every version counter of the DTensor where it was)",
        P(
            "engine/unit.py",
            "    for unit in list(_KEEPING):\n        unit._gathered_versions = STALE\n",
            "    for unit in list(_KEEPING):\n        pass  # planted: versions alone decide\n",
        ),
        first=("*/SHARD_OPTIM/fp32/foreach_optimizer/*",),
    ),
    _bug(
        "zero2_params_not_resharded_after_backward",
        "stale parameters",
        "SHARD_GRAD_OP never reshards, so the next forward runs on the pre-step params",
        "pytorch/pytorch#83129 (FSDP does not reshard params if post-backward did not fire)",
        P(
            "engine/unit.py",
            "        if self.state == ShardedState.UNSHARDED:\n            if after_forward and self._post_forward is not None:\n",
            "        if self.state == ShardedState.UNSHARDED and self.rules.reshard_after_forward:  # planted\n            if after_forward and self._post_forward is not None:\n",
        ),
        first=("*/SHARD_GRAD_OP/fp32/plain/lm_untied/*",),
    ),
    _bug(
        "next_step_prefetched_before_optimizer_step",
        "prefetch",
        "the end of backward prefetches the next step's first unit before the optimizer steps",
        "pytorch/pytorch#178142 (prefetch race: loss mismatch from the second step)",
        P(
            "engine/runtime.py",
            "        self._backward.clear()\n        self._callback_queued = False\n        if all(unit.settings.is_last_backward for unit in self.units):\n",
            '        if self.forward_order and self.forward_order[0].needs_unshard():  # planted\n            self.forward_order[0].unshard("forward", async_op=True)\n        self._backward.clear()\n        self._callback_queued = False\n        if all(unit.settings.is_last_backward for unit in self.units):\n',
        ),
        first=("*/FULL_SHARD/fp32/plain/lm_untied/*",),
    ),
    _bug(
        "reduce_scatter_summed_before_wait",
        "races",
        "the 2-rank reduce-scatter adds the peer's row before waiting for its receive",
        "pytorch/pytorch#115710 (found_inf copied before waiting on the async all-reduce)",
        P(
            "engine/collectives.py",
            "        (waiter or wait_each)(self.works)\n        self.works = []\n        if self.received is not None:\n",
            "        if self.received is not None:  # planted\n            self.output, self.received = self.received.add_(self.output), None\n        (waiter or wait_each)(self.works)\n        self.works = []\n        if self.received is not None:\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/lm_untied/*",),
    ),
    _bug(
        "copy_out_before_all_gather_wait",
        "races",
        "a prefetched unit's params are copied out of the all-gather output before the wait",
        "pytorch/pytorch#197827 (all-gather read stale chunks: a missing stream wait)",
        P(
            "engine/unit.py",
            "            self._wait(pending.op, pending.result)\n            self._copy_out(pending.result.all_gather_output)\n",
            "            self._copy_out(pending.result.all_gather_output)\n            self._wait(pending.op, pending.result)  # planted: after the copy-out\n",
        ),
        first=("*/FULL_SHARD/fp32/forward_prefetch/*",),
    ),
    # ---- frozen, unused, tied parameters ----------------------------------------------------------
    _bug(
        "frozen_weight_freed_before_input_grads",
        "frozen parameters",
        "a unit with frozen params frees them at its gradient count; autograd still reads them",
        "pytorch/pytorch#95805 (resharding frozen parameters in backward)",
        P(
            "engine/unit.py",
            "        self.keeps_frozen_unsharded = self._frozen_beside_trainable and rules.reshard_after_backward\n",
            "        self.keeps_frozen_unsharded = False  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/frozen_in_unit/*",),
    ),
    _bug(
        "unused_param_gets_zero_grad",
        "unused parameters",
        "a parameter no rank used in a step gets a zero gradient instead of None",
        "pytorch/pytorch#87308 (FSDP grad zero vs. None edge case)",
        P(
            "engine/unit.py",
            "            if used > 0 or self.settings.lands_unused_grads:\n                self.reduction.land(p, output[offset : offset + numel], keep_dtype)\n",
            "            if used > 0 or p.is_sharded:  # planted\n                self.reduction.land(p, output[offset : offset + numel], keep_dtype)\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/unused/*",),
    ),
    _bug(
        "tied_weight_second_use_not_repointed",
        "tied parameters",
        "only the first module holding a tied weight is pointed at its gathered copy",
        "NVIDIA-NeMo/RL#227 (tied weights not respected in FSDP1); "
        "Lightning-AI/pytorch-lightning#21613",
        P(
            "engine/param.py",
            "        for module, name in self.locations:\n",
            "        for module, name in self.locations[:1]:  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/tied_weights/*",),
    ),
    # ---- offload copies -----------------------------------------------------------------------------
    _bug(
        "disk_reused_file_not_rewritten",
        "offload copies",
        "moving a tensor into a file that already exists skips the copy: grads go stale",
        "facebookresearch/fairscale#496 (offloaded grad copy must complete); "
        "pytorch/pytorch#180666 (hook reads pinned CPU grads before the copy lands)",
        # Re-planted 2026-12-06: the old patch (copy unless ``flat is f.tensor``) became a no-op
        # when ``move`` began to slice the reserved file (a slice is never the file's tensor).
        P(
            "engine/disk.py",
            "            flat = f.tensor[: local.numel()]\n        flat.copy_(local.reshape(-1))\n",
            "            flat = f.tensor[: local.numel()]  # planted: no copy into an existing file\n"
            "            moved = flat.view(local.shape)\n"
            "            return with_local(value, moved) if isinstance(value, DTensor) else moved\n"
            "        flat.copy_(local.reshape(-1))\n",
        ),
        first=("*/FULL_SHARD/fp32/disk_offload/lm_untied/*",),
    ),
    _bug(
        "disk_private_mapping",
        "offload copies",
        "offload files are mapped MAP_PRIVATE, so dropping pages (MADV_DONTNEED) loses writes",
        "",
        P(
            "engine/disk.py",
            "            self.mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)\n",
            "            self.mmap = mmap.mmap(fd, nbytes, mmap.MAP_PRIVATE)  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/disk_offload/lm_untied/*",),
    ),
    # ---- optimizer state dicts, state dicts, DCP, resharding ----------------------------------------
    _bug(
        "optim_state_dict_names_reversed",
        "optimizer state dicts",
        "the optimizer state dict puts each state under the name of another parameter",
        "pytorch/pytorch#113673 (optimizer state rekeyed by name in the wrong order)",
        P(
            "state/optim_state.py",
            "    params = _optim_params(optim, model, optim_input)  # before any collective: it may "
            "raise\n",
            "    params = _optim_params(optim, model, optim_input)[::-1]  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/lm_untied/*",),
    ),
    _bug(
        "state_dict_keeps_wrapper_prefix",
        "state dicts",
        "state dict keys keep the _fsdp_wrapped_module. prefix of nested wrappers",
        "pytorch/pytorch#74810 (FSDP details can exist in full state dict key names)",
        P(
            "fronts/fsdp1.py",
            "def _strip_wrapper_prefix(module, state_dict, prefix, local_metadata) -> None:\n",
            "def _strip_wrapper_prefix(module, state_dict, prefix, local_metadata) -> None:\n"
            "    return  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/lm_untied/*",),
    ),
    _bug(
        "sharded_state_dict_values_are_local_rows",
        "state dicts",
        "SHARDED_STATE_DICT values are this rank's rows as plain tensors, not DTensors (DCP)",
        "pytorch/pytorch#136336 (loading plain tensors where DTensor shards are expected)",
        P(
            "state/state_dict.py",
            "    is_local = settings.state_dict_type == StateDictType.LOCAL_STATE_DICT\n",
            "    is_local = settings.state_dict_type != StateDictType.FULL_STATE_DICT  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/plain/lm_untied/*",),
    ),
    _bug(
        "sharded_state_dict_saves_padded_shards",
        "resharding",
        "SHARDED_STATE_DICT values are the padded shard buffers (N x shard_rows rows), taken back "
        "in place on load: exact at the same layout, an N * shard_rows-row tensor at any other",
        "NVIDIA/Megatron-LM#6024 (padded shards that do not tile like Shard(0) get wrong DCP "
        "metadata); pytorch/torchtitan#811 (checkpoints do not load at another world size)",
        P(
            "state/state_dict.py",
            "        elif config.offload_to_cpu:\n"
            "            value = with_local(value, value.to_local().cpu())\n",
            "        elif config.offload_to_cpu:\n"
            "            value = with_local(value, value.to_local().cpu())\n"
            "        else:  # planted: the padded shard buffer the flat collectives use\n"
            "            p = own[key]\n"
            "            rest = tuple(p.orig_size[1:])\n"
            "            value = DTensor.from_local(\n"
            "                p.sharded_flat.view(p.shard_rows, *rest),\n"
            "                value.device_mesh,\n"
            "                value.placements,\n"
            "                run_check=False,\n"
            "                shape=(p.shard_rows * p.world_size, *rest),\n"
            "                stride=value.stride(),\n"
            "            )\n",
        ),
        P(
            "state/state_dict.py",
            "    if isinstance(value, DTensor):\n        same_layout = (\n",
            "    if isinstance(value, DTensor) and value.to_local().data_ptr() == "
            "p.sharded_flat.data_ptr():\n"
            "        return target  # planted: dcp.load filled this rank's own buffer in place\n"
            "    if isinstance(value, DTensor):\n        same_layout = (\n",
        ),
        first=("*/FULL_SHARD/fp32/sharded_checkpoint/lm_untied/*",),
    ),
    # ---- gradient scaler -------------------------------------------------------------------------
    _bug(
        "grad_scaler_found_inf_not_agreed",
        "gradient scaler",
        "the sharded grad scaler's inf/NaN verdict is not all-reduced: ranks step or skip alone",
        "facebookresearch/fairscale#179, #180 (AMP with sharded grads hangs or diverges); "
        "pytorch/pytorch#115710",
        P(
            "optim/grad_scaler.py",
            "            dist.all_reduce(flag, group=self.process_group)  # > 0 on every rank if on any\n",
            "            pass  # planted\n",
        ),
        first=("*/FULL_SHARD/fp16/plain/spiky/*",),
    ),
    _bug(
        "grad_scaler_unscales_first_grad_only",
        "gradient scaler",
        "the sharded grad scaler checks and unscales only the first gradient of each dtype",
        "facebookresearch/fairscale#890 (only the first tensor was checked for inf/nan)",
        P(
            "optim/grad_scaler.py",
            "                        tensors, per_device_found_inf.get(device), "
            "per_device_inv_scale.get(device)\n",
            "                        tensors[:1], per_device_found_inf.get(device), "
            "per_device_inv_scale.get(device)  # planted\n",
        ),
        first=("*/FULL_SHARD/fp16/plain/lm_untied/*",),
    ),
    # ---- .to() after wrap, activation checkpointing ------------------------------------------------
    _bug(
        "to_after_wrap_detaches_shard",
        ".to() after wrap",
        "after nn.Module._apply the DTensor parameter no longer views the shard the gather reads",
        "torch FSDP1 loses updates after model.to() between steps (docs/compatibility.md, "
        "found by this suite)",
        P(
            "engine/param.py",
            "        current._local_tensor = flat.view(self.local_shape)\n",
            "        pass  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/move_mid_training/*",),
    ),
    _bug(
        "recompute_runs_as_a_new_forward",
        "activation checkpointing",
        "a forward recomputed in backward (a checkpoint_wrapper around the unit) is taken for a "
        "new forward, whose state check fails inside backward",
        "pytorch/pytorch#82203 (FSDP inside checkpoint_wrapper: the pre-backward hook runs "
        "before the recomputed forward); facebookresearch/fairscale#777",
        P(
            "engine/runtime.py",
            "        if unit.training_state == TrainingState.BACKWARD:\n"
            "            # Activation checkpointing recomputes this unit's forward inside its "
            "backward: the\n",
            "        if False:  # planted\n"
            "            # Activation checkpointing recomputes this unit's forward inside its "
            "backward: the\n",
        ),
        first=("*/FULL_SHARD/fp32/checkpoint_outside_unit/*",),
    ),
    # ---- construction paths: apply, summon writeback, policy overrides ---------------------------
    _bug(
        "summon_writeback_only_for_rank0",
        "construction paths",
        "summon_full_params writes the full parameters back only under rank0_only (a condition "
        "mixed up): model.apply(init_fn) after wrapping changes nothing",
        "pytorch/pytorch#107081 (summon_full_params(writeback=True) leaves the parameters "
        "unchanged); pytorch/pytorch#151223 (writeback fails under NO_SHARD)",
        P(
            "fronts/fsdp1.py",
            "    if writeback:  # registered last, so it runs first: before the modules are restored\n",
            "    if writeback and rank0_only:  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/apply/*", "*/FULL_SHARD/fp32/summon_writeback/*"),
    ),
    _bug(
        "strategy_override_resets_precision",
        "construction paths",
        "a policy's sharding_strategy override also takes the override's mixed_precision, which "
        "it does not set: those units compute in full precision under a bf16 root",
        "",
        P(
            "fronts/construct.py",
            "        changes.update(strategy=strategy, rules=STRATEGY_RULES[strategy])\n",
            "        changes.update(strategy=strategy, rules=STRATEGY_RULES[strategy], "
            "precision=resolve(kw['mixed_precision']))  # planted\n",
        ),
        first=("*/FULL_SHARD/bf16/policy_override/*",),
    ),
    # ---- hpZ: FSDP2's int reshard_after_forward, at 4 ranks ----------------------------------------
    _bug(
        "hpz_keeps_the_mirrored_block",
        "resharding",
        "after forward each rank of a 2-rank hpZ group keeps its partner's rows (its position "
        "in the group read in reverse): backward gathers the unit's shards in the wrong order",
        "",
        P(
            "engine/unit.py",
            "        first = dist.get_rank(group) * per\n",
            "        first = (dist.get_world_size(group) - 1 - dist.get_rank(group)) * per  # planted\n",
        ),
        first=("*/FULL_SHARD/fp32/hpz/*",),
        world_size=4,
        impl="fsdp_lite_fsdp2",
    ),
)
