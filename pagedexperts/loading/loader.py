"""Load a Hugging Face MoE checkpoint with paged experts: the library's entry point.

Owns: validating a model directory and the paging options before any work, building the
model with its parameters on the meta device, the host stores, one experts runner per MoE
layer (attached by ``runners``, which also switches mode or K: ``repage``), and the
``PagingRuntime`` attached as ``model.pagedexperts``. Reading
the checkpoint itself is ``checkpoint``'s. Does not: page (``pager``), decide residency
(``residency``), or generate text (``generate``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from pagedexperts import integration
from pagedexperts.loading.checkpoint import check_readable, checkpoint_files, expert_sources, stream_checkpoint
from pagedexperts.formats import ExpertFormat, format_for_config
from pagedexperts.formats.slots import DEFAULT_SLOT_FORMAT, check_slot_format, resolve_slot_format
from pagedexperts.models.sites import check_supported, find_experts_sites
from pagedexperts.analysis.recording import install_padding_hook
from pagedexperts.paging.host_executor import INNER_IMPLEMENTATIONS, ExpertPager
from pagedexperts.paging.baselines import MODES
from pagedexperts.residency.policies import DEFAULT_POLICY, make_policy
from pagedexperts.loading.runners import (  # noqa: F401  (kept importable from here)
    DEFAULT_RESIDENT_FRACTION, attach_runners, check_num_resident, random_fill, repage,
)
from pagedexperts.stats.accounting import ModelStats
from pagedexperts.storage.host_memory import HostMemoryPlan, kv_estimate_bytes, plan_host_memory
from pagedexperts.storage.host_tier import ReadAhead, TieredExpertStore
from pagedexperts.storage import host_store as store_module
from pagedexperts.storage.host_store import HostExpertStore

logger = logging.getLogger(__name__)

BUNDLED_MODEL = "tiny-qwen3-moe"
READ_AHEAD_EXPERTS_PER_TOP_K = 2  # disk tier staging: read-ahead buffers = 2 x top_k experts


def bundled_model_path() -> Path:
    """Directory of the tiny Qwen3-MoE model shipped inside the package."""
    return Path(str(resources.files("pagedexperts") / "data" / BUNDLED_MODEL))


@dataclass(frozen=True)
class PagingConfig:
    """How a model is paged. ``num_resident`` None means DEFAULT_RESIDENT_FRACTION x E."""

    num_resident: int | None = None
    device: str = "cpu"
    dtype: str | None = None  # "float32", "bfloat16", "float16"; None = checkpoint's dtype
    experts_implementation: str = "grouped_mm"
    policy: str = DEFAULT_POLICY
    mode: str = "paged"
    cpu_expert_layers: int = 0
    slot_format: str = "packed"  # "packed" or "dense", resolved from "auto" (formats.slots)
    host_memory_gb: float | None = None  # None: what fits in available memory


@dataclass
class PagingRuntime:
    """The paging state of one model: its pagers (one per MoE layer) and its config.

    Attached to the model as ``model.pagedexperts``; every bit of state lives here, on the
    model, never in module globals, so several paged models can share a process.
    """

    config: PagingConfig
    num_experts: int
    top_k: int
    num_resident: int
    pagers: dict[int, ExpertPager] = field(default_factory=dict)
    sites: list = field(default_factory=list, repr=False)
    stores: dict = field(default_factory=dict, repr=False)
    expert_format: str = "dense"  # the checkpoint's expert format (pagedexperts.formats)
    layouts: dict = field(default_factory=dict, repr=False)  # site name -> ExpertLayout
    buffers: dict = field(default_factory=dict, repr=False)  # shared dense scratch / packed staging
    host_memory: HostMemoryPlan | None = None
    read_ahead: ReadAhead | None = field(default=None, repr=False)

    def stats(self) -> ModelStats:
        """Current counters of every MoE layer (CUDA copy times folded in first), with the
        host and disk tier counters of each layer when the disk tier is on."""
        for p in self.pagers.values():
            p.collect_copy_time()
        fallbacks = sorted({p.store.fallback for p in self.pagers.values() if p.store.fallback})
        tiers = {i: p.store.tier_stats for i, p in self.pagers.items() if hasattr(p.store, "tier_stats")}
        return ModelStats.collect(((i, p.stats) for i, p in self.pagers.items()), fallbacks, tiers=tiers)

    def reset_stats(self) -> None:
        from pagedexperts.stats.accounting import LayerStats
        from pagedexperts.stats.tiers import TierStats

        for p in self.pagers.values():
            p.collect_copy_time()
            p.stats = LayerStats()
            if hasattr(p.store, "tier_stats"):
                p.store.tier_stats = TierStats()

    @property
    def expert_bytes(self) -> int:
        """Packed bytes of one expert (the unit of a page-in)."""
        return next(iter(self.pagers.values())).store.expert_bytes

    @property
    def dense_expert_bytes(self) -> int:
        """Bytes of one expert dequantized (one dense slot), in the experts' dtype: the model's,
        or a W4A16 checkpoint's scales' (``ExpertFormat.experts_dtype``)."""
        return next(iter(self.layouts.values())).dense_expert_bytes


def resolve_dtype(name: str | None, config) -> torch.dtype:
    """Torch dtype from a name (None: the checkpoint's ``dtype`` in config.json, else float32).

    Raises:
        ValueError: unknown name (lists the valid --dtype choices).
    """
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name is None or name == "auto":
        name = str(getattr(config, "dtype", None) or "float32").replace("torch.", "")
    if name not in choices:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(choices)} (--dtype)")
    return choices[name]


# The experts kernels that run routed experts held in another dtype than the model's:
# transformers' ``_grouped_mm`` casts its input to the weights' dtype; ``eager`` and
# ``batched_mm`` (``nn.functional.linear`` / ``_batched_linear``) fail on the mixed dtypes.
MIXED_DTYPE_IMPLEMENTATIONS = ("grouped_mm",)


def check_experts_dtype(fmt: ExpertFormat, model_dtype: torch.dtype, experts_implementation: str) -> None:
    """Refuse a kernel that cannot run ``fmt``'s experts at ``model_dtype``: transformers keeps
    a compressed-tensors int4 checkpoint's dequantized experts in its scales' dtype (float32
    scales loaded at --dtype bfloat16: float32 experts in a bfloat16 model), and only
    ``grouped_mm`` runs them; unpaged transformers fails the same way under the others.

    Raises:
        ValueError: names the format, both dtypes, the implementation and the flags to change.
    """
    experts = fmt.experts_dtype(model_dtype)
    if experts != model_dtype and experts_implementation not in MIXED_DTYPE_IMPLEMENTATIONS:
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        raise ValueError(
            f"--experts-implementation {experts_implementation} cannot run this {fmt.name} checkpoint at "
            f"--dtype {name(model_dtype)}: transformers keeps its dequantized routed experts in the scales' "
            f"dtype {name(experts)} and the {experts_implementation} kernel fails on {name(model_dtype)} inputs "
            f"with {name(experts)} weights (unpaged transformers too); use --experts-implementation grouped_mm "
            f"or --dtype {name(experts)}"
        )


@contextlib.contextmanager
def _parameters_on_meta():
    """Create every nn.Parameter on the meta device (buffers stay real: rotary tables etc.)."""
    original = torch.nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    torch.nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def load_model(
    model_path: str | Path | None = None,
    *,
    num_resident: int | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    experts_implementation: str = "grouped_mm",
    policy: str = DEFAULT_POLICY,
    mode: str = "paged",
    cpu_expert_layers: int = 0,
    prefetch: bool = False,
    prefetch_budget: int | None = None,
    slot_format: str = DEFAULT_SLOT_FORMAT,
    check_independence: bool = True,
    host_memory_gb: float | None = None,
):
    """Load a Hugging Face MoE model directory with K of E experts per layer resident.

    Args:
        model_path: model directory (config.json, safetensors, tokenizer); None = bundled.
        num_resident: K slots per MoE layer, top_k <= K <= E; None = max(top_k, E // 4).
        device: "cpu" or "cuda[:n]": where slots, attention and everything else live.
        dtype: "float32", "bfloat16", "float16"; None = the checkpoint's dtype.
        experts_implementation: the transformers experts kernel run over the slots
            (grouped_mm, batched_mm, eager); the paged output equals the unpaged model's
            with the same implementation.
        policy: eviction policy name (residency.POLICIES).
        mode: "paged" (this project), or a baseline (``modes``): "resident" (all E experts on
            the device), "offload" (all E copied in every step), "cpu-experts" (the first
            ``cpu_expert_layers`` MoE layers computed on the CPU, the rest resident).
        cpu_expert_layers: N for mode "cpu-experts", 0 <= N <= MoE layers.
        prefetch: mode "paged" only: while layer l computes, page in layer l+1's experts as
            predicted by layer l+1's router on layer l's input (``pagedexperts.paging.prefetch``).
        prefetch_budget: prefetch page-ins per layer per step at most (None = top_k).
        slot_format: for a quantized checkpoint, what the K slots hold: "packed" (what a
            page-in copies; each wave's experts dequantized before compute), "dense"
            (dequantized once at page-in) or "auto" (dense on CPU, packed on CUDA; see
            ``formats.slots``). No effect on an unquantized one.
        check_independence: at start-up, page a sample of experts of every layer into a slot
            and compare what the experts kernel would read with the checkpoint's own tensors
            of that expert (``independence``); raises naming the tensor on a mismatch.
            With the disk tier, the predictions are also read ahead from disk.
        host_memory_gb: G, host memory in GB (1e9 bytes) for the expert store. When all E
            experts of every layer do not fit in G, each layer keeps R host rows and reads the
            other experts from the checkpoint files on demand (the disk tier; mode "paged"
            only). None: what is available after the slots (CPU device), the non-expert
            weights (CPU device) and a KV estimate (CPU device).

    Returns:
        (model, tokenizer): a transformers causal LM usable with ``generate()``, with
        ``model.pagedexperts`` (a PagingRuntime: ``.stats()``), and its tokenizer (None if the
        directory has none).

    Raises:
        FileNotFoundError: path, config.json or a shard missing.
        ValueError: not an MoE model / unsupported architecture (lists supported ones), K out
            of [top_k, E] (names --num-resident), unknown dtype / implementation / policy,
            truncated shard, expert shapes that do not match the config.
            --host-memory-gb below the disk tier's minimum (names it).
        MemoryError: host memory too small for what must live there (before anything is
            loaded; names the bytes of each part).
    """
    check_device(device)
    if prefetch_budget is not None and not prefetch:
        raise ValueError(f"--prefetch-budget {prefetch_budget} needs --prefetch (it bounds prefetch page-ins)")
    if prefetch_budget is not None and prefetch_budget < 1:
        raise ValueError(f"prefetch budget {prefetch_budget} must be >= 1 (--prefetch-budget)")
    path, config, files = read_checkpoint_config(model_path)
    if getattr(config, "output_router_logits", False):
        config.output_router_logits = False  # a training-time aux loss; inference never needs it
    check_readable(files)
    if experts_implementation not in INNER_IMPLEMENTATIONS:
        raise ValueError(
            f"experts implementation {experts_implementation!r} is not supported under paging; "
            f"choose one of {list(INNER_IMPLEMENTATIONS)} (--experts-implementation)"
        )
    make_policy(policy, 1)  # validate the name before any work
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {list(MODES)} (--mode)")
    check_slot_format(slot_format)
    fmt = format_for_config(config)
    if fmt.name == "dense" and slot_format != DEFAULT_SLOT_FORMAT:
        logger.warning("--slot-format %s has no effect: %s is not quantized (its slots hold dense experts)",
                       slot_format, path)
    check_experts_dtype(fmt, resolve_dtype(dtype, config), experts_implementation)
    fill = functools.partial(stream_checkpoint, model_type=config.model_type, files=files, fmt=fmt)
    model = build_paged_model(
        config, fill, num_resident=num_resident, device=device, dtype=dtype,
        experts_implementation=experts_implementation, policy=policy, mode=mode,
        cpu_expert_layers=cpu_expert_layers, expert_format=fmt, slot_format=slot_format,
        host_memory_gb=host_memory_gb,
    )
    if check_independence:
        from pagedexperts.loading.independence import check_model_independence

        check_model_independence(model, files, fmt)
        for store in model.pagedexperts.stores.values():  # the check's samples leave no trace
            if hasattr(store, "reset"):
                store.reset()
    if prefetch and mode == "paged":
        from pagedexperts.paging import prefetch as prefetch_mod

        prefetch_mod.install(model, budget=prefetch_budget)
    tokenizer = _load_tokenizer(path)
    return model, tokenizer


def build_paged_model(
    config,
    fill,
    *,
    num_resident: int | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    experts_implementation: str = "grouped_mm",
    policy: str = DEFAULT_POLICY,
    mode: str = "paged",
    cpu_expert_layers: int = 0,
    expert_format: ExpertFormat | None = None,
    slot_format: str = DEFAULT_SLOT_FORMAT,
    host_memory_gb: float | None = None,
):
    """Build ``config``'s model with parameters on meta, host stores for the experts, and runners.

    ``fill(model, sites, stores, device)`` puts the weights in place: expert rows into the
    stores ({site name: HostExpertStore}), every other parameter onto ``device``. ``load_model``
    streams a checkpoint; ``random_fill`` makes random weights for benchmarks at real scale.
    ``expert_format``: the checkpoint's format (None: from ``config.quantization_config``); the
    stores hold its packed tensors. Other arguments and errors: see ``load_model``.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype, config)
    dev = check_device(device)

    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch_dtype, experts_implementation=experts_implementation
        )
    _keep_in_fp32(model, torch_dtype)
    sites = find_experts_sites(model)
    num_experts = sites[0].num_experts
    top_k = int(config.num_experts_per_tok)
    k_slots = check_num_resident(num_resident, num_experts, top_k) if mode == "paged" else num_experts
    if mode == "cpu-experts" and not 0 <= cpu_expert_layers <= len(sites):
        raise ValueError(
            f"--cpu-expert-layers {cpu_expert_layers} outside [0, {len(sites)}] (the model's MoE layers)"
        )
    fmt = expert_format if expert_format is not None else format_for_config(config)
    sources = expert_sources(config.model_type)
    layouts = {
        s.name: fmt.layout(s.specs, sources=sources, transposed=bool(getattr(s.module, "is_transposed", False)))
        for s in sites
    }
    packed_specs = list(layouts[sites[0].name].packed_specs)
    memory = _plan_memory(model, config, sites, dev, torch_dtype, packed_specs, k_slots=k_slots, mode=mode,
                          top_k=top_k, host_memory_gb=host_memory_gb)
    runtime = PagingRuntime(
        config=PagingConfig(
            k_slots, str(dev), dtype, experts_implementation, policy, mode, cpu_expert_layers,
            resolve_slot_format(slot_format, dev), host_memory_gb=host_memory_gb,
        ),
        num_experts=num_experts,
        top_k=top_k,
        num_resident=k_slots,
        expert_format=fmt.name,
        layouts=layouts,
        host_memory=memory,
    )
    if memory.disk_tier:
        runtime.read_ahead = ReadAhead(packed_specs, num_buffers=memory.staging_bytes // memory.expert_bytes)
    stores = {}
    for site in sites:
        specs = list(layouts[site.name].packed_specs)
        if memory.disk_tier:
            stores[site.name] = TieredExpertStore(
                specs, site.num_experts, memory.host_rows, policy=policy, pin=dev.type == "cuda",
                layer=site.layer, read_ahead=runtime.read_ahead,
            )
        else:
            stores[site.name] = HostExpertStore(specs, site.num_experts, pin=dev.type == "cuda")
        for spec in site.specs:  # the module keeps no [E, ...] tensor: only the runner's
            site.module._parameters.pop(spec.name, None)
            site.module._buffers.pop(spec.name, None)
    fill(model, {s.name: s for s in sites}, stores, dev)
    attach_runners(runtime, sites, stores, dev, mode=mode, cpu_expert_layers=cpu_expert_layers)
    model.to(dev)
    model.eval()
    model.pagedexperts = runtime
    install_padding_hook(model)
    integration.set_implementation(model, integration.IMPLEMENTATION_NAME)
    integration.follow_decode_switch(model)
    model.pagedexperts.sites = sites
    model.pagedexperts.stores = stores
    return model


def _plan_memory(model, config, sites, dev, dtype, packed_specs, *, k_slots, mode, top_k,
                 host_memory_gb) -> HostMemoryPlan:
    """Everything that will live in host memory, counted before any allocation (see
    ``storage.host_memory``); the disk tier (R < E) for mode "paged" only. Store rows hold
    ``packed_specs``; slots are counted at the dense size (the larger of the slot formats)."""
    if host_memory_gb is not None and host_memory_gb <= 0:
        raise ValueError(f"--host-memory-gb {host_memory_gb} must be > 0")
    expert_bytes = sum(s.row_bytes for s in packed_specs)
    slot_expert_bytes = max(expert_bytes, sum(s.row_bytes for s in sites[0].specs))
    expert_params = {f"{s.name}.{spec.name}" for s in sites for spec in s.specs}
    non_expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in expert_params)
    on_cpu = dev.type == "cpu"
    memory = plan_host_memory(
        budget_bytes=None if host_memory_gb is None else int(host_memory_gb * 1e9),
        available_bytes=store_module.host_memory_available_bytes(),
        num_layers=len(sites),
        num_experts=sites[0].num_experts,
        expert_bytes=expert_bytes,
        slot_bytes_on_host=k_slots * len(sites) * slot_expert_bytes if on_cpu and mode == "paged" else 0,
        staging_bytes=READ_AHEAD_EXPERTS_PER_TOP_K * top_k * expert_bytes,
        non_expert_bytes_on_host=non_expert if on_cpu else 0,
        kv_bytes_on_host=kv_estimate_bytes(config, dtype_bytes=dtype.itemsize) if on_cpu else 0,
    )
    if memory.disk_tier and mode != "paged":
        raise ValueError(
            f"mode {mode!r} needs all E experts in host memory ({memory.num_experts * len(sites) * expert_bytes:,} "
            f"bytes) but {memory.describe()}; use --mode paged for the disk tier or raise --host-memory-gb"
        )
    if memory.disk_tier:
        logger.info("disk tier: %s", memory.describe())
    return memory


def _keep_in_fp32(model, dtype: torch.dtype) -> None:
    """Give float32 to the tensors the model class keeps in float32, as ``from_pretrained``
    does: ``_keep_in_fp32_modules_strict`` under bf16/fp16, ``_keep_in_fp32_modules`` under fp16
    (e.g. DeepSeek-V3's ``e_score_correction_bias``; transformers 5.17's ``from_config`` skips
    this, and a bf16 correction bias changes which experts are selected)."""
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) if dtype in (torch.bfloat16, torch.float16) else set()
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if not keep:
        return
    for name, param in list(model.named_parameters()):
        if param.dtype != torch.float32 and any(k in name for k in keep):
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            module._parameters[attr] = torch.nn.Parameter(param.to(torch.float32), requires_grad=param.requires_grad)
    for name, buf in list(model.named_buffers()):
        if buf.is_floating_point() and buf.dtype != torch.float32 and any(k in name for k in keep):
            module_name, _, attr = name.rpartition(".")
            model.get_submodule(module_name)._buffers[attr] = buf.to(torch.float32)


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device: cpu, or cuda[:N] where CUDA is available.

    Raises:
        ValueError: not a device string, a type other than cpu/cuda, or CUDA not available
            (names the value and --device).
    """
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {str(device)!r} is not a device this runs on; use cpu or cuda[:N]")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available; use --device cpu")
    return dev


def read_checkpoint_config(model_path: str | Path | None):
    """(directory, transformers config, safetensors files) of a model directory (None: the
    bundled model), checked in this order before anything reads weights: the path exists, has
    config.json, is a supported MoE architecture, has a safetensors checkpoint.

    Raises:
        FileNotFoundError: path, config.json or safetensors missing (names --model-path).
        ValueError: not an MoE model / unsupported architecture (lists supported ones).
    """
    from transformers import AutoConfig

    path = Path(model_path) if model_path is not None else bundled_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (--model-path)")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json; is it a Hugging Face model directory? (--model-path)")
    config = AutoConfig.from_pretrained(path)
    check_supported(config)
    return path, config, checkpoint_files(path)


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not any((path / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(path)
