"""Exactness probe of the bundled model: paged vs unpaged greedy runs, batch 1 and batched.

Used in-process by ``test_exact_where_users_run.py`` and as a script in one subprocess per
``ATEN_CPU_CAPABILITY`` value (torch fixes its CPU kernels' vector width when it is imported):

    python tests/support/exact_probe.py --impl grouped_mm --dtype float32 bfloat16 --num-resident 4

prints one JSON object per dtype: the configuration (threads, capability) and per run max
|logit diff|, logits torch.equal at every step, greedy tokens equal.
"""

from __future__ import annotations

import argparse
import json

import torch

PROMPT_LENGTHS = (224, 9)  # one long prefill (multi-wave at small K, S x I above the grain size), one short


def prompt_rows(vocab: int, lengths=PROMPT_LENGTHS) -> list[torch.Tensor]:
    """Seeded random token ids [T_i] (ids >= 2: clear of pad and eos)."""
    return [torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]


def sdpa_refusal(dtype: str) -> str | None:
    """Why torch's own SDPA refuses a causal ``dtype`` prefill in this process, or None.

    torch 2.13's CPU flash attention picks VNNI packing for bfloat16 from the CPU it finds (AMX),
    then the packing checks the vector width ``ATEN_CPU_CAPABILITY`` forced lower (avx2, default)
    and raises "pack_vnni2 is only supported when avx512 is supported". A machine that really is
    AVX2 never takes that path; only a capability forced below the hardware does.
    """
    q = torch.zeros(1, 2, 64, 32, dtype=getattr(torch, dtype))
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as e:
        return str(e)
    return None


def probe(*, impl: str, dtype: str, num_resident: int, new_tokens: int = 3, model_path=None, reference=None) -> dict:
    """Each prompt alone (batch 1) and all as one left-padded batch, greedy ``new_tokens`` steps."""
    import pagedexperts
    from pagedexperts.tools.check import compare, left_padded, load_reference

    if reference is None:
        reference = load_reference(model_path, device="cpu", dtype=dtype, experts_implementation=impl)
    paged, _ = pagedexperts.load_model(model_path, num_resident=num_resident, dtype=dtype, experts_implementation=impl)
    refusal = sdpa_refusal(dtype)
    if refusal is not None:  # both models alike: attention is unpaged, the experts are what is probed
        for model in (reference, paged):
            model.set_attn_implementation("eager")
    rows = prompt_rows(reference.config.vocab_size)
    runs = []
    with torch.no_grad():
        for ids in rows:
            runs.append(compare(paged, reference, ids.unsqueeze(0), new_tokens, f"batch 1, T={ids.numel()}"))
        ids, mask = left_padded(rows)
        runs.append(compare(paged, reference, ids, new_tokens, f"batch {len(rows)} left-padded", mask))
    stats = paged.pagedexperts.stats().total()
    return dict(
        impl=impl, dtype=dtype, num_resident=num_resident, threads=torch.get_num_threads(),
        capability=torch.backends.cpu.get_cpu_capability(),
        attention=paged.config._attn_implementation, sdpa_refused=refusal, multi_wave_steps=stats.multi_wave_steps,
        runs=[dict(run=r.prompt, exact=r.exact, tokens_equal=r.tokens_equal, max_abs_diff=r.max_abs_diff) for r in runs],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", default="grouped_mm")
    p.add_argument("--dtype", nargs="+", default=["float32"])
    p.add_argument("--num-resident", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=3)
    a = p.parse_args()
    for dtype in a.dtype:
        print(json.dumps(probe(impl=a.impl, dtype=dtype, num_resident=a.num_resident, new_tokens=a.new_tokens)))


if __name__ == "__main__":
    main()
