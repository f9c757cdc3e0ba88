"""fsdp_lite.wrap picks the same units as native torch FSDP1 for the same model, policy, ignores.

Native FSDP1 runs in this process on a 1-rank gloo group. Our side wraps with `_Marker`, a stand-in
unit that keeps the wrapped module under torch's attribute name and records its constructor kwargs.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as NativeFSDP
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp import wrap as torch_wrap

from fsdp_lite import wrap as lite_wrap
from fsdp_lite.wrap import auto_wrap, enable_wrap, wrap

# FSDP1 warns that it is deprecated, and about wrapping containers with no forward: not our concern
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

CPU = torch.device("cpu")


class _Marker(nn.Module):
    """Stands in for one unit; holds the module as torch's FSDP does and the kwargs it was given."""

    def __init__(self, module: nn.Module, **kwargs):
        super().__init__()
        self._fsdp_wrapped_module = module
        self.kwargs = kwargs

    def forward(self, *args, **kwargs):
        return self._fsdp_wrapped_module(*args, **kwargs)


# ---- models -------------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block: attention-ish Linears, LayerNorms and an MLP."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Embedding, Blocks, final norm, and an lm_head tied to the embedding weight."""

    def __init__(self, vocab: int = 50, dim: int = 16, num_blocks: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


class AttnBN(nn.Module):
    """Exercises size_based's rules (MultiheadAttention is a forced leaf, ModuleList / ModuleDict
    are never wrapped themselves) and BatchNorm split off under mixed precision."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, num_heads=2, batch_first=True)
        self.bn = nn.BatchNorm1d(dim)
        self.heads = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])
        self.table = nn.ModuleDict(
            {"up": nn.Linear(dim, 4 * dim), "mix": nn.Sequential(nn.Linear(4 * dim, 4 * dim))}
        )
        self.out = nn.Linear(4 * dim, dim)


def mlp():
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
    )


def nested():
    return nn.Sequential(
        nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8))),
        nn.Linear(8, 100),
        nn.Sequential(nn.Linear(100, 4), nn.Sequential(nn.Linear(4, 4))),
        nn.Linear(4, 4),
    )


# (name, build, modules to ignore in the built model)
MODELS = [
    ("mlp", mlp, lambda m: []),
    ("tiny_lm", TinyLM, lambda m: []),
    ("nested", nested, lambda m: []),
    ("attn_bn", AttnBN, lambda m: []),
    ("lm_ignored_block", TinyLM, lambda m: [m.blocks[1]]),
    ("nested_ignored", nested, lambda m: [m[0][1], m[1]]),
]

# (name, policy built from a wrap module: torch's or ours, which export the same names)
POLICIES = [
    ("always", lambda w: w.always_wrap_policy),
    ("size_1", lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=1)),
    ("size_300", lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=300)),
    ("size_2000", lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=2000)),
    ("size_default", lambda w: w.size_based_auto_wrap_policy),
    (
        "size_300_no_rules",
        lambda w: functools.partial(
            w.size_based_auto_wrap_policy,
            min_num_params=300,
            force_leaf_modules=set(),
            exclude_wrap_modules=set(),
        ),
    ),
    (
        "transformer_block",
        lambda w: functools.partial(w.transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    ),
    (
        "lambda_big_linear",
        lambda w: functools.partial(
            w.lambda_auto_wrap_policy,
            lambda_fn=lambda m: isinstance(m, nn.Linear) and m.weight.numel() >= 1000,
        ),
    ),
    ("module_wrap_block_linear", lambda w: w.ModuleWrapPolicy({Block, nn.Linear})),
    ("custom_all", lambda w: w.CustomPolicy(lambda m: True)),
    ("custom_mixed", lambda w: w.CustomPolicy(_custom_fn)),
]


def _custom_fn(module):
    """True for big Linears, an override dict for norms, False for the rest."""
    if isinstance(module, (nn.LayerNorm, nn.BatchNorm1d)):
        return {"forward_prefetch": True}
    return isinstance(module, nn.Linear) and module.out_features >= 32


# ---- helpers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gloo_group(tmp_path_factory):
    """A 1-rank gloo group for native FSDP1, shared by this file's tests."""
    if dist.is_initialized():
        yield
        return
    rdzv = tmp_path_factory.mktemp("rdzv") / "rdzv"
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part != "_fsdp_wrapped_module")


def _unit_names(root: nn.Module, unit_cls: type) -> set[str]:
    """Names of the wrapped submodules, as in the unwrapped model; the root ("") excluded."""
    return {_clean(name) for name, m in root.named_modules() if isinstance(m, unit_cls) and name}


