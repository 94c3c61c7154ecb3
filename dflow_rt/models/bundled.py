"""The models shipped inside the package (`dflow_rt/assets/`): the defaults of every command."""

from __future__ import annotations

from pathlib import Path

from dflow_rt.errors import InputError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_DRAFTERS = ("dflash", "dflow")


def target_dir(spec: str | None) -> Path:
    """`spec` as a directory, or the bundled target when None."""
    return Path(spec) if spec else ASSETS / "target"


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
