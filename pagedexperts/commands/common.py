"""Flags shared by the commands that load a model (generate, check, serve, bench)."""

from __future__ import annotations

import argparse
import os
import sys

from pagedexperts.formats.slots import DEFAULT_SLOT_FORMAT, SLOT_FORMATS
from pagedexperts.loading.config import AUTO, DEFAULT_CUDA_GRAPH_MAX_BATCH
from pagedexperts.residency.policies import DEFAULT_POLICY, POLICIES
from pagedexperts.models.config import RUN_DTYPE_BYTES
from pagedexperts.paging.steps.table import INNER_IMPLEMENTATIONS, PACKED


def add_model_arguments(parser) -> None:
    """--model-path, --num-resident, --device, --dtype, --experts-implementation, --policy, --prefetch,
    --prefetch-budget, --slot-format, --decide, --host-memory-gb, --threads."""
    g = parser.add_argument_group("model and paging")
    g.add_argument("--model-path", default=None, help="Hugging Face model directory (default: the bundled tiny Qwen3-MoE)")
    g.add_argument(
        "--num-resident",
        type=int,
        default=None,
        metavar="K",
        help="resident expert slots per MoE layer, top_k <= K <= E (default: E/4, at least top_k)",
    )
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    g.add_argument("--dtype", default=None, choices=list(RUN_DTYPE_BYTES), help="default: the checkpoint's dtype")
    g.add_argument(
        "--experts-implementation",
        default=AUTO,
        action=_Given,
        choices=[*INNER_IMPLEMENTATIONS, AUTO],
        help="experts kernel run over the slots (default auto: packed on a CPU in --mode paged at bfloat16 for int4 "
        "/ int8 checkpoints (GPTQ, AWQ, compressed-tensors W4A16 / W8A16, AutoRound int), measured faster there, "
        "docs/benchmarks.md; grouped_mm otherwise: on CUDA, at float16 / float32 (the int4 kernel's scalar path), "
        "and for fp8 / fp4 / dense checkpoints): "
        "transformers' grouped_mm, batched_mm or "
        "eager (exact to the unpaged model), or fused: Triton MoE kernels reading the packed slots directly "
        "(device-planned steps only; CUDA, or CPU under TRITON_INTERPRET=1; exact to itself with all E "
        "resident, within a tolerance of transformers), or packed: int4 / per-channel int8 experts computed "
        "packed by torch's CPU kernels (--device cpu; slots converted at page-in; other formats run grouped_mm "
        "with a WARNING; exact to itself with all E resident, each matmul within a bound of float32: check), "
        "and the "
        "checkpoint's quantized attention / shared experts / lm_head too where the kernels take them",
    )
    g.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        choices=sorted(POLICIES),
        help=f"eviction policy (default {DEFAULT_POLICY}: LFU with aging, best measured in bench/policy_eval.py)",
    )
    g.add_argument(
        "--prefetch",
        action="store_true",
        help="page in the next layer's predicted experts while a layer computes (its router on this layer's input)",
    )
    g.add_argument("--prefetch-budget", type=int, default=None, metavar="N",
                   help="prefetch page-ins per layer per step at most (default: top_k)")
    g.add_argument("--no-read-ahead", dest="read_ahead", action="store_false",
                   help="with the disk tier (--host-memory-gb), do not read the next layer's predicted experts "
                   "from disk while a layer computes (read-ahead is on by default there, pauses in a layer where under half "
                   "of it is used, and pages nothing in)")
    g.add_argument("--no-stored-layout", dest="stored_layout", action="store_false", help="with packed experts, convert each expert "
                   "from the checkpoint (the disk tier's at page-in, a full host store's at load) instead of reading a stored copy in "
                   "the CPU kernels' layout (written once, on first load); no effect (a WARNING) where no experts run packed")
    g.add_argument("--stored-layout-dir", default=None, metavar="DIR",
                   help="where the stored kernel layout of a checkpoint is cached when the checkpoint has none in its own "
                   "kernel-layout/ directory (default: kernel-layouts/ in $PAGEDEXPERTS_CACHE, else $XDG_CACHE_HOME/pagedexperts, "
                   "else ~/.cache/pagedexperts; made if missing; not with --no-stored-layout; no effect, a WARNING, where no experts run packed)")
    g.add_argument(
        "--slot-format",
        default=DEFAULT_SLOT_FORMAT,
        choices=list(SLOT_FORMATS),
        help="quantized checkpoints: slots hold packed experts, dequantized per wave (packed), or experts "
        "dequantized once at page-in (dense: fewer slots per GB); page-ins copy packed bytes either way; "
        "auto = dense on CPU, packed on CUDA (default auto; see bench/formats_bench.py)",
    )
    add_decide_argument(g)
    add_beyond_k_arguments(g)
    g.add_argument(
        "--host-memory-gb", type=float, default=None, metavar="G",
        help="host memory (GB) for everything the process holds: the expert store, and on --device cpu the "
        "slots, the non-expert weights and a KV estimate, plus a runtime allowance (all printed at start-up). "
        "When all experts do not fit in what is left, each layer keeps R in host memory and reads the rest from "
        "the checkpoint files, or under --experts-implementation packed from a stored copy in the CPU kernels' "
        "layout (disk tier, reading the next layer's predicted experts ahead unless --no-read-ahead; "
        "docs/disk-tier.md). Default: the available memory (the "
        "smaller of the machine's and the memory cgroup's limit)",
    )
    add_threads_argument(g)


