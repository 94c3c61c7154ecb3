"""The models shipped inside the package (`dflow_rt/assets/`): the defaults of every command."""

from __future__ import annotations

from pathlib import Path

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
        if manifest(path) is None:
            raise InputError(f"the {spec} target is not in {path.parent}: run `dflow-rt fetch-model {spec}` "
                             f"first (or pass its directory to --target)")
        return path
    return Path(spec)


def drafter_dir(spec: str | None) -> Path | None:
    """'dflash' / 'dflow' name a bundled drafter; anything else is a directory; None stays None."""
    if spec is None:
        return None
    if spec in BUNDLED_DRAFTERS:
        path = ASSETS / spec
        if not (path / "config.json").exists():
            raise InputError(f"the bundled {spec} drafter is missing from {ASSETS} (a broken install?)")
        return path
    return Path(spec)
