"""transformers' loading as pagedexperts compares with it needs no network.

transformers (5.25) runs gpt-oss MXFP4 experts through Triton kernels that its ``kernels`` package
fetches from the Hub (``kernels-community/gpt-oss-triton-kernels``) wherever triton and kernels are
installed; behind a firewall the load failed (a ConnectError, then "could not verify publisher
trust status"), in check's reference, bench's plain model and the tests' oracles. They load
through ``tools.check.transformers_model``, which keeps transformers on its local path
(``Mxfp4Config(dequantize=True)``: its own dequantization). The fixture below makes this machine
one with triton and kernels whose Hub is unreachable, whatever is installed.
"""

from __future__ import annotations

import pytest
import torch

from pagedexperts.cli import main


@pytest.fixture
def hub_unreachable(monkeypatch):
    """triton and kernels as if installed (transformers' MXFP4 loader takes its kernel path), and the
    kernel fetch failing as with no network."""
    import transformers.integrations.hub_kernels as hub_kernels
    import transformers.quantizers.quantizer_mxfp4 as quantizer

    monkeypatch.setattr(quantizer, "is_triton_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(quantizer, "is_kernels_available", lambda *args, **kwargs: True)

    def fetch(repo_id, *args, **kwargs):
        raise ConnectionError(f"no network: {repo_id} cannot be fetched from the Hub")

    monkeypatch.setattr(hub_kernels, "get_kernel", fetch)


def test_transformers_model_of_mxfp4_stays_local(hub_unreachable, quantized_dirs):
    from transformers import AutoModelForCausalLM

    from pagedexperts.tools.check import transformers_model

    path = quantized_dirs("gpt_oss-mxfp4")
    with pytest.raises(ConnectionError, match="gpt-oss-triton-kernels"):  # transformers' default path: the Hub
        AutoModelForCausalLM.from_pretrained(path)
    model = transformers_model(path, dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16  # dequantized by transformers


def test_check_on_gpt_oss_mxfp4_needs_no_network(hub_unreachable, quantized_dirs, capsys):
    rc = main(["check", "--model-path", str(quantized_dirs("gpt_oss-mxfp4")), "--check-resident", "2",
               "--max-new-tokens", "1", "--prompt", "hello"])
    out = capsys.readouterr().out
    assert rc == 0 and "reference: transformers (cross-checked" in out, out
