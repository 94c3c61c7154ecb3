"""Compiled rounds kept on disk, so that a second start of a compiled Runtime takes seconds.

Each graph of a Runtime (one per row count, verify width and variant) is compiled ahead of time
(`compat.aot_compile`) into one file: dynamo's bytecode and guards with inductor's code.
Loading a file skips dynamo's trace, which a cache of inductor's output alone (torch's FX graph and
AOTAutograd caches) still pays at every start: about ten seconds a graph for SmolLM2 on two cores.
An entry is a directory keyed by everything the compiled code depends on (the models'
configurations and dtypes, the round's settings, the device and its instruction set, torch and
our own graph code), holding its graphs and a checksum of each: a file that does not match its
checksum, that torch refuses, or whose guards reject this Runtime's state is deleted and rebuilt,
never trusted. Graphs are written one by one as they compile, so an interrupted first start keeps
what it finished. Weights are inputs of the compiled graphs, not constants (`runner.compiling`), so
the code does not depend on their values and one entry serves every checkpoint of a shape.

Entries live under `$DFLOW_RT_CACHE/compiled/` (`dflow_rt.paths.cache_root`). Unless the process
chose its own (`TORCHINDUCTOR_CACHE_DIR`), torch's cache goes there too (`compiled/inductor/`):
it holds the compiled C++ and Triton kernels, which the graph files name but do not carry (without
it a load builds them again, minutes on CPU), and unlike torch's default under /tmp it survives a
reboot. All of it is kept within `MAX_BYTES` (least recently used entries go first, then torch's
cache as a whole); `dflow-rt compile-cache list|clear` shows and empties it. Only on a torch that
`dflow_rt.compat` knows: elsewhere compiled rounds are not kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

from dflow_rt import compat
from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.models import exact_codes

MAX_BYTES = int(os.environ.get("DFLOW_RT_COMPILE_CACHE_BYTES", 2 * 1024**3))
GRAPH, META, INDUCTOR = ".graph", "entry.json", "inductor"
SOURCES = ("graphs", "models", "kernels", "compat.py")  # the code the compiled rounds trace, and how it compiles


def root() -> Path:
    from dflow_rt.paths import cache_root

    return cache_root() / "compiled"


def _code_digest() -> str:
    """Our traced source and how it is compiled (`dflow_rt.compat`'s settings): a change to the round,
    the models or those is a new key (this file, which only stores what they compile to, is not part
    of it)."""
    pkg, h = Path(__file__).resolve().parent.parent, hashlib.sha256()
    for name in SOURCES:
        path = pkg / name
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            if f == Path(__file__).resolve():
                continue
            h.update(f.relative_to(pkg).as_posix().encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _model_key(model) -> dict | None:
    if model is None:
        return None
    w = next(model.parameters())
    config = asdict(model.config) if is_dataclass(model.config) else repr(model.config)
    vocab = getattr(model, "vocab_ids", None)
    kinds = exact_codes.graph_key(model)  # a product over codes is another op in the graph
    return {"class": type(model).__name__, "config": config, "dtype": str(w.dtype),
            "draft_vocab": None if vocab is None else len(vocab),
            "exact_codes": hashlib.sha256(kinds.encode()).hexdigest()[:16]}


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
            "cpu_gemv": cpu and cpu_ops.enabled(), "code": _code_digest()}
    blob = json.dumps(what, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24], what


def _say(message: str) -> None:
    print(f"dflow-rt: {message}", file=sys.stderr, flush=True)


def use_for_torch() -> None:
    """torch's inductor cache under ours, unless this process already has one (set or in use)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root() / INDUCTOR))


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


class Entry:
    """One entry's graphs: `load` them by name, `save` the ones compiled here. `loaded` and `saved`
    count them, so that the Runtime can say whether it started from the cache."""

    def __init__(self, key: str, what: dict) -> None:
        self.key, self.what, self.dir = key, what, root() / key
        self.loaded = self.saved = 0

    def _meta(self) -> dict | None:
        try:
            meta = json.loads((self.dir / META).read_text())
            return meta if isinstance(meta.get("graphs"), dict) else None
        except (OSError, ValueError, AttributeError):
            return None

    def _drop(self, name: str, why: str) -> None:
        _say(f"compile cache entry {self.key}: graph {name} {why}: rebuilding it")
        (self.dir / (name + GRAPH)).unlink(missing_ok=True)

    def load(self, name: str, external: dict) -> Callable | None:
        """Graph `name` (its modules given as `external`, by the names they were saved with), or None
        when the entry lacks it or it is bad (then it is deleted)."""
        if not self.dir.exists():
            return None
        meta = self._meta()
        if meta is None:
            _say(f"compile cache entry {self.key} is unreadable: rebuilding it")
            shutil.rmtree(self.dir, ignore_errors=True)
            return None
        if name not in meta["graphs"]:
            return None
        try:
            blob = (self.dir / (name + GRAPH)).read_bytes()
        except OSError:
            self._drop(name, "is missing")
            return None
        if hashlib.sha256(blob).hexdigest() != meta["graphs"][name].get("sha256"):
            self._drop(name, "does not match its checksum")
            return None
        try:
            fn = compat.deserialize(blob, external)
        except Exception as err:  # noqa: BLE001  (torch refused the bytes: whatever the reason, rebuild)
            self._drop(name, f"was refused by torch ({type(err).__name__}: {str(err)[:200]})")
            return None
        os.utime(self.dir / META)  # recently used
        self.loaded += 1
        return fn

    def reject(self, name: str, why: str) -> None:
        """Graph `name` loaded but does not serve this Runtime (`why`): deleted, to be rebuilt."""
        self.loaded -= 1
        self._drop(name, why)

    def save(self, name: str, fn, external: dict) -> None:
        """Write graph `name` (an `aot_compile` result), then list it with its checksum; each file is
        written whole or not at all. Two processes filling one entry at once may list only one
        writer's graphs: the others are compiled again later, never trusted unlisted."""
        self.dir.mkdir(parents=True, exist_ok=True)
        blob = compat.serialize(fn, external)
        _write(self.dir / (name + GRAPH), blob)
        meta = self._meta() or {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "key": self.what, "graphs": {}}
        meta["graphs"][name] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
        _write(self.dir / META, (json.dumps(meta, default=str, indent=1) + "\n").encode())
        self.saved += 1
        prune(MAX_BYTES)


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def entries() -> list[dict]:
    """Every entry, most recently used first: key, bytes, last use, graphs (None: an older format,
    which no Runtime reads), readable (False: no readable entry.json, as a process stopped between
    writing its first graph and listing it leaves)."""
    out = []
    for entry in root().glob("*") if root().is_dir() else ():
        if entry.name == INDUCTOR or entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            meta, used = json.loads((entry / META).read_text()), (entry / META).stat().st_mtime
        except (OSError, ValueError):
            meta, used = None, entry.stat().st_mtime
        graphs = meta.get("graphs") if isinstance(meta, dict) else None
        out.append({"key": entry.name, "bytes": _bytes(entry), "used": used, "readable": meta is not None,
                    "created": meta.get("created") if isinstance(meta, dict) else None,
                    "graphs": len(graphs) if isinstance(graphs, dict) else None})
    return sorted(out, key=lambda e: -e["used"])


def prune(max_bytes: int) -> None:
    """Drop least recently used entries (and leftovers of interrupted writes) beyond `max_bytes`,
    entries of an older format, and unreadable ones left for an hour (a younger one may be another
    process's first graph being listed); then torch's cache under ours if it alone would break the
    bound (it is rebuilt on demand)."""
    total = _bytes(root() / INDUCTOR)
    if total > max_bytes:
        shutil.rmtree(root() / INDUCTOR, ignore_errors=True)
        total = 0
    for e in entries():
        stale = e["graphs"] is None and (e["readable"] or time.time() - e["used"] > 3600)
        if stale or total + e["bytes"] > max_bytes:
            shutil.rmtree(root() / e["key"], ignore_errors=True)
        else:
            total += e["bytes"]
    leftovers = [*root().glob(".*"), *(p for p in root().glob("*/.*") if p.parent.name != INDUCTOR)]
    for leftover in leftovers:
        if time.time() - leftover.stat().st_mtime > 3600:
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)


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
        graphs = f"{e['graphs']:2d} graphs" if e["graphs"] is not None else "older format" if e["readable"] \
            else "unreadable"
        print(f"{e['key']}  {graphs} {e['bytes'] / 1e6:8.1f} MB  created {e['created']}  last used "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(e['used']))}")
    print(f"{root()}: {_bytes(root()) / 1e6:.1f} MB in all (torch's cache included), bound {MAX_BYTES / 1e6:.0f} MB")


use_for_torch()  # on import, before torch._dynamo's own import fixes torch's cache directory