def _native_units(build, ignored_fn, policy, **fsdp_kwargs) -> set[str]:
    torch.manual_seed(0)
    model = build()
    ignored = ignored_fn(model) or None
    fsdp = NativeFSDP(
        model, auto_wrap_policy=policy, device_id=CPU, ignored_modules=ignored, **fsdp_kwargs
    )
    return _unit_names(fsdp, NativeFSDP)


def _lite_wrap(build, ignored_fn, policy, **root_kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = build()
    ignored = set(ignored_fn(model))
    root_kwargs = {"auto_wrap_policy": policy, "device_id": CPU, **root_kwargs}
    auto_wrap(model, policy, _Marker, ignored, set(), root_kwargs)
    return model


# ---- parity with native FSDP1 -------------------------------------------------------------------


@pytest.mark.parametrize("policy_name, make_policy", POLICIES, ids=[p[0] for p in POLICIES])
@pytest.mark.parametrize("model_name, build, ignored_fn", MODELS, ids=[m[0] for m in MODELS])
def test_auto_wrap_picks_same_units_as_native_fsdp(
    gloo_group, model_name, build, ignored_fn, policy_name, make_policy
):
    expected = _native_units(build, ignored_fn, make_policy(torch_wrap))
    model = _lite_wrap(build, ignored_fn, make_policy(lite_wrap))
    assert _unit_names(model, _Marker) == expected, f"{model_name} / {policy_name}"
    assert not isinstance(model, _Marker), "the root is the caller's to wrap"
    for marker in model.modules():
        if isinstance(marker, _Marker):
            assert "auto_wrap_policy" not in marker.kwargs, "nested units must not auto-wrap again"


IGNORING_MODELS = [m for m in MODELS if "ignored" in m[0]]


@pytest.mark.parametrize(
    "model_name, build, ignored_fn", IGNORING_MODELS, ids=[m[0] for m in IGNORING_MODELS]
)
def test_ignored_roots_or_full_ignored_sets_pick_the_same_units(model_name, build, ignored_fn):
    # module.py may pass the roots the user gave or, as torch does, whole subtrees and their params
    policy = functools.partial(lite_wrap.size_based_auto_wrap_policy, min_num_params=1)
    from_roots = _unit_names(_lite_wrap(build, ignored_fn, policy), _Marker)
    torch.manual_seed(0)
    model = build()
    ignored_modules = {m for root in ignored_fn(model) for m in root.modules()}
    ignored_params = {p for m in ignored_modules for p in m.parameters()}
    auto_wrap(model, policy, _Marker, ignored_modules, ignored_params, {})
    assert _unit_names(model, _Marker) == from_roots


CALLABLE_POLICIES = [p for p in POLICIES if not p[0].startswith(("module_wrap", "custom"))]


@pytest.mark.parametrize(
    "policy_name, make_policy", CALLABLE_POLICIES, ids=[p[0] for p in CALLABLE_POLICIES]
)
def test_our_callable_policies_drive_native_fsdp_the_same(gloo_group, policy_name, make_policy):
    for model_name, build, ignored_fn in MODELS:
        expected = _native_units(build, ignored_fn, make_policy(torch_wrap))
        actual = _native_units(build, ignored_fn, make_policy(lite_wrap))
        assert actual == expected, f"{model_name} / {policy_name}"


MIXED_PRECISION_POLICIES = [
    p
    for p in POLICIES
    if p[0] in ("size_2000", "size_default", "lambda_big_linear", "custom_mixed")
]
MIXED_PRECISION_POLICIES.append(("module_wrap_linear", lambda w: w.ModuleWrapPolicy({nn.Linear})))


@pytest.mark.parametrize(
    "policy_name, make_policy",
    MIXED_PRECISION_POLICIES,
    ids=[p[0] for p in MIXED_PRECISION_POLICIES],
)
def test_mixed_precision_splits_off_batchnorm_as_native_fsdp(gloo_group, policy_name, make_policy):
    mixed_precision = MixedPrecision(param_dtype=torch.bfloat16)
    no_ignored = lambda m: []
    expected = _native_units(
        AttnBN, no_ignored, make_policy(torch_wrap), mixed_precision=mixed_precision
    )
    model = _lite_wrap(AttnBN, no_ignored, make_policy(lite_wrap), mixed_precision=mixed_precision)
    assert "bn" in expected
    assert _unit_names(model, _Marker) == expected
    assert model.bn.kwargs["mixed_precision"] is None, "BatchNorm runs without mixed precision"
    for name, marker in model.named_modules():
        if isinstance(marker, _Marker) and name != "bn":
            assert marker.kwargs["mixed_precision"] is mixed_precision, name


def test_mixed_precision_recurses_into_force_leaf_modules_as_native_fsdp(gloo_group):
    # torch ORs the policy with "wrap these classes", which always recurses, even with no classes
    mixed_precision = MixedPrecision(param_dtype=torch.bfloat16, _module_classes_to_ignore=())
    no_ignored = lambda m: []
    make_policy = lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=200)
    expected = _native_units(
        AttnBN, no_ignored, make_policy(torch_wrap), mixed_precision=mixed_precision
    )
    model = _lite_wrap(AttnBN, no_ignored, make_policy(lite_wrap), mixed_precision=mixed_precision)
    assert "attn.out_proj" in expected
    assert _unit_names(model, _Marker) == expected
    without_mixed_precision = _lite_wrap(AttnBN, no_ignored, make_policy(lite_wrap))
    assert "attn.out_proj" not in _unit_names(without_mixed_precision, _Marker)


