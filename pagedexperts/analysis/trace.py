"""Routing traces: one versioned, compact file format, its writer, and a loader.

Owns the trace format, ``TraceWriter`` (called per step and MoE layer), and ``load_trace``: that
format, JSON-lines traces (meta line, then a row per token and layer; warm-up rows dropped,
steps and streams recovered), or a directory of one model's traces (``load_trace_set``).
Does not: replay or judge routing (``simulate``).

Legend: T tokens (rows) of a step, k = top_k, E routed experts, S steps, R records.
Format version 1 (``.npz``, keys):
  meta            uint8 [*]   UTF-8 JSON: format_version, model_id, num_experts, top_k,
                              layers (MoE layer indices), extras (names), notes
  step_phase      int8 [S]    0 prefill, 1 decode
  step_offsets    int64 [S+1] rows of step s are request_ids[step_offsets[s]:step_offsets[s+1]]
  request_ids     int64 [sum T]  one per row in row order; -1 padding, -2 unknown
  rec_step, rec_layer  int32 [R]  record r = (step, MoE layer)
  rec_offsets     int64 [R+1] rows of record r are topk_ids[rec_offsets[r]:rec_offsets[r+1]]
  topk_ids        int16 [sum, k] (int32 if E > 32767);  topk_weights float16 [sum, k]
  x_<name>_step, x_<name>_layer int32 [X]; x_<name>_offsets int64 [X+1]; x_<name>_values [*]
                              per-layer extras, each entry's values flattened to 1-D
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
PHASES = ("prefill", "decode")
PREFETCH_EXTRA = "prefetch"  # the extra holding a layer's predicted experts, priority order
PADDING_REQUEST = -1  # a padding row: routed and planned like the runtime does, not a token
UNKNOWN_REQUEST = -2  # a real token whose request is not known (JSON-lines prefill rows)
DUMMY_MIN_ROWS = 1024  # a JSON-lines profiling pass repeats one routing on >= 1,024 leading rows
TRACE_SUFFIXES = (".npz", ".jsonl")  # the files of a directory that ``load_trace_set`` reads
# Models whose JSON-lines meta omits num_experts (routed experts; shared experts not counted).
_KNOWN_NUM_EXPERTS = {"Qwen/Qwen1.5-MoE-A2.7B-Chat": 60, "Qwen/Qwen1.5-MoE-A2.7B": 60}


@dataclass(frozen=True)
class TraceMeta:
    """What a trace describes: the model's E and top_k, its MoE layers, extras and notes."""

    num_experts: int
    top_k: int
    layers: tuple[int, ...]
    model_id: str = ""
    extras: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    format_version: int = FORMAT_VERSION


