"""The search behind `dflow-rt autotune`: which runtime knobs decode fastest on this machine, losslessly.

Coordinate descent: one axis at a time (mode, dtype, verify width per batch bucket, threads,
length-bucket spacing, kernels), every candidate differing from the incumbent on that axis only.
A candidate is first decoded once on every prompt group (its warm-up) and must emit exactly the
reference tokens: the untuned default's in the default dtype, the target's own greedy decoding in
any other (another dtype's target legitimately decodes other tokens). It is then decoded in turn
with the incumbent (A B, B A, ...: drift in a shared machine's load reaches both alike) and judged
on the median of the paired tokens/s ratios; it wins only by more than their spread. The search's
winner must beat the untuned default the same way in a last head-to-head, or the default is kept.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from dflow_rt.config import DTYPES, RuntimeConfig
from dflow_rt.engine.runtime import Runtime
from dflow_rt.engine.settings import apply_tuned
from dflow_rt.engine.tuned import TunedConfig
from dflow_rt.errors import InputError

MIN_NOISE = 0.02  # paired ratios within 2 % are noise on any machine we measured: a win must clear it
Timer = Callable[[TunedConfig, int, Callable[[], int]], tuple[int, float]]  # (point, rows, step) -> (tokens, s)
Loader = Callable[[str], tuple]  # dtype -> (target, drafter or None)


def wall_timer(point: TunedConfig, rows: int, run: Callable[[], int]) -> tuple[int, float]:
    """Wall time of one step (`run`); a step copies its tokens to the host, so the device is done by then."""
    t = time.perf_counter()
    tokens = run()
    return tokens, time.perf_counter() - t


@dataclass(frozen=True)
class Axis:
    """One knob (a TunedConfig field) and the values to try, or knobs tried jointly ("mode+dtype",
    tuple values). A per-bucket axis (the verify width) is chosen per batch bucket: each candidate
    runtime gives every bucket another value, so all values are tried in as many runtimes (compiles)
    as there are values."""

    name: str
    values: tuple
    per_bucket: bool = False

    def candidates(self, incumbent: TunedConfig, batches: Sequence[int]) -> list[TunedConfig]:
        if self.per_bucket:
            points = [dataclasses.replace(incumbent, **{self.name: tuple(
                (n, self.values[(j + i) % len(self.values)]) for i, n in enumerate(batches))})
                for j in range(len(self.values))]
        else:
            names = self.name.split("+")
            points = [dataclasses.replace(incumbent, **dict(zip(names, v if len(names) > 1 else (v,), strict=True)))
                      for v in self.values]
        return [p for p in dict.fromkeys(points) if p != incumbent]

    def value(self, point: TunedConfig) -> object:
        values = tuple(getattr(point, n) for n in self.name.split("+"))
        return values if len(values) > 1 else values[0]


@dataclass
class Paired:
    """tokens/s of two runtimes on the same prompts, measured in turn."""

    a: list[float] = field(default_factory=list)
    b: list[float] = field(default_factory=list)

    def ratios(self) -> list[float]:
        return [y / x for x, y in zip(self.a, self.b, strict=True)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios())

    @property
    def noise(self) -> float:
        """Robust spread of one ratio (1.4826 x its median absolute deviation), at least MIN_NOISE."""
        r, m = self.ratios(), self.ratio
        return max(MIN_NOISE, 1.4826 * statistics.median(abs(x - m) for x in r))

    def summary(self) -> dict:
        return {"a_tokens_per_s": round(statistics.median(self.a), 2),
                "b_tokens_per_s": round(statistics.median(self.b), 2),
                "ratio": round(self.ratio, 4), "noise": round(self.noise, 4)}


def gain(paired: dict[int, Paired]) -> float:
    """b's speed over a's across batch buckets: the geometric mean of the ratios."""
    return math.exp(statistics.fmean(math.log(p.ratio) for p in paired.values()))


def beats(paired: dict[int, Paired]) -> bool:
    """b is faster than a: slower at no batch bucket, and faster overall by more than the noise."""
    return min(p.ratio for p in paired.values()) > 1 and gain(paired) > 1 + statistics.fmean(
        p.noise for p in paired.values())


@dataclass(frozen=True)
class Measure:
    """How the search measures: `max_new` tokens per prompt in a `max_len` Runtime, `repeats` paired
    decodes per comparison, and after `budget_s` seconds (None: never) only the last axis."""

    max_new: int = 64
    repeats: int = 5
    max_len: int = 512
    budget_s: float | None = None


class Lossy(Exception):
    """A decode emitted other tokens than the reference."""


@dataclass
class Result:
    default: TunedConfig
    tuned: TunedConfig  # the default itself when nothing beat it
    final: dict[int, Paired]  # default (a) against the search's winner (b), per batch bucket
    kept_default: bool
    trials: list[dict]
    seconds: float

    def record(self, block_size: int) -> dict:
        """The tuned knobs of one dtype as the tuned file stores them (what `configs.load_tuned` reads)."""
        t = self.tuned
        widths = dict(t.verify_width)
        knobs: dict = {"mode": t.mode, "threads": t.threads, "length_step": t.length_step}
        if t.kernels is not None:
            knobs["kernels"] = t.kernels
        knobs["buckets"] = {str(n): {
            "verify_width": widths.get(n, block_size) if block_size > 1 else None,
            "default_tokens_per_s": round(statistics.median(p.a), 2),
            "tuned_tokens_per_s": round(statistics.median(p.a if self.kept_default else p.b), 2),
            "speedup": 1.0 if self.kept_default else round(p.ratio, 4), "noise": round(p.noise, 4)}
            for n, p in self.final.items()}
        return knobs


class Tuner:
    """Coordinate descent over `axes` from `default` on `prompts`, at every batch size of `batches`.

    `load(dtype)` gives the (target, drafter or None) pair in that dtype. A decode runs `measure.max_new`
    tokens per prompt, its first step (admission, prefill, first round) untimed. Each comparison
    takes `measure.repeats` paired decodes per batch bucket, cycling through the prompt groups. Once
    `measure.budget_s` seconds have passed, candidates are skipped, except on the last axis: quick mode
    puts the mode there, whose compiles are worth more than any other axis.
    """

    def __init__(self, load: Loader, prompts: list[list[int]], batches: Sequence[int], default: TunedConfig,
                 axes: Sequence[Axis], measure: Measure = Measure(), *, timer: Timer = wall_timer,
                 progress: bool = True):
        self.load, self.prompts, self.batches = load, prompts, tuple(sorted(batches))
        self.default, self.axes, self.measure = default, list(axes), measure
        self.timer, self.progress = timer, progress
        drafter = load(default.dtype)[1]
        self.block_size = drafter.block_size if drafter is not None else 1
        self.runtimes: dict[tuple[TunedConfig, bool], Runtime] = {}
        self.references: dict[str, dict[tuple[int, int], list[list[int]]]] = {}
        self.trials: list[dict] = []
        # every candidate's Runtime compiles the same round function: each counts its own graphs against its
        # own limit (`compat.compile_function`), so no global limit is raised here

    def runtime(self, point: TunedConfig, ar: bool = False) -> Runtime:
        """The Runtime of `point` (autoregressive, without the drafter, for `ar`), built once."""
        if (point, ar) not in self.runtimes:
            target, drafter = self.load(point.dtype)
            torch.set_num_threads(point.threads)  # compiled kernels keep the thread count they were built with
            base = RuntimeConfig(max_batch=max(self.batches), max_len=self.measure.max_len,
                                 batch_buckets=self.batches, tuned=False, ar_fallback=False)
            config = apply_tuned(base, point, self.block_size)
            self.runtimes[point, ar] = Runtime(target, None if ar else drafter, config)
        return self.runtimes[point, ar]

    def groups(self, n: int) -> list[list[list[int]]]:
        """The prompts in groups of `n` rows (cycled when there are fewer than n)."""
        P = self.prompts
        return [[P[(g * n + i) % len(P)] for i in range(n)] for g in range(max(1, len(P) // n))]

    def decode(self, point: TunedConfig, group: list[list[int]], ar: bool = False) -> tuple[list[list[int]], float]:
        """(tokens per prompt, decode tokens/s) of one batch of `group`. Decode tokens/s: the tokens after
        the first step over (steps x the median step time); one preempted step on a shared machine
        moves a sum, not a median."""
        rt = self.runtime(point, ar)
        torch.set_num_threads(point.threads)
        rids = [rt.add_request(p, max_new_tokens=self.measure.max_new) for p in group]
        rt.step()  # admission, prefill and the first round: the warm-up step, not timed
        count, times = 0, []
        while not all(rt.is_finished(r) for r in rids):
            tokens, seconds = self.timer(point, len(group), lambda: sum(len(t) for t in rt.step().values()))
            count, times = count + tokens, times + [seconds]
        if count == 0:
            raise InputError(f"max_new_tokens {self.measure.max_new} is too few: the untimed first step emitted "
                             f"them all")
        return [rt.pop(r).emitted for r in rids], count / (len(times) * statistics.median(times))

    def reference(self, dtype: str) -> dict[tuple[int, int], list[list[int]]]:
        """Tokens every candidate in `dtype` must emit, per (batch bucket, group)."""
        if dtype not in self.references:
            other = dtype != self.default.dtype
            point = TunedConfig(dtype, self.default.threads) if other else self.default
            self.references[dtype] = {(n, g): self.decode(point, group, ar=other)[0]
                                      for n in self.batches for g, group in enumerate(self.groups(n))}
        return self.references[dtype]

    def checked(self, point: TunedConfig, n: int, g: int) -> float:
        tokens, tps = self.decode(point, self.groups(n)[g])
        if tokens != self.reference(point.dtype)[n, g]:
            raise Lossy(f"batch {n}, prompt group {g}")
        return tps

    def compare(self, a: TunedConfig, b: TunedConfig) -> dict[int, Paired]:
        """Paired tokens/s of a and b per batch bucket; b is first decoded once on every group, untimed.
        A b at under half a's speed at every bucket after two repeats is not measured further."""
        for n in self.batches:
            for g in range(len(self.groups(n))):
                self.checked(b, n, g)
        paired = {n: Paired() for n in self.batches}
        for rep in range(self.measure.repeats):
            for n in self.batches:
                g = rep % len(self.groups(n))
                order = ((a, paired[n].a), (b, paired[n].b))
                for point, sink in order if rep % 2 == 0 else order[::-1]:
                    sink.append(self.checked(point, n, g))
            if rep >= 1 and max(p.ratio for p in paired.values()) < 0.5:
                break
        return paired

    def search(self) -> Result:
        start = time.monotonic()
        self.reference(self.default.dtype)
        best = self.default
        with tqdm(total=1, desc="autotune", unit="trial", disable=not self.progress) as bar:
            for index, axis in enumerate(self.axes):
                measured, candidates = [], axis.candidates(best, self.batches)
                bar.total += len(candidates)
                for cand in candidates:
                    record = {"axis": axis.name, "knobs": cand.knobs()}
                    bar.set_postfix_str(f"{axis.name}={axis.value(cand)}")
                    late = self.measure.budget_s is not None and time.monotonic() - start > self.measure.budget_s
                    if late and index < len(self.axes) - 1:
                        record["status"] = "skipped: over the time budget"
                    else:
                        t = time.monotonic()
                        try:
                            paired = self.compare(best, cand)
                            record |= {"status": "measured", "buckets": {n: p.summary() for n, p in paired.items()}}
                            measured.append((cand, paired))
                        except Lossy as err:
                            record["status"] = f"lossy: other tokens than the reference at {err}"
                        except Exception as err:  # a candidate that cannot build or run (a compiler error) loses
                            record["status"] = f"failed: {type(err).__name__}: {str(err)[:200]}"
                        record["seconds"] = round(time.monotonic() - t, 1)
                    self.trials.append(record)
                    bar.update()
                best = self.choose(axis, best, measured)
                self.drop(keep={self.default, best})
            final = self.compare(self.default, best)
            bar.update()
        kept = best == self.default or not beats(final)
        return Result(self.default, self.default if kept else best, final, kept, self.trials,
                      round(time.monotonic() - start, 1))

    def choose(self, axis: Axis, best: TunedConfig, measured: list[tuple[TunedConfig, dict[int, Paired]]]
               ) -> TunedConfig:
        """The axis' winner: per bucket for a per-bucket axis, else the candidate that beats the
        incumbent; the highest gain less its noise wins (a noisy high ratio is no proof); the
        incumbent when none beats it."""
        if axis.per_bucket:
            current = dict(getattr(best, axis.name))
            for n in self.batches:
                wins = [(p[n].ratio - p[n].noise, dict(getattr(c, axis.name))[n]) for c, p in measured
                        if p[n].ratio > 1 + p[n].noise]
                if wins:
                    current[n] = max(wins)[1]
            if current == dict(getattr(best, axis.name)):
                return best
            chosen = tuple((n, current.get(n, self.block_size)) for n in self.batches)
            return dataclasses.replace(best, **{axis.name: chosen})
        wins = [(gain(p) - statistics.fmean(q.noise for q in p.values()), c) for c, p in measured if beats(p)]
        return max(wins, key=lambda w: w[0])[1] if wins else best

    def drop(self, keep: set[TunedConfig]) -> None:
        """Forget the runtimes of losing candidates (their caches; compiled graphs stay with dynamo)."""
        self.runtimes = {k: rt for k, rt in self.runtimes.items() if k[0] in keep or k[1]}
        gc.collect()


