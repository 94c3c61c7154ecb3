"""llama.cpp as a peer in `bench --suite e2e`: the same weights, converted by llama.cpp's own converter.

The rows need llama-cpp-python, which the `llamacpp` extra builds from its source distribution, so
its kernels are compiled for this CPU. Its wheel does not ship llama.cpp's HF-to-GGUF converter:
that is taken from the source distribution of the installed version (downloaded once with pip into
the cache, or from `$DFLOW_RT_LLAMA_CPP`, a llama.cpp checkout) and run on the target's directory
with `--outtype f32`, so the llama.cpp rows read the float32 weights our float32 rows read. The
converter dispatches on `architectures` in config.json, which `dflow-rt fetch-model` writes.

A second GGUF, quantised from that one by llama.cpp to Q4_1 with a Q8_0 embedding (the layout SmolLM2
is published in), gives the row a CPU user of the published file gets: llama.cpp's own 4-bit kernels,
which also round the activations, so its tokens can differ from float32 greedy decoding.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from dflow_rt.bench.decoders import Run, Runner
from dflow_rt.errors import InputError
from dflow_rt.paths import cache_root

CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def available() -> str | None:
    """The installed llama-cpp-python version, or None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.__version__


def converter_dir(version: str) -> Path:
    """A directory holding llama.cpp's convert_hf_to_gguf.py (with its `conversion` and `gguf-py` packages)."""
    if os.environ.get("DFLOW_RT_LLAMA_CPP"):
        return Path(os.environ["DFLOW_RT_LLAMA_CPP"])
    out = cache_root() / "llama.cpp" / version
    if (out / CONVERTER_PARTS[0]).exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        part = out.with_name(out.name + ".partial")
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(CONVERTER_PARTS)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(part, members, filter="data")
        part.replace(out)
    return out


def gguf_file(model_dir: Path, version: str) -> Path:
    """The target's float32 GGUF, converted once per (weights, config, llama.cpp version) and cached."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        path = model_dir / name
        digest.update(f"{name}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode() if path.exists() else b"-")
    out = cache_root() / "gguf" / f"{model_dir.name}-{digest.hexdigest()[:16]}-llama.cpp{version}-f32.gguf"
    if out.exists():
        return out
    src = converter_dir(version)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(src)])}
    done = subprocess.run([sys.executable, str(src / CONVERTER_PARTS[0]), str(model_dir), "--outtype", "f32",
                           "--outfile", str(tmp)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise InputError(f"llama.cpp's converter refused {model_dir}: {done.stderr.strip().splitlines()[-1:]}")
    tmp.replace(out)
    return out


QUANTIZE = """import ctypes, sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.token_embedding_type, p.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1, llama_cpp.GGML_TYPE_Q8_0, 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


def q4_1_file(f32: Path) -> Path:
    """`f32` quantised by llama.cpp to Q4_1 (embedding Q8_0), once, beside it (in a child process:
    llama.cpp prints every tensor)."""
    out = f32.with_name(f32.name.removesuffix("-f32.gguf") + "-q4_1.gguf")
    if out.exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    done = subprocess.run([sys.executable, "-c", QUANTIZE, str(f32), str(tmp)], capture_output=True, text=True)
    if done.returncode != 0:
        raise InputError(f"llama.cpp could not quantise {f32.name}: {done.stderr.strip().splitlines()[-1:]}")
    tmp.replace(out)
    return out


def llama_cpp_runner(gguf: Path, stops: Sequence[int], threads: int, n_ctx: int,
                     prompt_lookup: int | None = None) -> Runner:
    """llama.cpp greedy decoding at batch 1 (`Llama.generate` with temperature 0); `prompt_lookup`
    candidates per round turn on its prompt-lookup speculative mode. llama.cpp does not report its
    rounds, so every token counts as one (tau is not measured for these rows)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup) if prompt_lookup else None
    llm = Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                draft_model=draft, verbose=False)
    stop = set(stops)

    def run(prompts: list[list[int]], max_new: int) -> Run:
        (prompt,) = prompts
        tokens, times = [], []
        t0 = time.perf_counter()
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            tokens.append(tok)
            if tok in stop or len(tokens) == max_new:  # up to and including a stop token, as ours
                break
        return Run([tokens], [[1] * len(tokens)], times[0] - t0, len(tokens) - 1, times[-1] - times[0])

    return run
