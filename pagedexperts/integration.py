"""Integration with transformers' experts registry: one stateless dispatcher, registered once.

Owns: the registry key (transformers 5.x calls ``fn(experts_module, hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k])`` for every MoE layer whose config names it), the
attachment attribute (the function forwards to the runner attached to the module it is called
with, so models with different K live side by side), the custom op
``torch.ops.pagedexperts.experts_step`` with its fake implementation and weak-reference module
table, ``follow_decode_switch`` and ``install_padding_hook``. Why a custom op: docs/design.md.
Does not: build runners (``loading``).
"""

from __future__ import annotations

import contextlib
import types
import weakref

import torch

IMPLEMENTATION_NAME = "pagedexperts"
RUNNER_ATTR = "_pagedexperts_runner"
KEY_ATTR = "_pagedexperts_key"

# key -> experts module, weakly: how the custom op finds its module (see module docstring)
_EXPERTS_MODULES: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()


def attach(module: torch.nn.Module, runner) -> None:
    """Attach ``runner`` (a ``paging.runner_contract.ExpertsRunner``: an executor or a baseline) to an
    experts module."""
    setattr(module, RUNNER_ATTR, runner)
    setattr(module, KEY_ATTR, id(module))
    _EXPERTS_MODULES[id(module)] = module


@torch.library.custom_op("pagedexperts::experts_step", mutates_args=())
def experts_step(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    padding_count: torch.Tensor | None,
    module_key: int,
) -> torch.Tensor:
    """The paged experts step of the module registered under ``module_key`` ([T, H], [T, k],
    [T, k], 0-dim padding rows or None -> [T, H] in hidden_states.dtype)."""
    module = _EXPERTS_MODULES[module_key]
    return getattr(module, RUNNER_ATTR).step(module, hidden_states, top_k_index, top_k_weights, padding_count)


@experts_step.register_fake
def _experts_step_fake(hidden_states, top_k_index, top_k_weights, padding_count, module_key):
    return hidden_states.new_empty(hidden_states.shape)


def paged_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Experts step of a paged layer: [T, H], [T, k], [T, k] -> [T, H]: the runner's ``step``, called
    directly in eager mode and for an ``inline`` runner, else through the opaque custom op.

    Raises:
        RuntimeError: the module has no runner attached (not loaded through ``pagedexperts.load_model``).
    """
    runner = getattr(module, RUNNER_ATTR, None)
    if runner is None:
        raise RuntimeError(
            f"{type(module).__name__} has no experts runner attached but its model selects the "
            f"{IMPLEMENTATION_NAME!r} experts implementation; load it with pagedexperts.load_model"
        )
    if runner.inline or not torch.compiler.is_compiling():
        return runner.step(module, hidden_states, top_k_index, top_k_weights, runner.padding_count)
    return experts_step(hidden_states, top_k_index, top_k_weights, runner.padding_count, getattr(module, KEY_ATTR))


def register() -> None:
    """Register the dispatcher under IMPLEMENTATION_NAME (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if ALL_EXPERTS_FUNCTIONS.get(IMPLEMENTATION_NAME) is not paged_experts_forward:
        ExpertsInterface.register(IMPLEMENTATION_NAME, paged_experts_forward)


def set_implementation(model: torch.nn.Module, name: str) -> None:
    """Select experts implementation ``name`` on ``model`` and all its sub-configs."""
    if name == IMPLEMENTATION_NAME:
        register()
    model.set_experts_implementation(name)


class _InnerImplementations:
    """What transformers' ``_optimize_model_for_decode`` sees of a paged model: its runners'
    inner implementation in place of the registry key, and the model's device."""

    def __init__(self, model, runners: dict) -> None:
        self._model = model
        self._runners_of = runners

    @property
    def device(self):
        return self._model.device

    def _runners(self):
        return list(self._runners_of.values())

    def get_experts_implementation(self) -> dict[str, str]:
        return {"": self._runners()[0].inner}

    def set_experts_implementation(self, implementation) -> None:
        name = implementation.get("", None) if isinstance(implementation, dict) else implementation
        for runner in self._runners():
            runner.inner = name


def follow_decode_switch(model, runners: dict) -> None:
    """Make ``model.generate`` switch the runners' inner implementation exactly as it switches an
    unpaged model's (transformers' ``_optimize_model_for_decode``, run on a view of the paged model
    whose implementation is the inner one of ``runners``, read per call), so paged and unpaged
    decode with the same kernel.
    """
    original = getattr(type(model), "_optimize_model_for_decode", None)
    if original is None:  # a transformers release without the switch: nothing to follow
        return

    @contextlib.contextmanager
    def optimize_for_decode(self):
        with original(_InnerImplementations(self, runners)):
            yield

    model._optimize_model_for_decode = types.MethodType(optimize_for_decode, model)


# -- hooks: the step's padding rows for every runner --


def batch_seq(kwargs: dict, args: tuple) -> tuple[int, int]:
    """(B, T) of a model call, from its input_ids (keyword or first positional) or inputs_embeds."""
    ids = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    if ids is None:
        ids = kwargs["inputs_embeds"]
    return ids.shape[0], ids.shape[1]


def padding_count(kwargs: dict, args: tuple) -> torch.Tensor | None:
    """Padding rows of a model call as a 0-dim int64 tensor on the mask's device (no sync), or
    None without a 2-D attention mask."""
    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return None
    seq = batch_seq(kwargs, args)[1]
    return (mask[:, -seq:] == 0).sum()


def install_padding_hook(model, runners: dict) -> None:
    """Before each forward, give every runner of ``runners`` (the runtime's own dict, read per call:
    it follows ``repage``) the step's padding count (``padding_count``).
    """

    def hook(module, args, kwargs):
        count = padding_count(kwargs, args)
        for runner in runners.values():
            runner.padding_count = count

    model.register_forward_pre_hook(hook, with_kwargs=True)
