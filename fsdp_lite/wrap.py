"""Choosing units: which submodules become their own FullyShardedDataParallel unit.

It runs once, in the FSDP constructor, before any parameter is sharded. It owns the auto-wrap
policies (plain callables and `Policy` objects), `enable_wrap` / `wrap` for manual wrapping, and
`auto_wrap`, which replaces each chosen submodule in its parent by `wrapper_cls(submodule, **kw)`.
Names, signatures and choices mirror torch FSDP's `wrap` module and FSDP1's `_auto_wrap`, so a
policy picks the same units as in torch. It knows nothing about sharding: module.py resolves ignored
modules and params, calls `auto_wrap`, and wraps the root itself.
"""

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch.nn as nn

# torch's public names; auto_wrap is fsdp_lite's own, called by module.py
__all__ = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "enable_wrap",
    "wrap",
    "CustomPolicy",
    "ModuleWrapPolicy",
]


def _as_class_tuple(module_classes: Any, arg_name: str) -> tuple[type, ...]:
    """Checks `module_classes` is a collection of classes; returns it as a tuple for isinstance."""
    # torch calls tuple(module_classes) once per module: a bare class or a string fails there with
    # an obscure TypeError, and an iterator is used up by the first module, so that nothing after
    # it is wrapped, silently
    is_iterable = isinstance(module_classes, Iterable)
    if isinstance(module_classes, (type, str, Iterator)) or not is_iterable:
        raise TypeError(
            f"{arg_name} must be a set of nn.Module classes such as {{nn.Linear}}, "
            f"got {module_classes!r}"
        )
    classes = tuple(module_classes)
    not_classes = [c for c in classes if not isinstance(c, type)]
    if not_classes:
        raise TypeError(f"{arg_name} must contain only classes, got {not_classes!r}")
    return classes


# Callable policies. _recursive_wrap calls each one twice per module: with recurse=True to ask
# whether to descend into the children, then, once the children are done, with recurse=False to ask
# whether to wrap the module itself, nonwrapped_numel then counting only params no child took.


