"""What a Runtime's rounds are built from: its settings resolved against the models, once.

The round, its compiled forms and the compile cache's key read this one object rather than a
dozen arguments each, so a setting added here reaches all three.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflow_rt.config import RuntimeConfig
from dflow_rt.errors import InputError
from dflow_rt.kernels import Kernels, select_for
from dflow_rt.kernels.attention import cpu_serves_every_pass
from dflow_rt.kernels.sampling import excluded_token


@dataclass(frozen=True)
class RoundPlan:
    mode: str  # eager, compile or cudagraph (RuntimeConfig.mode, resolved)
    compiler: str  # torch.compile's backend for the compiled modes
    freeze: bool  # weights folded into compiled rounds as constants (`runner.compiling`)
    buckets: tuple[int, ...]  # batch buckets: a round runs the first n rows of the state, n a bucket
    lengths: tuple[int, ...]  # length buckets: a round attends over the first `length` cache positions
    static_length: bool  # one length, traced as a constant (`of`); else the length is a symbol
    widths: dict[int, int]  # verify width per batch bucket
    sampling: bool  # rounds in which a row samples are built (RuntimeConfig.sampling); else only greedy ones
    ar_fallback: bool  # each bucket also has rounds at widths 1 (no draft pass) and ceil(k / 2): `round_widths`
    lookup: bool  # with the fallback, each bucket also has a round at k from the host's drafts (`graphs`)
    block_size: int  # B: 1 without a drafter
    filler: int  # block slots 1.. before drafting: the drafter's mask token (0 without a drafter)
    exclude: int | None  # the token no choice may be (`sampling.excluded_token`)
    layer_ids: tuple[int, ...]  # target layers whose features the drafter reads
    kernels: Kernels  # the fused ops (`dflow_rt.kernels`)

    @classmethod
    def of(cls, c: RuntimeConfig, target, drafter) -> RoundPlan:
        """The plan of a checked config whose "auto" fields are resolved (`tuned.resolve`)."""
        block_size = 1 if drafter is None else (c.block_size or drafter.block_size)
        lengths = c.lengths()
        if min(lengths) <= block_size or max(lengths) > c.max_len:  # (batch buckets: limits.check_config)
            raise InputError(f"length_buckets must lie in {block_size + 1}..max_len ({c.max_len}), got {lengths}")
        widths, kernels = c.widths(block_size), select_for(c.kernels, target, drafter)
        static = c.mode == "compile" and c.length_buckets is None and kernels.implementations["attention"] == "cpu" \
            and cpu_serves_every_pass(target, drafter, block_size)
        if static:  # no round's cost depends on the length: one, traced as a constant (`static_length`)
            lengths = (static_length(c.max_len),)
        fallback = c.ar_fallback is True and drafter is not None and max(widths.values()) > 1 \
            and not hasattr(kernels.attention, "plan")  # FlashInfer plans per verify width
        return cls(mode=c.mode, compiler=c.compiler, freeze=c.freeze, buckets=c.buckets(), lengths=lengths,
                   static_length=static,
                   widths=widths, sampling=c.sampling, ar_fallback=fallback, lookup=fallback and c.lookup,
                   block_size=block_size,
                   filler=drafter.config.mask_token_id if drafter is not None else 0,
                   exclude=excluded_token(drafter, c.emit_mask_token),
                   layer_ids=drafter.target_layer_ids if drafter is not None else (),
                   kernels=kernels)

    def graph_settings(self) -> dict:
        """What the compiled rounds depend on beyond the models and their own row count, width and
        variant (which name a graph within an entry), for the compile cache's key: the length where it
        is static, else not the lengths, which the rounds trace as a symbol, so that one entry serves
        every max_len and every set of buckets."""
        return {"mode": self.mode, "block_size": self.block_size, "max_width": self.max_width,
                "filler": self.filler, "exclude": self.exclude, "layer_ids": self.layer_ids,
                "kernels": dict(self.kernels.implementations),
                "length": self.lengths[0] if self.static_length else "symbolic"}

    @property
    def max_width(self) -> int:
        """The widest verify width of any bucket: the verify record's rows a round writes to the
        drafter's context, which no round's committed positions exceed (`batched_round.draft`)."""
        return max(self.widths.values())

    def round_widths(self, bucket: int) -> tuple[int, ...]:
        """The verify widths `bucket` has a round for: its own k, and with the fallback also 1 (a
        plain step) and ceil(k / 2), among which `dflow_rt.engine.policy` chooses per round."""
        k = self.widths[bucket]
        return tuple(sorted({1, (k + 1) // 2, k})) if self.ar_fallback else (k,)

    def graphs(self, variants: tuple[bool, ...]) -> list[tuple[int, bool, int, bool]]:
        """(bucket, greedy, width, lookup) of every round graph, for the greedy `variants` built: each
        bucket's `round_widths` in each variant, and with `lookup` a round at the bucket's k whose
        drafts the host writes (`dflow_rt.engine.lookup`), also in each variant: a looked-up token is a
        point-mass draft like the drafter's argmax, which the sampled verify accepts losslessly."""
        drafted = [(n, g, k, False) for n in self.buckets for g in variants for k in self.round_widths(n)]
        return drafted + [(n, g, self.widths[n], True) for n in self.buckets for g in variants if self.lookup]


def static_length(max_len: int) -> int:
    """The one length of a static plan: max_len rounded up to a power of two, at least 512. Rounds
    over the C++ attention cost the same at any cache length (a row reads up to its own position),
    and a symbolic length cost a SmolLM2 step on CPU 6 % (docs/experiments.md); rounding keeps the
    graphs of requests sized one by one (`generate`: prompt + new tokens + block) to a few sizes."""
    return max(512, 1 << (max_len - 1).bit_length())
