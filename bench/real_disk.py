"""Paging larger than RAM on a CPU: the disk tier at a real model's expert shapes.

Issue 32. The checkpoint of ``bench/real_shape.py make`` (Qwen3-30B-A3B's expert shapes, 1.2 GB
of experts per layer), loaded with ``--host-memory-gb`` below its size, in a memory cgroup below
its size where this machine lets us create one, the checkpoint's files dropped from the page
cache first.

Subcommands:

  disk DIR --host-memory-gb G [--num-resident 8] [--tokens 12] [--cgroup-mb 1500]
                                larger than RAM: the page cache of DIR dropped (posix_fadvise
                                DONTNEED), then in a child process (inside a new memory cgroup
                                of --cgroup-mb where this machine lets us create one: v2, else v1)
                                load with the disk tier and decode teacher-forced; MB read from
                                disk per token (the tier's counters and /proc/self/io), wall and
                                CPU seconds per token, peak RSS and the cgroup's peak; a child
                                the cgroup OOM-kills or that start-up refuses is reported as such
  llama DIR --gguf FILE [--no-repack] [--cgroup-mb 1180] [--tokens 32] [--threads 1]
                                npm's prebuilt llama.cpp (bench/llama_cpp_prebuilt.py) teacher-forced on
                                the same ids, the GGUF dropped from the page cache, in its own cgroup
  larger-than-ram DIR --gguf Q4_0.gguf --stored-layout-dir D [--rounds 3] [--cgroup-mb 1180] [--tokens 32]
                                issue 46's table: this project (default, packed, without read-ahead, without
                                the stored layout) and llama.cpp Q4_0 (default, --no-repack), interleaved
                                rounds, each cold in its own cgroup; medians [min-max], OOM kills and
                                start-up refusals, top-1 agreement; --rows 2,6 picks rows, --from-log FILE
                                prints the table of an earlier run's output
  disk-compare DIR --before TREE --before-host-memory-gb G0 --host-memory-gb G [disk's flags]
                                ``disk`` alternately from TREE and this tree (``--runs`` each);
                                G0 for TREE (before issue 32, G budgeted the store alone)

Usage: python bench/real_shape.py make /tmp/real2 --layers 2
       python bench/real_disk.py disk /tmp/real2 --host-memory-gb 1 --cgroup-mb 1500 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from pagedexperts.analysis import diskbench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_shape import ROOT, decode, strip_flags, text_ids  # noqa: E402


def cold_files(path: Path, *more: Path) -> list[Path]:
    """The files a cold run must find out of the page cache: the checkpoint's shards, its own
    stored kernel layout (``path/kernel-layout/``, written by ``pagedexperts quantize``: what the
    packed disk tier reads), and every file under ``more`` (a stored-layout cache directory)."""
    dirs = [path / "kernel-layout", *more]
    return sorted(path.glob("*.safetensors")) + [f for d in dirs if d.exists() for f in sorted(d.rglob("*")) if f.is_file()]


def drop_page_cache(path: Path, *more: Path) -> None:
    """Drop ``cold_files(path, *more)`` from the page cache (posix_fadvise DONTNEED): reads then
    come from the disk, as for a checkpoint larger than RAM."""
    for f in cold_files(path, *more):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def io_read_bytes() -> int:
    """Bytes this process caused to be read from storage (/proc/self/io read_bytes)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def disk_child(args) -> dict:
    """The measurement inside the (cgroup'd) child: load with the disk tier, decode, counters."""
    import resource

    import pagedexperts

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.dir)
    ids = text_ids(path, args.prefill_tokens + args.tokens)
    t0 = time.perf_counter()
    try:
        extra = {} if args.read_ahead else {"read_ahead": False}  # a tree before issue 32 has no read-ahead flag
        if args.experts_implementation:
            extra["experts_implementation"] = args.experts_implementation
        if args.stored_layout_dir and args.stored_layout:  # both together are refused
            extra["stored_layout_dir"] = args.stored_layout_dir
        if not args.stored_layout:
            extra["stored_layout"] = False
        model, _ = pagedexperts.load_model(path, num_resident=args.num_resident, host_memory_gb=args.host_memory_gb,
                                           prefetch=args.prefetch, **extra)
    except (ValueError, MemoryError) as exc:
        return dict(refused=f"{type(exc).__name__}: {exc}")
    load_s = time.perf_counter() - t0
    rt = model.pagedexperts
    io0, wall0, cpu0 = io_read_bytes(), time.perf_counter(), time.process_time()
    state = {}

    def start() -> None:
        rt.reset_stats()
        state.update(io=io_read_bytes(), wall=time.perf_counter(), cpu=time.process_time())

    _, logits = decode(model, ids, args.prefill_tokens, on_prefilled=start)
    n = args.tokens
    d = rt.stats().as_dict(times=False)
    return dict(load_s=load_s, host_rows=rt.host_memory.host_rows, num_resident=rt.num_resident,
                plan=rt.host_memory.describe(), tokens=n,
                wall_s_per_token=(time.perf_counter() - state["wall"]) / n,
                cpu_s_per_token=(time.process_time() - state["cpu"]) / n,
                disk_mb_per_token=d["disk_bytes_read"] / n / 1e6,
                io_mb_per_token=(io_read_bytes() - state["io"]) / n / 1e6,
                misses_per_token=d["misses_per_token"], host_hit_rate=d["host_hit_rate"],
                zero_copy_per_token=d.get("zero_copy_page_ins", 0) / n,  # absent before the slots read host rows
                read_ahead_issued=d["read_ahead_issued"], read_ahead_used=d["read_ahead_used"],
                disk_reads_per_token=d["disk_reads"] / n,
                disk_read_ms_per_expert=1e3 * d["disk_read_s"] / max(1, d["disk_reads"]),
                stored_layout=getattr(rt, "stored_layout", None), fallbacks=rt.stats().fallbacks,
                prefill_io_mb=(state["io"] - io0) / 1e6, prefill_wall_s=state["wall"] - wall0,
                prefill_cpu_s=state["cpu"] - cpu0,
                peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
                argmax=logits.float().argmax(-1).tolist(),
                pagedexperts=str(Path(pagedexperts.__file__).parent))


