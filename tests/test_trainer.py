"""HF Trainer on fsdp_lite: ``FSDPLiteTrainer`` (fsdp_lite/integrations/transformers.py) at 2 gloo
ranks, against Trainer's own DDP run of the same settings in the same launch.

A tiny ``LlamaForCausalLM`` built from a config (conformance.models, no download), synthetic token
rows, AdamW with weight decay (so Trainer's decay groups must name the parameters right),
gradient accumulation over 2 micro-batches. At 2 ranks fp32 sharded training is DDP's arithmetic
(each rank's gradient halved, then summed), and ``bf16=True`` is Trainer's autocast around the same
forward with the gradients still reduced in fp32, so every loss, the eval loss and every trained
weight are bitwise DDP's, both fronts, with and without bf16. Grad norms are not: fsdp_lite sums
per-shard squares across ranks, DDP per whole parameter, so the last bit may differ; with clipping
off (``max_grad_norm=0``) or inactive (norms below it) that never reaches the weights.

One launch runs every check (tests/ranks.py's run_checks); a second test runs a plain Trainer
script under torchrun twice, once as written and once with its Trainer import changed.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conformance.models import build
from tests.ranks import run_checks, run_ranks
from tests.test_swap_in import _NATIVE_CRASHES

transformers = pytest.importorskip("transformers")  # the hf extra, in the test extra
accelerate = pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("ddp", "fsdp2", "fsdp1", "fsdp1_user")
# bf16 compares fewer: the script's own wrapper is fp32's concern, and fsdp2 comes from model_init
BF16_KINDS = ("ddp", "fsdp2_init", "fsdp1")


def _join_hf(rank: int, world_size: int) -> None:
    """What torchrun sets: Accelerate reads the ranks off the environment (the process group
    exists already, so it joins it instead of starting one)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
    )


