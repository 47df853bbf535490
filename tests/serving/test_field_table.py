"""docs/server.md's table of request fields stays true to the request models.

Each row names fields, the endpoints they are sent to, and what the server does: "implemented" and
"accepted" fields are declared by that endpoint's request model; a "refused" field is either not
declared (an unknown field: 400) or declared only to refuse any value but its default; every field
a request model declares has a row.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("fastapi")

from pagedexperts.serving.protocol import SGLANG_DEFAULTS, UNSUPPORTED, ChatCompletionRequest, CompletionRequest  # noqa: E402
from pagedexperts.serving.responses_api import DEFAULTS_ONLY, ResponsesRequest  # noqa: E402
from support.paths import ROOT  # noqa: E402

MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest, "responses": ResponsesRequest}
DEFAULT_ONLY = {"chat": set(UNSUPPORTED) | set(SGLANG_DEFAULTS), "completions": set(UNSUPPORTED) | set(SGLANG_DEFAULTS),
                "responses": set(DEFAULTS_ONLY)}
ROW = re.compile(r"^\| ((?:`[a-z_]+`(?:, )?)+) \| ([a-z, ]+) \| (implemented|accepted|refused)", re.M)


def _rows():
    text = (ROOT / "docs/server.md").read_text()
    section = text[text.index("## Request fields of OpenAI, vLLM and SGLang clients"):text.index("## Serving on the fast path")]
    for names, endpoints, what in ROW.findall(section):
        for endpoint in endpoints.split(", "):
            for name in re.findall(r"`([a-z_]+)`", names):
                yield endpoint, name, what


def test_each_row_is_what_the_request_model_does():
    rows = list(_rows())
    assert len(rows) > 150
    for endpoint, name, what in rows:
        declared = name in MODELS[endpoint].model_fields
        if what in ("implemented", "accepted"):
            assert declared, f"{endpoint} {name!r}: the table says {what}, the request model does not declare it"
        else:
            assert not declared or name in DEFAULT_ONLY[endpoint], f"{endpoint} {name!r}: declared, not refused"


def test_every_declared_field_has_a_row():
    listed = {(endpoint, name) for endpoint, name, _ in _rows()}
    for endpoint, model in MODELS.items():
        missing = sorted(set(model.model_fields) - {name for e, name in listed if e == endpoint})
        assert not missing, f"docs/server.md's field table lacks {endpoint} fields {missing}"
