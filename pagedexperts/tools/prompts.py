"""Benchmark prompt files: JSON lines with ``prompt``, ``turns`` (first turn) or ``question``
(one object a line), or a ShareGPT-style JSON list. Owns reading them; does not
tokenize or measure (``tools.bench``)."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from a JSON-lines file (``prompt``, ``turns`` [first turn] or ``question``) or a
    ShareGPT-style JSON list (first human turn of ``conversations``).

    Raises:
        FileNotFoundError: no such file. ValueError: no prompt found (names the fields tried).
    """
    path = Path(path)
    text = path.read_text()
    prompts: list[str] = []
    if text.lstrip().startswith("["):
        for item in json.loads(text):
            turns = item.get("conversations") or []
            human = [t.get("value", "") for t in turns if t.get("from") in ("human", "user")]
            if human:
                prompts.append(human[0])
    else:
        for line in text.splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            p = row.get("prompt") or (row.get("turns") or [None])[0] or row.get("question")
            if p:
                prompts.append(p)
    if not prompts:
        raise ValueError(f"{path}: no prompts found (want JSON lines with prompt/turns/question, or ShareGPT JSON)")
    return prompts[:limit] if limit else prompts
