"""`dflow-rt eval-tau` with each draft pass over the drafter's whole block, whatever the verify width.

A Runtime at verify width k drafts only the k verified positions (a cheaper pass); this measures
what drafting the whole block and verifying its first k would accept instead, the other side of
that trade. Arguments are eval-tau's:

    python bench/whole_block_tau.py --target smollm2 --drafter DIR --verify-width 4 --limit 40 \\
        --max-new-tokens 64 --threads 1 --batch 8 --json
"""

from __future__ import annotations

import sys

import torch

from dflow_rt import cli
from dflow_rt.models.drafter import Drafter

_propose = Drafter.propose


def propose_whole_block(self: Drafter, target, block_ids: torch.Tensor, block_pos: torch.Tensor, **kw) -> torch.Tensor:
    """Drafts for the first n positions of `block_ids`, from a pass over all block_size positions
    (the positions past n hold the mask token)."""
    n, size = block_ids.shape[1], self.block_size
    if n == size:
        return _propose(self, target, block_ids, block_pos, **kw)
    full = block_ids.new_full((block_ids.shape[0], size), self.config.mask_token_id)
    full[:, :n] = block_ids
    positions = block_pos[:, :1] + torch.arange(size, device=block_pos.device)
    return _propose(self, target, full, positions, **kw)[:, :n - 1]


if __name__ == "__main__":
    Drafter.propose = propose_whole_block
    sys.exit(cli.main(["eval-tau", *sys.argv[1:]]))
