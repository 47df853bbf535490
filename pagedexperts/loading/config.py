"""One validated paging configuration: every problem with the options reported at once.

Owns: ``PagingConfig`` (the options of ``load_model`` and the commands' flags, frozen, kept on
the runtime as given), ``check_config`` (every problem of the options alone and against the
model's config, raised once before any weight is read) and the rules that resolve "auto" and
None (K, the experts implementation, the slot format, ``--decide``, CUDA graphs), each beside
the check that shares its predicates; ``loading.resolved`` applies them once per load.
Does not: read checkpoints or build (``loading.loader``, ``loading.build``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedexperts.formats import FORMATS
from pagedexperts.formats.slots import DEFAULT_SLOT_FORMAT, SLOT_FORMATS, resolve_slot_format
from pagedexperts.models import config as model_config
from pagedexperts.paging.baselines import mode_problem
from pagedexperts.loading.experts_options import beyond_k_problems, experts_dtype_problem, is_fused, planned_on_device
from pagedexperts.paging.device_residency import DEVICE_RULES
from pagedexperts.paging.steps.table import PACKED, inner_problem
from pagedexperts.paging.kernels._triton import HAVE_TRITON, INTERPRETED
from pagedexperts.residency.planner import default_num_resident, num_resident_problem
from pagedexperts.residency.policies import DEFAULT_POLICY, POLICIES

# --decide: where a paged layer-step is planned (docs/design.md "Executors"): "host" (the top-k ids
# read back, ``paging.host_executor``), "device" (``paging.device_executor``: no read-back) or
# "auto" (device where it can serve the step on CUDA with triton installed, host otherwise)
DECIDE_CHOICES = ("auto", "host", "device")
DEFAULT_DECIDE = "auto"

# CUDA graphs of decode steps (``generation.graphs``): "auto" (captured where the step can be:
# CUDA, device-planned or resident; a WARNING where auto falls back on CUDA), "on" (a clear error
# where it cannot work), "off" (--no-cuda-graphs), "eager" (the same static-buffer decode run
# eagerly, no capture: CPU tests; not a command flag)
CUDA_GRAPHS_CHOICES = ("auto", "on", "off", "eager")
DEFAULT_CUDA_GRAPH_MAX_BATCH = 8
GRAPH_MODES = ("paged", "resident")  # modes whose steps read nothing back (paged: device-planned)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PagingConfig:
    """How a model is paged: the options of ``load_model`` and the commands' flags, each field's
    meaning in its comment."""

    num_resident: int | None = None  # K slots per MoE layer, top_k <= K <= E; None: max(top_k, E // 4)
    device: str = "cpu"  # "cpu" or "cuda[:n]": slots, attention and everything else
    dtype: str | None = None  # "float32", "bfloat16", "float16"; None: the checkpoint's
    experts_implementation: str = "auto"  # resolved per format and device: ``resolve_experts_implementation``
    policy: str = DEFAULT_POLICY  # eviction policy (``residency.policies.POLICIES``)
    mode: str = "paged"  # or a baseline (``paging.baselines``): "resident", "offload", "cpu-experts"
    cpu_expert_layers: int = 0  # mode "cpu-experts": the first N MoE layers computed on the CPU
    slot_format: str = DEFAULT_SLOT_FORMAT  # "auto", "packed" or "dense" (formats.slots)
    host_memory_gb: float | None = None  # the budget for all host memory (HostMemoryPlan); None: what is available
    # mode "paged": page in layer l+1's experts predicted by its router on layer l's input (``paging.prefetch``)
    prefetch: bool = False
    prefetch_budget: int | None = None  # None: top_k
    read_ahead: bool = True  # the disk tier reads the next layer's predicted experts ahead (--no-read-ahead)
    # packed experts are read from a stored copy in the CPU kernels' layout (loading.stored_layout: the
    # checkpoint's kernel-layout/, else written once to stored_layout_dir, None: the cache root), by the
    # disk tier at page-in and by a full store at load; False: converted from the checkpoint's rows.
    # Either where no experts run packed: a WARNING, no effect
    stored_layout: bool = True
    stored_layout_dir: str | None = None
    decide: str = DEFAULT_DECIDE  # DECIDE_CHOICES; mode "paged" only (the baselines plan nothing)
    # the device decide's kernels: "triton", or "torch" (their plain-torch references: CPU only,
    # for tests where the Triton interpreter is too slow); not a command flag
    device_kernels: str = "triton"
    cuda_graphs: str = "auto"  # CUDA_GRAPHS_CHOICES (--cuda-graphs / --no-cuda-graphs)
    cuda_graph_max_batch: int = DEFAULT_CUDA_GRAPH_MAX_BATCH  # decode batch sizes captured: 1..N
    # a routed union larger than K (``paging.device_residency.BEYOND_K``): "waves", or "in-place" (one
    # wave, the experts without a slot read from the host store; fused + device-planned only)
    beyond_k: str = "waves"
    admit_per_step: int | None = None  # in-place: page-ins per layer-step at most (None: K)

    def resident_slots(self, *, num_experts: int, top_k: int) -> int:
        """K for E experts of which a token routes to top_k: all E unless mode "paged"."""
        if self.mode != "paged":
            return num_experts
        return self.num_resident if self.num_resident is not None else default_num_resident(
            num_experts=num_experts, top_k=top_k)


class ConfigError(ValueError):
    """The configuration has problems; ``problems`` lists each (a flag and its limit)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        if len(problems) == 1:
            super().__init__(problems[0])
        else:
            super().__init__(f"{len(problems)} problems with the configuration:\n" + "\n".join(f"- {p}" for p in problems))