class _Given(argparse.Action):
    """Stores the value and records that the flag was given (``args.given``: the set of dests given),
    so that a start-up line says "the default" only for a default."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", set()) | {self.dest}


def given(args, dest: str):
    """The value of flag ``dest`` when the command line gave it (``_Given``), else None."""
    return getattr(args, dest) if dest in getattr(args, "given", ()) else None


def utf8_text(text: str, what: str) -> str:
    """``text`` (a prompt or stop string from argv or stdin), checked to be UTF-8 text. Python
    decodes argv and stdin with surrogateescape, so bytes that are not UTF-8 arrive as lone
    surrogates, which the tokenizer refused with a TypeError after the model had loaded.

    Raises:
        ValueError: names ``what``, the first bad byte and its character position.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        bad = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise ValueError(f"{what} is not valid UTF-8 ({bad} at character {exc.start}); give UTF-8 text") from None
    return text


THREADS_AUTO = "auto"
THREADS_HELP = (
    "torch CPU threads for the model's compute: N >= 1, 0 for torch's own default (one per core), or auto "
    "(default): the cores the rest of the machine leaves idle, round(CPUs - 1-minute load average), at least 1 "
    "and at most torch's default. Every op waits for its slowest thread, so threads on cores other processes "
    "keep busy lose several-fold: on a 2-core machine at load average 11, the bundled model decoded 4.7x "
    "faster at 1 thread than at torch's default (docs/threads.md); on an idle machine auto takes every core"
)


def _threads_value(text: str):
    """--threads' argparse type: "auto" or an integer (its range is ``resolve_threads``')."""
    if text == THREADS_AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want auto or an integer >= 0") from None


def add_threads_argument(group) -> None:
    """--threads N|auto (default auto; 0: torch's default), resolved by ``resolve_threads``."""
    group.add_argument("--threads", type=_threads_value, default=THREADS_AUTO, metavar="N", help=THREADS_HELP)


def auto_threads(*, default_threads: int, cpu_count: int, load_average: float) -> int:
    """``--threads auto``: the CPUs the machine's other work leaves idle, ``round(cpu_count -
    load_average)`` (the 1-minute load average counts the runnable processes of the whole
    machine), clamped to [1, default_threads] (torch's own default: one per core it may use)."""
    return max(1, min(default_threads, round(cpu_count - load_average)))


def resolve_threads(value) -> tuple[int, str]:
    """(torch threads, how chosen) for a --threads value: N >= 1 as given; 0: torch's default;
    auto: ``auto_threads`` of this machine now.

    Raises:
        ValueError: an integer below 0 (names the value and the flag).
    """
    import torch

    if value == THREADS_AUTO:
        load = os.getloadavg()[0]
        n = auto_threads(default_threads=torch.get_num_threads(), cpu_count=os.cpu_count() or 1, load_average=load)
        return n, f"auto: {os.cpu_count()} CPUs at load average {load:.1f}; --threads N to choose"
    if value < 0:
        raise ValueError(f"--threads {value} must be >= 1 (or 0: torch's default, or auto)")
    return (value, "--threads") if value else (torch.get_num_threads(), "torch's default, --threads 0")


