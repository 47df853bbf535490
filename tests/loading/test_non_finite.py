"""Non-finite numbers: a checkpoint holding NaN or infinity is refused at load naming the
tensor (expert and non-expert tensors, per-expert and stacked layouts, float32 and bfloat16);
NaN logits at run time fail that request alone with a clear error, its batch-mates go on;
no NaN is ever written into a JSON body.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.tiny import TOP_K
from pagedexperts import load_model
from pagedexperts.engine.sampling import NonFiniteLogits, SamplingParams, sample, token_logprobs
from pagedexperts.loading.fill import NonFiniteWeights
from pagedexperts.serving import bodies


def _damaged(src, dst, pick, value: float, dtype=None):
    """A copy of checkpoint ``src`` in ``dst`` (optionally cast to ``dtype``) whose first tensor
    whose key ``pick`` accepts has ``value`` at one element; returns (dir, that key)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    key = None
    for shard in sorted(src.glob("*.safetensors")):
        state = load_file(str(shard))
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        for k in sorted(state):
            if key is None and pick(k):
                key = k
                state[k] = state[k].clone()
                state[k].view(-1)[state[k].numel() // 2] = value
        save_file(state, str(dst / shard.name), metadata={"format": "pt"})
    assert key is not None
    if dtype is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst, key


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("what, value", [("norm", float("nan")), ("experts", float("inf")), ("experts", float("nan"))])
def test_non_finite_checkpoint_tensor_is_refused_naming_it(tmp_path, tiny_moe_dir, tiny_moe_stacked_dir, layout, dtype,
                                                          what, value):
    src = tiny_moe_dir if layout == "per_expert" else tiny_moe_stacked_dir
    pick = (lambda k: "layers.1." in k and "norm" in k) if what == "norm" else (lambda k: "layers.1." in k and
                                                                               "experts" in k and "down" in k)
    path, key = _damaged(src, tmp_path / "bad", pick, value, dtype)
    with pytest.raises(NonFiniteWeights, match="holds NaN or infinite values") as err:
        load_model(path, num_resident=TOP_K)
    assert repr(key) in str(err.value), f"{err.value} does not name {key}"


def test_finite_checkpoint_loads(tmp_path, tiny_moe_dir):
    """The check refuses nothing sound: -inf-free weights, a bf16 copy, load."""
    path, _ = _damaged(tiny_moe_dir, tmp_path / "ok", lambda k: "norm" in k, 0.5, torch.bfloat16)
    model, _ = load_model(path, num_resident=TOP_K)
    assert model.pagedexperts.num_resident == TOP_K


@pytest.mark.parametrize("proj", ["up_proj", "gate_proj"])
def test_non_finite_scales_of_one_source_of_a_fused_row_are_refused_naming_it(tmp_path, proj):
    """GPTQ group 16 of a 32-wide input: each expert's gate and up scales [2, I] sit side by side in
    the store's gate_up row [2, 2I] (two scale groups per source). A NaN in the second group of one
    source is found and named as that source's tensor; the finite checkpoint loads."""
    from support.paths import DATA

    src = DATA / "gptqmodel/qwen3_moe-gptq_2bit_asym_g16-experts"
    target = f"model.layers.1.mlp.experts.3.{proj}.scales"
    shape = load_file(str(src / "model.safetensors"))[target].shape
    assert shape[0] > 1, shape  # more than one scale group per source
    path, key = _damaged(src, tmp_path / "bad", lambda k: k == target, float("nan"))
    assert key == target
    with pytest.raises(NonFiniteWeights, match="holds NaN or infinite values") as err:
        load_model(path, num_resident=TOP_K)
    assert repr(target) in str(err.value), err.value
    model, _ = load_model(src, num_resident=TOP_K)
    assert model.pagedexperts.num_resident == TOP_K


def test_nan_logits_choose_no_token():
    logits = torch.tensor([0.0, float("nan"), 1.0])
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.9)):
        with pytest.raises(NonFiniteLogits, match="1 NaN or \\+inf values of 3"):
            sample(logits, params, [], torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteLogits):
        token_logprobs(torch.tensor([[0.0, float("inf")]]), [0], 1, str)
    assert sample(torch.tensor([0.0, float("-inf"), 1.0]), SamplingParams(temperature=0), [], None) == 2  # -inf: ruled out


def test_no_nan_in_a_server_sent_event():
    with pytest.raises(ValueError):
        bodies.sse({"token_logprobs": [float("nan")]})
    assert bodies.sse({"token_logprobs": [-0.5]}) == 'data: {"token_logprobs": [-0.5]}\n\n'


def test_nan_logits_fail_that_request_alone():
    """Three greedy requests in one batch; one's logits turn NaN at its 3rd token: it ends with
    finish "error" naming the NaN, the others produce the tokens they produce without it."""
    from support.serving_fixtures import CONTEXT, HAVE_MODEL, MODEL_PATH, PROMPTS, _top_k

    if not HAVE_MODEL:
        pytest.skip(f"no model at {MODEL_PATH}")
    from pagedexperts.engine.scheduler import BatchScheduler
    from pagedexperts.engine.scheduler_config import SchedulerConfig

    class Poisoned(BatchScheduler):
        target = None

        def _accept(self, req, logits, token=None):
            if req.request_id == self.target and len(req.output_ids) == 2:
                logits = logits.clone()
                logits[7] = float("nan")
            super()._accept(req, logits, token)

    model, tok = load_model(MODEL_PATH, num_resident=_top_k())
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]

    def run(target):
        sched = Poisoned(model, tok, SchedulerConfig(3, CONTEXT))
        sched.target, events = target, {}
        reqs = [sched.submit(p, SamplingParams(max_new_tokens=6, temperature=0),
                             lambda e, i=i: events.setdefault(i, []).append(e)) for i, p in enumerate(prompts)]
        sched.target = reqs[1].request_id if target else None
        while sched.num_running or sched.num_waiting:
            sched.step()
        return reqs, events

    clean, _ = run(False)
    hit, events = run(True)
    final = events[1][-1]
    assert final.finish_reason == "error" and "NaN" in final.error, final
    assert len(hit[1].output_ids) == 2
    assert [hit[0].output_ids, hit[2].output_ids] == [clean[0].output_ids, clean[2].output_ids]
