"""The ``check`` command's runs: per K, paged against its reference, the verdict lines it prints.

Owns: ``CheckRequest`` (what ``pagedexperts check`` was asked) and ``check_checkpoint``: the K
values checked against [top_k, E], the prompts against the model's positions, the options and
each K's host-memory plan checked against the checkpoint before the reference loads, then one of
three runs by the resolved experts implementation: dense (paged == the unpaged reference,
torch.equal), ``run_fused`` (paged == the same kernels all resident, and within tolerance of
transformers' model) and ``run_packed`` (paged == the same kernels all resident, and each packed
matmul within its bound of float32). Does not: compare logits (``tools.check``), bound a matmul
(``tools.packed_bound``) or parse flags (``commands.check``).
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pagedexperts.tools.check import DEFAULT_PROMPTS, each_message_once


@dataclass(frozen=True)
class CheckRequest:
    """What ``pagedexperts check`` was asked: ``options``, ``load_model`` keywords but
    ``num_resident``; ``check_resident`` (the K values of --check-resident, parsed by
    ``commands.flag_lists.comma_ints``) else ``num_resident`` (None: top_k and E/2);
    the ``prompts``, ``max_new_tokens`` > 0 each; ``source_model_path``, the float32 source of the
    fused and packed runs' top-1 comparison (None: none).
    """

    model_path: str | None
    options: Mapping
    check_resident: tuple[int, ...] | None = None
    num_resident: int | None = None
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_new_tokens: int = 8
    source_model_path: str | None = None


def resident_values(check_resident: tuple[int, ...] | None, num_resident: int | None, *, top_k: int,
                    num_experts: int) -> list[int]:
    """The K values to check (``check_resident``, else ``num_resident``, else top_k and E/2), each
    validated against [top_k, E] before any model is loaded.

    Raises:
        ValueError: a K outside [top_k, E] (names the flag).
    """
    from pagedexperts.residency.planner import check_num_resident

    if check_resident:
        ks = list(check_resident)
    elif num_resident is not None:
        ks = [num_resident]
    else:
        ks = [top_k, max(top_k, num_experts // 2)]
    flag = "--check-resident" if check_resident else "--num-resident"
    for k in ks:
        check_num_resident(k, num_experts=num_experts, min_slots=top_k, flag=flag)
    return ks


def check_prompts_fit(request: CheckRequest, config, tokenizer) -> None:
    """Refuse, before any model loads, a check whose longest prompt + ``max_new_tokens`` exceeds the
    model's max_position_embeddings (``generation.config.check_context``, generate's and serve's rule;
    each prompt runs alone and in the left-padded batch, as wide as the longest).

    Raises:
        ValueError: names the token counts, the limit, --max-new-tokens and the prompt.
    """
    from pagedexperts.generation.config import check_context

    counts = {prompt: len(tokenizer(prompt)["input_ids"]) for prompt in request.prompts}
    longest = max(counts, key=counts.get)
    try:
        check_context(counts[longest], request.max_new_tokens, int(getattr(config, "max_position_embeddings", 0) or 0))
    except ValueError as exc:
        raise ValueError(f"{exc} (the longest prompt check runs: {longest!r})") from None


def _dense_reference_bytes(files, dtype) -> int:
    """Bytes of the parameters of the unpaged reference of a dense checkpoint (transformers' model at
    run ``dtype``): every tensor of the shards ``files`` at ``dtype``'s size. An estimate of what the
    paged loads will count as held: tensors transformers leaves mapped from the file count there
    less (not anonymous memory), float32-kept ones more."""
    import math

    from pagedexperts.storage.safetensors_files import read_header_json

    itemsize = dtype.itemsize
    return sum(math.prod(t["shape"]) * itemsize for f in files for t in read_header_json(f)[0].values())


def verdict_line(k: int, num_experts: int, res, *, steps: int, decide: str = "host") -> str:
    """One line per K: what ran (``decide``: where the paged steps were planned), the two
    comparisons, and PASS / FAIL."""
    exact = all(p.exact for p in res.prompts)
    tokens = all(p.tokens_equal for p in res.prompts)
    return (
        f"K={k} of E={num_experts}: {len(res.prompts)} runs x {steps} greedy steps ({decide}-planned), misses {res.misses}; "
        f"logits torch.equal: {'yes' if exact else 'NO'} (max |diff| {res.max_abs_diff:.3g}); "
        f"greedy tokens equal: {'yes' if tokens else 'NO'} -> {'PASS (bit-identical)' if res.passed else 'FAIL'}"
    )


def _paged_against_resident(request: CheckRequest, k: int, oracle, tokenizer, on_paged_load):
    """The paged model at K = ``k`` (``on_paged_load`` called on it) and ``tools.check.check_model``'s
    comparison with ``oracle``, the same kernels with all E resident."""
    from pagedexperts.loading.loader import load_model
    from pagedexperts.tools.check import check_model

    paged, _ = load_model(request.model_path, num_resident=k, **request.options)
    if on_paged_load is not None:
        on_paged_load(paged)  # the start-up lines: host memory, the stored layout read or written
    return paged, check_model(paged, oracle, tokenizer, list(request.prompts), max_new_tokens=request.max_new_tokens)


def run_fused(request: CheckRequest, ks, reference, choice, num_experts: int, *, path, quantized: bool,
              on_paged_load: Callable | None = None) -> int:
    """``check --experts-implementation fused`` (or ``packed``: torch's packed CPU matmuls): per
    K, paged == the same kernels with all E resident (torch.equal), and within tolerance of
    transformers' model (``tools.check_fused``). Every label says what ran (``tools.what_ran``):
    a layer that fell back runs grouped_mm, and a check where the kernel ran nowhere says so."""
    import torch

    from pagedexperts.loading.loader import load_model
    from pagedexperts.tools.check import reference_label, transformers_model
    from pagedexperts.tools.check_fused import tolerance_check, tolerance_line
    from pagedexperts.tools.what_ran import kernels_ran

    source_path = request.source_model_path
    if source_path is None and not quantized and reference.dtype == torch.float32:
        source_path = str(path)  # an unquantized float32 checkpoint is its own float32 source
    source = None if source_path is None else transformers_model(source_path, dtype="float32").to(request.options["device"]).eval()
    oracle, tokenizer = load_model(request.model_path, num_resident=num_experts, **request.options)
    ran = kernels_ran(oracle)
    print(f"ran: {ran.label()}")
    if not ran.ran_at_all:
        print(f"--experts-implementation {ran.implementation} ran nowhere: this checks {ran.kernel} "
              f"(paged == {ran.kernel} with all E resident, and within tolerance of {choice.source})")
    transformers_ref = reference_label(choice, quantized=quantized)
    print(f"references: the same kernels ({ran.kernel}) with all E={num_experts} experts resident (exact); "
          f"{transformers_ref} (within tolerance)")
    prompts = list(request.prompts)
    ok = True
    for k in ks:
        paged, res = _paged_against_resident(request, k, oracle, tokenizer, on_paged_load)
        print(verdict_line(k, num_experts, res, steps=request.max_new_tokens, decide=paged.pagedexperts.decide)
              + f" [vs {ran.kernel}, all E={num_experts} resident]")
        tol = tolerance_check(paged, reference, source, tokenizer, prompts, max_new_tokens=request.max_new_tokens)
        print(tolerance_line(k, tol, reference=transformers_ref, source=source_path, name=ran.kernel,
                             reference_name=choice.source))
        ok &= res.passed and tol.passed
        del paged  # collected (its modules hold cycles) before the next K's load plans its host memory
        gc.collect()
    print("verdict:", "PASS" if ok else "FAIL", f"(paged {ran.kernel} == {ran.kernel} all resident; within tolerance "
          f"of {choice.source})" + ("" if ran.ran_at_all else f"; {ran.implementation} ran nowhere"))
    return 0 if ok else 1


def run_packed(request: CheckRequest, ks, reference, choice, num_experts: int, *, config, files, fmt,
               on_paged_load: Callable | None = None) -> int:
    """``check`` where experts run packed (torch's CPU int4 / int8 kernels): per K, paged == the
    same kernels with all E resident (torch.equal); once, every sampled packed matmul within its
    derived bound of the checkpoint's weights dequantized in float32 (``tools.packed_bound``); per
    K, top-1 agreement with ``reference`` (the float32 model) as a rate, and with the float32
    source where given. Every label says what ran (``tools.what_ran``)."""
    from pagedexperts.loading.config import resolve_dtype
    from pagedexperts.loading.loader import load_model
    from pagedexperts.tools.check import transformers_model
    from pagedexperts.tools.check_fused import top1_agreement
    from pagedexperts.tools.packed_bound import experts_on_meta, kernel_bound_check, linear_bound_check
    from pagedexperts.tools.what_ran import kernels_ran

    source_path = request.source_model_path
    source = None if source_path is None else transformers_model(source_path, dtype="float32").to(request.options["device"]).eval()
    # all E resident: every expert in the host store and the slots, no disk tier (--host-memory-gb is the paged run's)
    oracle, tokenizer = load_model(request.model_path, num_resident=num_experts, **{**request.options, "host_memory_gb": None})
    ran = kernels_ran(oracle)
    print(f"ran: {ran.label()}")
    if not ran.ran_at_all:
        print(f"--experts-implementation {ran.implementation} ran nowhere: this checks {ran.kernel} "
              f"(paged == {ran.kernel} with all E resident)")
    bound = linear_bound_check(oracle, files, kernel_bound_check(experts_on_meta(config), files, fmt,
                                                                 resolve_dtype(request.options["dtype"], config)))
    within = "the checkpoint's weights dequantized in float32 (each packed matmul, within its bound); "
    print(f"references: the same kernels ({ran.kernel}) with all E={num_experts} experts resident (exact); "
          f"{within if bound.matmuls else ''}{choice.source} in float32 (top-1 agreement)")
    print(bound.line())
    prompts = list(request.prompts)
    ok = bound.passed
    for k in ks:
        paged, res = _paged_against_resident(request, k, oracle, tokenizer, on_paged_load)
        print(verdict_line(k, num_experts, res, steps=request.max_new_tokens, decide=paged.pagedexperts.decide)
              + f" [vs {ran.kernel}, all E={num_experts} resident]")
        agreement = top1_agreement(paged, reference, tokenizer, prompts, max_new_tokens=request.max_new_tokens)
        line = (f"K={k} top-1 agreement with float32 ({choice.source}, teacher-forced): {agreement.rate()}; "
                f"max |logit diff| {agreement.max_abs_diff:.3g} (reported, not bounded: a last-bit difference "
                "can flip an expert choice)")
        if source is not None:
            line += f"; with the float32 source {source_path}: " + top1_agreement(
                paged, source, tokenizer, prompts, max_new_tokens=request.max_new_tokens).rate()
        print(line)
        ok &= res.passed
        del paged  # collected (its modules hold cycles) before the next K's load plans its host memory
        gc.collect()
    print("verdict:", "PASS" if ok else "FAIL", f"(paged {ran.kernel} == {ran.kernel} all resident"
          + ("; packed matmuls within their bound of float32)" if bound.matmuls else ")")
          + ("" if ran.ran_at_all else f"; {ran.implementation} ran nowhere"))
    return 0 if ok else 1


def _experts_in_float32(model):
    """``model`` (loaded at float32) with routed experts kept in another dtype (compressed-tensors'
    scales' dtype) widened to float32, exactly: every product of the float32 model in float32.
    In place: transformers refuses ``.float()`` on a model its quantizer loaded."""
    import torch

    from pagedexperts.tools.library_reference import expert_parameters

    for param in expert_parameters(model).values():
        if param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()
    return model


def check_checkpoint(request: CheckRequest, *, on_paged_load: Callable | None = None) -> int:
    """``pagedexperts check`` on ``request``: the K values and the options checked against the
    checkpoint before the reference loads, then the dense, fused or packed run by the resolved
    implementation, its lines on stdout; ``on_paged_load(model)`` after each paged load of the
    dense run. Returns 0 on PASS, 1 on FAIL.

    Raises:
        ValueError: no tokenizer, a prompt + ``max_new_tokens`` past the model's positions
            (``check_prompts_fit``), a K outside [top_k, E], any problem of the options (``ConfigError``),
            --host-memory-gb below the least the paged load fits (``loading.build.meta_build``).
        MemoryError: the paged load's host memory exceeds what is available (``meta_build``).
    """
    with each_message_once():  # the reference and each K load the same checkpoint: its WARNINGs once
        return _check(request, on_paged_load)


def _check(request: CheckRequest, on_paged_load) -> int:
    from pagedexperts.loading.build import meta_build
    from pagedexperts.loading.checkpoint import format_for_checkpoint
    from pagedexperts.loading.config import PagingConfig, check_config, resolve_dtype
    from pagedexperts.loading.experts_options import check_experts_dtype
    from pagedexperts.loading.loader import has_tokenizer, load_model, load_tokenizer, read_checkpoint_config
    from pagedexperts.loading.resolved import resolve_implementation
    from pagedexperts.models.config import num_routed_experts
    from pagedexperts.paging.steps.table import FUSED, PACKED, transformers_inner
    from pagedexperts.tools.check import check_model, load_reference_with_choice

    path, config, files = read_checkpoint_config(request.model_path)
    if not has_tokenizer(path):  # check tokenizes its prompts: refuse before the reference loads
        raise ValueError(f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json / tokenizer.model); "
                         "check tokenizes its prompts: add the source model's tokenizer files (--model-path)")
    check_prompts_fit(request, config, load_tokenizer(path))
    num_experts, top_k = num_routed_experts(config), int(config.num_experts_per_tok)
    ks = resident_values(request.check_resident, request.num_resident, top_k=top_k, num_experts=num_experts)
    options = dict(request.options)
    fmt = format_for_checkpoint(config, files)
    implementation = resolve_implementation(PagingConfig(**options), fmt, config)  # auto: per format, dtype
    options["experts_implementation"] = implementation
    request = dataclasses.replace(request, options=options)
    for k in ks:  # every problem of the options, at once, before the reference loads
        check_config(PagingConfig(num_resident=k, **options), config, fmt)
    check_experts_dtype(fmt, resolve_dtype(options["dtype"], config), transformers_inner(implementation))
    fused = implementation in (FUSED, PACKED)  # exact to themselves, within tolerance of transformers
    # the paged loads' host-memory plans and their refusals (--host-memory-gb below the least that fits), with
    # what the process will hold by then: the reference (a dense checkpoint's; a quantized one's is not known here)
    held_later = _dense_reference_bytes(files, resolve_dtype(options["dtype"], config)) \
        if fmt.name == "dense" and not fused else 0
    for k in ks:
        try:
            meta_build(config, PagingConfig(num_resident=k, **options), experts_implementation=implementation,
                       expert_format=fmt, files=files, held_later_bytes=held_later)
        except (ValueError, MemoryError) as exc:  # the plan's own message, for check's flag and this K
            raise type(exc)(f"at K = {k} (--check-resident): "
                            + str(exc).replace("lower --num-resident", "lower --check-resident")) from exc
    packed = implementation == PACKED  # the reference in float32: the second verdict's model
    print(f"check: loading the unpaged reference, then the paged model at K = {', '.join(map(str, ks))}",
          file=sys.stderr, flush=True)
    reference, choice = load_reference_with_choice(
        request.model_path, device=options["device"], dtype="float32" if packed else options["dtype"],
        experts_implementation=transformers_inner(implementation)
    )
    print(choice.line())  # every verdict names its reference: transformers' loading, or which and why
    if packed:
        return run_packed(request, ks, _experts_in_float32(reference), choice, num_experts, config=config,
                          files=files, fmt=fmt, on_paged_load=on_paged_load)
    if fused:
        return run_fused(request, ks, reference, choice, num_experts, path=path,
                         quantized=fmt.name != "dense", on_paged_load=on_paged_load)
    ok = True
    for k in ks:
        paged, tokenizer = load_model(request.model_path, num_resident=k, **options)
        if on_paged_load is not None:
            on_paged_load(paged)
        res = check_model(paged, reference, tokenizer, list(request.prompts), max_new_tokens=request.max_new_tokens,
                          progress=True)
        print(verdict_line(k, num_experts, res, steps=request.max_new_tokens, decide=paged.pagedexperts.decide))
        ok &= res.passed
        del paged  # collected (its modules hold cycles) before the next K's load plans its host memory
        gc.collect()
    verdict = "PASS: paging is exact on this checkpoint" if ok else "FAIL: MISMATCH, do not trust paging here"
    print("verdict:", verdict, f"(against {choice.source})")
    return 0 if ok else 1