def apply_threads(args) -> int:
    """``torch.set_num_threads`` of ``resolve_threads(--threads)``: the process-wide intra-op pool,
    so the server's scheduler thread runs with it too. Returns the thread count; ``args.threads_note``
    says how it was chosen (``load_from_args`` prints it with the host-memory line, after every
    start-up check).

    Raises:
        ValueError: --threads below 0.
    """
    import torch

    n, how = resolve_threads(getattr(args, "threads", THREADS_AUTO))
    torch.set_num_threads(n)
    args.threads_note = f"threads: {n} ({how})"
    return n


DECIDE_HELP = (
    "where each paged layer-step is planned: host (top-k ids read back once per layer, planned in Python; "
    "any device), device (decide, page-in and remap by Triton kernels on the device, no read-back; CUDA "
    "with triton installed, or a CPU under TRITON_INTERPRET=1 for tests; --policy lru or lfu, no --prefetch, "
    "no disk tier), auto (device on CUDA where it can serve the step, host otherwise and on CPU; default auto)"
)


def add_decide_argument(group) -> None:
    """--decide auto|host|device (``loading.config.DECIDE_CHOICES``)."""
    group.add_argument("--decide", default="auto", choices=["auto", "host", "device"], help=DECIDE_HELP)


BEYOND_K_HELP = (
    "a step whose routed experts do not fit the K slots: waves (default: W = ceil(union / K) waves per layer-step, "
    "each paged in then computed) or in-place (one wave at any batch size: the experts that get no slot this step "
    "are read in place from the host store, page-locked and mapped on CUDA, inside the same fused launch; needs "
    "--experts-implementation fused on the device-planned step). The default stays waves until a GPU has timed both "
    "(bench/gpu_check.sh); docs/fused-kernels.md"
)


def add_beyond_k_arguments(group) -> None:
    """--beyond-k waves|in-place (``paging.device_residency.BEYOND_K``) and --admit-per-step N."""
    from pagedexperts.paging.device_residency import BEYOND_K

    group.add_argument("--beyond-k", default="waves", choices=list(BEYOND_K), help=BEYOND_K_HELP)
    group.add_argument("--admit-per-step", type=int, default=None, metavar="N",
                       help="with --beyond-k in-place: page-ins per layer-step at most, N >= 0 (default K: every "
                       "miss that fits beside the step's hits, which keeps the eviction policy's decisions for "
                       "unions <= K); a smaller N keeps a large batch from evicting the table for experts it reads once")


GRAPHS_HELP = (
    "capture every decode step in a CUDA graph (static KV cache, one capture per batch size up to "
    "--cuda-graph-max-batch; prefill stays eager; serve: each decode batch bucket over its KV rows, prefill, "
    "chunked prefill and --speculative verification eager); an error where capture cannot work (CPU, --decide host, "
    "a mode that copies on the host). Default: auto, graphs where the step is capturable (CUDA, device-planned "
    "or resident, a syncless experts kernel), else a WARNING and decode without them (silent on CPU); "
    "docs/cuda-graphs.md"
)


def add_graph_arguments(group, *, max_batch_default: str | None = None) -> None:
    """--cuda-graphs / --no-cuda-graphs (default auto) and --cuda-graph-max-batch N (default
    ``DEFAULT_CUDA_GRAPH_MAX_BATCH``; with ``max_batch_default``, a text saying what None means:
    serve captures every bucket up to --max-running-requests)."""
    group.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_const", const="on", default="auto",
                       help=GRAPHS_HELP)
    group.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const="off",
                       help="decode without CUDA graphs (generate: transformers' generate, dynamic KV cache; "
                       "serve: the same fixed-shape steps over the KV rows, run eagerly)")
    default = DEFAULT_CUDA_GRAPH_MAX_BATCH if max_batch_default is None else None
    group.add_argument("--cuda-graph-max-batch", type=int, default=default, metavar="N",
                       help=f"largest decode batch captured, N >= 1 (default {max_batch_default or default}); "
                       "larger batches run the same static step eagerly")


