"""Static-buffer decode (``generation.static_decode``, eager backend) vs transformers' ``generate`` on a CPU.

One process, interleaved rounds (round r runs the pairs in an order rotated by r), CPU time
(``time.process_time``) per decode token: from the first new token to the last, timed by a
streamer (prefill excluded), greedy, a fixed number of new tokens after a prompt of real text.
Each checkpoint is loaded once through ``pagedexperts.load_model`` with every expert resident
(K = E) unless ``--num-resident`` says otherwise; ``generate`` runs transformers' own
``model.generate`` (dynamic KV cache), ``static`` runs ``static_generate`` over
``DecodeGraphs(backend="eager")`` (a static KV cache, the step's buffers reused, no capture):
what ``pagedexperts generate`` runs with ``--no-static-decode`` and by default on a CPU. The
greedy tokens of the two are compared (equal tokens expected; the logits may differ in the last
bits: attention over the static cache's masked positions).

    python bench/static_decode_cpu.py /work/ckpts/real4 \\
        --model whole=/work/ckpts/real4-w4a16-model --model experts=/work/ckpts/real4-w4a16 \\
        --experts-implementation packed --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from real_shape import text_ids  # this folder (python bench/static_decode_cpu.py)


class CpuClock:
    """A streamer that records the CPU time of each new token (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.process_time())

    def end(self) -> None:
        pass

    def per_token(self) -> float:
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1)


def run_generate(model, ids, n: int):
    clock = CpuClock()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, streamer=clock, pad_token_id=0)
    return clock.per_token(), out[0, ids.shape[1]:]


def run_static(model, graphs, ids, n: int):
    from pagedexperts.generation.static_decode import DecodeOptions, static_generate

    clock = CpuClock()
    out = static_generate(model, graphs, ids, torch.ones_like(ids), DecodeOptions(n, ignore_eos=True), streamer=clock)
    return clock.per_token(), out[0, ids.shape[1]:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", help="a checkpoint for the prompt's tokenizer (bench/real_shape.py make)")
    p.add_argument("--model", action="append", required=True, metavar="LABEL=DIR", help="a checkpoint to load (repeat)")
    p.add_argument("--experts-implementation", default=None, help="passed to load_model (default: its own)")
    p.add_argument("--num-resident", type=int, default=None, help="K (default: every expert resident)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import pagedexperts
    from pagedexperts.generation.graphs import DecodeGraphs

    torch.set_num_threads(args.threads)
    ids = text_ids(args.dir, args.prompt_tokens)
    models, graphs = {}, {}
    for spec in args.model:
        label, _, path = spec.partition("=")
        options = {} if args.experts_implementation is None else dict(experts_implementation=args.experts_implementation)
        model, _ = pagedexperts.load_model(path, check_independence=False, **options)
        if args.num_resident is not None or model.pagedexperts.num_resident != model.pagedexperts.num_experts:
            from pagedexperts.loading.runners import repage

            repage(model, num_resident=args.num_resident or model.pagedexperts.num_experts)
        models[label] = model.eval()
        graphs[label] = DecodeGraphs(model, backend="eager", max_batch=1)
    pairs = [(label, mode) for label in models for mode in ("generate", "static")]
    times = {pair: [] for pair in pairs}
    tokens = {}
    for r in range(args.rounds):
        for i in range(len(pairs)):
            label, mode = pairs[(i + r) % len(pairs)]
            model = models[label]
            t, new = (run_generate(model, ids, args.tokens) if mode == "generate"
                      else run_static(model, graphs[label], ids, args.tokens))
            times[(label, mode)].append(t * 1e3)
            tokens.setdefault((label, mode), new)
    print(f"CPU ms per decode token, {args.threads} thread(s), {args.prompt_tokens}-token prompt, {args.tokens} new "
          f"tokens, median of {args.rounds} interleaved rounds [min-max]; static / generate per round")
    for label in models:
        g, s = times[(label, "generate")], times[(label, "static")]
        ratios = [b / a for a, b in zip(g, s)]
        same = int((tokens[(label, "generate")] == tokens[(label, "static")]).sum())
        print(f"{label}: generate {statistics.median(g):.2f} [{min(g):.2f}-{max(g):.2f}]  static "
              f"{statistics.median(s):.2f} [{min(s):.2f}-{max(s):.2f}]  static/generate {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}-{max(ratios):.3f}]  greedy tokens equal {same}/{args.tokens}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
