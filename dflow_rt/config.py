"""Runtime settings."""

from __future__ import annotations

from dataclasses import dataclass

from dflow_rt.checks import check_int
from dflow_rt.errors import InputError

MODES = ("eager", "compile", "cudagraph")  # how the rounds run: RuntimeConfig.mode
DTYPES = ("float32", "bfloat16")  # the model dtypes commands, autotune and fetch-model offer
AUTO = "auto"  # a field the Runtime chooses at start: the autotune file's knob, else DEVICE_DEFAULTS

# What "auto" becomes where no autotune entry exists for the models on this device, per device class
# (device type, weight dtype; None = any dtype). Figures behind each choice: docs/RESULTS.md, "Defaults".
DEVICE_DEFAULTS: dict[tuple[str, str | None], dict] = {
    ("cpu", "float32"): {"mode": "compile", "verify_width": 4, "ar_fallback": True},
    ("cpu", "bfloat16"): {"mode": "compile", "verify_width": 4, "ar_fallback": True},
    ("cuda", None): {"mode": "cudagraph", "verify_width": None, "ar_fallback": False},
}


@dataclass(frozen=True)
class RuntimeConfig:
    """Static sizes of a Runtime: everything is preallocated for `max_batch` x `max_len`.

    mode: how the rounds run: `eager` (plain torch), `compile` (torch.compile, fullgraph, fixed
    shapes), `cudagraph` (compiled and captured as CUDA graphs; CUDA only), or `auto`: what
    `dflow-rt autotune` chose for these models on this device, else DEVICE_DEFAULTS (compile on
    CPU, cudagraph on CUDA). Compiled rounds are kept on disk (`compile_cache`).
    batch_buckets: batch sizes the round is built for (default: powers of two up to
    max_batch); a step runs the smallest bucket that covers the live rows.
    verify_width: how many of the B drafted positions the target verifies, per batch bucket
    (see `widths`); any width is lossless, and fewer positions make verify cheaper where its
    cost grows with the width (CPU), at the price of shorter acceptances. None: all B; `auto`:
    the autotune file's widths, else DEVICE_DEFAULTS (a few positions on CPU, all on CUDA).
    length_buckets: cache lengths the round is built for; a step attends over the smallest
    one that covers every live request's next block, so attention costs what the live
    requests need, not max_len. Default: every multiple of 64 from 128 up to max_len, or
    powers of two from 128 for `cudagraph`, where each bucket is a captured graph (the
    compiled round traces the length as a symbol, so there many buckets cost nothing). A
    compiled float32 Runtime on CPU whose attention is the C++ kernel (which reads each row's
    keys up to its own position at any length) takes one length by default instead, max_len
    rounded up to a power of two (at least 512), traced as a constant: 6 % off a SmolLM2 step.
    kernels: which implementation serves each op of the round (`dflow_rt.kernels`: attention,
    sample, commit, and linear, the models' products): "auto" (FlashInfer attention and Triton on
    CUDA where they import; on CPU the C++ attention and products, plain torch for the rest),
    "torch", "triton", "flashinfer" (attention only) or "cpu" (attention and linear) for every op it
    serves, or a dict op -> implementation; resolved once at construction.
    tuned: fill the `auto` fields (and kernels "auto", default length buckets) from what
    `dflow-rt autotune` chose for these models on this device, when it wrote any (`dflow_rt.engine.tuned`;
    the file used is logged); False: DEVICE_DEFAULTS only. Explicit settings always win.
    emit_mask_token: by default the target never chooses the drafter's mask token (it is no text,
    and a block would read it as a hole); True lets it, as the public DFlash implementation does,
    which matters only where the mask token is an ordinary vocabulary entry (tiny test models).
    freeze: inductor folds the weights into the compiled rounds as constants (prepacked; on CPU each
    product also autotunes inductor's C++ GEMM templates, which stream batch-1 weights about twice as
    fast as the GEMM library); torch's caches cannot keep such rounds, so every Runtime compiles
    afresh, for minutes (see `graphs.runner.compiling` and the figures in docs/RESULTS.md).
    ar_fallback: each round runs the verify width that decodes the most tokens per second, as timed
    on the running rounds, among verify_width's k, ceil(k / 2) and 1, the target stepping alone
    without the draft pass (`dflow_rt.engine.policy`); drafting is retried at growing intervals while
    plain steps win. Lossless either way; the plain steps are counted apart from the drafted rounds'
    acceptance. `auto`: DEVICE_DEFAULTS (on
    for CPU) where verify_width is `auto` too, else off (a width given is a width kept). Never with
    FlashInfer attention, whose host-side plan is made per verify width.
    lookup: with ar_fallback, where a row's last 3 tokens occurred before in its prompt or output, a
    round may verify what followed them then (`dflow_rt.engine.lookup`): no draft pass, a round at k, run
    while such rounds decode faster than the width the fallback chose (`RoundPolicy.lookup`); one
    graph more per batch bucket and round variant (greedy, sampled).
    keep_timings: with ar_fallback, what the fallback learned (round times and tokens per width, lookup
    rounds' rate) is kept on disk per machine, models and settings (`dflow_rt.engine.policy.TimingsFile`),
    so that a later Runtime starts at the width that won rather than learning it again: a process
    answering one short request otherwise spends most of its rounds learning. False: start afresh.
    compile_cache: `compile` and `cudagraph` rounds are kept on disk (`dflow_rt.graphs.compile_cache`)
    and a later Runtime of the same shapes starts from them in seconds; False compiles afresh.
    eager_start: where the disk cache holds no compiled rounds for this Runtime yet, start at once on
    eager rounds (as lossless, slower) instead of compiling for minutes, and switch to the compiled
    rounds between requests once they are on disk (`Runtime.compile_rounds`; the commands build
    them in a background process). Default False: a library caller gets compiled rounds or waits.
    sampling: False builds only the rounds in which no request samples (greedy), half the graphs
    a compiled Runtime compiles on its first start; `add_request` then refuses a temperature above 0.
    prefill_chunk: the most prompt tokens one `step()` prefills (a per-step token budget): a longer
    prompt, or several, is prefilled over the following steps in chunks of what the budget leaves,
    while the rows already decoding run their round every step, so a newcomer stalls the running
    streams for one chunk, not one prompt. None (the default): each admitted prompt whole, in the
    step that admits it (fastest to a first token where nothing else runs). Lossless either way.
    memory_limit: construction refuses a state (KV caches, verify record, rotary tables) larger
    than this many bytes, before allocating anything; by default, larger than the free memory
    of the models' device (`dflow_rt.engine.limits`, which also checks every field's type and range).
    """

    max_batch: int = 8
    max_len: int = 4096
    mode: str = AUTO
    block_size: int | None = None
    batch_buckets: tuple[int, ...] | None = None
    length_buckets: tuple[int, ...] | None = None
    compiler: str = "inductor"  # torch.compile's backend; tests use "aot_eager" to check tracing fast
    verify_width: int | dict[int, int] | str | None = AUTO
    emit_mask_token: bool = False
    tuned: bool = True
    memory_limit: int | None = None  # bytes the preallocated state may take; None = the device's free memory
    kernels: str | dict[str, str] = "auto"
    compile_cache: bool = True
    eager_start: bool = False
    keep_timings: bool = True
    freeze: bool = False
    ar_fallback: bool | str = AUTO
    lookup: bool = True
    sampling: bool = True
    prefill_chunk: int | None = None

    def widths(self, block_size: int) -> dict[int, int]:
        """Verify width k per batch bucket: the drafter drafts all B slots, the target checks the first
        k. None = B everywhere; an int = that k everywhere; a dict = k per bucket (others B)."""
        given = self.verify_width
        per = given if isinstance(given, dict) else {n: given for n in self.buckets()} if given is not None else {}
        unknown = set(per) - set(self.buckets())
        if unknown:
            raise InputError(f"verify_width names batch buckets {sorted(unknown)} not in {self.buckets()}")
        for n, k in per.items():
            check_int(f"verify_width[{n}]", k, 1, block_size)
        return {n: per.get(n, block_size) for n in self.buckets()}

    def buckets(self) -> tuple[int, ...]:
        return _bucket_sizes(self.batch_buckets, 1, self.max_batch)

    def lengths(self) -> tuple[int, ...]:
        step = None if self.mode == "cudagraph" else 64
        return _bucket_sizes(self.length_buckets, 128, self.max_len, step)


def _bucket_sizes(given: tuple[int, ...] | None, first: int, largest: int, step: int | None = None) -> tuple[int, ...]:
    """`given` plus `largest`, sorted; by default `first`, then every `step` (or doubling) below `largest`."""
    sizes = set(given or ())
    if not given:
        n = first
        while n < largest:
            sizes.add(n)
            n = n + step if step else 2 * n
    return tuple(sorted(sizes | {largest}))