class _Tokens(torch.utils.data.Dataset):
    """Fixed random token rows; each row is its own labels (Trainer's sampler splits the rows)."""

    def __init__(self, rows: int = 32, seed: int = 1) -> None:
        self.ids = torch.randint(0, 61, (rows, 12), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _weights(trainer) -> dict[str, torch.Tensor]:
    """The trained weights, full, on rank 0 ({} elsewhere for a sharded model: a collective)."""
    from fsdp_lite.integrations.accelerate import full_state_dict, sharded_root

    if sharded_root(trainer.model) is None:
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return full_state_dict(trainer.model)


def _train(
    kind: str,
    out: Path,
    *,
    evaluate_first: bool = False,
    resume: str | None = None,
    seed: int = 0,
    callbacks: tuple = (),
    **overrides,
):
    """One Trainer run; (record, trainer). ``kind``: "ddp" (transformers.Trainer), "fsdp2" and
    "fsdp1" (FSDPLiteTrainer sharding as fsdp_config says), "fsdp2_init" (the same, the model
    from model_init), "fsdp1_user" (FSDPLiteTrainer given a model the script wrapped in
    FullyShardedDataParallel itself, Trainer's defaults otherwise: remove_unused_columns too)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fsdp_lite import FullyShardedDataParallel
    from fsdp_lite.integrations.transformers import FSDPLiteTrainer
    from fsdp_lite.wrap import transformer_auto_wrap_policy

    class Log(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs) -> None:
            if logs and "loss" in logs:
                self.steps.append(dict(logs))

    settings = dict(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        weight_decay=0.1,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    if kind in ("fsdp2", "fsdp1", "fsdp2_init"):
        settings.update(fsdp=True, fsdp_config={"version": 1 if kind == "fsdp1" else 2})
    model_init = kind == "fsdp2_init"  # Trainer builds the model in train(), we shard it there
    settings.update(overrides)
    model = build("hf_llama", seed=seed)
    if kind == "fsdp1_user":
        policy = functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}
        )
        model = FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True)
    log = Log()
    trainer = (Trainer if kind == "ddp" else FSDPLiteTrainer)(
        model=None if model_init else model,
        model_init=(lambda: build("hf_llama", seed=seed)) if model_init else None,
        args=TrainingArguments(**settings),
        train_dataset=_Tokens(),
        eval_dataset=_Tokens(8, seed=2),
        callbacks=[log, *callbacks],
    )
    record: dict = {}
    if evaluate_first:
        record["eval_before"] = trainer.evaluate()["eval_loss"]
        # A forward with grad and no backward leaves the root holding its unsharded params; the
        # optimizer train() builds must still get the shards.
        trainer.model(input_ids=_Tokens().ids[:2])
    trainer.train(resume_from_checkpoint=resume)
    record["losses"] = [s["loss"] for s in log.steps]
    record["grad_norms"] = [s["grad_norm"] for s in log.steps]
    record["eval_loss"] = trainer.evaluate()["eval_loss"]
    record["weights"] = _weights(trainer)
    return record, trainer


def _expect(error: type, words: str, call) -> None:
    """``call()`` raises ``error`` mentioning ``words``. An AssertionError otherwise, not pytest's
    Failed (a BaseException), so that run_checks reports it and goes on to the next check."""
    try:
        call()
    except error as e:
        assert re.search(words, str(e)), f"{type(e).__name__} without {words!r}: {e}"
        return
    raise AssertionError(f"no {error.__name__} ({words!r})")


def _assert_same_weights(got: dict, want: dict, what: str, **tolerance) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ"
    for key, value in want.items():
        assert type(got[key]) is torch.Tensor, f"{what}: {key} is a {type(got[key]).__name__}"
        torch.testing.assert_close(
            got[key], value, **(tolerance or {"rtol": 0, "atol": 0}), msg=f"{what}: {key}"
        )


def _fronts_are_ddp(out: Path, rank: int, kinds: tuple[str, ...], save: bool, **precision) -> None:
    """Trainer's DDP run, then each front: the same losses, eval loss and weights, bitwise; with
    ``save``, the folder save_model wrote loads with from_pretrained as DDP's trained weights.
    The numbers go to a file."""
    from transformers import LlamaForCausalLM

    from fsdp_lite import FSDPModule, FullyShardedDataParallel

    runs = {}
    for kind in kinds:
        runs[kind], trainer = _train(kind, out / kind, evaluate_first=kind != "ddp", **precision)
        if kind != "ddp":
            assert type(trainer.accelerator).__name__ == "FSDPLiteAccelerator"
            front = FullyShardedDataParallel if "fsdp1" in kind else FSDPModule
            assert isinstance(trainer.model, front), type(trainer.model)
        if save and kind != "ddp":
            trainer.save_model(str(out / kind / "final"))
    want = runs["ddp"]
    for kind in kinds[1:]:
        got = runs[kind]
        assert got["losses"] == want["losses"], f"{kind}: losses {got['losses']} != DDP's"
        assert got["eval_loss"] == want["eval_loss"], f"{kind}: eval loss"
        assert got["eval_before"] == runs[kinds[1]]["eval_before"], f"{kind}: eval before"
        assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-6), kind
        if rank == 0:
            _assert_same_weights(got["weights"], want["weights"], kind)
            if save:
                loaded = LlamaForCausalLM.from_pretrained(str(out / kind / "final")).state_dict()
                _assert_same_weights(loaded, want["weights"], f"{kind} from_pretrained")
        else:
            assert got["weights"] == {}, "only rank 0 keeps the gathered weights"
    if rank == 0:
        table = {
            k: {n: r[n] for n in ("losses", "eval_loss", "grad_norms")} for k, r in runs.items()
        }
        (out / "losses.json").write_text(json.dumps(table, indent=1))


def _clipping(out: Path, rank: int) -> None:
    """max_grad_norm below the norms: each front clips as DDP does. Not bitwise by construction:
    the total norm sums shard norms in another order, so it and the clip factor may differ in the
    last bit (fp32: 1.2e-7 relative), and the updates with them. Measured (2 ranks, 4 steps):
    losses equal, grad norms within 1.4e-7 relative, weights within 6e-8; the bounds below leave
    about 10x."""
    runs = {kind: _train(kind, out / kind, max_grad_norm=0.5)[0] for kind in KINDS[:3]}
    want = runs["ddp"]
    assert all(n > 0.5 for n in want["grad_norms"]), "the clip must be active"
    for kind in ("fsdp2", "fsdp1"):
        got = runs[kind]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-6), kind
        assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-6), kind
        if rank == 0:
            _assert_same_weights(got["weights"], want["weights"], kind, rtol=0, atol=1e-6)


def _resume(out: Path, kind: str, state_dict_type: str) -> None:
    """save_steps=2, then a new Trainer (another model init) resumed from checkpoint-2: its two
    steps are the uninterrupted run's last two, bitwise, and so are the final weights."""
    import safetensors.torch

    from fsdp_lite.integrations.transformers import CHECKPOINT_DIR

    config = {"version": int(kind[-1]), "state_dict_type": state_dict_type}
    common = dict(save_strategy="steps", save_steps=2, fsdp=True, fsdp_config=config)
    whole, _ = _train(kind, out / "whole", **common)
    checkpoint = out / "whole" / "checkpoint-2"
    files = set(os.listdir(checkpoint))
    assert {CHECKPOINT_DIR, "scheduler.pt", "trainer_state.json", "rng_state_1.pth"} <= files
    assert "optimizer.pt" not in files, "Trainer's own optimizer file would hold rank 0's shards"
    assert ("model.safetensors" in files) == (state_dict_type == "FULL_STATE_DICT"), files
    resumed, trainer = _train(kind, out / "resumed", resume=str(checkpoint), seed=7, **common)
    assert resumed["losses"] == whole["losses"][2:], (resumed["losses"], whole["losses"])
    assert resumed["grad_norms"] == whole["grad_norms"][2:]
    assert resumed["eval_loss"] == whole["eval_loss"]
    if trainer.is_world_process_zero():
        _assert_same_weights(resumed["weights"], whole["weights"], f"{kind} resumed")
        if state_dict_type == "FULL_STATE_DICT":  # the checkpoint's full weights are step 2's
            saved = safetensors.torch.load_file(
                str(out / "whole" / "checkpoint-4" / "model.safetensors")
            )
            _assert_same_weights(saved, whole["weights"], "checkpoint-4/model.safetensors")


def _resume_save_only_model(out: Path) -> None:
    """A save_only_model checkpoint holds the full weights alone: resuming reads them into the
    shards, so the first step after is the uninterrupted run's (the optimizer starts afresh)."""
    common = dict(save_strategy="steps", save_steps=2, save_only_model=True)
    whole, _ = _train("fsdp2", out / "whole", **common)
    checkpoint = out / "whole" / "checkpoint-2"
    resumed, _ = _train("fsdp2", out / "resumed", resume=str(checkpoint), seed=7, **common)
    assert resumed["losses"][0] == whole["losses"][2], (resumed["losses"], whole["losses"])


def _best_model_at_end(out: Path, rank: int) -> None:
    """load_best_model_at_end reads the best checkpoint's shards back."""
    from transformers import TrainerCallback

    from fsdp_lite.integrations.accelerate import full_state_dict

    saved = {}

    class Keep(TrainerCallback):
        def on_save(self, args, state, control, model=None, **kwargs) -> None:
            saved[state.global_step] = full_state_dict(model)  # every rank calls on_save

    record, trainer = _train(
        "fsdp2",
        out,
        callbacks=[Keep()],
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,  # the worse loss: step 2's here, so the load changes the model
    )
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    if rank == 0:
        _assert_same_weights(record["weights"], saved[2], "best model")
        assert not torch.equal(saved[2]["lm_head.weight"], saved[4]["lm_head.weight"])


# Other fsdp_config values Trainer takes, each honoured (units as they ask) and still DDP's numbers.
PLANS = {
    "fsdp2_defaults": (None, 3),  # fsdp unset: version 2, each decoder layer and the root
    "fsdp2_keep_offload": ({"reshard_after_forward": False, "cpu_offload": True}, 3),
    "fsdp2_size_based": ({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 2000}, 6),
    "fsdp1_size_shard_grad_op": (
        {
            "version": 1,
            "auto_wrap_policy": "SIZE_BASED_WRAP",
            "min_num_params": 2000,
            "reshard_after_forward": "shard_grad_op",
            "backward_prefetch": "BACKWARD_PRE",
            "forward_prefetch": True,
        },
        4,
    ),
}


def _plans(out: Path, rank: int) -> None:
    from fsdp_lite.engine.unit import unit_owners

    want, _ = _train("ddp", out / "ddp", max_steps=2)
    for name, (config, units) in PLANS.items():
        fsdp = (
            {"fsdp": True, "fsdp_config": config} if config else {"fsdp": "", "fsdp_config": None}
        )
        got, trainer = _train("fsdp2", out / name, max_steps=2, **fsdp)
        assert len(unit_owners(trainer.model)) == units, name
        assert got["losses"] == want["losses"], f"{name}: {got['losses']} != {want['losses']}"
        if rank == 0:
            _assert_same_weights(got["weights"], want["weights"], name)


def _refusals(out: Path, rank: int) -> None:
    """Each refused on every rank alike, before fsdp_lite's first collective."""
    from transformers import TrainingArguments

    from fsdp_lite.integrations.transformers import FSDPLiteTrainer

    def make(fsdp_config=None, **kwargs):
        settings = dict(output_dir=str(out), report_to=[], use_cpu=True, max_steps=1)
        if fsdp_config is not None:
            settings.update(fsdp=True, fsdp_config=fsdp_config)
        return FSDPLiteTrainer(
            model=build("hf_llama"), args=TrainingArguments(**settings), **kwargs
        )

    _expect(ValueError, "activation_checkpointing", lambda: make({"activation_checkpointing": 1}))
    _expect(ValueError, "version", lambda: make({"version": 3}))
    _expect(
        ValueError, "NoSuchLayer", lambda: make({"transformer_layer_cls_to_wrap": "NoSuchLayer"})
    )
    optimizer = torch.optim.AdamW(build("hf_llama").parameters())
    _expect(ValueError, "optimizers=", lambda: make(optimizers=(optimizer, None)))


CHECKS = {
    "fp32": lambda out, rank: _fronts_are_ddp(out / "fp32", rank, KINDS, save=True),
    # with Trainer's activation checkpointing too (the model's own, around each layer's call)
    "bf16": lambda out, rank: _fronts_are_ddp(
        out / "bf16", rank, BF16_KINDS, save=False, bf16=True, activation_checkpointing=True
    ),
    "clipping": lambda out, rank: _clipping(out / "clip", rank),
    "resume_fsdp2_sharded": lambda out, rank: _resume(out / "r2", "fsdp2", "SHARDED_STATE_DICT"),
    "resume_fsdp1_full": lambda out, rank: _resume(out / "r1", "fsdp1", "FULL_STATE_DICT"),
    "resume_save_only_model": lambda out, rank: _resume_save_only_model(out / "r0"),
    "best_model_at_end": lambda out, rank: _best_model_at_end(out / "best", rank),
    "plans": lambda out, rank: _plans(out / "plans", rank),
    "refusals": lambda out, rank: _refusals(out / "refused", rank),
}


def _rank(rank: int, world_size: int, out: str) -> dict[str, str]:
    _join_hf(rank, world_size)
    return run_checks(CHECKS, list(CHECKS), Path(out), rank)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer")
    return out, run_ranks(_rank, 2, out, timeout=240, args=(str(out),))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHECKS))