def check_config(cfg: PagingConfig, model=None, fmt=None, *, experts_implementation: str | None = None) -> None:
    """Raise once with every problem of ``cfg``, alone and (given the transformers ``model`` config
    and the format ``fmt``) against the model running ``experts_implementation``
    (``loading.resolved.resolve_implementation``'s value; None: ``cfg``'s own, and "auto" leaves
    the implementation's checks to the caller that resolves it).

    Raises:
        ConfigError (a ValueError): lists every problem, each naming its flag.
    """
    problems = option_problems(cfg)
    if model is not None:
        problems += model_problems(cfg, model, fmt, experts_implementation or cfg.experts_implementation)
    if problems:
        raise ConfigError(problems)


def option_problems(cfg: PagingConfig) -> list[str]:
    """The problems of the options alone (no model needed)."""
    on_device = planned_on_device(cfg)
    problems = [device_problem(cfg.device), mode_problem(cfg.mode),
                None if cfg.experts_implementation == AUTO else
                inner_problem(cfg.experts_implementation, decide="device" if on_device and is_fused(cfg) else "host")]
    if cfg.policy not in POLICIES:
        problems.append(f"unknown eviction policy {cfg.policy!r}; choose one of {sorted(POLICIES)} (--policy)")
    if cfg.slot_format not in SLOT_FORMATS:
        problems.append(f"unknown slot format {cfg.slot_format!r}; choose one of {list(SLOT_FORMATS)} (--slot-format)")
    if cfg.dtype not in (None, "auto", *model_config.RUN_DTYPE_BYTES):
        problems.append(f"unknown dtype {cfg.dtype!r}; choose one of {sorted(model_config.RUN_DTYPE_BYTES)} (--dtype)")
    if cfg.prefetch_budget is not None and not cfg.prefetch:
        problems.append(f"--prefetch-budget {cfg.prefetch_budget} needs --prefetch (it bounds prefetch page-ins)")
    elif cfg.prefetch_budget is not None and cfg.prefetch_budget < 1:
        problems.append(f"prefetch budget {cfg.prefetch_budget} must be >= 1 (--prefetch-budget)")
    if cfg.host_memory_gb is not None and not 0 < cfg.host_memory_gb < math.inf:  # nan and inf: int() raised
        problems.append(f"--host-memory-gb {cfg.host_memory_gb} must be a finite number > 0 (leave it out: the "
                        "available memory)")
    if cfg.cpu_expert_layers < 0:
        problems.append(f"--cpu-expert-layers {cfg.cpu_expert_layers} must be >= 0")
    if cfg.decide not in DECIDE_CHOICES:
        problems.append(f"unknown --decide {cfg.decide!r}; choose one of {list(DECIDE_CHOICES)}")
    elif on_device:
        problems += device_decide_problems(cfg)
    problems += graph_option_problems(cfg)
    problems.append(packed_problem(cfg))
    problems += beyond_k_problems(cfg)
    problems.append(stored_layout_problem(cfg))
    return list(dict.fromkeys(p for p in problems if p is not None))


