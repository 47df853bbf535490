"""Routing statistics of the bundled tiny model (``train_tiny_moe.py``), for its model card.

Owns: the held-out prompts the routing is measured on, each prompt's per-layer stream of top-k
expert sets, and per layer the load entropy, the adjacent-token overlap and the LRU and Belady
hit rates at each K of ``RESIDENT_SLOTS`` (``LayerRouting``), beside the published
Qwen3-30B-A3B figures (``QWEN3_30B``). The hit rates are the package's own simulator's
(``pagedexperts.analysis.simulate``), not a copy of it. A helper module of the scripts, not
part of the library.

Dimension letters: P prompts, L layers, T tokens, E routed experts, k top_k, K resident slots.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedexperts.analysis import simulate

RESIDENT_SLOTS = (4, 8, 16, 32)  # K values for the LRU / Belady tables
# Published Qwen3-30B-A3B figures (E=128, k=8), keyed by resident slots K.
QWEN3_30B = {
    "experts": 128, "top_k": 8, "overlap": 0.389,
    "lru": {8: 0.424, 16: 0.647, 32: 0.810, 64: 0.918},
    "belady": {8: 0.608, 16: 0.784, 32: 0.888, 64: 0.929},
}


@dataclass
class LayerRouting:
    """Routing statistics of one MoE layer over all held-out prompt streams."""
    layer: int
    load_entropy_bits: float
    overlap_mean: float
    lru_hit: dict[int, float]
    belady_hit: dict[int, float]


def routing_prompts(prompts_dir: str, tokenizer, per_source: int) -> list[tuple[str, str]]:
    """(source, text) held-out prompts: GSM8K test questions, MT-Bench first turns, WikiText-2 test lines."""
    d = Path(prompts_dir)
    out = []
    gsm = [json.loads(x) for x in (d / "gsm8k_test.jsonl").read_text().splitlines() if x.strip()]
    out += [("gsm8k_test", f"Question: {r['question']}\nAnswer:") for r in gsm[:per_source]]
    mt = [json.loads(x) for x in (d / "mt_bench_questions.jsonl").read_text().splitlines() if x.strip()]
    out += [("mt_bench", tokenizer.apply_chat_template(
        [{"role": "user", "content": r["turns"][0]}], tokenize=False, add_generation_prompt=True))
        for r in mt[:per_source]]
    wiki = [x.strip() for x in (d / "wikitext2_test.txt").read_text().splitlines()
            if len(x.strip()) > 300 and not x.strip().startswith("=")]
    out += [("wikitext2_test", x) for x in wiki[:per_source]]
    return out


@torch.no_grad()
def route_streams(model, tokenizer, prompts, max_tokens: int) -> list[list[list[tuple[int, ...]]]]:
    """Per prompt, per layer, the token stream of top-k expert sets: [P][L][T] tuples of k ids."""
    model.eval()
    k = model.config.num_experts_per_tok
    streams = []
    for _, text in prompts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :max_tokens]
        logits = model(input_ids=ids, output_router_logits=True).router_logits  # L x [T, E]
        streams.append([[tuple(sorted(r)) for r in lg.topk(k, dim=-1).indices.tolist()]
                        for lg in logits])
    return streams


def load_entropy_bits(sets: list[tuple[int, ...]]) -> float:
    """Entropy (bits) of the expert load over ``sets``: log2 E when every expert is routed to equally."""
    counts = Counter(e for s in sets for e in s)
    n = sum(counts.values())
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def overlap_fractions(stream: list[tuple[int, ...]], k: int) -> list[float]:
    """|S_t ∩ S_{t+1}| / k for each adjacent token pair."""
    return [len(set(a) & set(b)) / k for a, b in zip(stream, stream[1:])]


def hit_rate(streams: list[list[tuple[int, ...]]], *, policy: str, num_slots: int, num_experts: int) -> float:
    """Hits / accesses of ``policy`` ("lru" or "belady") with ``num_slots`` resident experts over
    ``streams``, each replayed from an empty cache, one token per step, by the package's
    simulator (``pagedexperts.analysis.simulate.replay``: the runtime's residency planner and
    its accounting, one hit or miss per distinct expert per step). K >= E: nothing is ever
    evicted, so K = E stands in (the simulator, like the runtime, takes K in [k, E])."""
    num_slots = min(num_slots, num_experts)
    hits = accesses = 0
    for stream in (s for s in streams if s):
        steps = [simulate.SimStep(phase="decode", tokens=1, ids={0: np.array([ids])}) for ids in stream]
        layer = simulate.replay(steps, num_experts=num_experts, num_resident=num_slots, policy=policy)[0].layers[0]
        hits += layer.hits
        accesses += layer.hits + layer.misses
    return hits / accesses


def routing_stats(streams, num_layers: int, k: int, num_experts: int) -> list[LayerRouting]:
    """Per layer: load entropy, mean adjacent-token overlap, LRU and Belady hit rates at each
    K of ``RESIDENT_SLOTS`` (``hit_rate``), over every prompt's stream of top-k sets."""
    rows = []
    for layer in range(num_layers):
        per_prompt = [s[layer] for s in streams]
        overlaps = [o for s in per_prompt for o in overlap_fractions(s, k)]
        lru, bel = {}, {}
        for K in RESIDENT_SLOTS:
            lru[K] = hit_rate(per_prompt, policy="lru", num_slots=K, num_experts=num_experts)
            bel[K] = hit_rate(per_prompt, policy="belady", num_slots=K, num_experts=num_experts)
        rows.append(LayerRouting(layer, load_entropy_bits([x for s in per_prompt for x in s]),
                                 sum(overlaps) / len(overlaps), lru, bel))
    return rows
