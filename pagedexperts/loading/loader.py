"""Load a Hugging Face MoE checkpoint with paged experts: the library's entry point.

Owns: ``load_model`` read top-down: the options checked once with the model's config
(``loading.config``), the shards' headers, the build (``loading.build``) with the one fill path
(``loading.fill``), the start-up independence check, prefetch; the tokenizer. Does not: page
(``paging``), decide residency (``residency``), or generate text (``generation``); the bundled
model's path is ``loading.bundled``'s.
"""

from __future__ import annotations

import functools
import logging
import numbers
import typing
from pathlib import Path

from pagedexperts.formats.slots import DEFAULT_SLOT_FORMAT
from pagedexperts.loading.bundled import bundled_model_path
from pagedexperts.loading.build import build_paged_model
from pagedexperts.loading.checkpoint import format_for_checkpoint
from pagedexperts.loading.config import (ConfigError, PagingConfig, check_config, option_problems,
                                         resolve_dtype, resolve_experts_implementation)
from pagedexperts.loading.fill import fill_from_checkpoint
from pagedexperts.loading.independence import check_model_independence
from pagedexperts.loading.runners import install_prefetch
from pagedexperts.loading.stored_layout import (attach_stored_layout, read_stored_layout, skip_stored_layout,
                                                 warn_no_effect)
from pagedexperts.models.sites import check_supported
from pagedexperts.models.config import read_config, routing_problem, with_modelopt_quantization
from pagedexperts.paging.steps.table import PACKED
from pagedexperts.storage.safetensors_files import checkpoint_files
from pagedexperts.storage.safetensors_index import check_readable

logger = logging.getLogger(__name__)