def stored_layout_problem(cfg: PagingConfig) -> str | None:
    """Why ``--stored-layout-dir`` cannot hold a stored layout, or None: given with --no-stored-layout
    (contradictory), empty (read as cwd), a file or under one (it failed after the whole conversion)."""
    where = cfg.stored_layout_dir
    if where is None:
        return None
    if not cfg.stored_layout:
        return (f"--stored-layout-dir {where} with --no-stored-layout: one says read no stored layout, the other "
                "where to keep it; give one of them")
    if not str(where).strip():
        return f"--stored-layout-dir {where!r} is empty; give a directory (made if missing), or leave it out: the cache"
    file = next((p for p in (Path(where), *Path(where).parents) if p.exists() and not p.is_dir()), None)
    if file is not None:
        return f"--stored-layout-dir {where}: {file} is a file, not a directory; give a directory (made if missing)"
    return None


AUTO = "auto"  # --experts-implementation auto: packed where measured faster (``resolve_experts_implementation``)


PACKED_FAST_DTYPE = torch.bfloat16  # torch's int4 CPU kernel's vectorised x dtype (float16 / float32: a scalar path)


def resolve_experts_implementation(cfg: PagingConfig, fmt, dtype: torch.dtype | None = None) -> str:
    """``cfg.experts_implementation`` with "auto" resolved: ``packed`` on a CPU in mode paged at run
    ``dtype`` bfloat16 (None: taken as bfloat16) for a format whose record says torch's CPU kernels
    compute it (``formats.FormatRecord.cpu_packed``), else ``grouped_mm``. Why: docs/benchmarks.md,
    "CPU kernel routes" and "Quantized experts on a CPU".
    """
    if cfg.experts_implementation != AUTO:
        return cfg.experts_implementation
    on_cpu = device_problem(cfg.device) is None and torch.device(cfg.device).type == "cpu"
    fast = dtype is None or dtype == PACKED_FAST_DTYPE
    if on_cpu and cfg.mode == "paged" and fast and fmt is not None and FORMATS[fmt.name].cpu_packed:
        return PACKED
    return "grouped_mm"


def packed_problem(cfg: PagingConfig) -> str | None:
    """Why ``--experts-implementation packed`` (torch's packed CPU matmuls over the paged slots,
    ``paging.steps.host_packed``) cannot run with ``cfg``'s device and mode, or None."""
    if cfg.experts_implementation != PACKED or device_problem(cfg.device) is not None:
        return None
    if torch.device(cfg.device).type != "cpu":
        return (f"--experts-implementation packed runs torch's packed CPU matmuls: --device cpu, not {cfg.device} "
                "(on CUDA use --experts-implementation fused)")
    if cfg.mode != "paged":
        return (f"--experts-implementation packed computes the paged slots (--mode paged); --mode {cfg.mode} runs "
                "transformers' own kernels: use --experts-implementation grouped_mm")
    return None


def slot_format_of(cfg: PagingConfig) -> str:
    """"packed" or "dense" (``formats.slots.resolve_slot_format``), "auto" packed for ``fused`` on
    every device. Raises ValueError for an unknown slot format (names --slot-format).
    """
    if cfg.slot_format == "auto" and is_fused(cfg):
        return "packed"
    return resolve_slot_format(cfg.slot_format, cfg.device)


def graph_option_problems(cfg: PagingConfig) -> list[str]:
    """The problems of the CUDA-graph options alone: unknown choice, max batch < 1, and
    ``--cuda-graphs`` (on) where capture cannot work (``graph_problems`` of the options)."""
    if cfg.cuda_graphs not in CUDA_GRAPHS_CHOICES:
        return [f"unknown cuda_graphs {cfg.cuda_graphs!r}; choose one of {list(CUDA_GRAPHS_CHOICES)} "
                "(--cuda-graphs / --no-cuda-graphs)"]
    problems = []
    if not isinstance(cfg.cuda_graph_max_batch, int) or cfg.cuda_graph_max_batch < 1:
        problems.append(f"--cuda-graph-max-batch {cfg.cuda_graph_max_batch} must be an integer >= 1 (the largest "
                        "decode batch captured); use --no-cuda-graphs to capture none")
    if cfg.cuda_graphs == "on":
        problems += graph_problems(cfg, cfg.decide)
    return problems


