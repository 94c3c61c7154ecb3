"""`dflow-rt eval-tau` with each draft pass over the drafter's whole block, whatever the verify width.

A Runtime at verify width k drafts only the k verified positions (a cheaper pass) unless the drafter's
checkpoint sets `dflash_config.draft_whole_block`; this measures any drafter as if it did, the other
side of that trade, without editing its config. Arguments are eval-tau's:

    python bench/whole_block_tau.py --target smollm2 --drafter DIR --verify-width 4 --limit 40 \\
        --max-new-tokens 64 --threads 1 --batch 8 --json
"""

from __future__ import annotations

import sys
from dataclasses import replace

from dflow_rt import cli
from dflow_rt.models import checkpoint
from dflow_rt.models.drafter import DrafterConfig

_drafter_config = checkpoint.drafter_config


def whole_block_config(cfg: dict, path: object) -> DrafterConfig:
    """The checkpoint's config with `draft_whole_block` set (`Drafter.propose` pads the pass)."""
    return replace(_drafter_config(cfg, path), draft_whole_block=True)


if __name__ == "__main__":
    checkpoint.drafter_config = whole_block_config
    sys.exit(cli.main(["eval-tau", *sys.argv[1:]]))