def load_model(model_path: str | Path | None = None, *, check_independence: bool = True, **options):
    """Load a Hugging Face MoE model directory with K of E experts per layer resident.

    Args:
        model_path: model directory (config.json, safetensors, tokenizer); None = bundled.
        check_independence: see below. Every other keyword is a ``loading.config.PagingConfig``
            field (defaults there):
        num_resident: K slots per MoE layer, top_k <= K <= E; None = max(top_k, E // 4).
        device: "cpu" or "cuda[:n]": where slots, attention and everything else live.
        dtype: "float32", "bfloat16", "float16"; None = the checkpoint's dtype.
        experts_implementation: the transformers experts kernel run over the slots
            (grouped_mm, batched_mm, eager); the paged output equals the unpaged model's
            with the same implementation. Or "fused" (Triton, device-planned), "packed"
            (torch's int4 / int8 CPU kernels), both exact to themselves with all E resident,
            or "auto", the default (packed on a CPU in mode paged for the int formats whose
            record says so, ``formats.FormatRecord.cpu_packed``, else grouped_mm). Under packed the quantized
            non-expert linears (attention, shared experts, dense MLPs, lm_head) are computed
            packed too where the kernels take them (``loading.linears``), else dequantized at load.
        policy: eviction policy name (``residency.policies.POLICIES``).
        mode: "paged" (this project), or a baseline (``paging.baselines``): "resident" (all E experts on
            the device), "offload" (all E copied in every step), "cpu-experts" (the first
            ``cpu_expert_layers`` MoE layers computed on the CPU, the rest resident).
        cpu_expert_layers: N for mode "cpu-experts", 0 <= N <= MoE layers.
        prefetch: mode "paged" only: while layer l computes, page in layer l+1's experts as
            predicted by layer l+1's router on layer l's input (``pagedexperts.paging.prefetch``).
        prefetch_budget: prefetch page-ins per layer per step at most (None = top_k).
        read_ahead: with the disk tier (see host_memory_gb), read the next layer's predicted
            experts (its router on this layer's input) from disk into staging rows while this
            layer computes, without paging them into slots (default True; ``prefetch`` does
            both). No effect without the disk tier.
        slot_format: for a quantized checkpoint, what the K slots hold: "packed" (what a
            page-in copies; each wave's experts dequantized before compute), "dense"
            (dequantized once at page-in) or "auto" (dense on CPU, packed on CUDA; see
            ``formats.slots``). No effect on an unquantized one.
        decide: where a paged layer-step is planned: "host" (the top-k ids read back once,
            the residency planned in Python; any step, any device), "device" (decide, page-in
            and remap by kernels on the device, no read-back: ``paging.device_executor``; CUDA
            with triton installed, or a CPU under TRITON_INTERPRET=1 for tests; policies lru
            and lfu, grouped_mm or batched_mm, packed slots, no prefetch, no disk tier) or
            "auto" (default: device on CUDA where it can serve the step, host otherwise and on
            CPU). ``model.pagedexperts.decide`` says which was chosen.
        device_kernels: the device decide's kernels: "triton" (default), or "torch" (their
            plain-torch references, CPU only: tests where the Triton interpreter is slow).
        cuda_graphs: decode steps of ``generation.generate.generate_text`` in CUDA graphs
            (``generation.graphs``): "auto" (default: where the step is capturable, i.e. CUDA
            and device-planned or resident steps; else decode without them, a WARNING on
            CUDA), "on" (a ConfigError where capture cannot work), "off", or "eager" (the same
            static-buffer decode without capture: CPU tests). ``model.pagedexperts.resolved
            .cuda_graphs`` says what was resolved ("cuda", "eager", "off") and ``.reasons`` why.
        cuda_graph_max_batch: N >= 1, the largest decode batch captured (default 8).
        beyond_k: a step whose routed experts do not fit the K slots: "waves" (default: in
            W = ceil(union / K) waves, each paged in then computed) or "in-place" (one wave:
            the experts that get no slot this step are read in place from the host store by
            the fused kernels; ``experts_implementation="fused"`` on the device-planned step only).
        admit_per_step: with beyond_k "in-place", page-ins per layer-step at most (None: K,
            which decides unions <= K exactly as waves do).
        check_independence: at start-up, page a sample of experts of every layer into a slot
            and compare what the experts kernel would read with the checkpoint's own tensors
            of that expert (``loading.independence``); raises naming the tensor on a mismatch.
            With the disk tier, the predictions are also read ahead from disk.
        stored_layout: where the experts run packed (auto's choice or the flag), read them
            from a stored copy in the CPU kernels' layout (``loading.stored_layout``: the
            checkpoint's own ``kernel-layout/``, or written once to ``stored_layout_dir``, None:
            kernel-layouts/ in $PAGEDEXPERTS_CACHE, else $XDG_CACHE_HOME/pagedexperts, else
            ~/.cache/pagedexperts), so that a disk-tier miss is a read and a copy and a full host
            store is read at load, never converted; False: each expert converted from the
            checkpoint's rows (the disk tier's at page-in, a full store's at load). Either flag
            where no experts run packed: a WARNING, no effect.
        host_memory_gb: G, host memory in GB (1e9 bytes) for everything the process holds
            (``storage.host_memory.HostMemoryPlan``): the expert store, the slots, non-expert
            weights and a KV estimate on a CPU device, and the runtime allowance. When all E
            experts of every layer do not fit in what is left for the store, each layer keeps
            R host rows and reads the other experts from the checkpoint files on demand (the
            disk tier; mode "paged" only). None: the available memory (the smaller of the
            machine's and the memory cgroup's).

    Returns:
        (model, tokenizer): a transformers causal LM usable with ``generate()``, with
        ``model.pagedexperts`` (a PagingRuntime: ``.stats()``; ``.resolved``, every choice made
        from these options with its reason), and its tokenizer (None if the directory has none).

    Raises:
        TypeError: an argument of another type than it takes, or an unknown keyword (``check_arguments``).
        FileNotFoundError: path, config.json or a shard missing; tokenizer.json missing where
            the tokenizer cannot be built without it (names the file).
        ValueError: config.json not valid JSON (names the file and the position); not an MoE
            model / unsupported architecture (lists supported ones); num_experts_per_tok above
            E (names config.json's keys);
            ``loading.config.ConfigError`` listing every problem of the options at once (K out
            of [top_k, E] naming --num-resident, unknown dtype / implementation / policy /
            mode, --decide device with an option it cannot serve naming both flags, ...); truncated shard, expert shapes that do not match the config;
            --host-memory-gb below the disk tier's minimum (names it).
        MemoryError: host memory too small for what must live there (before anything is
            loaded; names the bytes of each part).
    """
    check_arguments(model_path, check_independence, options)
    cfg = PagingConfig(**options)  # the one construction; checked once, below, and resolved once in the build
    path, config, files = _read_checked(model_path, cfg)
    fmt = format_for_checkpoint(config, files)
    check_config(cfg, config, fmt)
    check_readable(files)
    if fmt.name == "dense" and cfg.slot_format != DEFAULT_SLOT_FORMAT:
        logger.warning("--slot-format %s has no effect: %s is not quantized (its slots hold dense experts)",
                       cfg.slot_format, path)
    tokenizer = _load_tokenizer(path)  # a broken tokenizer is refused before the weights load
    # the non-expert linears run packed too where the experts do (loading.linears)
    packed = resolve_experts_implementation(cfg, fmt, resolve_dtype(cfg.dtype, config)) == PACKED
    fill = functools.partial(fill_from_checkpoint, model_type=config.model_type, files=files, fmt=fmt,
                             packed_linears=packed)
    sources, cache_dir = [*files, path / "config.json"], None if cfg.stored_layout_dir is None else Path(cfg.stored_layout_dir)
    read_stored = functools.partial(read_stored_layout, checkpoint=path, files=sources, cache_dir=cache_dir)
    model = build_paged_model(config, fill, cfg, expert_format=fmt, files=files,
                              before_fill=read_stored if cfg.stored_layout else None)
    if cfg.stored_layout:
        attach_stored_layout(model, path, sources, cache_dir=cache_dir)
    else:
        skip_stored_layout(model.pagedexperts)
    if cfg.stored_layout_dir is not None:
        warn_no_effect(model.pagedexperts, "--stored-layout-dir")
    if check_independence:
        check_model_independence(model, files, fmt)
        for store in model.pagedexperts.stores.values():  # the check's samples leave no trace
            store.reset()
    disk_tier = model.pagedexperts.host_memory.disk_tier
    if cfg.mode == "paged" and (cfg.prefetch or (disk_tier and cfg.read_ahead)):
        install_prefetch(model, budget=cfg.prefetch_budget, page_in=cfg.prefetch)
    return model, tokenizer