def graph_problems(cfg: PagingConfig, decide: str) -> list[str]:
    """Why decode steps of ``cfg`` with paged steps planned by ``decide`` ("auto" counts as possible)
    cannot be captured in a CUDA graph, each naming its flag; [] if they can (the experts
    implementation is checked per captured step, ``generation.capture_checks``).
    """
    problems = []
    if device_problem(cfg.device) is None and torch.device(cfg.device).type != "cuda":
        problems.append(f"--cuda-graphs needs a CUDA device, not --device {cfg.device}; drop --cuda-graphs "
                        "(or --no-cuda-graphs)")
    if cfg.mode not in GRAPH_MODES:
        problems.append(f"--cuda-graphs cannot capture mode {cfg.mode!r} (its steps copy or compute on the host); "
                        f"use a mode of {list(GRAPH_MODES)} or --no-cuda-graphs")
    elif cfg.mode == "paged" and decide == "host":
        problems.append("--cuda-graphs needs the device-planned step (--decide device or auto on CUDA): the "
                        "host-planned step reads its top-k ids back every layer-step; use --no-cuda-graphs "
                        "with --decide host")
    return problems


def resolve_cuda_graphs(cfg: PagingConfig, decide: str) -> tuple[str, str | None]:
    """(backend, reason) of ``cfg.cuda_graphs`` once ``decide`` is resolved: "cuda" (capture), "eager"
    (the static-buffer decode without capture) or "off" with its reason; "auto": "cuda" where
    ``graph_problems`` is empty, else off (a WARNING on CUDA).

    Raises:
        ConfigError: "on" where capture cannot work (every reason).
    """
    if cfg.cuda_graphs == "off":
        return "off", "--no-cuda-graphs"
    if cfg.cuda_graphs == "eager":
        return "eager", None
    problems = graph_problems(cfg, decide)
    if not problems:
        return "cuda", None
    if cfg.cuda_graphs == "on":
        raise ConfigError(problems)
    if torch.device(cfg.device).type != "cuda":  # the problems name --cuda-graphs, which auto users never gave
        return "off", f"auto: capture needs a CUDA device, not --device {cfg.device}"
    logger.warning("--cuda-graphs auto: decode runs without CUDA graphs because %s", "; ".join(problems))
    return "off", "; ".join(problems)


def device_decide_problems(cfg: PagingConfig) -> list[str]:
    """What the device-planned step (``paging.device_executor``) cannot serve in ``cfg``'s options
    alone, each naming --decide and the other flag; [] if it can serve them. (The disk tier and
    a quantized layer's slot format are checked with the memory plan and the model.)"""
    problems = []
    if cfg.device_kernels not in ("triton", "torch"):
        problems.append(f"unknown device kernels {cfg.device_kernels!r}; choose 'triton' or 'torch'")
    on_cpu = device_problem(cfg.device) is None and torch.device(cfg.device).type == "cpu"
    if on_cpu and not INTERPRETED and is_fused(cfg):
        problems.append(f"--experts-implementation fused runs Triton kernels: on --device {cfg.device} only under "
                        "TRITON_INTERPRET=1 (the Triton interpreter, for tests); use --experts-implementation "
                        "grouped_mm on CPU")
    elif on_cpu and not INTERPRETED:
        problems.append(f"--decide device on --device {cfg.device} runs only under TRITON_INTERPRET=1 (the Triton "
                        "interpreter, for tests); use --decide host or auto on CPU")
    if (cfg.device_kernels == "triton" or is_fused(cfg)) and not HAVE_TRITON:
        what = "--experts-implementation fused" if is_fused(cfg) else "--decide device"
        problems.append(f"{what} needs triton, from the 'gpu' extra: pip install -e '.[gpu]' (or use --decide host "
                        "with --experts-implementation grouped_mm)")
    if cfg.device_kernels == "torch" and not on_cpu:
        problems.append("device kernels 'torch' (their torch backends) page in over host memory: CPU only")
    if cfg.prefetch:
        problems.append("--decide device cannot serve --prefetch (prefetch plans page-ins on the host from "
                        "read-back predictions); use --decide host or drop --prefetch")
    if cfg.policy not in DEVICE_RULES:
        problems.append(f"--decide device has a device decide for --policy {' and '.join(sorted(DEVICE_RULES))} "
                        f"only, not {cfg.policy!r}; use --decide host or another --policy")
    inner_on_device = inner_problem(cfg.experts_implementation, decide="device")
    if inner_on_device is not None and inner_problem(cfg.experts_implementation) is None:  # unknown: reported once
        problems.append(inner_on_device)
    return problems


def decide_model_problem(cfg: PagingConfig, fmt) -> str | None:
    """Why the device decide cannot serve ``fmt``'s slots under ``cfg`` (dense slots of a
    quantized format dequantize at page-in on the host), or None."""
    if not planned_on_device(cfg) or fmt is None or fmt.name == "dense":
        return None
    if cfg.slot_format not in SLOT_FORMATS or device_problem(cfg.device) is not None:
        return None  # reported by option_problems
    if slot_format_of(cfg) == "dense":
        return (f"--decide device pages packed slots of this {fmt.name} checkpoint; --slot-format "
                f"{cfg.slot_format} gives dense slots on {cfg.device} (dequantized at page-in on the host): "
                "use --slot-format packed or --decide host")
    return None


