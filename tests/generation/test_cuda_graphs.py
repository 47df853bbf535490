"""Decode steps captured in CUDA graphs (``generation.graphs``, CudaGraphBackend): CUDA only;
``generate``'s static steps (``TestCudaGraphs``) and the server's decode steps over KV rows
(``engine.row_forwards``, ``TestServerDecodeGraphs``).

Run by ``bench/gpu_check.sh`` (``pytest -m cuda``); the tests are in ``TestCudaGraphs``, behind
``skipif`` where torch sees no CUDA device or triton is missing (the device-planned step's
kernels); tests/project/test_gpu_guards.py checks each is collected and holds the CPU guards of the
same code (capability rule, one stream for warm-up and capture). NOT YET RUN ON A GPU when written.
Oracles: the same checkpoint loaded a second time and decoded through the same static-buffer
step eagerly (``EagerBackend``: the function the graph captured, run op by op): logits
torch.equal every step and the same paging counters per layer (a capture that ran its
kernels, or a replay that skipped one, would count differently); torch's own sync detector
(``set_sync_debug_mode("error")``) over replayed steps; the runners a repage attaches.

Legend: B batch, K slots, k top_k.
"""

from __future__ import annotations

import pytest
import torch

from support.tiny import PAD_ID
from pagedexperts.generation.capture_checks import GROUPED_MM_CAPABILITIES, capture_problem_of
from pagedexperts.generation.graphs import DecodeGraphs
from pagedexperts.generation.static_decode import DecodeOptions, static_generate
from pagedexperts.loading import runners
from pagedexperts.loading.loader import load_model
from pagedexperts.paging.kernels import HAVE_TRITON

pytestmark = pytest.mark.cuda
STEPS = 24
COUNTED = ("hits", "misses", "waves", "multi_wave_steps", "steps", "tokens", "bytes_paged")


def _load(path, *, impl: str = "batched_mm", dtype: str = "float32"):
    return load_model(path, device="cuda", num_resident=4, decide="device", policy="lru", dtype=dtype,
                      experts_implementation=impl, cuda_graphs="off", check_independence=False)[0]


