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
        ValueError: no such file (or a directory), text that is not UTF-8 or not JSON, or a line /
            list item that is not an object (names the file and the line or item), or no prompt found
            (names the fields tried).
    """
    path = Path(path)
    if path.is_dir() or not path.is_file():
        raise ValueError(f"{path} is a directory; give a file" if path.is_dir() else f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    prompts: list[str] = []
    if text.lstrip().startswith("["):
        for n, item in enumerate(_json(text, f"{path}"), 1):
            turns = _object(item, f"{path}: item {n}").get("conversations") or []
            human = [t.get("value", "") for t in turns if t.get("from") in ("human", "user")]
            if human:
                prompts.append(human[0])
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            row = _object(_json(line, f"{path}:{n}"), f"{path}:{n}")
            p = row.get("prompt") or (row.get("turns") or [None])[0] or row.get("question")
            if p:
                prompts.append(p)
    if not prompts:
        raise ValueError(f"{path}: no prompts found (want JSON lines with prompt/turns/question, or ShareGPT JSON)")
    return prompts[:limit] if limit else prompts


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None


def _object(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a JSON {type(value).__name__}, not an object with prompt/turns/question "
                         "(or ShareGPT's conversations)")
    return value