def _graph_max_batch(args) -> int:
    """--cuda-graph-max-batch as given (checked by ``loading.config``), or the default where the
    command leaves it None (serve: its buckets are the server's, ``ServeConfig``)."""
    value = getattr(args, "cuda_graph_max_batch", None)
    return DEFAULT_CUDA_GRAPH_MAX_BATCH if value is None else value


def load_from_args(args):
    """(model, tokenizer) from the flags of add_model_arguments, with the threads chosen
    (``apply_threads``) and the host-memory plan printed (stderr; not under --quiet)."""
    from pagedexperts.loading.loader import load_model

    model, tokenizer = load_model(args.model_path, **paging_options(args))
    if not getattr(args, "quiet", False):
        if getattr(args, "threads_note", None):
            print(args.threads_note, file=sys.stderr)
        print_host_memory(model)
        print(experts_note(model.pagedexperts, asked=given(args, "experts_implementation")), file=sys.stderr)
    return model, tokenizer


def experts_note(runtime, *, asked: str | None = None) -> str:
    """The one start-up line of the experts: which implementation runs and why (``asked``: the
    --experts-implementation given, None when left at its default), under packed on which MoE
    layers and non-expert linears (``packed_paths``), where steps are planned, and how a union
    beyond K is computed (``PagingRuntime``: its config and what was resolved, ``.resolved``)."""
    cfg, resolved = runtime.config, runtime.resolved
    name = resolved.experts_implementation
    line = f"experts: {name} ({experts_why(runtime, asked)})"
    if name == PACKED:
        line = f"experts: {name} (torch's CPU int4 / int8 kernels) {packed_paths(runtime, why=experts_why(runtime, asked))}"
    if cfg.mode != "paged":
        return f"{line}; mode {cfg.mode}"
    decide = resolved.decide if cfg.decide != "auto" else f"{resolved.decide} (--decide auto)"
    if resolved.beyond_k == "in-place":
        admit = "K" if resolved.admit_per_step is None else str(resolved.admit_per_step)
        beyond = f"in place from the host store, one wave a step, page-ins per step <= {admit} (--beyond-k in-place)"
    else:
        beyond = "in waves (--beyond-k waves, the default until a GPU has timed in-place)"
    return f"{line}; {decide}-planned steps; experts beyond K={resolved.num_resident} computed {beyond}"


def experts_why(runtime, asked: str | None) -> str:
    """Why ``runtime``'s experts implementation runs: the flag where it was named (the resolved
    record's reason), else auto's choice (default, or ``asked`` "auto") and ``auto_reason``."""
    named = not runtime.resolved.reasons["experts_implementation"].startswith("auto:")
    if named or asked not in (None, AUTO):
        return "--experts-implementation"
    return f"{'the default, ' if asked is None else ''}auto's choice for {runtime.expert_format}: {auto_reason(runtime)}"


def auto_reason(runtime) -> str:
    """Why auto (``loading.config.resolve_experts_implementation``) chose what ``runtime`` runs."""
    from pagedexperts.formats import FORMATS

    cfg = runtime.config
    if runtime.resolved.experts_implementation == PACKED:
        return ("int4 / int8 on a CPU: torch's packed kernels, faster than dequantizing, exact to itself with all E "
                "resident, each matmul within a bound of float32 (check); --experts-implementation grouped_mm for "
                "bits equal to transformers'")
    if not cfg.device.startswith("cpu"):
        return ("grouped_mm on CUDA (fused becomes the default on CUDA once its CUDA tests and bench/gpu_check.sh "
                "have run on a GPU, docs/fused-kernels.md)")
    if cfg.mode != "paged":
        return f"grouped_mm in --mode {cfg.mode} (packed computes the paged slots)"
    record = FORMATS.get(runtime.expert_format)
    if record is None or not record.cpu_packed:
        return (f"grouped_mm: torch's packed CPU kernels take int4 / int8, not {runtime.expert_format} "
                "(exact to transformers)")
    return ("grouped_mm: torch's int4 CPU kernel is fast in bfloat16 only (float16 / float32 take a scalar path, "
            "30-50x slower, docs/benchmarks.md); --dtype bfloat16 runs packed")