def make_cgroup(limit_bytes: int, name: str) -> Path | None:
    """A new memory cgroup limited to ``limit_bytes`` (v2 where the unified hierarchy has the
    memory controller, else v1), or None where this machine does not let us create one."""
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    for fstype, limit_file in (("cgroup2", "memory.max"), ("cgroup", "memory.limit_in_bytes")):
        for m in mounts:
            if m[2] != fstype or (fstype == "cgroup" and "memory" not in m[3].split(",")):
                continue
            root = Path(m[1])
            if fstype == "cgroup2" and "memory" not in (root / "cgroup.controllers").read_text().split():
                continue
            try:
                (root / name).mkdir(exist_ok=True)
                (root / name / limit_file).write_text(str(limit_bytes))
                if fstype == "cgroup":  # no swap beyond the limit either, where the kernel counts it
                    try:
                        (root / name / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
                    except OSError:
                        pass
                return root / name
            except OSError:
                continue
    return None


def cgroup_peak_mb(cgroup: Path) -> float | None:
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        if (cgroup / name).exists():
            return int((cgroup / name).read_text()) / 1e6
    return None


def run_disk(args, argv: list[str], tree: Path = ROOT) -> dict:
    """``disk_child`` in a subprocess from ``tree`` (in a fresh memory cgroup when --cgroup-mb)."""
    drop_page_cache(Path(args.dir), *([Path(args.stored_layout_dir)] if args.stored_layout_dir else []))
    cgroup = make_cgroup(int(args.cgroup_mb * 1e6), f"pagedexperts-bench-{os.getpid()}") if args.cgroup_mb else None
    env = dict(os.environ, PYTHONPATH=str(tree))
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    enter = (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
    cmd = [sys.executable, str(Path(__file__).resolve()), "disk-child", *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, preexec_fn=enter)
    out = {"tree": str(tree), "cgroup": str(cgroup) if cgroup else
           ("none: could not create a memory cgroup here (ran with --host-memory-gb and the page cache dropped)"
            if args.cgroup_mb else None), "cgroup_mb": args.cgroup_mb, "host_memory_gb": args.host_memory_gb}
    if proc.returncode == 0:
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return _finish(out, proc, cgroup, stderr_chars=1500)


def _finish(out: dict, proc, cgroup, *, stderr_chars: int) -> dict:
    """``out`` with a failed run's exit (SIGKILL named as the cgroup's OOM kill) and stderr tail,
    the cgroup's peak memory, and the cgroup removed."""
    if proc.returncode != 0:
        killed = " (killed: SIGKILL, the cgroup's OOM killer)" if proc.returncode == -9 else ""
        out["failed"] = f"exit {proc.returncode}{killed}"
        out["stderr"] = proc.stderr[-stderr_chars:]
    if cgroup:
        out["cgroup_peak_mb"] = cgroup_peak_mb(cgroup)
        try:
            cgroup.rmdir()
        except OSError as exc:
            out["cgroup_left"] = str(exc)
    return out


def run_llama(args) -> dict:
    """npm's prebuilt llama.cpp (``llama_cpp_prebuilt``) on GGUF ``args.gguf``, teacher-forced on
    the same ids as ``disk``, the GGUF dropped from the page cache first, in a fresh memory cgroup
    of --cgroup-mb: wall and CPU s/token over the decode steps, bytes read from storage per token
    (/proc/self/io), peak RSS and the cgroup's peak; an OOM kill reported as such."""
    import tempfile

    from llama_cpp_prebuilt import setup

    pb = setup(Path(args.llama_cache)) if args.llama_cache else setup()
    ids = text_ids(Path(args.dir), args.prefill_tokens + args.tokens)[0].tolist()
    gguf = Path(args.gguf)
    diskbench.drop_page_cache([gguf])
    cgroup = make_cgroup(int(args.cgroup_mb * 1e6), f"pagedexperts-llama-{os.getpid()}") if args.cgroup_mb else None
    enter = (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
    with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as f:
        f.write(" ".join(map(str, ids)))
    cmd = pb.command("run", gguf, f.name, "--prefill", str(args.prefill_tokens), "--decode", str(args.tokens),
                     "--threads", str(args.threads or 1), *([] if args.repack else ["--no-repack"]))
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=enter)
    os.unlink(f.name)
    out = {"gguf": str(gguf), "repack": args.repack, "cgroup_mb": args.cgroup_mb}
    if proc.returncode == 0:
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        n = len(r["cpu_s"])
        out.update(wall_s_per_token=sum(r["wall_s"]) / n, cpu_s_per_token=sum(r["cpu_s"]) / n,
                   io_mb_per_token=r["decode_read_bytes"] / n / 1e6, peak_rss_mb=r["peak_rss_kb"] / 1e3,
                   load_wall_s=r["load_wall_s"], buffers=r["buffers"], argmax=r["argmax"])
    return _finish(out, proc, cgroup, stderr_chars=800)


def llama_line(r: dict) -> str:
    label = f"llama.cpp {Path(r['gguf']).name} {'repack' if r['repack'] else '--no-repack'} cgroup={r['cgroup_mb']} MB"
    if "failed" in r:
        return f"{label}: FAILED {r['failed']} (cgroup peak {r.get('cgroup_peak_mb')} MB)"
    return (f"{label}: {r['wall_s_per_token']:.3f} s/token wall, {r['cpu_s_per_token']:.3f} s/token CPU, "
            f"{r['io_mb_per_token']:.1f} MB/token from storage; peak RSS {r['peak_rss_mb']:.0f} MB, cgroup peak "
            f"{r.get('cgroup_peak_mb')} MB; load {r['load_wall_s']:.1f} s")


def disk_line(r: dict) -> str:
    label = f"{r['tree']} G={r['host_memory_gb']} cgroup={r['cgroup_mb']} MB"
    if "refused" in r:
        return f"{label}: refused at start-up: {r['refused']}"
    if "failed" in r:
        return f"{label}: FAILED {r['failed']} (cgroup peak {r.get('cgroup_peak_mb')} MB)\n{r['stderr']}"
    return (f"{label}: R={r['host_rows']} K={r['num_resident']}: {r['wall_s_per_token']:.3f} s/token wall, "
            f"{r['cpu_s_per_token']:.3f} s/token CPU, {r['disk_mb_per_token']:.1f} MB/token read by the tier "
            f"({r['io_mb_per_token']:.1f} from storage), misses/token {r['misses_per_token']:.1f}, host hit rate "
            f"{r['host_hit_rate']:.2f}, read-ahead used {r['read_ahead_used']}/{r['read_ahead_issued']}, "
            f"{r.get('disk_read_ms_per_expert', float('nan')):.2f} ms per expert read; peak RSS "
            f"{r['peak_rss_mb']:.0f} MB, cgroup peak {r.get('cgroup_peak_mb')} MB; load {r['load_s']:.1f} s\n  {r['plan']}")


LARGER_THAN_RAM = [  # (label, real_disk.py argv after DIR): issue 46's table
    ("pagedexperts, default settings", ["disk"]),
    ("pagedexperts, packed", ["disk", "--experts-implementation", "packed"]),
    ("pagedexperts, packed, --no-read-ahead", ["disk", "--experts-implementation", "packed", "--no-read-ahead"]),
    ("pagedexperts, packed, --no-stored-layout", ["disk", "--experts-implementation", "packed", "--no-stored-layout"]),
    ("llama.cpp Q4_0, default (repack)", ["llama"]),
    ("llama.cpp Q4_0, --no-repack (mmap)", ["llama", "--no-repack"]),
]


def top1_agreement(results: list[dict], reference: list[dict]) -> list[float]:
    """Per round, the fraction of decode steps whose argmax token equals the reference row's of the
    same round (rounds where either has no ``argmax``, e.g. an OOM kill, are left out)."""
    out = []
    for res, ref in zip(results, reference):
        a, b = res.get("argmax"), ref.get("argmax")
        if a is None or b is None:
            continue
        if len(a) != len(b):
            raise ValueError(f"top-1 agreement over {len(a)} steps against a reference of {len(b)}")
        out.append(sum(x == y for x, y in zip(a, b)) / len(a))
    return out


def larger_than_ram(args) -> None:
    """The LARGER_THAN_RAM rows (``--rows``: their 1-based numbers; default all), ``--rounds``
    interleaved rounds (round r rotates the order by r), each cold and in its own cgroup; a
    markdown table (``larger_than_ram_table``); ``--from-log``: the table of an earlier run's output."""
    if args.from_log:
        print(larger_than_ram_table(rows_from_log(Path(args.from_log).read_text()), args.cgroup_mb, args.tokens))
        return
    chosen = [LARGER_THAN_RAM[i - 1] for i in args.rows] if args.rows else LARGER_THAN_RAM
    if args.before:  # this project's rows again from the tree of the code before, in the same rounds
        chosen = chosen + [(f"{label} (before: {Path(args.before).name})", [*sub, "--tree", args.before])
                           for label, sub in chosen if sub[0] == "disk"]
    rows = {label: [] for label, _ in chosen}
    for r in range(args.rounds):
        order = chosen[r % len(chosen):] + chosen[:r % len(chosen)]
        for label, sub in order:
            extra = ["--gguf", args.gguf] if sub[0] == "llama" else ["--stored-layout-dir", args.stored_layout_dir]
            cmd = [sys.executable, str(Path(__file__).resolve()), sub[0], args.dir, *sub[1:], *extra, "--json",
                   "--tokens", str(args.tokens), "--prefill-tokens", str(args.prefill_tokens), "--threads", "1",
                   "--cgroup-mb", str(args.cgroup_mb)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            res = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"failed": proc.stderr[-300:]}
            rows[label].append(res)
            print(label, json.dumps({k: v for k, v in res.items() if k not in ("stderr", "buffers", "plan")}), flush=True)

    print("\n" + larger_than_ram_table(rows, args.cgroup_mb, args.tokens))


def rows_from_log(text: str) -> dict[str, list[dict]]:
    """The per-run lines ``larger-than-ram`` printed (label, then its JSON), grouped by label in
    order of first appearance."""
    rows: dict[str, list[dict]] = {}
    for line in text.splitlines():
        if " {" in line and not line.startswith("|"):
            label, _, blob = line.partition(" {")
            rows.setdefault(label, []).append(json.loads("{" + blob))
    return rows


def larger_than_ram_table(rows: dict[str, list[dict]], cgroup_mb: float, tokens: int) -> str:
    """Markdown: per row the median [min-max] over its rounds; OOM kills and start-up refusals
    counted; top-1 agreement per round against the first row that decoded (its argmax tokens)."""
    import statistics

    def cell(results, key, fmt="{:.3f}"):
        vals = [x[key] for x in results if key in x]
        if not vals:
            return "-"
        return fmt.format(statistics.median(vals)) + (f" [{fmt.format(min(vals))}-{fmt.format(max(vals))}]"
                                                       if len(vals) > 1 else "")

    reference = next((label for label, results in rows.items() if any("argmax" in x for x in results)), None)
    lines = [f"| run ({cgroup_mb:.0f}M cgroup, cold, 1 thread, {tokens} tokens) | wall s/token | CPU s/token | "
             f"MB/token from storage | MB/token read by the tier | peak RSS MB | OOM kills | top-1 = {reference} |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, results in rows.items():
        kills = sum("OOM" in x.get("failed", "") for x in results)
        refused = sum("refused" in x for x in results)
        agree = [{"top1": a} for a in top1_agreement(results, rows[reference])] if reference else []
        lines.append(f"| {label} | {cell(results, 'wall_s_per_token')} | {cell(results, 'cpu_s_per_token')} | "
                     f"{cell(results, 'io_mb_per_token', '{:.1f}')} | {cell(results, 'disk_mb_per_token', '{:.1f}')} | "
                     f"{cell(results, 'peak_rss_mb', '{:.0f}')} | {kills} of {len(results)}"
                     + (f" ({refused} refused at start-up)" if refused else "") + f" | {cell(agree, 'top1', '{:.2f}')} |")
    return "\n".join(lines)


def disk_compare(args, argv: list[str]) -> None:
    inner = strip_flags(argv, {"--before": 2, "--runs": 2, "--before-host-memory-gb": 2})[1:]
    for run_no in range(args.runs):
        for tree, g in ((Path(args.before).resolve(), args.before_host_memory_gb), (ROOT, args.host_memory_gb)):
            sub = strip_flags(inner, {"--host-memory-gb": 2}) + ["--host-memory-gb", str(g)]
            args.host_memory_gb = g
            print(disk_line(run_disk(args, sub, tree)), flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("disk", "disk-child", "disk-compare"):
        p = sub.add_parser(name)
        p.add_argument("dir")
        p.add_argument("--tree", default=str(ROOT), help="the source tree whose pagedexperts runs (default this one)")
        p.add_argument("--host-memory-gb", type=float, default=None, help="default: none given (the loader's own)")
        p.add_argument("--experts-implementation", default=None, help="default: the loader's")
        p.add_argument("--stored-layout-dir", default=None, help="where the stored kernel layout is cached "
                       "(dropped from the page cache too)")
        p.add_argument("--no-stored-layout", dest="stored_layout", action="store_false")
        p.add_argument("--num-resident", type=int, default=8)
        p.add_argument("--tokens", type=int, default=12, help="timed decode tokens")
        p.add_argument("--prefill-tokens", type=int, default=16)
        p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's default)")
        p.add_argument("--prefetch", action="store_true")
        p.add_argument("--no-read-ahead", dest="read_ahead", action="store_false",
                       help="this tree only: the disk tier without read-ahead")
        p.add_argument("--cgroup-mb", type=float, default=None, help="run inside a new memory cgroup of this limit")
        p.add_argument("--json", action="store_true", help="one JSON line instead of the text line")
    lt = sub.add_parser("larger-than-ram", help="issue 46's table: this project and llama.cpp, interleaved rounds")
    lt.add_argument("dir")
    lt.add_argument("--gguf", required=True)
    lt.add_argument("--stored-layout-dir", required=True)
    lt.add_argument("--rounds", type=int, default=3)
    lt.add_argument("--tokens", type=int, default=32)
    lt.add_argument("--prefill-tokens", type=int, default=16)
    lt.add_argument("--cgroup-mb", type=float, default=1180)
    lt.add_argument("--from-log", default=None, help="print the table of an earlier run's output (its "
                    "per-run lines) instead of running; --cgroup-mb and --tokens label it")
    lt.add_argument("--before", default=None, help="also run this project's chosen rows from this source tree "
                    "(the code before a change), in the same interleaved rounds")
    lt.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",")], default=None,
                    help=f"which rows, 1-based, comma-separated (default all {len(LARGER_THAN_RAM)}): "
                         + "; ".join(f"{i + 1} {label}" for i, (label, _) in enumerate(LARGER_THAN_RAM)))
    lp = sub.add_parser("llama", help="llama.cpp (npm's prebuilt) on a GGUF of the same weights, in a cgroup")
    lp.add_argument("dir", help="the transformers checkpoint whose tokenizer gives the ids")
    lp.add_argument("--gguf", required=True)
    lp.add_argument("--no-repack", dest="repack", action="store_false")
    lp.add_argument("--tokens", type=int, default=12)
    lp.add_argument("--prefill-tokens", type=int, default=16)
    lp.add_argument("--threads", type=int, default=1)
    lp.add_argument("--cgroup-mb", type=float, default=None)
    lp.add_argument("--llama-cache", default=None, help="llama_cpp_prebuilt's cache (default its own)")
    lp.add_argument("--json", action="store_true", help="one JSON line instead of the text line")
    dc = sub.choices["disk-compare"]
    dc.add_argument("--before", required=True, help="tree of the 'before' code")
    dc.add_argument("--before-host-memory-gb", type=float, required=True)
    dc.add_argument("--runs", type=int, default=2)
    args = ap.parse_args(argv)
    if args.cmd == "larger-than-ram":
        larger_than_ram(args)
    elif args.cmd == "llama":
        r = run_llama(args)
        print(json.dumps(r) if args.json else llama_line(r))
    elif args.cmd == "disk":
        inner = strip_flags([a for a in argv[1:] if a != "--json"], {"--tree": 2})
        r = run_disk(args, inner, Path(args.tree).resolve())
        print(json.dumps(r) if args.json else disk_line(r))
    elif args.cmd == "disk-child":
        print(json.dumps(disk_child(args)))
    else:
        disk_compare(args, argv)


if __name__ == "__main__":
    main()
