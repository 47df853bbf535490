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
from pagedexperts.loading.config import ConfigError, PagingConfig, check_config, option_problems
from pagedexperts.loading.fill import fill_from_checkpoint
from pagedexperts.loading.independence import check_model_independence
from pagedexperts.loading.resolved import resolve_implementation
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
        model_path: model directory (config.json, safetensors, tokenizer); None = the bundled model.
        check_independence: page a sample of every layer's experts into a slot at start-up and
            compare what the kernel reads with the checkpoint's tensors (``loading.independence``).
        options: ``loading.config.PagingConfig`` fields (num_resident, device, dtype,
            experts_implementation, mode, host_memory_gb, ...; each field's comment says what it
            means). grouped_mm, batched_mm and eager are exact to transformers with the same
            kernel; fused and packed are exact to themselves with all E experts resident.

    Returns:
        (model, tokenizer): a transformers causal LM usable with ``generate()``, with
        ``model.pagedexperts`` (a ``PagingRuntime``: ``.stats()``; ``.resolved``, every choice made
        from the options with its reason), and its tokenizer (None if the directory has none).

    Raises:
        TypeError: an argument of another type than it takes, or an unknown keyword (``check_arguments``).
        FileNotFoundError: path, config.json or a shard missing; tokenizer.json missing where the
            tokenizer cannot be built without it (names the file).
        ValueError: config.json not valid JSON, not an MoE model or an unsupported architecture,
            top_k above E; ``loading.config.ConfigError`` listing every problem of the options at
            once, each naming its flag; a truncated shard or expert shapes that do not match the
            config; --host-memory-gb below the disk tier's minimum.
        MemoryError: host memory too small for what must live there (before anything is loaded;
            names the bytes of each part).
    """
    check_arguments(model_path, check_independence, options)
    cfg = PagingConfig(**options)  # the one construction; checked once, below, and resolved once
    path, config, files = _read_checked(model_path, cfg)
    fmt = format_for_checkpoint(config, files)
    implementation = resolve_implementation(cfg, fmt, config)  # the one evaluation: the check, build and fill read it
    check_config(cfg, config, fmt, experts_implementation=implementation)
    check_readable(files)
    if fmt.name == "dense" and cfg.slot_format != DEFAULT_SLOT_FORMAT:
        logger.warning("--slot-format %s has no effect: %s is not quantized (its slots hold dense experts)",
                       cfg.slot_format, path)
    tokenizer = load_tokenizer(path)  # a broken tokenizer is refused before the weights load
    # the non-expert linears run packed too where the experts do (loading.linears)
    fill = functools.partial(fill_from_checkpoint, model_type=config.model_type, files=files, fmt=fmt,
                             packed_linears=implementation == PACKED)
    sources, cache_dir = [*files, path / "config.json"], None if cfg.stored_layout_dir is None else Path(cfg.stored_layout_dir)
    read_stored = functools.partial(read_stored_layout, checkpoint=path, files=sources, cache_dir=cache_dir)
    model = build_paged_model(config, fill, cfg, expert_format=fmt, files=files, experts_implementation=implementation,
                              before_fill=read_stored if cfg.stored_layout else None)
    if cfg.stored_layout:
        attach_stored_layout(model, path, sources, cache_dir=cache_dir)
    else:
        skip_stored_layout(model.pagedexperts)
    if cfg.stored_layout_dir is not None:
        warn_no_effect(model.pagedexperts, "--stored-layout-dir")
    if not cfg.read_ahead and not model.pagedexperts.host_memory.disk_tier:
        logger.warning("--no-read-ahead has no effect: read-ahead serves only the disk tier, and here every "
                       "expert is in host memory (%s)", model.pagedexperts.resolved.reasons["host_memory"])
    if check_independence:
        check_model_independence(model, files, fmt)
        for store in model.pagedexperts.stores.values():  # the check's samples leave no trace
            store.reset()
    disk_tier = model.pagedexperts.host_memory.disk_tier
    if cfg.mode == "paged" and (cfg.prefetch or (disk_tier and cfg.read_ahead)):
        install_prefetch(model, budget=cfg.prefetch_budget, page_in=cfg.prefetch)
    return model, tokenizer


def check_arguments(model_path, check_independence, options: dict) -> None:
    """``load_model``'s arguments checked by type, each error naming the Python argument; a bool is
    neither an int nor a float here.

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
    """(directory, transformers config, safetensors files) of a model directory (None: the bundled
    model), checked before any weight is read.

    Raises:
        FileNotFoundError: path, config.json or safetensors missing (names --model-path).
        ValueError: config.json not valid JSON (names the file and the position); not an MoE model
            or an unsupported architecture (lists the supported ones); top_k above E (names both keys).
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


def load_tokenizer(path: Path):
    """The tokenizer of model directory ``path``, or None without tokenizer files. Raises
    FileNotFoundError naming tokenizer.json where transformers cannot build the tokenizer without it.
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