def always_wrap_policy(*args, **kwargs) -> bool:
    """Wraps every submodule (and always recurses)."""
    return True


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable
) -> bool:
    """Always recurses; wraps `module` if `lambda_fn(module)` is true."""
    if recurse:
        return True
    return lambda_fn(module)


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: set[type[nn.Module]],
) -> bool:
    """Wraps each instance of `transformer_layer_cls`, e.g. `{Block}`; the root unit keeps the rest,
    so an embedding and the lm_head tied to it stay in one unit."""
    if recurse:
        return True
    return isinstance(module, _as_class_tuple(transformer_layer_cls, "transformer_layer_cls"))


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wraps a module once its not-yet-wrapped params reach a size.

    Args:
        min_num_params: numel (not a count of params) that a module's not-yet-wrapped params must
            reach for it to be wrapped, and its whole subtree to be recursed into. Default 1e8.
        force_leaf_modules: classes whose children are never wrapped. Default
            `size_based_auto_wrap_policy.FORCE_LEAF_MODULES`, `{nn.MultiheadAttention}`.
        exclude_wrap_modules: classes never wrapped themselves (their children may be). Default
            `size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES`, `{nn.ModuleList, nn.ModuleDict}`.
    """
    if force_leaf_modules is None:
        force_leaf_modules = size_based_auto_wrap_policy.FORCE_LEAF_MODULES
    if exclude_wrap_modules is None:
        exclude_wrap_modules = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(
            module, _as_class_tuple(force_leaf_modules, "force_leaf_modules")
        )
    return is_large and not isinstance(
        module, _as_class_tuple(exclude_wrap_modules, "exclude_wrap_modules")
    )


# Function attributes, as in torch, so users can read and extend the defaults.
# MultiheadAttention reads its out_proj weight directly instead of calling out_proj, so a wrapped
# out_proj would never be unsharded; ModuleList and ModuleDict have no forward to hook.
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}


class Policy(ABC):
    """A policy that picks all units up front, each with its own constructor kwargs."""

    @abstractmethod
    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> dict[nn.Module, dict[str, Any]]:
        """Maps each module to wrap to the kwargs for its wrapper; may include the root."""


_Policy = Policy  # torch's name


class ModuleWrapPolicy(Policy):
    """Wraps every module of the given classes, each with a copy of the root's kwargs."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        if isinstance(module_classes, Iterator):  # read once here, so an iterator is fine
            module_classes = list(module_classes)
        self._module_classes = set(_as_class_tuple(module_classes, "module_classes"))

    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> dict[nn.Module, dict[str, Any]]:
        module_classes = tuple(self._module_classes)
        return {
            module: dict(root_kwargs)  # a copy each, so one unit's overrides stay its own
            for module in root_module.modules()
            if module not in ignored_modules and isinstance(module, module_classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args, **kwargs) -> bool:
        # torch keeps ModuleWrapPolicy usable as a callable policy too
        return recurse or isinstance(module, tuple(self._module_classes))

    def __repr__(self) -> str:
        return super().__repr__() + f"({self._module_classes})"


class CustomPolicy(Policy):
    """Asks `lambda_fn(module)` about every module: False or {} skips it, True wraps it with the
    root's kwargs, and a non-empty dict wraps it with those kwargs overriding the root's."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]):
        self._lambda_fn = lambda_fn

    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> dict[nn.Module, dict[str, Any]]:
        target_module_to_kwargs: dict[nn.Module, dict[str, Any]] = {}
        for module in root_module.modules():
            if module in ignored_modules:
                continue
            res = self._lambda_fn(module)
            if not isinstance(res, (dict, bool)):
                raise ValueError(
                    "The lambda_fn passed to CustomPolicy should return False/True or a kwarg "
                    f"dict, but it returned {res}"
                )
            if res:
                overrides = res if isinstance(res, dict) else {}
                target_module_to_kwargs[module] = {**root_kwargs, **overrides}
        return target_module_to_kwargs


class _ConfigAutoWrap:
    """The wrapper class and kwargs of the active `enable_wrap` block; never instantiated."""

    # The one piece of process-wide state in fsdp_lite: wrap() is called deep inside user model
    # constructors, which cannot be handed a config argument, so enable_wrap must leave the config
    # where wrap() can find it. torch keeps it on this class too; enable_wrap clears it on exit.
    in_autowrap_context: bool = False
    wrapper_cls: Callable | None = None
    kwargs: dict[str, Any] = {}


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Generator[None, None, None]:
    """Makes `wrap(module)` return `wrapper_cls(module, **wrapper_kwargs)` inside the block.

    Args:
        wrapper_cls: class (or function) `wrap` applies, e.g. FullyShardedDataParallel.
        **wrapper_kwargs: constructor kwargs for each `wrap` in the block, which may override them.
    """
    if _ConfigAutoWrap.in_autowrap_context:
        raise NotImplementedError(
            "You are already within an autowrap context and we currently do not supported nested "
            "autowrap."
        )
    _ConfigAutoWrap.in_autowrap_context = True
    _ConfigAutoWrap.wrapper_cls = wrapper_cls
    _ConfigAutoWrap.kwargs = wrapper_kwargs
    try:
        yield
    finally:
        _ConfigAutoWrap.in_autowrap_context = False
        _ConfigAutoWrap.wrapper_cls = None
        _ConfigAutoWrap.kwargs = {}


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wraps `module` with the `enable_wrap` block's wrapper class and kwargs; `wrap_overrides` win.

    Outside an `enable_wrap` block it returns `module` unchanged, so one model definition builds
    with or without wrapping.
    """
    if not _ConfigAutoWrap.in_autowrap_context:
        return module
    return _ConfigAutoWrap.wrapper_cls(module, **{**_ConfigAutoWrap.kwargs, **wrap_overrides})


def auto_wrap(
    root_module: nn.Module,
    policy: Callable | Policy | None,
    wrapper_cls: Callable,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    root_kwargs: dict[str, Any],
) -> None:
    """Replaces each submodule `policy` picks, in its parent, by `wrapper_cls(submodule, **kwargs)`.

    Children are wrapped before their parents; `root_module` itself is never wrapped (the caller
    wraps it). The units are the ones torch FSDP1 picks for the same policy.

    Args:
        root_module: the module passed to the FSDP constructor.
        policy: None (wrap nothing), a callable policy, or a `Policy` (`ModuleWrapPolicy`,
            `CustomPolicy`); anything else raises TypeError.
        wrapper_cls: called as `wrapper_cls(module, **kwargs)`. A submodule that is already an
            instance of it raises ValueError: manual wrapping and auto-wrapping do not mix.
        ignored_modules: modules whose subtrees are never wrapped (the subtrees are added here).
        ignored_params: params that size-based policies do not count (ignored_modules' are added).
        root_kwargs: the root's constructor kwargs. Each wrapper gets them without
            "auto_wrap_policy", with `CustomPolicy` and mixed-precision overrides merged over them.
    """
    if policy is None:
        return
    # duck-typed so torch's own ModuleWrapPolicy / CustomPolicy objects work here too
    is_policy = isinstance(policy, Policy) or callable(getattr(policy, "_run_policy", None))
    if not is_policy and not callable(policy):
        raise TypeError(
            "auto_wrap_policy must be a callable or a Policy (ModuleWrapPolicy, CustomPolicy), "
            f"got {type(policy).__name__}"
        )
    ignored_modules = {m for ignored in ignored_modules for m in ignored.modules()}
    ignored_params = set(ignored_params) | {p for m in ignored_modules for p in m.parameters()}
    # nested units must not auto-wrap again; torch drops the key for callables, sets None for Policy
    root_kwargs = {k: v for k, v in root_kwargs.items() if k != "auto_wrap_policy"}
    # FSDP1 requires a tree with no units yet (manual wrapping and auto-wrapping do not mix)
    for name, module in root_module.named_modules():
        if _is_wrapped(module, wrapper_cls):
            raise ValueError(
                "FSDP auto wrapping requires modules to not already have FSDP applied but "
                f"found {name} in\n{root_module}"
            )
    # MixedPrecision._module_classes_to_ignore (default: BatchNorm) become units of their own with
    # mixed_precision=None, whatever the policy; module.py / mixed_precision.py add the fp32 casts
    mixed_precision = root_kwargs.get("mixed_precision")
    fp32_classes = tuple(getattr(mixed_precision, "_module_classes_to_ignore", ()))

    if is_policy:
        target_module_to_kwargs = policy._run_policy(root_module, ignored_modules, root_kwargs)
        if mixed_precision is not None:
            for module in root_module.modules():
                if module not in ignored_modules and isinstance(module, fp32_classes):
                    kwargs = target_module_to_kwargs.get(module, root_kwargs)
                    target_module_to_kwargs[module] = {**kwargs, "mixed_precision": None}
        wrapped = _wrap_post_order(root_module, target_module_to_kwargs, wrapper_cls)
        _point_aliases_at_wrappers(root_module, wrapped)
        return

    def wrap_fn(module: nn.Module) -> nn.Module:
        if mixed_precision is not None and isinstance(module, fp32_classes):
            return wrapper_cls(module, **{**root_kwargs, "mixed_precision": None})
        return wrapper_cls(module, **root_kwargs)

    if mixed_precision is not None:  # even with no classes to ignore, as in torch
        policy = functools.partial(_or_wrap_classes, policy=policy, module_classes=fp32_classes)
    wrapped: dict[nn.Module, nn.Module] = {}
    _recursive_wrap(
        root_module, policy, wrap_fn, wrapper_cls, ignored_modules, ignored_params, wrapped, True
    )
    _point_aliases_at_wrappers(root_module, wrapped)


def _point_aliases_at_wrappers(root_module: nn.Module, wrapped: dict[nn.Module, nn.Module]) -> None:
    """A module registered under several names (``self.alias = self.block``, or two parents)
    is wrapped once; every other name is pointed at that wrapper too, so each path runs the
    unit's hooks. (``named_children`` lists a module once, so only ``_modules`` shows them.)
    torch FSDP1 leaves the other names on the bare module, whose sharded parameters then fail
    in forward ("mat2 must be a matrix")."""
    for module in list(root_module.modules()):
        for name, child in list(module._modules.items()):
            wrapper = wrapped.get(child) if child is not None else None
            if wrapper is not None and wrapper is not module:
                setattr(module, name, wrapper)


def _or_wrap_classes(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, policy: Callable, module_classes: tuple
) -> bool:
    """`policy`, or else wrap each instance of `module_classes`; always recurses, as in torch."""
    return policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) or (
        recurse or isinstance(module, module_classes)
    )