def packed_paths(runtime, *, why: str) -> str:
    """Under --experts-implementation packed: how many MoE layers compute their experts packed
    and which run grouped_mm and why (``why``: why packed runs), how many quantized non-expert
    linears are packed and dequantized and why."""
    fallbacks = runtime.resolved.experts_fallbacks
    line = f"on {len(runtime.runners) - len(fallbacks)} of {len(runtime.runners)} MoE layers ({why})"
    if fallbacks:
        reasons = sorted(set(fallbacks.values()))
        line += f"; grouped_mm on layers {sorted(fallbacks)} ({'; '.join(reasons)})"
    linears = runtime.quantized_linears
    if linears is not None and (linears.packed or linears.modules):
        line += (f"; quantized non-expert linears: {len(linears.packed)} packed, {len(linears.modules)} dequantized"
                 + "".join(f" ({why})" for why in dict.fromkeys(why for _, why in linears.fallbacks)))
    return line


def print_host_memory(model) -> None:
    """One line on stderr: every part of host memory the loader counted (``HostMemoryPlan.describe``); with packed experts a
    second: the stored kernel layout the disk tier reads (or the host store was read from at load), or that they convert, and why."""
    resolved = model.pagedexperts.resolved
    plan = resolved.host_memory
    if plan is not None:
        print(f"host memory: {plan.describe()}", file=sys.stderr)
    if "stored_layout" in resolved.reasons:
        tier, path = plan is not None and plan.disk_tier, resolved.stored_layout
        said = (("reads the " if tier else "") + f"stored kernel layout {path}" if path is not None else
                f"converts each expert read to the CPU kernels' layout {'at page-in' if tier else 'at load'}")
        print(f"{'disk tier' if tier else 'host store'}: {said} ({resolved.reasons['stored_layout']})", file=sys.stderr)


def check_paging_flags(args) -> None:
    """The paging flags' problems that need no model (every one at once, each naming its flag),
    for a command to raise before it reads --model-path (as ``load_model`` raises them first).

    Raises:
        loading.config.ConfigError: the problems.
    """
    from pagedexperts.loading.config import ConfigError, PagingConfig, option_problems

    problems = option_problems(PagingConfig(**paging_options(args)))
    if problems:
        raise ConfigError(problems)


def paging_options(args) -> dict:
    """``load_model``'s keyword options from the flags of add_model_arguments."""
    return dict(
        num_resident=args.num_resident,
        device=args.device,
        dtype=args.dtype,
        experts_implementation=args.experts_implementation,
        policy=args.policy,
        prefetch=getattr(args, "prefetch", False),
        prefetch_budget=getattr(args, "prefetch_budget", None),
        read_ahead=getattr(args, "read_ahead", True),
        stored_layout=getattr(args, "stored_layout", True),
        stored_layout_dir=getattr(args, "stored_layout_dir", None),
        slot_format=getattr(args, "slot_format", DEFAULT_SLOT_FORMAT),
        host_memory_gb=getattr(args, "host_memory_gb", None),
        decide=decide_for(args),
        # commands without the graph flags (check, bench) decode without graphs
        cuda_graphs=getattr(args, "cuda_graphs", "off"),
        cuda_graph_max_batch=_graph_max_batch(args),
        beyond_k=getattr(args, "beyond_k", "waves"),
        admit_per_step=getattr(args, "admit_per_step", None),
    )


def decide_for(args) -> str:
    """--decide, with auto meaning host when --record-trace is given (a trace reads every step's
    routing on the host); --decide device with --record-trace is refused (names both flags)."""
    if getattr(args, "record_trace", None):
        if args.decide == "device":
            raise ValueError("--record-trace reads every step's routing on the host; --decide device reads "
                             "nothing back: use --decide host (or auto) to record a trace")
        return "host"
    return args.decide