def test_trainer_on_fsdp_lite(results, name):
    out, failures = results
    for rank, failed in enumerate(failures):
        assert name not in failed, f"rank {rank}:\n{failed[name]}"
    if name in ("fp32", "bf16"):  # the numbers docs/integrations.md quotes (pytest -s shows them)
        print(f"\n{name}: " + (out / name / "losses.json").read_text())


def test_the_private_names_the_integrations_use_are_as_pinned():
    """TRANSFORMERS_PRIVATE_API and ACCELERATE_PRIVATE_API were read off the versions that
    pyproject.toml pins; a new version must be read again (then update the pins and names)."""
    from transformers import PreTrainedModel, Trainer

    from fsdp_lite.integrations.accelerate import ACCELERATE_PRIVATE_API
    from fsdp_lite.integrations.transformers import TRANSFORMERS_PRIVATE_API

    pins = dict(
        re.findall(r'"(transformers|accelerate)==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    )
    assert transformers.__version__ == pins["transformers"], "read TRANSFORMERS_PRIVATE_API again"
    assert accelerate.__version__ == pins["accelerate"], "read ACCELERATE_PRIVATE_API again"
    owners = {"Trainer": Trainer, "PreTrainedModel": PreTrainedModel}
    for name, signature in TRANSFORMERS_PRIVATE_API.items():
        owner, attr = name.split(".")
        if signature is not None:
            assert str(inspect.signature(getattr(owners[owner], attr))) == signature, name
        elif owner == "Trainer":  # an instance attribute that __init__ sets
            assert f"self.{attr} = None" in inspect.getsource(Trainer.__init__), name
        else:
            assert isinstance(getattr(owners[owner], attr), (list, type(None))), name
    from transformers import LlamaForCausalLM

    assert LlamaForCausalLM._no_split_modules == ["LlamaDecoderLayer"]
    # Accelerate's registries: checked on a prepared accelerator in tests/test_accelerate.py
    assert ACCELERATE_PRIVATE_API == ("Accelerator._models", "Accelerator._optimizers")


# A Trainer script as a user writes it (fsdp=True: on this CPU machine Trainer's own run is DDP,
# Accelerate enables FSDP on GPU-type backends only). The test runs it as written and with its
# Trainer import changed.
USER_SCRIPT = """
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
from transformers import Trainer

out = sys.argv[1]
torch.manual_seed(0)
config = LlamaConfig(vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                     attn_implementation="eager")
model = LlamaForCausalLM(config)
ids = torch.randint(0, 61, (40, 12), generator=torch.Generator().manual_seed(1))
rows = [{"input_ids": row, "labels": row} for row in ids]
args = TrainingArguments(output_dir=out, fsdp=True, bf16=True, max_steps=4,
                         per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True,
                         save_strategy="no", seed=0, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=rows[:32], eval_dataset=rows[32:])
trainer.train()
metrics = trainer.evaluate()
trainer.save_model()
if trainer.is_world_process_zero():
    history = [e for e in trainer.state.log_history if "loss" in e]
    with open(out + "/result.json", "w") as f:
        json.dump({"losses": [e["loss"] for e in history],
                   "grad_norms": [e["grad_norm"] for e in history],
                   "eval_loss": metrics["eval_loss"]}, f)
# Leave together, then tear down (fsdp_lite/tools/launch.py, leave_together: a gloo thread that
# outlives the last collective can abort the interpreter's exit).
from fsdp_lite.tools.launch import leave_together
leave_together()
torch.distributed.destroy_process_group()
"""
SWAPPED = "from fsdp_lite.integrations.transformers import FSDPLiteTrainer as Trainer"


def _run_script(script: Path, out: Path, reference: bool = False) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(script), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    if reference and proc.returncode != 0 and any(s in proc.stderr for s in _NATIVE_CRASHES):
        # torch's gloo teardown abort (tests/test_swap_in.py): the reference, DDP, gets one more
        # try, with a warning; fsdp_lite's run gets none.
        warnings.warn(
            f"the DDP run crashed at exit; rerunning it:\n{proc.stderr[-2000:]}", stacklevel=2
        )
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{script.name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
def test_a_trainer_script_with_only_its_import_changed_trains_as_its_ddp_run(tmp_path):
    import safetensors.torch

    swapped = USER_SCRIPT.replace("from transformers import Trainer", SWAPPED)
    changed = [a for a, b in zip(USER_SCRIPT.splitlines(), swapped.splitlines()) if a != b]
    assert changed == ["from transformers import Trainer"]
    runs = {}
    for name, text in (("ddp", USER_SCRIPT), ("fsdp_lite", swapped)):
        script = tmp_path / f"{name}_script.py"  # not fsdp_lite.py: it would shadow the package
        script.write_text(text)
        runs[name] = _run_script(script, tmp_path / name, reference=name == "ddp")
    # Clipping (max_grad_norm 1.0) stays inactive at these norms, so the math is DDP's: bitwise.
    assert all(n < 1.0 for n in runs["ddp"]["grad_norms"]), runs["ddp"]["grad_norms"]
    assert runs["fsdp_lite"]["losses"] == runs["ddp"]["losses"]
    assert runs["fsdp_lite"]["eval_loss"] == runs["ddp"]["eval_loss"]
    weights = {
        n: safetensors.torch.load_file(str(tmp_path / n / "model.safetensors")) for n in runs
    }
    _assert_same_weights(weights["fsdp_lite"], weights["ddp"], "saved model")
    print(f"\nscript, bf16, fsdp=True: {json.dumps(runs)}")  # pytest -s shows the numbers