def _is_wrapped(module: nn.Module, wrapper_cls: Callable) -> bool:
    """Whether `module` is already a unit; a wrapper function, not a class, cannot be checked."""
    return isinstance(wrapper_cls, type) and isinstance(module, wrapper_cls)


def _recursive_wrap(
    module: nn.Module,
    policy: Callable,
    wrap_fn: Callable[[nn.Module], nn.Module],
    wrapper_cls: Callable,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    wrapped: dict[nn.Module, nn.Module],
    only_wrap_children: bool = False,
) -> tuple[nn.Module, int]:
    """Wraps the subtree for a callable policy; returns (module or its wrapper, numel wrapped).
    ``wrapped`` maps each module wrapped so far to its wrapper: a module under two parents is
    wrapped on the first visit and handed back on the second."""
    if module in wrapped:
        return wrapped[module], 0
    for child in module.modules():
        if child not in ignored_modules and _is_wrapped(child, wrapper_cls):
            raise AssertionError(f"Child module {child} is already wrapped by {wrapper_cls}")
    # counted before any child is wrapped; each wrapped child then subtracts what it took
    nonwrapped_numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel):
        return module, 0
    total_wrapped_numel = 0
    for name, child in module.named_children():
        if child in ignored_modules:
            continue
        wrapped_child, num_wrapped_params = _recursive_wrap(
            child, policy, wrap_fn, wrapper_cls, ignored_modules, ignored_params, wrapped
        )
        setattr(module, name, wrapped_child)
        total_wrapped_numel += num_wrapped_params
    # a param tied across two wrapped children is counted twice: this can be negative, as in torch
    remainder = nonwrapped_numel - total_wrapped_numel
    if not only_wrap_children and policy(module=module, recurse=False, nonwrapped_numel=remainder):
        wrapped[module] = wrap_fn(module)
        return wrapped[module], nonwrapped_numel
    return module, total_wrapped_numel


def _wrap_post_order(
    root_module: nn.Module,
    target_module_to_kwargs: dict[nn.Module, dict[str, Any]],
    wrapper_cls: Callable,
) -> dict[nn.Module, nn.Module]:
    """Wraps the modules a `Policy` picked, children before parents, each with its own kwargs;
    returns each wrapped module's wrapper."""
    # a module shared by two parents is visited, and so wrapped, once: under its first parent
    visited: set[nn.Module] = {root_module}
    wrapped: dict[nn.Module, nn.Module] = {}

    def visit(module: nn.Module, name: str, parent: nn.Module | None) -> None:
        for child_name, child in module.named_children():
            if child not in visited:
                visited.add(child)
                visit(child, child_name, module)
        if module in target_module_to_kwargs and module is not root_module:
            wrapped[module] = wrapper_cls(module, **target_module_to_kwargs[module])
            setattr(parent, name, wrapped[module])

    visit(root_module, "", None)
    return wrapped