def check_arguments(model_path, check_independence, options: dict) -> None:
    """``load_model``'s arguments checked by type at the door, each error naming the Python
    argument (a command's flags are typed by argparse): ``num_resident="8"`` raised a TypeError from
    deep inside, ``8.0`` another, and ``True`` was taken as 1 (a bool is no int here, nor a float).

    Raises:
        TypeError: an unknown keyword (lists the known ones), or a value of another type than the
            argument's (``PagingConfig``'s annotation; ``model_path``: a path or None).
    """
    hints = typing.get_type_hints(PagingConfig)
    unknown = sorted(set(options) - set(hints))
    if unknown:
        raise TypeError(f"load_model() got unknown keyword arguments {unknown}; it takes model_path, "
                        f"check_independence and {', '.join(sorted(hints))}")
    checks = {"model_path": (model_path, str | Path | None), "check_independence": (check_independence, bool),
              **{name: (value, hints[name]) for name, value in options.items()}}
    for name, (value, hint) in checks.items():
        allowed = typing.get_args(hint) or (hint,)
        ok = any(value is None if t is type(None) else _of_type(value, t) for t in allowed)
        if not ok:
            takes = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise TypeError(f"load_model({name}={value!r}): {name} takes {takes}, not {type(value).__name__}")


def _of_type(value, t: type) -> bool:
    """isinstance, with a bool no int and no float, any integer (numpy's too) an int, and any real
    number a float (a whole number of GB)."""
    if isinstance(value, bool):
        return t is bool
    return isinstance(value, {int: numbers.Integral, float: numbers.Real}.get(t, t))


def _read_checked(model_path, cfg: PagingConfig):
    """``read_checkpoint_config``, with the option problems first: an unreadable directory is
    one more problem in the same error when the options have problems too."""
    try:
        path, config, files = read_checkpoint_config(model_path)
    except (FileNotFoundError, ValueError) as exc:
        problems = option_problems(cfg)
        if problems:
            raise ConfigError(problems + [str(exc)]) from exc
        raise
    if getattr(config, "output_router_logits", False):
        config.output_router_logits = False  # a training-time aux loss; inference never needs it
    return path, config, files


def read_checkpoint_config(model_path: str | Path | None):
    """(directory, transformers config, safetensors files) of a model directory (None: the
    bundled model), checked in this order before anything reads weights: the path exists, has
    config.json, is a supported MoE architecture, has a safetensors checkpoint.

    Raises:
        FileNotFoundError: path, config.json or safetensors missing (names --model-path).
        ValueError: config.json not valid JSON (names the file and the position); not an MoE
            model / unsupported architecture (lists supported ones); config.json's top_k above
            its E (names both keys).
    """
    from transformers import AutoConfig

    path = Path(model_path) if model_path is not None else bundled_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (--model-path)")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json; is it a Hugging Face model directory? (--model-path)")
    spelled = read_config(str(path))  # valid JSON, or one line naming the file (transformers: an OSError)
    config = with_modelopt_quantization(AutoConfig.from_pretrained(path), path)
    check_supported(config)
    if routing_problem(spelled):  # names the keys as config.json spells them
        raise ValueError(routing_problem(spelled))
    return path, config, checkpoint_files(path)


def has_tokenizer(path: Path) -> bool:
    """Whether model directory ``path`` holds a tokenizer (tokenizer.json, tokenizer_config.json or
    tokenizer.model): what ``load_model`` needs to return one instead of None."""
    return any((Path(path) / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _load_tokenizer(path: Path):
    """The tokenizer of model directory ``path``, or None when it has no tokenizer files.

    Raises:
        FileNotFoundError: transformers cannot build it and tokenizer.json is missing beside
            tokenizer_config.json (names the file; transformers' own message suggests installing
            sentencepiece or tiktoken, which would not help).
    """
    from transformers import AutoTokenizer

    if not has_tokenizer(path):
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError) as exc:
        if (path / "tokenizer.json").exists() or not (path / "tokenizer_config.json").exists():
            raise
        raise FileNotFoundError(
            f"{path} has tokenizer_config.json but no tokenizer.json, and transformers cannot build the "
            f"tokenizer without it (transformers raised {type(exc).__name__}); copy tokenizer.json from the source "
            "model into the directory (--model-path)") from exc