def _prompt(rows: int):
    ids = torch.randint(2, 100, (rows, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if rows > 1:
        ids[1, :3], mask[1, :3] = PAD_ID, 0
    return ids.cuda(), mask.cuda()


def _decode(model, graphs, ids, mask, tokens, *, sync_check: bool = False) -> list[torch.Tensor]:
    """Prefill, then one decode step per column of ``tokens`` [B, n]; the first decode step
    (the capture) before ``set_sync_debug_mode("error")`` when ``sync_check``."""
    st = graphs.step_for(ids.shape[0], ids.shape[1] + tokens.shape[1] + 1)
    out = []
    with torch.no_grad():
        out.append(st.prefill(ids, mask))
        for i in range(tokens.shape[1]):
            if sync_check and i == 1:
                torch.cuda.set_sync_debug_mode("error")
            try:
                out.append(graphs.decode(st, tokens[:, i], ids.shape[1] + i))
            except Exception:
                torch.cuda.set_sync_debug_mode("default")
                raise
        torch.cuda.set_sync_debug_mode("default")
    return out


def _per_layer(model) -> dict:
    return {i: {f: getattr(s, f) for f in COUNTED} for i, s in model.pagedexperts.stats().layers.items()}


def _tokens(model, ids, mask):
    eager = DecodeGraphs(model, backend="eager", max_batch=8)
    out = static_generate(model, eager, ids, mask, DecodeOptions(max_new_tokens=STEPS, ignore_eos=True))
    model.pagedexperts.reset_stats()
    return out[:, ids.shape[1]:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda)")
@pytest.mark.skipif(not HAVE_TRITON, reason="the device-planned step needs triton")
class TestCudaGraphs:
    @pytest.mark.parametrize("rows", [1, 4], ids=["batch1", "batch4-multiwave"])
    @pytest.mark.parametrize("impl,dtype", [("batched_mm", "float32"), ("grouped_mm", "bfloat16")])
    def test_captured_decode_equals_the_same_step_run_eagerly(self, tiny_moe_dir, rows, impl, dtype):
        captured, eager = _load(tiny_moe_dir, impl=impl, dtype=dtype), _load(tiny_moe_dir, impl=impl, dtype=dtype)
        ids, mask = _prompt(rows)
        tokens = _tokens(eager, ids, mask)
        runners.repage(eager, mode="paged", num_resident=4)  # empty slots, as the captured model's
        graphs = DecodeGraphs(captured, backend="cuda", max_batch=4, strict=True)
        got = _decode(captured, graphs, ids, mask, tokens)
        want = _decode(eager, DecodeGraphs(eager, backend="eager", max_batch=4), ids, mask, tokens)
        assert graphs.counters.captures == 1 and graphs.counters.replays == STEPS - 1
        for step, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"step {step}"
        assert _per_layer(captured) == _per_layer(eager)
        assert captured.pagedexperts.stats().as_dict()["misses"] > 4 * len(_per_layer(eager)), "routing must change"


    def test_replayed_decode_makes_no_host_sync(self, tiny_moe_dir):
        model = _load(tiny_moe_dir)
        ids, mask = _prompt(1)
        tokens = torch.randint(2, 100, (1, STEPS), device="cuda")
        graphs = DecodeGraphs(model, backend="cuda", max_batch=2, strict=True)
        _decode(model, graphs, ids, mask, tokens, sync_check=True)  # raises on a sync
        assert graphs.counters.replays == STEPS - 1


    def test_repage_invalidates_the_cuda_graph(self, tiny_moe_dir):
        captured, eager = _load(tiny_moe_dir), _load(tiny_moe_dir)
        ids, mask = _prompt(1)
        tokens = _tokens(eager, ids, mask)[:, :8]
        graphs = DecodeGraphs(captured, backend="cuda", max_batch=2, strict=True)
        _decode(captured, graphs, ids, mask, tokens)
        for m in (captured, eager):
            runners.repage(m, mode="paged", num_resident=8)
        got = _decode(captured, graphs, ids, mask, tokens)
        want = _decode(eager, DecodeGraphs(eager, backend="eager", max_batch=2), ids, mask, tokens)
        assert (graphs.counters.captures, graphs.counters.invalidations) == (2, 1)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


    def test_graph_decode_tokens_equal_transformers_generate(self, tiny_moe_dir):
        model = _load(tiny_moe_dir)
        ids, mask = _prompt(2)
        graphs = DecodeGraphs(model, backend="cuda", max_batch=4, strict=True)
        got = static_generate(model, graphs, ids, mask, DecodeOptions(max_new_tokens=STEPS, ignore_eos=True))
        runners.repage(model, mode="paged", num_resident=4)
        with torch.no_grad():
            want = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS,
                                  do_sample=False, pad_token_id=PAD_ID)
        assert torch.equal(got, want)

    def test_grouped_mm_capture_follows_the_capability_rule(self, tiny_moe_dir):
        """Review item 6: bf16 grouped_mm is capturable on compute capability 9.x / 10.x only
        (torch's grouped GEMM kernels; elsewhere its fallback reads the offsets back): here the
        rule's answer and what capture does agree."""
        model = _load(tiny_moe_dir, impl="grouped_mm", dtype="bfloat16")
        problem = capture_problem_of(model)
        graphs = DecodeGraphs(model, backend="cuda", max_batch=1, strict=True)
        ids, mask = _prompt(1)
        tokens = torch.randint(2, 100, (1, 4), device="cuda")
        if torch.cuda.get_device_capability()[0] in GROUPED_MM_CAPABILITIES:
            assert problem is None
            _decode(model, graphs, ids, mask, tokens, sync_check=True)  # replays raise on a sync
            assert graphs.counters.replays == tokens.shape[1] - 1
        else:
            assert "compute capability" in problem
            with pytest.raises(ValueError, match="compute capability"):
                _decode(model, graphs, ids, mask, tokens)

    def test_capture_runs_on_the_warm_up_stream(self, tiny_moe_dir):
        """Review item 11: the warm-up and the capture on one stream (cuBLAS keeps its
        workspace per stream: a capture on a fresh stream allocated it inside the graph)."""
        model = _load(tiny_moe_dir, impl="grouped_mm", dtype="bfloat16")
        graphs = DecodeGraphs(model, backend="cuda", max_batch=1, strict=True)
        ids, mask = _prompt(1)
        st = graphs.step_for(1, ids.shape[1] + 4)
        seen, forward = [], st.forward

        def spy():
            seen.append(torch.cuda.current_stream().cuda_stream)
            forward()

        st.forward = spy
        with torch.no_grad():
            st.prefill(ids, mask)
            graphs.decode(st, torch.tensor([5], device="cuda"), ids.shape[1])
        assert graphs.counters.captures == 1 and len(seen) == 2  # the warm-up, the capture
        assert seen[0] == seen[1] == graphs._stream.cuda_stream


# ---- the server: decode steps over KV rows, one capture per batch bucket ----

SERVER_PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo", "First Citizen:\nBefore we proceed", "KING HENRY:",
                  "To be, or not to be", "Now is the winter"]


