"""Integration with transformers' experts registry: one stateless dispatcher, registered once.

transformers 5.x calls ``fn(experts_module, hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k])`` for every MoE layer whose config names ``fn``'s registry key as its
experts implementation (``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``). The registry
is process-global, so the function registered here holds no state: it forwards to the
``ExpertPager`` attached to the experts module it is called with. Two models with different K
therefore live side by side in one process.

The step runs as the custom op ``torch.ops.pagedexperts.experts_step`` (``torch.library``),
with a fake implementation (output [T, H] like hidden_states), so ``torch.compile`` keeps the
rest of the model in its graph and treats the paged step as one opaque call: the host-side
planning and the page-ins run eagerly inside it (the approach of vLLM's expert cache, which
makes the MoE op its graph's splitting op). A custom op takes tensors and numbers, not modules:
the experts module is found by an integer key in a table of weak references, filled when a
runner is attached (``attach``), a lookup that holds nothing alive.

Owns: the registry key, the attachment attribute, the custom op and its module table, and following ``generate``'s decode-time switch of experts implementation
(``follow_decode_switch``). Does not: build pagers (``loader``).
"""

from __future__ import annotations

import contextlib
import types
import weakref

import torch

IMPLEMENTATION_NAME = "pagedexperts"
PAGER_ATTR = "_pagedexperts_pager"
KEY_ATTR = "_pagedexperts_key"

# key -> experts module, weakly: how the custom op finds its module (see module docstring)
_EXPERTS_MODULES: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()


def attach(module: torch.nn.Module, runner) -> None:
    """Attach ``runner`` (an ``ExpertPager`` or a baseline of ``modes``) to an experts module."""
    setattr(module, PAGER_ATTR, runner)
    setattr(module, KEY_ATTR, id(module))
    _EXPERTS_MODULES[id(module)] = module


class InlineRunner:
    """Contract of a runner whose step is the model's own device math and nothing else (no
    host read, no Python decision: ``modes.ResidentRunner``). It is called inline, not through
    the opaque custom op: eager skips the op's dispatcher round trip (its autograd and dynamo-disable wrappers) and
    ``torch.compile`` traces it like the unpaged model."""


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
    runner = getattr(module, PAGER_ATTR)
    runner.padding_count = padding_count
    return runner(module, hidden_states, top_k_index, top_k_weights)


@experts_step.register_fake
def _experts_step_fake(hidden_states, top_k_index, top_k_weights, padding_count, module_key):
    return hidden_states.new_empty(hidden_states.shape)


def paged_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Experts step of a paged layer: [T, H], [T, k], [T, k] -> [T, H].

    Raises:
        RuntimeError: the module has no pager attached (the model was not loaded through
            ``pagedexperts.load_model`` / ``attach_pagers``).
    """
    pager = getattr(module, PAGER_ATTR, None)
    if pager is None:
        raise RuntimeError(
            f"{type(module).__name__} has no pager attached but its model selects the "
            f"{IMPLEMENTATION_NAME!r} experts implementation; load it with pagedexperts.load_model"
        )
    if isinstance(pager, InlineRunner):
        return pager(module, hidden_states, top_k_index, top_k_weights)
    return experts_step(hidden_states, top_k_index, top_k_weights, pager.padding_count, getattr(module, KEY_ATTR))


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

    def __init__(self, model) -> None:
        self._model = model

    @property
    def device(self):
        return self._model.device

    def _runners(self):
        return list(self._model.pagedexperts.pagers.values())

    def get_experts_implementation(self) -> dict[str, str]:
        return {"": self._runners()[0].inner}

    def set_experts_implementation(self, implementation) -> None:
        name = implementation.get("", None) if isinstance(implementation, dict) else implementation
        for runner in self._runners():
            runner.inner = name


def follow_decode_switch(model) -> None:
    """Make ``model.generate`` switch the runners' inner implementation exactly as it switches
    an unpaged model's: transformers' own ``_optimize_model_for_decode`` (5.17 to 5.24: on a
    non-CPU device, ``grouped_mm`` -> ``batched_mm`` for the decode loop, restored after) runs
    on a view of the paged model whose implementation is the runners' inner one. Without it the
    paged model (implementation "pagedexperts") would decode with ``grouped_mm`` while the
    unpaged reference decodes with ``batched_mm``: two kernels, not bit-identical.
    """
    original = getattr(type(model), "_optimize_model_for_decode", None)
    if original is None:  # a transformers release without the switch: nothing to follow
        return

    @contextlib.contextmanager
    def optimize_for_decode(self):
        with original(_InnerImplementations(self)):
            yield

    model._optimize_model_for_decode = types.MethodType(optimize_for_decode, model)
