"""tau on held-out prompts: mean acceptance length per round, counting the bonus token.

Prompts run through `Runtime` (eager mode, several requests per round). Greedy rounds are
token-for-token those of the batch-1 reference round, and sampling draws from a per-prompt
seed with a counter-based RNG, so every drafter sees the same prompts and, at any
temperature, emits the same text: per-prompt differences between drafters are paired.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from dflow_rt.config import RuntimeConfig
from dflow_rt.data.synth import stable_unit
from dflow_rt.engine.runtime import Runtime
from dflow_rt.errors import RequestError
from dflow_rt.models.drafter import relay_off


@dataclass
class TauResult:
    block_size: int
    acceptance: list[list[int]]  # per prompt, tokens per round

    @property
    def per_prompt(self) -> list[float]:
        return [sum(a) / len(a) for a in self.acceptance]

    @property
    def tau(self) -> float:
        """Mean of per-prompt means: every prompt weighs the same however many rounds it took."""
        return mean(self.per_prompt)

    def histogram(self) -> list[int]:
        """Rounds that emitted 1..B tokens."""
        counts = [0] * self.block_size
        for rounds in self.acceptance:
            for n in rounds:
                counts[n - 1] += 1
        return counts

    def position_acceptance(self) -> list[float]:
        """For draft slots 1..B-1: the fraction of rounds that accepted that slot."""
        hist, total = self.histogram(), max(sum(self.histogram()), 1)
        return [sum(hist[k:]) / total for k in range(1, self.block_size)]

    def summary(self) -> dict:
        return {"prompts": len(self.acceptance), "tau": round(self.tau, 4), "tau_se": round(sem(self.per_prompt), 4),
                "rounds": sum(map(len, self.acceptance)), "histogram": self.histogram(),
                "position_acceptance": [round(x, 4) for x in self.position_acceptance()],
                "per_prompt_tau": [round(x, 4) for x in self.per_prompt]}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def sem(xs: list[float]) -> float:
    """Standard error of the mean (sample standard deviation / sqrt n)."""
    if len(xs) < 2:
        return float("nan")
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def prompt_seed(suite: str, index: int) -> int:
    """The sampling seed of prompt `index` of `suite`: the same for every drafter."""
    return int(stable_unit(f"eval:{suite}:{index}") * 2**62)


@torch.inference_mode()
def measure_tau(target, drafter, prompts: list[list[int]], suite: str = "", temperature: float = 0.0,
                max_new_tokens: int = 128, stop_token_ids: tuple[int, ...] = (), batch: int = 8, *,
                verify_width: int | None = None, progress: bool = False) -> TauResult:
    """Decode every prompt and keep each round's acceptance length. `verify_width` k verifies only the
    first k - 1 drafted tokens, as a Runtime at that width does (None: the whole block)."""
    from tqdm import tqdm

    max_len = max(map(len, prompts)) + max_new_tokens + drafter.block_size
    rt = Runtime(target, drafter, RuntimeConfig(max_batch=batch, max_len=max_len, mode="eager",
                                                verify_width=verify_width, tuned=False))
    rids = [rt.add_request(p, max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop_token_ids,
                           seed=prompt_seed(suite, i)) for i, p in enumerate(prompts)]
    quiet = not sys.stderr.isatty()  # a log file gets a line every 30 s, not every round
    with tqdm(total=len(rids), desc=f"tau {suite}".strip(), unit="prompt", disable=not progress, leave=False,
              mininterval=30.0 if quiet else 0.1) as bar:
        while not all(rt.is_finished(r) for r in rids):
            rt.step()
            bar.update(sum(rt.is_finished(r) for r in rids) - bar.n)
    records = [rt.pop(r) for r in rids]
    failed = next((r for r in records if r.error is not None), None)
    if failed is not None:
        raise RequestError(failed.rid, failed.error)
    return TauResult(drafter.block_size, [r.acceptance for r in records])


def heldout_tau(target, drafter, prompts: list[list[int]], max_new_tokens: int,
                stop_ids: list[int] = ()) -> dict[str, float]:
    """Greedy tau (`dflow-rt eval-tau`'s definition) on held-out prompts; for a DFlow drafter also with its
    relay off, the ablation that tells whether the relay helps."""
    out = {}
    for name, off in [("tau", False), ("tau_norelay", True)][:2 if drafter.relay is not None else 1]:
        with relay_off(drafter, off):
            out[name] = measure_tau(target, drafter, prompts, max_new_tokens=max_new_tokens,
                                    stop_token_ids=tuple(stop_ids)).tau
    return out