def test_tied_embedding_and_lm_head_forward_unchanged_after_wrapping():
    tokens = torch.randint(0, 50, (2, 5))
    torch.manual_seed(0)
    expected = TinyLM()(tokens)
    # size_based never wraps the ModuleList, which has no forward of its own to call
    policy = functools.partial(lite_wrap.size_based_auto_wrap_policy, min_num_params=1)
    model = _lite_wrap(TinyLM, lambda m: [], policy)
    torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)
    assert model.lm_head._fsdp_wrapped_module.weight is model.embed._fsdp_wrapped_module.weight


def test_shared_module_is_one_unit_reached_from_both_parents(gloo_group):
    def build():
        shared = nn.Linear(4, 4)
        return nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared))

    make_policy = lambda w: w.ModuleWrapPolicy({nn.Linear})
    expected = _native_units(build, lambda m: [], make_policy(torch_wrap))
    model = _lite_wrap(build, lambda m: [], make_policy(lite_wrap))
    assert _unit_names(model, _Marker) == expected == {"0.0"}  # torch's units
    # torch leaves the second parent on the bare module (whose params are then sharded);
    # fsdp_lite points it at the same unit (wrap.py, _point_aliases_at_wrappers)
    assert isinstance(model[1][0], _Marker) and model[1][0] is model[0][0]


@pytest.mark.parametrize(
    "make_policy",
    [lambda w: w.always_wrap_policy, lambda w: w.CustomPolicy(lambda m: True)],
    ids=["always", "custom_all"],
)
def test_root_is_never_wrapped_even_by_a_wrapper_function(make_policy):
    wrapped = []

    def wrapper_fn(module, **kwargs):  # a function, not a class: torch allows it
        wrapped.append(module)
        return _Marker(module, **kwargs)

    model = mlp()
    auto_wrap(model, make_policy(lite_wrap), wrapper_fn, set(), set(), {})
    assert len(wrapped) == 5
    assert all(module is not model for module in wrapped)


def test_torch_policy_objects_are_accepted():
    # torch's CustomPolicy is not callable, so only its _run_policy can drive the walk
    policy = torch_wrap.CustomPolicy(lambda m: isinstance(m, Block) and {"forward_prefetch": True})
    model = _lite_wrap(TinyLM, lambda m: [], policy)
    assert _unit_names(model, _Marker) == {"blocks.0", "blocks.1", "blocks.2"}
    assert model.blocks[0].kwargs == {"device_id": CPU, "forward_prefetch": True}


# ---- kwargs reaching each unit ------------------------------------------------------------------


def test_custom_policy_dict_overrides_reach_wrapper_kwargs():
    policy = lite_wrap.CustomPolicy(
        lambda m: (
            {"forward_prefetch": True} if isinstance(m, nn.LayerNorm) else isinstance(m, Block)
        )
    )
    model = _lite_wrap(TinyLM, lambda m: [], policy, forward_prefetch=False)
    root_kwargs = {"device_id": CPU, "forward_prefetch": False}
    assert model.blocks[0].kwargs == root_kwargs
    assert model.norm.kwargs == {**root_kwargs, "forward_prefetch": True}
    inner_norm = model.blocks[0]._fsdp_wrapped_module.ln1
    assert inner_norm.kwargs == {**root_kwargs, "forward_prefetch": True}


def test_custom_policy_rejects_non_bool_non_dict():
    policy = lite_wrap.CustomPolicy(lambda m: 1)
    with pytest.raises(ValueError, match="should return False/True or a kwarg dict"):
        _lite_wrap(mlp, lambda m: [], policy)


def test_callable_policy_passes_root_kwargs_without_auto_wrap_policy():
    model = _lite_wrap(mlp, lambda m: [], lite_wrap.always_wrap_policy, sync_module_states=True)
    assert model[0].kwargs == {"device_id": CPU, "sync_module_states": True}


