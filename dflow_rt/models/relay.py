"""DFlow relay: the verifier's features at rejected positions, reused by the next draft.

After verifying block `[x_s .. x_{s+B-1}]` with `a` drafts accepted, the target's features
at positions `s+a+1 .. s+B-1` were computed but DFlash drops them. The target state at
position p predicts token p+1, so the feature of p belongs to next-round slot
`j = p - s' + 1` (`s' = s + a + 1`): slots 1..B-1-a. Those states were computed behind the
wrong token d (the first rejected draft) rather than the bonus c, so a small MLP over
[E(c), E(d), u] gives a per-channel scale and shift: relay = scale * LayerNorm(u) + shift,
added to the mask embedding of that slot (`relay_input = "mask_embedding"`, the default) or
attended as extra keys/values by the next block (`"kv"`, see `relay_keys`). The MLP's last
projection starts at zero, so a fresh relay changes nothing and a converted DFlash drafter
drafts exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflow_rt.kernels.commit import record_relay


class Relay(nn.Module):
    """Boundary correction MLP; its weights live under `relay.` in DFlow checkpoints."""

    def __init__(self, hidden: int, relay_hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(3 * hidden, relay_hidden)
        self.fc2 = nn.Linear(relay_hidden, 2 * hidden)

    def zero_init(self) -> Relay:
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)
        return self

    def forward(self, u: torch.Tensor, bonus_emb: torch.Tensor, rejected_emb: torch.Tensor) -> torch.Tensor:
        """u [batch, slots, hidden] projected features; *_emb [batch, hidden] -> relay [batch, slots, hidden]."""
        ctx = torch.cat([bonus_emb, rejected_emb], dim=-1)[:, None].expand(-1, u.shape[1], -1)
        scale, shift = self.fc2(F.silu(self.fc1(torch.cat([ctx, u], dim=-1)))).chunk(2, dim=-1)
        return scale * F.layer_norm(u, u.shape[-1:]) + shift


def relay_mask(valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, N*B, 1 + N*B] for the `kv` relay input (N blocks of B slots per row): every query sees
    the null key, and the relayed slots of its own block where `valid` [b, N*B]."""
    idx = torch.arange(valid.shape[1], device=valid.device)
    own = (idx[:, None] // block_size) == (idx[None, :] // block_size)
    seen = own & valid[:, None, :]
    return torch.cat([seen.new_ones(*seen.shape[:2], 1), seen], dim=-1)


def relay_keys(attn: nn.Module, relay: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values and mask of the `kv` relay input for one attention layer.

    Relay vectors [b, N*B, hidden] become keys/values at their slots' positions, attended
    through a softmax of their own behind a zero "null" key (`mask` from `relay_mask`). With a
    fresh relay (zero vectors) every value is zero, so the branch adds exactly nothing: a
    converted DFlash drafter drafts as before, and a block with nothing relayed attends to the
    null key alone.
    """
    k, v = attn.key_value(relay, cos, sin)
    null = k.new_zeros(*k.shape[:2], 1, k.shape[-1])
    return torch.cat([null, k], dim=2), torch.cat([null, v], dim=2), mask


def shift_to_slots(features: torch.Tensor, accepted: torch.Tensor,
                   width: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Move last round's verify features [batch, B, F] so row a+j lands in slot j.

    `accepted` [batch] is a (drafts accepted); `width` [batch] how many block positions that
    verify checked (default all B: a Runtime may verify fewer). Returns (shifted [batch, B, F],
    valid [batch, B]): slot j is valid for 1 <= j <= width-1-a; slot 0 and slots past the
    rejected suffix are not. Static shapes throughout, so the same code serves the eager and
    the compiled round.
    """
    B = features.shape[1]
    slots = torch.arange(B, device=features.device)
    src = (accepted[:, None] + slots).clamp(max=B - 1)
    last = (B if width is None else width[:, None]) - 1 - accepted[:, None]
    valid = (slots >= 1) & (slots <= last)
    shifted = torch.gather(features, 1, src[..., None].expand(-1, -1, features.shape[-1]))
    return shifted, valid


@dataclass
class VerifyRecord:
    """Per-request record of the last verify pass, preallocated once and rewritten in place: the
    DFlow ring buffer of rejected-suffix states, which DFlash rounds read too (for their context).

    Holds the verify features (accepted prefix and rejected suffix alike: the prefix is the
    next draft's new context, the suffix its relay), the accepted count a, the bonus token c,
    the first rejected draft d and the verify width k (B, or fewer when only the first k
    drafted positions were verified). The valid relay count is k - 1 - a: a fresh request is
    recorded as a fully accepted block, which relays nothing.
    """

    features: torch.Tensor  # [batch, B, F]
    accepted: torch.Tensor  # [batch]
    bonus: torch.Tensor  # [batch]
    rejected: torch.Tensor  # [batch]
    width: torch.Tensor  # [batch]

    @classmethod
    def allocate(cls, batch: int, block_size: int, feature_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> VerifyRecord:
        def longs(value: int) -> torch.Tensor:
            return torch.full((batch,), value, dtype=torch.long, device=device)

        return cls(torch.zeros(batch, block_size, feature_dim, dtype=dtype, device=device), longs(block_size - 1),
                   longs(0), longs(0), longs(block_size))

    def view(self, n: int) -> VerifyRecord:
        """The first `n` rows, sharing storage (a batch bucket of the static round)."""
        return VerifyRecord(*(t[:n] for t in self.tensors()))

    def tensors(self) -> list[torch.Tensor]:
        return [self.features, self.accepted, self.bonus, self.rejected, self.width]

    def write(self, rows: torch.Tensor | None, features: torch.Tensor, block: torch.Tensor, verified: torch.Tensor,
              accepted: torch.Tensor) -> None:
        """Record one verify pass of `rows` (None: all): features [b, k, F] and ids [b, k] of the k
        verified block positions (k <= B), accepted [b]. The one relay write: the reference round,
        training and the batched round's `commit_torch` run `kernels.commit.record_relay` (the Triton
        commit kernel repeats it in its launch and is tested against `commit_torch`)."""
        record_relay(self.tensors(), rows, features, block, verified, accepted)

    def clear(self, rows: torch.Tensor) -> None:
        """Nothing to relay for `rows` (a request that has just been prefilled)."""
        self.accepted[rows] = self.features.shape[1] - 1
        self.width[rows] = self.features.shape[1]
