"""A paged model and check's references built the same whatever another library patched in transformers.

auto-round's loader replaces transformers' checkpoint conversion table of the model type it loads,
process-wide (``register_checkpoint_conversion_mapping(..., overwrite=True)``, without the
per-expert -> stacked converters, for its own unfused experts): afterwards the paged build read no
expert tensor ("checkpoint lacks expert tensors") and transformers' own loading of any other
checkpoint of that type left the experts randomly initialised. The paged build maps its checkpoint
with the table transformers ships (``loading.checkpoint.shipped_conversion_mapping``) and check
loads its references with it (``shipped_conversion_table``), putting the replaced table back.
The last tests run check on each AutoRound export with auto-round installed (skipped without it;
CI installs it with the optional peers).
"""

from __future__ import annotations

import pytest
import torch

from pagedexperts.cli import main
from support.paths import DATA

AUTOROUND = DATA / "autoround"


@pytest.fixture
def replaced_table():
    """qwen3_moe's conversion table replaced as auto-round's loader replaces it (the expert converters
    dropped); transformers' own put back after the test."""
    from transformers import conversion_mapping as cm

    shipped = cm.get_checkpoint_conversion_mapping("qwen3_moe")
    kept = [t for t in shipped if type(t).__name__ != "WeightConverter"]
    cm.register_checkpoint_conversion_mapping("qwen3_moe", kept, overwrite=True)
    yield kept
    cm.register_checkpoint_conversion_mapping("qwen3_moe", shipped, overwrite=True)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_paged_build_reads_the_table_transformers_ships(replaced_table, tiny_moe_dir):
    from pagedexperts.loading.loader import load_model

    ids = torch.tensor([[1, 5, 9, 3]])
    model, _ = load_model(tiny_moe_dir, num_resident=4, check_independence=False)
    paged = _logits(model, ids)
    from transformers import conversion_mapping as cm

    cm.register_checkpoint_conversion_mapping("qwen3_moe", cm._build_checkpoint_conversion_mapping()["qwen3_moe"],
                                              overwrite=True)
    again, _ = load_model(tiny_moe_dir, num_resident=4, check_independence=False)
    assert torch.equal(paged, _logits(again, ids))  # the same model as under transformers' own table


def test_check_passes_and_leaves_the_replaced_table(replaced_table, capsys):
    from transformers import conversion_mapping as cm

    rc = main(["check", "--check-resident", "8", "--max-new-tokens", "1", "--prompt", "ROMEO:"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "reference: transformers (its own loading of an unquantized checkpoint)" in out
    assert repr(cm.get_checkpoint_conversion_mapping("qwen3_moe")) == repr(replaced_table)  # as check found it


EXPORTS = ["qwen3_moe-auto_round-MXFP4-experts", "qwen3_moe-auto_gptq", "qwen3_moe-auto_round-experts",
           *(pytest.param(name, marks=pytest.mark.slow) for name in (
               "qwen3_moe-auto_round-FP8_STATIC-experts", "qwen3_moe-auto_round-FP8_BLOCK-experts",
               "qwen3_moe-auto_round-NVFP4-experts", "qwen3_moe-auto_round-FPW8A16-experts",
               "qwen3_moe-auto_round-W8A16-experts", "qwen3_moe-auto_awq"))]


@pytest.mark.parametrize("name", EXPORTS)
def test_check_passes_on_autoround_exports_with_autoround_installed(name, capsys):
    """auto-round's loader runs when transformers loads the export (check's first reference
    candidate) and replaces the table before the paged model is built; then a dense checkpoint of
    the same type still checks against transformers in the same process."""
    pytest.importorskip("auto_round")
    rc = main(["check", "--model-path", str(AUTOROUND / name), "--check-resident", "3", "--max-new-tokens", "2",
               "--prompt", "hello"])
    out = capsys.readouterr().out
    assert rc == 0 and "verdict: PASS" in out, out
    rc = main(["check", "--check-resident", "8", "--max-new-tokens", "1", "--prompt", "ROMEO:"])
    out = capsys.readouterr().out
    assert rc == 0 and "reference: transformers (its own loading of an unquantized checkpoint)" in out, out
