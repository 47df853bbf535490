"""check's second verdict where experts run packed (``tools.packed_bound``): each packed matmul
within the bound derived from the run dtype's unit roundoff and the reduction length of the
checkpoint's weights dequantized in float32; a wrong group scale or zero point is caught."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from pagedexperts.formats.cpu_pack import KernelTensor
from pagedexperts.loading.checkpoint import format_for_checkpoint
from pagedexperts.storage.safetensors_files import checkpoint_files
from pagedexperts.tools.packed_bound import experts_on_meta, gamma, kernel_bound_check, unit_roundoff
from support.paths import DATA

INT_EXPORTS = ("gptqmodel/qwen3_moe-gptq-experts", "autoround/qwen3_moe-auto_round-experts",
               "autoround/qwen3_moe-auto_awq-experts", "autoround/qwen3_moe-auto_round-W8A16-experts",
               "llmc/mixtral-W4A16_ASYM-g32", "llmc_whole/qwen3_moe-W4A16-g32",
               "ct/qwen3_moe-named_attention_first")  # the last: a format that multiplies in bfloat16


def _bound(name: str, dtype: torch.dtype):
    path = DATA / name
    config, files = AutoConfig.from_pretrained(path), checkpoint_files(path)
    return kernel_bound_check(experts_on_meta(config), files, format_for_checkpoint(config, files), dtype)


def test_unit_roundoff_and_gamma():
    assert unit_roundoff(torch.bfloat16) == 2.0 ** -8 and unit_roundoff(torch.float32) == 2.0 ** -24
    assert gamma(2048) == pytest.approx(2048 * 2.0 ** -24 / (1 - 2048 * 2.0 ** -24), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", INT_EXPORTS)
def test_tool_written_exports_within_the_bound(name, dtype):
    """Every layer packed, every sampled expert tensor at 1 and 16 rows within its bound."""
    res = _bound(name, dtype)
    assert res.layers == res.layer_count == 2 and res.matmuls == 2 * 4 * 2 * 2, res  # layers x experts x tensors x M
    assert res.passed and 0 < res.worst <= 1, res.line()


@pytest.mark.parametrize("bug", ["neighbour group's scale", "zero point dropped"])
def test_a_wrong_group_scale_or_zero_point_fails(bug, monkeypatch):
    """The kernel layout built with the next group's scale (or no float zero point) is outside the
    bound at bfloat16 (an asymmetric group-16 export: both bugs change the weights)."""
    convert = KernelTensor.convert

    def wrong(self, rows):
        out = convert(self, rows)
        pair = out[self.scale_name]  # [n, G, N, 2]
        if bug == "zero point dropped":
            pair[..., 1] = 0
        else:
            pair[..., 0] = pair[..., 0].roll(1, dims=1)
        return out

    monkeypatch.setattr(KernelTensor, "convert", wrong)
    res = _bound("llmc/mixtral-W4A16_ASYM-g32", torch.bfloat16)
    assert not res.passed and res.worst > 1, res.line()