@dataclass(frozen=True)
class Step:
    """One engine step: ``request_ids`` [T] int64 (-1 padding, -2 unknown request),
    ``topk_ids[layer]`` [T, k], ``topk_weights[layer]`` [T, k], ``extras[(layer, name)]`` 1-D."""

    phase: str
    request_ids: np.ndarray
    topk_ids: dict[int, np.ndarray]
    topk_weights: dict[int, np.ndarray]
    extras: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Rows that are tokens (not padding)."""
        return int((self.request_ids != PADDING_REQUEST).sum())

    @property
    def num_padding(self) -> int:
        return int((self.request_ids == PADDING_REQUEST).sum())


@dataclass
class Trace:
    """A loaded trace: ``meta`` and its ``steps`` in order; iterating yields the steps."""

    meta: TraceMeta
    steps: list[Step]

    def __iter__(self):
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.steps)

    def check_model(self, *, num_experts: int, top_k: int) -> None:
        """Raise ValueError if this trace's E or top_k differ from the model's."""
        m = self.meta
        if (m.num_experts, m.top_k) != (num_experts, top_k):
            raise ValueError(
                f"trace of {m.model_id or 'unknown model'} has E={m.num_experts}, top_k={m.top_k}; "
                f"the model has E={num_experts}, top_k={top_k}: record a trace of this model"
            )

    def streams(self) -> dict[int, dict[int, np.ndarray]]:
        """Per-request decode streams: request id -> layer -> topk ids [n, k] in token order (rows with
        a known request id)."""
        rows: dict[int, dict[int, list[np.ndarray]]] = {}
        for step in self.steps:
            if step.phase != "decode":
                continue
            for i, rid in enumerate(step.request_ids.tolist()):
                if rid < 0:
                    continue
                per_layer = rows.setdefault(rid, {})
                for layer, ids in step.topk_ids.items():
                    per_layer.setdefault(layer, []).append(ids[i])
        return {rid: {ly: np.stack(v) for ly, v in d.items()} for rid, d in rows.items()}


class TraceWriter:
    """Collects routing step by step (``begin_step``, then ``add`` per MoE layer, ``add_extra``) and
    saves it in format version 1."""

    def __init__(self, *, num_experts: int, top_k: int, layers: list[int], model_id: str = "") -> None:
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, E={num_experts}]")
        self.meta = TraceMeta(num_experts=num_experts, top_k=top_k, layers=tuple(layers), model_id=model_id)
        self._phases: list[int] = []
        self._request_ids: list[np.ndarray] = []
        self._records: list[tuple[int, int, np.ndarray, np.ndarray]] = []  # step, layer, ids, weights
        self._extras: dict[str, list[tuple[int, int, np.ndarray]]] = {}
        self._layers_done: set[int] = set()

    def begin_step(self, *, phase: str, request_ids: list[int]) -> None:
        """Start a step of one row per ``request_ids`` entry (``PADDING_REQUEST`` for padding);
        ``phase`` "prefill" or "decode"."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} must be one of {PHASES}")
        self._phases.append(PHASES.index(phase))
        self._request_ids.append(np.asarray(request_ids, dtype=np.int64).reshape(-1))
        self._layers_done = set()

    def add(self, *, layer: int, topk_ids, topk_weights) -> None:
        """Record one MoE layer of the current step: ``topk_ids`` [T, k] int, ``topk_weights`` [T, k].
        Raises ValueError: no step begun, unknown or repeated layer, shape not [T, k], id outside [0, E)."""
        step = self._current_step(layer)
        ids, weights = np.asarray(topk_ids), np.asarray(topk_weights)
        shape = (len(self._request_ids[step]), self.meta.top_k)
        if ids.shape != shape or weights.shape != shape:
            raise ValueError(f"layer {layer}: topk ids {ids.shape} / weights {weights.shape}, expected [T, k]={shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.meta.num_experts):
            raise ValueError(f"layer {layer}: expert id outside [0, E={self.meta.num_experts})")
        self._layers_done.add(layer)
        self._records.append((step, layer, ids.astype(np.int32), weights.astype(np.float32)))

    def add_extra(self, *, layer: int, name: str, values) -> None:
        """Attach 1-D ``values`` (flattened) called ``name`` to ``layer`` of the current step."""
        if not name.isidentifier():
            raise ValueError(f"extra name {name!r} must be an identifier")
        if not self._phases:
            raise ValueError("add_extra() before begin_step()")
        entry = (len(self._phases) - 1, layer, np.asarray(values).reshape(-1))
        self._extras.setdefault(name, []).append(entry)

    def _current_step(self, layer: int) -> int:
        if not self._phases:
            raise ValueError("add() before begin_step()")
        if layer not in self.meta.layers:
            raise ValueError(f"layer {layer} is not one of the trace's MoE layers {list(self.meta.layers)}")
        if layer in self._layers_done:
            raise ValueError(f"layer {layer} added twice in step {len(self._phases) - 1}")
        return len(self._phases) - 1

    def save(self, path) -> None:
        """Write the trace to ``path`` (a compressed .npz, no suffix added)."""
        m = self.meta
        meta = dict(format_version=FORMAT_VERSION, model_id=m.model_id, num_experts=m.num_experts,
                    top_k=m.top_k, layers=list(m.layers), extras=sorted(self._extras), notes=list(m.notes))
        id_dtype = np.int16 if m.num_experts <= np.iinfo(np.int16).max else np.int32
        recs = self._records
        arrays = dict(
            meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
            step_phase=np.asarray(self._phases, dtype=np.int8),
            step_offsets=_offsets([len(r) for r in self._request_ids]),
            request_ids=_concat(self._request_ids, np.int64, ()),
            rec_step=np.asarray([r[0] for r in recs], dtype=np.int32),
            rec_layer=np.asarray([r[1] for r in recs], dtype=np.int32),
            rec_offsets=_offsets([len(r[2]) for r in recs]),
            topk_ids=_concat([r[2] for r in recs], id_dtype, (m.top_k,)),
            topk_weights=_concat([r[3] for r in recs], np.float16, (m.top_k,)),
        )
        for name, entries in self._extras.items():
            arrays[f"x_{name}_step"] = np.asarray([e[0] for e in entries], dtype=np.int32)
            arrays[f"x_{name}_layer"] = np.asarray([e[1] for e in entries], dtype=np.int32)
            arrays[f"x_{name}_offsets"] = _offsets([len(e[2]) for e in entries])
            arrays[f"x_{name}_values"] = np.concatenate([e[2] for e in entries])
        with open(path, "wb") as f:
            np.savez_compressed(f, **arrays)


def _offsets(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def _concat(parts: list[np.ndarray], dtype, tail: tuple) -> np.ndarray:
    if not parts:
        return np.zeros((0, *tail), dtype=dtype)
    return np.concatenate(parts).astype(dtype)


def load_trace(path, *, num_experts: int | None = None, top_k: int | None = None) -> Trace:
    """A format-version-1 ``.npz`` or JSON-lines file (told by content), or a directory of them
    (``load_trace_set``), checked against ``num_experts`` and ``top_k`` when both are given.
    Raises ValueError: empty, truncated or malformed file; unknown version; E / top_k mismatch; a directory
    with no trace, or traces of different models; FileNotFoundError: no such file."""
    trace = load_trace_set(path) if Path(path).is_dir() else _load_file(path)
    if num_experts is not None and top_k is not None:
        trace.check_model(num_experts=num_experts, top_k=top_k)
    return trace


def load_trace_set(directory) -> Trace:
    """Every ``*.npz`` / ``*.jsonl`` of ``directory`` as ONE trace of one model (E, top_k, layers):
    the files' steps in turn, request ids shifted so each request stays its own stream; extras
    those every file has.
    Raises ValueError: no trace file; files of different models (names both); a file that does not load."""
    files = sorted(p for p in Path(directory).iterdir() if p.suffix in TRACE_SUFFIXES and p.is_file())
    if not files:
        raise ValueError(f"{directory}: a directory with no trace files ({', '.join('*' + x for x in TRACE_SUFFIXES)}); "
                         "give a trace file, or a directory of traces of one model")
    traces = [_load_file(f) for f in files]
    first, shape = traces[0].meta, lambda m: f"E={m.num_experts}, top_k={m.top_k}, layers {list(m.layers)}"
    for f, t in zip(files[1:], traces[1:]):
        if shape(t.meta) != shape(first):
            raise ValueError(f"{directory}: {files[0].name} ({shape(first)}) and {f.name} ({shape(t.meta)}) are traces "
                             "of different models; a directory is replayed as one set: give one file, or a directory "
                             "of one model's traces")
    steps, offset = [], 0
    for t in traces:
        steps += [dataclasses.replace(s, request_ids=np.where(s.request_ids >= 0, s.request_ids + offset, s.request_ids))
                  for s in t.steps]
        offset += 1 + max([int(s.request_ids.max()) for s in t.steps if (s.request_ids >= 0).any()], default=-1)
    meta = dataclasses.replace(first, model_id=", ".join(sorted({t.meta.model_id for t in traces} - {""})),
                               extras=tuple(x for x in first.extras if all(x in t.meta.extras for t in traces)),
                               notes=(f"{len(files)} traces of {directory}: {', '.join(f.name for f in files)}",))
    return Trace(meta=meta, steps=steps)


def _load_file(path) -> Trace:
    """One trace file, its format told by its first bytes (an .npz is a zip archive)."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if not magic:
        raise ValueError(f"{path}: empty trace file")
    return _load_npz(path) if magic == b"PK" else _load_jsonl(path)


def _load_npz(path) -> Trace:
    try:
        with np.load(path, allow_pickle=False) as z:
            a = {key: z[key] for key in z.files}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise ValueError(f"{path}: truncated or corrupt trace file ({exc})") from None
    try:
        meta = json.loads(a["meta"].tobytes().decode())
    except KeyError:
        raise ValueError(f"{path}: not a pagedexperts trace (no meta)") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: trace format version {meta.get('format_version')}, this reader knows {FORMAT_VERSION}")
    so, ro = a["step_offsets"], a["rec_offsets"]
    steps = [Step(phase=PHASES[p], request_ids=a["request_ids"][so[s]:so[s + 1]], topk_ids={}, topk_weights={})
             for s, p in enumerate(a["step_phase"].tolist())]
    for r, (s, layer) in enumerate(zip(a["rec_step"].tolist(), a["rec_layer"].tolist())):
        steps[s].topk_ids[layer] = a["topk_ids"][ro[r]:ro[r + 1]]
        steps[s].topk_weights[layer] = a["topk_weights"][ro[r]:ro[r + 1]]
    for name in meta["extras"]:
        xo = a[f"x_{name}_offsets"]
        for x, (s, layer) in enumerate(zip(a[f"x_{name}_step"].tolist(), a[f"x_{name}_layer"].tolist())):
            steps[s].extras[(layer, name)] = a[f"x_{name}_values"][xo[x]:xo[x + 1]]
    tmeta = TraceMeta(num_experts=meta["num_experts"], top_k=meta["top_k"], layers=tuple(meta["layers"]),
                      model_id=meta["model_id"], extras=tuple(meta["extras"]), notes=tuple(meta["notes"]))
    return Trace(meta=tmeta, steps=steps)


# ---------------------------------------------------------------------------------------------
# JSON-lines traces: a meta line, then one row per token and layer
# ---------------------------------------------------------------------------------------------


def _read_jsonl(path) -> tuple[dict, list[dict]]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n}: truncated or malformed JSON line") from None
    if not rows or rows[0].get("type") != "meta":
        raise ValueError(f"{path}: not a trace (no pagedexperts npz header, no JSON-lines meta first line)")
    return rows[0], [r for r in rows[1:] if r.get("type") == "route"]


def _split_runs(rows: list[dict]) -> list[list[list[dict]]]:
    """Rows of one layer -> runs -> steps: a step ends where token_idx restarts; leading rows
    (>= DUMMY_MIN_ROWS) repeating one routing are a profiling pass, dropped."""
    steps, cur = [], []
    for r in rows:
        if cur and r["token_idx"] <= cur[-1]["token_idx"]:
            steps.append(cur)
            cur = []
        cur.append(r)
    if cur:
        steps.append(cur)
    runs: list[list[list[dict]]] = [[]]
    for step in steps:
        first = (step[0]["topk_ids"], step[0]["topk_weights"])
        lead = next((i for i, r in enumerate(step) if (r["topk_ids"], r["topk_weights"]) != first), len(step))
        if lead >= DUMMY_MIN_ROWS:
            step = step[lead:]
            runs.append([])
        if step:
            runs[-1].append(step)
    return [run for run in runs if run]


def _run_steps(run: list[list[dict]], first_id: int) -> list[tuple[str, list[int], list[dict]]]:
    """(phase, request ids, rows) of a run's steps: one step is one stream; else prefill first
    (requests unknown), then decode, requests by position while the batch keeps its first size."""
    if len(run) == 1:
        return [("decode", [first_id], [r]) for r in run[0]]
    out = [("prefill", [UNKNOWN_REQUEST] * len(run[0]), run[0])]
    width, known = len(run[1]), True
    for step in run[1:]:
        known = known and len(step) == width
        ids = list(range(first_id, first_id + width)) if known else [UNKNOWN_REQUEST] * len(step)
        out.append(("decode", ids, step))
    return out


def _load_jsonl(path) -> Trace:
    head, rows = _read_jsonl(path)
    if not rows:
        raise ValueError(f"{path}: trace has a meta line but no route rows")
    model_id = head.get("model_id", "")
    top_k = int(head.get("top_k") or len(rows[0]["topk_ids"]))
    notes = []
    e = head.get("num_experts") or _KNOWN_NUM_EXPERTS.get(model_id)
    if not e:
        e = 1 + max(max(r["topk_ids"]) for r in rows)
        notes.append(f"num_experts not in meta: taken as max id + 1 = {e}")
    layers = sorted({r["layer"] for r in rows})
    per_layer = {ly: [] for ly in layers}
    for layer in layers:
        next_id = 0
        for run in _split_runs([r for r in rows if r["layer"] == layer]):
            per_layer[layer].extend(_run_steps(run, next_id))
            next_id += max(len(s) for s in run)
    counts = {ly: [len(s[2]) for s in v] for ly, v in per_layer.items()}
    if len({tuple(c) for c in counts.values()}) > 1:
        raise ValueError(f"{path}: layers have different step structures; cannot align them")
    steps = []
    for parts in zip(*(per_layer[ly] for ly in layers)):
        phase, ids = parts[0][0], parts[0][1]
        steps.append(Step(
            phase=phase, request_ids=np.asarray(ids, dtype=np.int64),
            topk_ids={ly: np.asarray([r["topk_ids"] for r in p[2]], dtype=np.int32) for ly, p in zip(layers, parts)},
            topk_weights={ly: np.asarray([r["topk_weights"] for r in p[2]], dtype=np.float32)
                          for ly, p in zip(layers, parts)},
        ))
    meta = TraceMeta(num_experts=int(e), top_k=top_k, layers=tuple(layers), model_id=model_id,
                     notes=tuple(notes) + ("converted from JSON lines: warm-up dropped, steps recovered",))
    return Trace(meta=meta, steps=steps)