def test_enable_wrap_kwargs_match_torch():
    recorded = {}
    for name, w in (("torch", torch_wrap), ("lite", lite_wrap)):
        with w.enable_wrap(wrapper_cls=_Marker, a=1, b=2):
            unit = w.wrap(nn.Linear(2, 2), b=3)
        recorded[name] = unit.kwargs
    assert recorded["lite"] == recorded["torch"] == {"a": 1, "b": 3}


def test_wrap_outside_enable_wrap_returns_module_unchanged():
    linear = nn.Linear(2, 2)
    assert wrap(linear) is linear
    with enable_wrap(wrapper_cls=_Marker):
        assert isinstance(wrap(linear), _Marker)
    assert wrap(linear) is linear


def test_enable_wrap_cannot_nest_and_clears_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with enable_wrap(wrapper_cls=_Marker):
            with pytest.raises(NotImplementedError, match="nested autowrap"):
                with enable_wrap(wrapper_cls=_Marker):
                    pass
            raise RuntimeError("boom")
    linear = nn.Linear(2, 2)
    assert wrap(linear) is linear


# ---- errors and already-wrapped modules ---------------------------------------------------------


@pytest.mark.parametrize("bad_policy", [5, "size_based", {Block}], ids=["int", "str", "set"])
def test_invalid_policy_type_raises_type_error(bad_policy):
    msg = (
        r"auto_wrap_policy must be a callable or a Policy \(ModuleWrapPolicy, CustomPolicy\), "
        f"got {type(bad_policy).__name__}"
    )
    with pytest.raises(TypeError, match=msg):
        auto_wrap(mlp(), bad_policy, _Marker, set(), set(), {})


@pytest.mark.parametrize(
    "bad_classes",
    [Block, "Block", (c for c in [Block]), [Block, "Linear"]],
    ids=["bare_class", "str", "iterator", "str_in_list"],
)
def test_transformer_layer_cls_must_be_a_set_of_classes(bad_classes):
    policy = functools.partial(
        lite_wrap.transformer_auto_wrap_policy, transformer_layer_cls=bad_classes
    )
    with pytest.raises(TypeError, match="transformer_layer_cls must"):
        auto_wrap(TinyLM(), policy, _Marker, set(), set(), {})


def test_module_wrap_policy_rejects_bare_class_but_takes_iterator():
    with pytest.raises(TypeError, match="module_classes must be a set of nn.Module classes"):
        lite_wrap.ModuleWrapPolicy(Block)
    model = _lite_wrap(TinyLM, lambda m: [], lite_wrap.ModuleWrapPolicy(iter([Block])))
    assert _unit_names(model, _Marker) == {"blocks.0", "blocks.1", "blocks.2"}


def test_already_wrapped_submodule_raises_as_in_native_fsdp(gloo_group):
    torch.manual_seed(0)
    native = TinyLM()
    native.blocks[0] = NativeFSDP(native.blocks[0], device_id=CPU)
    with pytest.raises(ValueError, match="already"):
        NativeFSDP(native, auto_wrap_policy=torch_wrap.always_wrap_policy, device_id=CPU)

    for policy in (lite_wrap.always_wrap_policy, lite_wrap.ModuleWrapPolicy({nn.Linear})):
        model = TinyLM()
        model.blocks[0] = _Marker(model.blocks[0])
        with pytest.raises(ValueError, match="already have FSDP applied but found blocks.0"):
            auto_wrap(model, policy, _Marker, set(), set(), {})


def test_already_wrapped_modules_left_alone_without_policy():
    model = TinyLM()
    unit = _Marker(model.blocks[0])
    model.blocks[0] = unit
    auto_wrap(model, None, _Marker, set(), set(), {})
    assert model.blocks[0] is unit
    assert _unit_names(model, _Marker) == {"blocks.0"}


def test_module_shared_by_two_parents_trips_double_wrap_check_as_in_native_fsdp(gloo_group):
    def build():
        shared = nn.Sequential(nn.Linear(4, 4))
        return nn.Sequential(nn.Sequential(shared), nn.Sequential(shared))

    policy = torch_wrap.always_wrap_policy
    with pytest.raises(AssertionError, match="already wrapped"):
        NativeFSDP(build(), auto_wrap_policy=policy, device_id=CPU)
    with pytest.raises(AssertionError, match="already wrapped"):
        auto_wrap(build(), lite_wrap.always_wrap_policy, _Marker, set(), set(), {})


def test_size_based_defaults_match_torch():
    ours, theirs = lite_wrap.size_based_auto_wrap_policy, torch_wrap.size_based_auto_wrap_policy
    assert ours.FORCE_LEAF_MODULES == theirs.FORCE_LEAF_MODULES
    assert ours.EXCLUDE_WRAP_MODULES == theirs.EXCLUDE_WRAP_MODULES
    assert set(lite_wrap.__all__) == set(torch_wrap.__all__)
    assert lite_wrap._Policy is lite_wrap.Policy