def default_axes(quick: bool, cuda: bool, default: TunedConfig, block_size: int, cores: int) -> list[Axis]:
    """The axes to search, in order. Quick mode screens every axis in eager mode (cheap builds) and tries
    the compiled modes last on the screened knobs, jointly with the dtype: a compiled round may round
    differently (inductor fuses bf16 ops in float32), so a dtype lossless in eager may not be compiled.
    The full search settles the mode first, so every later axis is measured as it will run (one
    compile per candidate)."""
    dtypes = tuple(dict.fromkeys((default.dtype, *DTYPES)))
    axes = [Axis("dtype", dtypes)]
    widths = tuple(k for k in ((8, 4) if quick else (12, 8, 6, 4, 2)) if k < block_size)
    if widths:
        axes.append(Axis("verify_width", widths, per_bucket=True))
    if not cuda:  # on a GPU the host threads only launch kernels
        axes.append(Axis("threads", tuple(sorted({1, max(1, cores // 2), cores}))))
    axes.append(Axis("length_step", (128,) if quick else (32, 128, 256)))
    if cuda:
        axes.append(Axis("kernels", ("torch", "triton")))
    compiled = ("compile", "cudagraph") if cuda else ("compile",)
    if quick:
        return axes + [Axis("mode+dtype", tuple((m, d) for m in compiled for d in dtypes))]
    return [Axis("mode", ("eager", *compiled))] + axes
