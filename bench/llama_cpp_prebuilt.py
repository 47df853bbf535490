"""llama.cpp without building it: npm's prebuilt libraries, the release's source, a small driver.

Issue 45 item 5 (and issue 46's larger-than-RAM benchmark reuses it). Two npm packages of one
version, fetched with ``npm pack`` (no ``npm install``) into a cache directory and reused there:

- ``@node-llama-cpp/linux-x64``: libllama, libggml, libggml-base and one CPU backend per
  instruction-set level (``libggml-cpu-{x64,sse42,haswell,skylakex,icelake,sapphirerapids,zen4,...}.so``);
  ggml scores each against this CPU and loads the best (``ggml_backend_load_all_from_path``);
- ``node-llama-cpp``: the same llama.cpp release's source as a git bundle
  (``llama/gitRelease.bundle``, ``llama/llama.cpp.info.json`` names its tag), from which the headers
  (``include/llama.h``, ``ggml/include``), ``convert_hf_to_gguf.py`` with its ``conversion`` package
  and ``gguf-py`` are checked out (``git clone`` of a bundle needs no network).

Both tarballs are checked against the sha512 the registry lists for them (pinned here). The
driver, ``bench/llama_cpp_driver.cpp``, is compiled with the machine's g++ against those headers
and libraries (rpath to them), once per version of its source.

Owns: fetching, extracting, compiling, and running the converter and the driver. Does not
compare sides or time this project (``bench/llama_cpp_peer.py``).

Usage (prints the release and the CPU backend ggml chose here):
  python bench/llama_cpp_prebuilt.py [--cache DIR]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

VERSION = "3.22.1"  # node-llama-cpp; its llama/llama.cpp.info.json names the llama.cpp release (v0.5.0)
PACKAGES = {  # npm name -> the registry's dist.integrity of VERSION
    "@node-llama-cpp/linux-x64": "sha512-5uCCDNqWCNfaAm8aR/Uzxbo4HBpKgNF91kCHPepKhgMgV2OAmatoefbOlMihsqCiH2Od35E/eUHQCFbfRBJuOg==",
    "node-llama-cpp": "sha512-bltIipuWmc123H7tMIgDGKSsSrhmhlQYeVUC48XTjVW7XGJJiJJyCdlTMzQ/LiWoPkGDpcL4FviDpgw7qfTiDw==",
}
SOURCE_PATHS = ("include", "ggml/include", "convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE", "CMakeLists.txt")
LIBS = ("libllama.v0.5.0.so", "libggml.v0.5.0.so", "libggml-base.so")  # what the driver links
DRIVER_SOURCE = Path(__file__).resolve().parent / "llama_cpp_driver.cpp"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedexperts" / f"node-llama-cpp-{VERSION}"
# The converter knows a BPE pre-tokenizer by the hash of its tokens on a fixed text; the bundled
# model's (a GPT-2-style byte-level BPE, trained here) is unknown to it, so it is named "gpt-2"
# where the converter would refuse. ``tokenize`` checks the GGUF's ids against the HF tokenizer's.
CONVERT_SHIM = """
import logging, sys, runpy
sys.path.insert(1, {src!r})
sys.path.insert(1, {src!r} + '/gguf-py')
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        logging.warning('BPE pre-tokenizer unknown to the converter: named gpt-2 (byte-level BPE)')
        return 'gpt-2'
