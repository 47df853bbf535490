"""The server's KV rows (``engine.kv_rows``, ``engine.row_forwards``): rows placed and grown, and
16 concurrent greedy requests token for token equal to each request run alone.

Oracle: each prompt run alone (``--max-running-requests 1``: every decode step the bucket of
one row, no other request in the step) and, in float32, the layout before the KV rows (the
batch cache rebuilt every step, ``static_kv=False``). Alone and in a batch of 16 the decode
step over rows computes each row with the same reductions (its own row, the same L columns,
padding masked), so the tokens are equal exactly, bfloat16 included, not only until a near tie.
Through HTTP: completions, chat and responses, streamed and not. Speculative (ngram) decoding
over the rows: verification steps of (bucket, width), equal to plain greedy decoding alone.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from support.serving_fixtures import (CONTEXT, HAVE_MODEL, MODEL_PATH, NAME, PROMPTS, _top_k, client, httpx, load_model,  # noqa: F401
                              metric, one_thread, schedule, serve, torch)
from pagedexperts.engine.forwards import HOWS
from pagedexperts.engine.kv_rows import COLUMN_ROUND, KVRows
from pagedexperts.engine.row_forwards import bucket_sizes
from pagedexperts.engine.speculative.config import speculative_config
from pagedexperts.serving.handlers import ServeConfig

PROMPTS16 = PROMPTS + [p + " and" for p in PROMPTS]
TOKENS = 8
RUNNING = 16

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")


# ---- pure parts ----

def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(4) == [1, 2, 4]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert bucket_sizes(17) == [1, 2, 4, 8, 16, 17]


def test_rows_placed_lowest_free_and_grown_keeping_columns():
    kv = KVRows(rows=3, scratch=2, limit=200)
    assert [kv.place(i, 10) for i in (7, 8)] == [0, 1]
    assert (kv.width, kv.positions, kv.generation) == (COLUMN_ROUND + 2, COLUMN_ROUND, 1)
    key, value = torch.zeros((1, 2, 1, 4)), torch.zeros((1, 2, 1, 3))  # values may have their own head dim
    keys, values = kv.layer(0, key, value)
    assert keys.shape == (3, 2, COLUMN_ROUND + 2, 4) and values.shape == (3, 2, COLUMN_ROUND + 2, 3)
    keys[1, :, :5] = torch.arange(5.0).view(1, 5, 1)
    values[1, :, :5] = -torch.arange(5.0).view(1, 5, 1)
    kv.release(7)
    assert kv.place(9, 10) == 0  # the freed row, before row 2
    assert kv.place(10, 150) == 2  # grows: max(150, 2 x 64) rounded up to 192 positions
    assert (kv.width, kv.generation) == (192 + 2, 2)
    grown, grown_values = kv.layer(0, key, value)
    assert grown.shape == (3, 2, 194, 4) and grown is not keys
    assert grown_values.shape == (3, 2, 194, 3) and grown_values is not values  # keys and values grow together
    assert torch.equal(grown[1, :, :5], torch.arange(5.0).view(1, 5, 1).expand(2, 5, 4))
    assert torch.equal(grown_values[1, :, :5], -torch.arange(5.0).view(1, 5, 1).expand(2, 5, 3))
    assert not grown_values[:, :, 5:].any() and not grown_values[0].any()  # the new columns are zeros
    with pytest.raises(ValueError, match="all 3 KV rows.*--max-running-requests 3"):
        kv.place(11, 5)
    with pytest.raises(ValueError, match="needs 201 KV positions; the limit is 200.*--context-length"):
        kv.place(12, 201)


# ---- 16 concurrent requests vs each alone, in the scheduler ----

@pytest.fixture(scope="module")
def models():
    return {dtype: load_model(MODEL_PATH, num_resident=_top_k(), **({"dtype": dtype} if dtype else {}))
            for dtype in (None, "bfloat16")}


@pytest.fixture(scope="module")
def alone(models):
    """Each prompt alone (one running request at a time), greedy, per dtype."""
    return {dtype: schedule(m, t, PROMPTS16, max_running=1, max_tokens=TOKENS)[0] for dtype, (m, t) in models.items()}


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_16_concurrent_equal_each_alone(models, alone, dtype):
    model, tokenizer = models[dtype]
    from pagedexperts.engine.scheduler import BatchScheduler
    from pagedexperts.engine.scheduler_config import SchedulerConfig
    from support.serving_fixtures import run_schedule

    sched = BatchScheduler(model, tokenizer, SchedulerConfig(RUNNING, CONTEXT))
    got = run_schedule(sched, tokenizer, PROMPTS16, max_tokens=TOKENS)
    assert sched.stats.max_decode_batch == RUNNING
    assert all(len(o) == TOKENS for o in alone[dtype])
    bad = [i for i, (a, b) in enumerate(zip(got, alone[dtype])) if a != b]
    assert not bad, f"{len(bad)} of 16 differ from alone, first: {got[bad[0]]} vs {alone[dtype][bad[0]]}"
    counts = sched.forwards.counts
    assert sched.forwards.name == "rows" and counts.dynamic == 0 and counts.static_eager > 0
    assert set(sched.forwards.steps) >= {(16, 1)}
    if dtype is None:  # float32: also equal to the layout before (a batch cache rebuilt each step)
        before, _ = schedule(model, tokenizer, PROMPTS16, max_running=RUNNING, max_tokens=TOKENS, static_kv=False)
        assert got == before


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_long_request_admitted_beside_a_short_one_equals_each_alone(models, dtype):
    """A short request runs (its need: 64 columns); a long prompt admitted at its third step
    needs more, so the rows grow while the short one's keys and values are in them, and both go
    on decoding over the grown rows. Each one's tokens equal its tokens alone, token for token.
    Prefill apart (``chunked_prefill`` off): no decode rides in a prompt's forward."""
    from pagedexperts.engine.scheduler import BatchScheduler
    from pagedexperts.engine.scheduler_config import SchedulerConfig
    from pagedexperts.generation.config import SamplingConfig

    model, tokenizer = models[dtype]
    short, long = tokenizer(PROMPTS[0])["input_ids"], tokenizer(" ".join(PROMPTS * 2))["input_ids"]
    plan = ((short, 12), (long, 6))
    assert len(short) + 12 <= COLUMN_ROUND < len(long) + 6

    def run(items, admit_second_after=None):
        sched = BatchScheduler(model, tokenizer, SchedulerConfig(2, CONTEXT, chunked_prefill=False))
        reqs, steps = [sched.submit(items[0][0], SamplingConfig(max_new_tokens=items[0][1]), lambda e: None)], 0
        while sched.num_running or sched.num_waiting or len(reqs) < len(items):
            if len(reqs) < len(items) and steps == admit_second_after:
                reqs.append(sched.submit(items[1][0], SamplingConfig(max_new_tokens=items[1][1]), lambda e: None))
            sched.step()
            steps += 1
        return [r.output_ids for r in reqs], sched

    alone = [run([item])[0][0] for item in plan]
    together, sched = run(plan, admit_second_after=2)
    assert sched.forwards.kv.generation == 2 and sched.stats.max_decode_batch == 2  # grown with both rows in use
    assert len(together[0][2:]) > 0 and [len(o) for o in alone] == [12, 6]
    assert together == alone, f"short {together[0]} vs {alone[0]}; long {together[1]} vs {alone[1]}"