def disk_tier_problem(cfg: PagingConfig, *, disk_tier: bool, described: str = "") -> str | None:
    """Why ``--decide device`` cannot serve the host-memory plan (the disk tier pages from a
    store the device cannot read), or None."""
    if planned_on_device(cfg) and disk_tier:
        return ("--decide device pages in from the full host store, but --host-memory-gb gives the disk tier "
                f"({described or 'not every expert fits in host memory'}); use --decide host or raise --host-memory-gb")
    return None


def resolve_decide(cfg: PagingConfig, *, disk_tier: bool, pinned: bool, quantized: bool) -> str:
    """"host" or "device" for ``cfg.decide`` (checked) of a paged model: "auto" is device on CUDA
    where the step can be served (``device_decide_problems`` empty, triton, no disk tier, a
    page-locked store, packed slots for a ``quantized`` checkpoint), with a WARNING naming the
    reasons where not; host on CPU; ``fused``: device everywhere (``planned_on_device``).
    """
    if cfg.decide != "auto":
        return cfg.decide
    if planned_on_device(cfg):
        return "device"
    if cfg.mode != "paged" or torch.device(cfg.device).type != "cuda":
        return "host"
    reasons = device_decide_problems(cfg)
    if disk_tier:
        reasons.append("the disk tier (--host-memory-gb)")
    if not pinned:
        reasons.append("the host store is not page-locked")
    if quantized and slot_format_of(cfg) == "dense":
        reasons.append("--slot-format dense (dense slots of a quantized checkpoint dequantize at page-in on the host)")
    if reasons:
        logger.warning("--decide auto: deciding on the host on %s because %s", cfg.device, "; ".join(reasons))
        return "host"
    return "device"


def model_problems(cfg: PagingConfig, model, fmt, implementation: str) -> list[str]:
    """The problems of ``cfg`` for the transformers config ``model`` (and its format ``fmt``, None:
    not known) running the experts ``implementation`` ("auto": not resolved, not checked)."""
    num_experts, top_k = model_config.num_routed_experts(model), model_config.top_k(model)
    problems = []
    if cfg.mode == "paged" and cfg.num_resident is not None:
        problems.append(num_resident_problem(cfg.num_resident, num_experts=num_experts, min_slots=top_k))
    moe_layers = len(model_config.moe_layer_indices(model))
    if cfg.mode == "cpu-experts" and cfg.cpu_expert_layers > moe_layers:
        problems.append(f"--cpu-expert-layers {cfg.cpu_expert_layers} outside [0, {moe_layers}] (the model's MoE layers)")
    run_dtype = known_run_dtype(cfg, model)
    if implementation != cfg.experts_implementation and planned_on_device(cfg):
        problems.append(inner_problem(implementation, decide="device"))
    if fmt is not None and run_dtype is not None and implementation != AUTO:
        problems.append(experts_dtype_problem(fmt, run_dtype, implementation))
    problems.append(decide_model_problem(cfg, fmt))
    return [p for p in problems if p is not None]


def device_problem(device) -> str | None:
    """Why ``device`` is not one this runs on (cpu, or cuda[:N] with CUDA available), or None."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        return f"--device {str(device)!r} is not a device this runs on; use cpu or cuda[:N]"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"device {str(device)!r} requested but CUDA is not available; use --device cpu"
    return None


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device: cpu, or cuda[:N] where CUDA is available. Raises ValueError with
    ``device_problem``'s message (names the value and --device).
    """
    problem = device_problem(device)
    if problem is not None:
        raise ValueError(problem)
    return torch.device(device)


def known_run_dtype(cfg: PagingConfig, config) -> torch.dtype | None:
    """``resolve_dtype`` of ``cfg.dtype``, or None where that name is unknown (``option_problems`` names it)."""
    return resolve_dtype(cfg.dtype, config) if cfg.dtype in (None, "auto", *model_config.RUN_DTYPE_BYTES) else None


def resolve_dtype(name: str | None, config) -> torch.dtype:
    """Torch dtype of the run: ``name`` (``--dtype``), else the checkpoint's (``models.config.run_dtype``),
    else float32. Raises ValueError for an unknown name, listing the --dtype choices.
    """
    return getattr(torch, model_config.run_dtype(config, dtype=name))