TextModel.get_vocab_base_pre = pre
sys.argv = ['convert_hf_to_gguf.py'] + {argv!r}
runpy.run_path({src!r} + '/convert_hf_to_gguf.py', run_name='__main__')
"""


class Unavailable(RuntimeError):
    """npm, g++ or git missing, or the registry unreachable: the prebuilt cannot be set up here."""


@dataclass(frozen=True)
class Prebuilt:
    """A ready llama.cpp: ``lib_dir`` (the .so files; ``--backend-dir`` of the driver),
    ``src_dir`` (headers, converter), ``driver`` (the compiled binary), ``release`` (the tag of
    llama.cpp.info.json, e.g. "v0.5.0")."""

    cache: Path
    lib_dir: Path
    src_dir: Path
    driver: Path
    release: str

    def command(self, sub: str, *args: str) -> list[str]:
        """argv of ``driver SUB ARGS --backend-dir LIB_DIR`` (for a caller that runs it itself,
        e.g. in a memory cgroup)."""
        return [str(self.driver), sub, *map(str, args), "--backend-dir", str(self.lib_dir)]

    def call(self, sub: str, *args: str) -> dict:
        """Run the driver; its JSON line. Raises RuntimeError with its stderr on failure."""
        proc = subprocess.run(self.command(sub, *args), capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(self.command(sub, *args))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def convert(self, hf_dir: Path, out: Path, outtype: str = "bf16", python: str = sys.executable) -> None:
        """``hf_dir`` (a transformers checkpoint) -> GGUF ``out`` at ``outtype`` (f32, f16, bf16,
        q8_0) by the release's convert_hf_to_gguf.py, run by ``python`` (torch, numpy,
        safetensors, transformers). Written to a temporary name first, renamed when complete."""
        tmp = out.with_name(out.name + ".part")
        shim = CONVERT_SHIM.format(src=str(self.src_dir), argv=[str(hf_dir), "--outtype", outtype, "--outfile", str(tmp)])
        proc = subprocess.run([python, "-c", shim], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"convert_hf_to_gguf.py {hf_dir} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        tmp.rename(out)

    def quantize(self, src: Path, out: Path, qtype: str, threads: int = 1) -> dict:
        """``llama_model_quantize`` of ``src`` to ``out`` at ``qtype`` (Q4_0, Q8_0, BF16, F16), with
        llama-quantize's defaults; the driver's JSON."""
        tmp = out.with_name(out.name + ".part")
        res = self.call("quantize", src, tmp, qtype, "--threads", str(threads))
        tmp.rename(out)
        return res

    def tokenize(self, gguf: Path, text_file: Path) -> list[int]:
        """The GGUF vocabulary's ids of the text in ``text_file`` (no BOS, specials as text)."""
        return self.call("tokenize", gguf, text_file)["ids"]

    def run(self, gguf: Path, ids: list[int], prefill: int, decode: int, *, threads: int = 1, load_mode: str = "auto",
            repack: bool = True, logits: Path | None = None) -> dict:
        """Teacher-forced ``ids`` (prefill + decode of them): the driver's ``run`` JSON (per decode
        step cpu_s, thread_cpu_s, wall_s, argmax; read bytes, peak RSS, the CPU backend)."""
        with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as f:
            f.write(" ".join(map(str, ids[: prefill + decode])))
        try:
            args = [gguf, f.name, "--prefill", str(prefill), "--decode", str(decode), "--threads", str(threads),
                    "--load-mode", load_mode] + ([] if repack else ["--no-repack"]) + (["--logits", str(logits)] if logits else [])
            return self.call("run", *args)
        finally:
            os.unlink(f.name)


def require_tools() -> None:
    """Raises Unavailable naming the first of npm, g++, git this machine lacks."""
    for tool in ("npm", "g++", "git"):
        if shutil.which(tool) is None:
            raise Unavailable(f"{tool} not found on PATH (needed to set up the prebuilt llama.cpp)")


def sha512_integrity(path: Path) -> str:
    """npm's ``dist.integrity`` form of ``path``: "sha512-" + base64 of its SHA-512."""
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