def test_16_concurrent_with_ngram_speculation_equal_plain_alone(models, alone):
    model, tokenizer = models[None]
    from pagedexperts.engine.scheduler import BatchScheduler
    from pagedexperts.engine.scheduler_config import SchedulerConfig
    from support.serving_fixtures import run_schedule

    sched = BatchScheduler(model, tokenizer, SchedulerConfig(RUNNING, CONTEXT),
                           speculative=speculative_config("ngram", num_speculative_tokens=3))
    got = run_schedule(sched, tokenizer, PROMPTS16, max_tokens=TOKENS)
    assert got == alone[None]
    assert sched.speculative.stats.proposed > 0  # verification steps of width > 1 ran
    assert sched.forwards.counts.dynamic == 0 and any(w > 1 for _, w in sched.forwards.steps)


# ---- through HTTP: completions, chat, responses; streamed and not ----

@pytest.fixture(scope="module")
def server16():
    yield from serve(ServeConfig(NAME, RUNNING, CONTEXT))


def _complete(c, prompt, endpoint, stream):
    if endpoint == "completions":
        r = c.completions.create(model=NAME, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=stream)
        return "".join(ch.choices[0].text for ch in r) if stream else r.choices[0].text
    if endpoint == "chat":
        msgs = [{"role": "user", "content": prompt}]
        r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=TOKENS, temperature=0, stream=stream)
        return "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if stream else \
            r.choices[0].message.content
    r = c.responses.create(model=NAME, input=prompt, max_output_tokens=TOKENS, temperature=0, stream=stream)
    return "".join(e.delta for e in r if e.type == "response.output_text.delta") if stream else r.output_text


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat", "responses"])
def test_http_16_concurrent_equal_each_alone(server16, endpoint):
    url = server16[0]
    c = client(url)
    alone = [_complete(c, p, endpoint, False) for p in PROMPTS16]
    for stream in (False, True):
        with ThreadPoolExecutor(RUNNING) as pool:
            together = list(pool.map(lambda p: _complete(c, p, endpoint, stream), PROMPTS16))
        assert together == alone, f"{endpoint} stream={stream}"
    assert metric(url, 'pagedexperts_decode_steps_total{how="dynamic"}') == 0
    assert metric(url, 'pagedexperts_decode_steps_total{how="static_eager"}') > 0


def test_server_info_and_metrics_name_the_layout_and_why_not_captured(server16):
    url = server16[0]
    _complete(client(url), PROMPTS[0], "completions", False)
    info = httpx.get(url + "/server_info").json()["decode"]
    assert info["kv_layout"] == "rows" and info["buckets"] == [1, 2, 4, 8, 16]
    assert info["steps"]["backend"] == "eager" and "capture needs a CUDA device" in info["steps"]["reason"]
    text = httpx.get(url + "/metrics").text
    line = [x for x in text.splitlines() if x.startswith("pagedexperts_decode_backend{")]
    assert line and 'kv_layout="rows"' in line[0] and 'backend="eager"' in line[0]
    assert text.count("# TYPE pagedexperts_decode_steps_total counter") == 1  # one family, labelled by how
    steps = sum(metric(url, f'pagedexperts_decode_steps_total{{how="{how}"}}') for how in HOWS)
    assert steps == server16[1].state.scheduler.stats.decode_steps > 0


def test_serve_captures_every_bucket_up_to_the_running_cap_by_default(server16):
    """The issue asks every bucket up to --max-running-requests captured (beyond SGLang's K // top_k):
    serve's --cuda-graph-max-batch defaults to None, the scheduler's graphs to the row count."""
    from pagedexperts.cli import build_parser

    def parse(*flags):
        return build_parser(["serve", *flags]).parse_args(["serve", *flags])

    assert parse().cuda_graph_max_batch is None
    assert ServeConfig(NAME, RUNNING, CONTEXT).cuda_graph_max_batch is None
    assert server16[1].state.scheduler.forwards.graphs.max_batch == RUNNING
    assert parse("--cuda-graph-max-batch", "4").cuda_graph_max_batch == 4