def _server(backend: str):
    """A scheduler over the bundled model (CUDA, device-planned, K = top_k) whose decode steps
    run on ``backend``; chunks and decodes in forwards apart (the captured schedule) for both."""
    from pagedexperts import bundled_model_path
    from pagedexperts.engine.scheduler import BatchScheduler
    from pagedexperts.engine.scheduler_config import SchedulerConfig

    class Recording(BatchScheduler):
        def _accept(self, req, logits, token=None):
            self.logits.setdefault(req.request_id, []).append(logits.clone())
            super()._accept(req, logits, token)

    import json

    top_k = json.loads((bundled_model_path() / "config.json").read_text())["num_experts_per_tok"]
    model, tokenizer = load_model(bundled_model_path(), device="cuda", num_resident=top_k, decide="device",
                                  cuda_graphs="off", check_independence=False)
    sched = Recording(model, tokenizer, SchedulerConfig(4, 128, max_prefill_tokens=8, cuda_graphs=backend,
                                                        strict_cuda_graphs=backend == "cuda"))
    sched.logits, sched.forwards.mixes_decodes = {}, False
    return sched, tokenizer


def _serve_schedule(sched, tokenizer) -> None:
    """Requests of different lengths joining and leaving: the batch bucket changes step to step."""
    from pagedexperts.engine.sampling import SamplingParams

    def submit(prompt, n):
        sched.submit(tokenizer(prompt)["input_ids"], SamplingParams(max_new_tokens=n), lambda e: None)

    for prompt, n in zip(SERVER_PROMPTS[:3], (4, 12, 20)):
        submit(prompt, n)
    with torch.no_grad():
        for step in range(200):
            if step == 6:
                for prompt, n in zip(SERVER_PROMPTS[3:], (9, 5, 16)):
                    submit(prompt, n)
            if not (sched.num_running or sched.num_waiting):
                break
            sched.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda)")
@pytest.mark.skipif(not HAVE_TRITON, reason="the device-planned step needs triton")
class TestServerDecodeGraphs:
    def test_captured_server_logits_equal_the_same_steps_run_eagerly(self):
        (captured, tok), (eager, _) = _server("cuda"), _server("eager")
        for sched in (captured, eager):
            _serve_schedule(sched, tok)
        assert captured.logits.keys() == eager.logits.keys() and len(captured.logits) == 6
        for rid, rows in captured.logits.items():
            want = eager.logits[rid]
            assert len(rows) == len(want)
            for step, (g, w) in enumerate(zip(rows, want)):
                assert torch.equal(g, w), f"request {rid}, token {step}: max |diff| {(g - w).abs().max():.3g}"
        c, e = captured.forwards.counts, eager.forwards.counts
        assert c.capture == len(captured.forwards.steps) >= 2 and c.replay > 10  # a capture per bucket (2, 4)
        assert c.static_eager == c.dynamic == e.dynamic == 0
        assert e.static_eager == c.capture + c.replay

    def test_replayed_server_step_makes_no_host_sync(self):
        sched, tok = _server("cuda")
        _serve_schedule(sched, tok)  # every bucket captured
        fw = sched.forwards
        step = fw.steps[(4, 1)]
        assert step.backend is not None
        replays = fw.graphs.counters.replays
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(5):
                step.load([(0, [5 + i], 3 + i), (2, [7], 9 + i)])
                fw.graphs.run(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert fw.graphs.counters.replays == replays + 5