def npm_pack(name: str, cache: Path) -> Path:
    """``npm pack NAME@VERSION`` into ``cache`` (reused when there), checked against PACKAGES."""
    tgz = cache / f"{name.lstrip('@').replace('/', '-')}-{VERSION}.tgz"
    if not tgz.exists():
        proc = subprocess.run(["npm", "pack", f"{name}@{VERSION}", "--pack-destination", str(cache), "--silent"],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode or not tgz.exists():
            raise Unavailable(f"npm pack {name}@{VERSION} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    got = sha512_integrity(tgz)
    if got != PACKAGES[name]:
        tgz.unlink()
        raise RuntimeError(f"{tgz}: integrity {got} is not the registry's {PACKAGES[name]} (removed; run again)")
    return tgz


def extract_libs(tgz: Path, lib_dir: Path) -> None:
    """The .so files of ``package/bins/linux-x64/`` into ``lib_dir`` (written beside, then renamed)."""
    tmp = Path(tempfile.mkdtemp(dir=lib_dir.parent, prefix=".lib-"))
    with tarfile.open(tgz) as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.startswith("package/bins/linux-x64/") and m.name.endswith(".so"):
                (tmp / Path(m.name).name).write_bytes(tar.extractfile(m).read())
    missing = [lib for lib in LIBS if not (tmp / lib).exists()]
    if missing or not list(tmp.glob("libggml-cpu-*.so")):
        raise RuntimeError(f"{tgz}: no {missing or 'libggml-cpu-*.so'} under package/bins/linux-x64/")
    tmp.rename(lib_dir)


def extract_source(tgz: Path, src_dir: Path) -> str:
    """The release's headers and converter from ``package/llama/gitRelease.bundle`` into
    ``src_dir``; returns the release tag (``llama/llama.cpp.info.json``)."""
    work = Path(tempfile.mkdtemp(dir=src_dir.parent, prefix=".src-"))
    with tarfile.open(tgz) as tar:
        info = json.loads(tar.extractfile("package/llama/llama.cpp.info.json").read())
        (work / "release.bundle").write_bytes(tar.extractfile("package/llama/gitRelease.bundle").read())
    tree = work / "llama.cpp"
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(work / "release.bundle"), str(tree)], check=True,
                   capture_output=True)
    subprocess.run(["git", "-C", str(tree), "checkout", "-q", "HEAD", "--", *SOURCE_PATHS], check=True, capture_output=True)
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    (tree / "release.json").write_text(json.dumps(dict(info, bundle_commit=commit, node_llama_cpp=VERSION)))
    shutil.rmtree(tree / ".git")
    tree.rename(src_dir)
    shutil.rmtree(work)
    return info["tag"]


def compile_driver(src_dir: Path, lib_dir: Path, cache: Path) -> Path:
    """g++ -O2 of DRIVER_SOURCE against ``src_dir``'s headers and ``lib_dir``'s libraries, named by
    the source's hash (recompiled when it changes; the builds of other versions removed)."""
    digest = hashlib.sha256(DRIVER_SOURCE.read_bytes()).hexdigest()[:12]
    out = cache / f"llama_cpp_driver-{digest}"
    if not out.exists():
        tmp = out.with_name(out.name + ".part")
        cmd = ["g++", "-O2", "-std=c++17", "-o", str(tmp), str(DRIVER_SOURCE), f"-I{src_dir / 'include'}",
               f"-I{src_dir / 'ggml' / 'include'}", f"-L{lib_dir}", *(f"-l:{lib}" for lib in LIBS), f"-Wl,-rpath,{lib_dir}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        tmp.rename(out)
    for stale in cache.glob("llama_cpp_driver-*"):  # builds of earlier versions of the source
        if stale != out:
            stale.unlink()
    return out


@contextlib.contextmanager
def locked(cache: Path):
    """An exclusive lock on ``cache`` (two set-ups never extract into it at once)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def setup(cache: Path = DEFAULT_CACHE) -> Prebuilt:
    """Fetch, extract and compile what is not yet in ``cache``; the ready Prebuilt.

    Raises:
        Unavailable: npm / g++ / git missing, or npm pack failed (no registry).
        RuntimeError: a tarball whose integrity is not the pinned one, or a failed compile."""
    require_tools()
    cache = Path(cache).resolve()
    with locked(cache):
        lib_dir, src_dir = cache / "lib", cache / "llama.cpp"
        if not lib_dir.exists():
            extract_libs(npm_pack("@node-llama-cpp/linux-x64", cache), lib_dir)
        if not src_dir.exists():
            extract_source(npm_pack("node-llama-cpp", cache), src_dir)
        release = json.loads((src_dir / "release.json").read_text())["tag"]
        return Prebuilt(cache=cache, lib_dir=lib_dir, src_dir=src_dir, driver=compile_driver(src_dir, lib_dir, cache),
                        release=release)


def describe(pb: Prebuilt) -> dict:
    """The release (tag, the bundle's commit, llama_version()), the CPU backend ggml chose here
    and its features."""
    return dict(json.loads((pb.src_dir / "release.json").read_text()), **pb.call("info"), driver=str(pb.driver))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"where the packages go (default {DEFAULT_CACHE})")
    args = ap.parse_args(argv)
    print(json.dumps(describe(setup(args.cache)), indent=1))


if __name__ == "__main__":
    main()
