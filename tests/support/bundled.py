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
