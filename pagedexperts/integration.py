"""Integration with transformers' experts registry: one stateless dispatcher, registered once.

transformers 5.x calls ``fn(experts_module, hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k])`` for every MoE layer whose config names ``fn``'s registry key as its
experts implementation (``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``). The registry
is process-global, so the function registered here holds no state: it forwards to the runner
(``paging.runner_contract.ExpertsRunner``) attached to the experts module it is called with. Two models with different K
therefore live side by side in one process.

The step runs as the custom op ``torch.ops.pagedexperts.experts_step`` (``torch.library``),
with a fake implementation (output [T, H] like hidden_states), so ``torch.compile`` keeps the
rest of the model in its graph and treats the paged step as one opaque call: the host-side
planning and the page-ins run eagerly inside it (the approach of vLLM's expert cache, which
makes the MoE op its graph's splitting op); in eager mode the dispatcher calls the runner
directly, the op's dispatch costing ~8 us a layer-step for nothing. A custom op takes tensors and numbers, not modules:
the experts module is found by an integer key in a table of weak references, filled when a
runner is attached (``attach``), a lookup that holds nothing alive.

Owns: the registry key, the attachment attribute, the custom op and its module table, following
``generate``'s decode-time switch of experts implementation (``follow_decode_switch``), and the
pre-hook that gives every runner its model step's padding rows (``install_padding_hook``).
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
    """Experts step of a paged layer: [T, H], [T, k], [T, k] -> [T, H]. The runner's ``step``,
    called directly in eager mode (the op's dispatch, ~8 us, buys nothing there) and for an
    ``inline`` runner; under ``torch.compile`` through the opaque custom op otherwise.

    Raises:
        RuntimeError: the module has no runner attached (the model was not loaded through
            ``pagedexperts.load_model``).
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
    """Make ``model.generate`` switch the runners' inner implementation exactly as it switches
    an unpaged model's: transformers' own ``_optimize_model_for_decode`` (5.17 to 5.24: on a
    non-CPU device, ``grouped_mm`` -> ``batched_mm`` for the decode loop, restored after) runs
    on a view of the paged model whose implementation is the inner one of ``runners`` (MoE
    layer -> runner, read per call). Without it the
    paged model (implementation "pagedexperts") would decode with ``grouped_mm`` while the
    unpaged reference decodes with ``batched_mm``: two kernels, not bit-identical.
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
    """Before each forward, give every runner of ``runners`` (MoE layer -> runner, the runtime's
    own dict) the step's padding count (``padding_count``; the dispatcher hands it to the step,
    which reads it back with its top-k ids). The dict is read per call, so the hook follows
    ``loading.runners.repage`` and holds no reference to dropped runners or their slots."""

    def hook(module, args, kwargs):
        count = padding_count(kwargs, args)
        for runner in runners.values():
            runner.padding_count = count

    model.register_forward_pre_hook(hook, with_kwargs=True)
