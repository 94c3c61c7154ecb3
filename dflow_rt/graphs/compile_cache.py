"""Compiled rounds kept on disk, so that a second start of a compiled Runtime takes seconds.

torch keeps what inductor compiled in its own caches (the FX graph and AOTAutograd caches), which
serve any later compile of the same graph; `torch.compiler.save_cache_artifacts` packs what one
process compiled into bytes that `load_cache_artifacts` puts back. We keep those bytes per entry,
keyed by everything the compiled code depends on (the models' configurations and dtypes, the
Runtime's shape settings, the device and its instruction set, torch and our own graph code), with a
checksum: an entry that does not match its checksum or that torch refuses is deleted and rebuilt,
never trusted. Weights are inputs of the compiled graphs, not constants (`runner.compiling`), so
the code does not depend on their values and one entry serves every checkpoint of a shape.

Entries live under `$DFLOW_RT_CACHE/compiled/` (`models.fetch.cache_root`). Unless the process
chose its own (`TORCHINDUCTOR_CACHE_DIR`), torch's cache goes there too (`compiled/inductor/`):
it also holds the compiled C++ kernels, which the packed bytes do not carry, and unlike torch's
default under /tmp it survives a reboot. All of it is kept within `MAX_BYTES` (least recently used
entries go first, then torch's cache as a whole); `dflow-rt compile-cache list|clear` shows and empties it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

from dflow_rt.models import cpu_gemv

MAX_BYTES = int(os.environ.get("DFLOW_RT_COMPILE_CACHE_BYTES", 2 * 1024**3))
BLOB, META, INDUCTOR = "artifacts.bin", "entry.json", "inductor"
SOURCES = ("graphs", "models", "kernels", "sampling.py")  # the code the compiled rounds trace


def root() -> Path:
    from dflow_rt.models.fetch import cache_root

    return cache_root() / "compiled"


def _code_digest() -> str:
    """Our traced source: a change to the round or the models is a new key."""
    pkg, h = Path(__file__).resolve().parent.parent, hashlib.sha256()
    for name in SOURCES:
        path = pkg / name
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(f.relative_to(pkg).as_posix().encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _model_key(model) -> dict | None:
    if model is None:
        return None
    w = next(model.parameters())
    config = asdict(model.config) if is_dataclass(model.config) else repr(model.config)
    vocab = getattr(model, "vocab_ids", None)
    return {"class": type(model).__name__, "config": config, "dtype": str(w.dtype),
            "draft_vocab": None if vocab is None else len(vocab)}


def entry_key(target, drafter, settings: dict) -> tuple[str, dict]:
    """(hex key, what it hashes): models, Runtime settings, device and threads (inductor's CPU kernels
    are built for a thread count), torch, our code, and whether our CPU product kernel is in the
    graphs (a graph that calls it cannot run in a process where it is off)."""
    device = target.lm_head.weight.device
    cpu = device.type == "cpu"
    what = {"target": _model_key(target), "drafter": _model_key(drafter), "settings": settings,
            "device": device.type, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": sys.version.split()[0],
            "isa": torch.backends.cpu.get_cpu_capability() if cpu else torch.cuda.get_device_name(device),
            "cpu_gemv": cpu and cpu_gemv.enabled(), "code": _code_digest()}
    blob = json.dumps(what, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24], what


def _say(message: str) -> None:
    print(f"dflow-rt: {message}", file=sys.stderr, flush=True)


def use_for_torch() -> None:
    """torch's inductor cache under ours, unless this process already has one (set or in use)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root() / INDUCTOR))


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def load(key: str) -> bool:
    """Put entry `key` into torch's caches; False (and the entry deleted) when it is absent or bad."""
    entry = root() / key
    try:
        meta = json.loads((entry / META).read_text())
        blob = (entry / BLOB).read_bytes()
    except (OSError, ValueError):
        if entry.exists():
            _say(f"compile cache entry {key} is unreadable: rebuilding it")
            shutil.rmtree(entry, ignore_errors=True)
        return False
    if hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        _say(f"compile cache entry {key} does not match its checksum: rebuilding it")
        shutil.rmtree(entry, ignore_errors=True)
        return False
    try:
        torch.compiler.load_cache_artifacts(blob)
    except Exception as err:  # noqa: BLE001  (torch refused the bytes: whatever the reason, rebuild)
        _say(f"compile cache entry {key} was refused by torch ({type(err).__name__}): rebuilding it")
        shutil.rmtree(entry, ignore_errors=True)
        return False
    os.utime(entry / META)  # recently used
    return True


def save(key: str, what: dict) -> Path | None:
    """Write what this process compiled (or found in torch's caches) as entry `key`, atomically, then
    keep the cache within MAX_BYTES. All of the process's artifacts: a round compiled earlier in
    the process (the same graph, reused from memory) compiles nothing new now."""
    packed = torch.compiler.save_cache_artifacts()
    if packed is None:
        return None
    blob = packed[0]
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    tmp = base / f".{key}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / BLOB).write_bytes(blob)
    (tmp / META).write_text(json.dumps({"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob),
                                        "created": time.strftime("%Y-%m-%d %H:%M:%S"), "key": what},
                                       default=str, indent=1) + "\n")
    final = base / key
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    prune(MAX_BYTES)
    return final


def entries() -> list[dict]:
    """Every complete entry, most recently used first: key, bytes, last use."""
    out = []
    for entry in root().glob("*") if root().is_dir() else ():
        if entry.name == INDUCTOR:
            continue
        try:
            meta, used = json.loads((entry / META).read_text()), (entry / META).stat().st_mtime
        except (OSError, ValueError):
            continue
        out.append({"key": entry.name, "bytes": meta.get("bytes", 0), "used": used, "created": meta.get("created")})
    return sorted(out, key=lambda e: -e["used"])


def prune(max_bytes: int) -> None:
    """Drop least recently used entries (and leftovers of interrupted writes) beyond `max_bytes`,
    then torch's cache under ours if it alone would break the bound (it is rebuilt on demand)."""
    total = _bytes(root() / INDUCTOR)
    if total > max_bytes:
        shutil.rmtree(root() / INDUCTOR, ignore_errors=True)
        total = 0
    for e in entries():
        total += e["bytes"]
        if total > max_bytes:
            shutil.rmtree(root() / e["key"], ignore_errors=True)
    for leftover in root().glob(".*"):
        if time.time() - leftover.stat().st_mtime > 3600:
            shutil.rmtree(leftover, ignore_errors=True)


def clear() -> int:
    """Remove every entry and torch's cache under ours; returns how many bytes that freed."""
    freed = _bytes(root())
    shutil.rmtree(root(), ignore_errors=True)
    return freed


def add_parser(subparsers) -> None:
    """`dflow-rt compile-cache list|clear`."""
    p = subparsers.add_parser("compile-cache", help=f"compiled rounds kept on disk ({root()})")
    p.add_argument("action", choices=("list", "clear"))
    p.set_defaults(run=_cmd)


def _cmd(args) -> None:
    if args.action == "clear":
        print(f"removed {root()}: {clear() / 1e6:.1f} MB")
        return
    for e in entries():
        print(f"{e['key']}  {e['bytes'] / 1e6:8.1f} MB  created {e['created']}  last used "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(e['used']))}")
    print(f"{root()}: {_bytes(root()) / 1e6:.1f} MB in all (torch's cache included), bound {MAX_BYTES / 1e6:.0f} MB")


use_for_torch()  # on import, before torch._dynamo's own import fixes torch's cache directory
