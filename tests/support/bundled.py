"""The bundled model's shape, read once from its config.json (``pagedexperts/data/tiny-qwen3-moe``):
tests name ``bundled.E`` instead of writing 64 down (tests/project/test_test_layout.py checks).

Legend: E routed experts, k top_k, H hidden, I expert intermediate.
"""

import json

from pagedexperts import bundled_model_path

PATH = bundled_model_path()
CONFIG = json.loads((PATH / "config.json").read_text())
E = CONFIG["num_local_experts"]  # 64 (the name its config.json gives E)
TOP_K = CONFIG["num_experts_per_tok"]  # 4
HIDDEN = CONFIG["hidden_size"]  # 128
MOE_INTERMEDIATE = CONFIG["moe_intermediate_size"]  # 64
LAYERS = CONFIG["num_hidden_layers"]
VOCAB = CONFIG["vocab_size"]  # 4096


def untied_copy(dst):
    """The bundled model written to ``dst`` with lm_head as its own tensor (a copy of the tied
    embeddings) and ``tie_word_embeddings`` off: what a quantizer can give its own lm_head."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(PATH, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(dict(CONFIG, tie_word_embeddings=False)))
    return dst
