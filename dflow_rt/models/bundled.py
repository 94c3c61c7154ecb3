"""The models shipped inside the package (`dflow_rt/assets/`): the defaults of every command."""

from __future__ import annotations

from pathlib import Path

import torch

from dflow_rt.errors import InputError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_DRAFTERS = ("dflash", "dflow")


def target_dir(spec: str | None) -> Path:
    """The bundled target when None; a fetched model's cache directory for a name `dflow-rt fetch-model`
    knows (e.g. 'smollm2'); otherwise `spec` as a directory."""
    from dflow_rt.models.fetch import REGISTRY, manifest, model_dir

    if not spec:
        return ASSETS / "target"
    if spec in REGISTRY:
        path = model_dir(spec)
        if manifest(path) is None:  # first use: fetched once (pip's progress bar), as `dflow-rt fetch-model` does
            from dflow_rt.models.fetch import fetch_model

            fetch_model(spec)
        return path
    return Path(spec)


def drafter_dir(spec: str | None, target: str | None = None) -> Path | None:
    """'dflash' / 'dflow' name the bundled drafter of that kind trained for `target` (the bundled target
    when None; a fetched target by its name, e.g. 'smollm2', or by any directory `fetch-model` wrote);
    anything else is a directory; None stays None."""
    from dflow_rt.models.fetch import fetched_name

    if spec is None:
        return None
    if spec in BUNDLED_DRAFTERS:
        if target and Path(target).resolve() == (ASSETS / "target").resolve():
            target = None  # the bundled target named by its directory
        elif target and target not in bundled_targets():
            target = fetched_name(target) or target  # a fetched model is known by what it is, not where
        if target and target not in bundled_targets():
            raise InputError(f"no bundled {spec} drafter for --target {target} (bundled for: the default target, "
                             f"{', '.join(bundled_targets())}): pass a drafter directory")
        path = ASSETS / target / spec if target else ASSETS / spec
        if not (path / "config.json").exists():
            raise InputError(f"the bundled {spec} drafter is missing from {path.parent} (a broken install?)")
        return path
    return Path(spec)


def bundled_targets() -> tuple[str, ...]:
    """Fetched targets (`dflow-rt fetch-model` names) that the package carries drafters for."""
    from dflow_rt.models.fetch import REGISTRY

    return tuple(name for name in REGISTRY if (ASSETS / name).is_dir())


def pick_device(device: str | None) -> str:
    """`device`, by default CUDA when there is one; InputError for CUDA on a machine without it."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available on this machine")
    return device


def load_models(target: str | None, drafter: str | None, device: str | None = None, threads: int | None = None,
                need_tokenizer: bool = True, dtype: str | None = None):
    """(target, drafter or None, tokenizer) by name or directory: the one place commands load models.

    No `target` means the bundled one; `drafter` None or "none" means no drafter; `device` None
    picks CUDA when there is one; `threads` as `set_threads`; `dtype` ("float32",
    "bfloat16") None means the device's default. Without `need_tokenizer`, a directory with no
    tokenizer (random benchmark models) gives None for it.
    """
    import torch

    from dflow_rt.models.checkpoint import load_drafter, load_target
    from dflow_rt.tokenizer import load_tokenizer

    device = pick_device(device)
    path = target_dir(target)
    model = load_target(path, dtype=getattr(torch, dtype) if dtype else None, device=device)
    set_threads(threads, model)
    spec = None if drafter in (None, "none") else drafter_dir(drafter, target)
    has_tokenizer = need_tokenizer or (path / "tokenizer.json").exists()
    return model, load_drafter(spec, model) if spec else None, load_tokenizer(path) if has_tokenizer else None


SMALL_TARGET = 50_000_000  # parameters: below, decoding on CPU keeps to one thread


def set_threads(threads: int | None, target) -> None:
    """`threads`, or by default 1 for a small target on CPU: its ops are too small to gain from
    splitting, and with a second thread every op waits for the slower core (decoding the bundled
    model drops from ~60 to ~2 tokens/s when another job holds one of two cores)."""
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise InputError(f"--threads must be an int of at least 1, got {threads!r}")
    if threads:
        torch.set_num_threads(threads)
    elif target.lm_head.weight.device.type == "cpu" and sum(p.numel() for p in target.parameters()) < SMALL_TARGET:
        torch.set_num_threads(1)
