"""What a DFlash round costs at batch 1, eager and compiled, against a compiled AR step: the Runtime's
own rounds (fallback off) over the first prompts of the code suite, wall time per round after the
first, medians over prompts.

    python bench/round_cost.py --target smollm2 --drafter dflash --verify-width 2 4 --prompts 6
    python bench/round_cost.py --attention torch cpu   # each Runtime once per attention implementation
    python bench/round_cost.py --device cuda --shape qwen3-0.6b --verify-width 2 4 8 16  # (gpu_run.sh)

The first AR row named is the unit of every row's "AR steps". On CPU each width also gets the cost
of its arithmetic: the target's products at k rows are k times an AR step's multiply-adds, timed at
the rate torch's own float32 GEMM reaches here, alone and added to an AR step (the round's cost
where the extra rows' multiply-adds overlap nothing else in the step: exact products cannot skip
them, and on CPU they share the vector units with the step's other work).

`--shape` builds random models in a public model's shape instead (a round's cost at a fixed width
does not depend on the weights' values, and the fallback is off): a GPU check needs no checkpoint.
On CUDA the compiled rows are CUDA graphs (`--compiler eager` captures them without inductor's
minutes of compiling).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflow_rt.config import RuntimeConfig
from dflow_rt.data.prompts import suite_prompts
from dflow_rt.engine.runtime import Runtime
from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.models.bundled import load_models, pick_device
from dflow_rt.models.drafter import Drafter, DrafterConfig, build_target_layer_ids
from dflow_rt.models.target import Target, TargetConfig

# batch 1, fallback off, greedy rounds only: also the Runtimes of step_profile.py and lookup_ab.py, which
# then load the compiled rounds this script compiled
SIZES = dict(max_batch=1, max_len=512, batch_buckets=(1,), tuned=False, ar_fallback=False, sampling=False)
BUCKETS = tuple(range(128, 512, 64))  # the default length buckets of a plan whose length is a symbol
# public configs (the models' config.json), for random models of their shape
SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, model_type="llama"),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, model_type="qwen3"),
}


def random_models(shape: str, block_size: int, drafter_layers: int, device: str, dtype: torch.dtype):
    """A target of `shape` (tied embeddings) and a DFlash drafter of its width, randomly initialised."""
    cfg = TargetConfig(**SHAPES[shape], tie_word_embeddings=True)
    target = Target(cfg)
    drafter = Drafter(DrafterConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=drafter_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, block_size=block_size, mask_token_id=cfg.vocab_size - 1,
        target_layer_ids=tuple(build_target_layer_ids(cfg.num_hidden_layers, drafter_layers)),
        num_target_layers=cfg.num_hidden_layers))
    for model in (target, drafter):
        for name, p in model.named_parameters():
            if "norm" not in name:
                torch.nn.init.normal_(p, std=0.02)
        model.to(device=device, dtype=dtype).eval()
    return target, drafter


def gemm_rate() -> float:
    """Multiply-adds a second of torch's float32 GEMM on two 2048 x 2048 matrices here, the best of
    six products (the first warms up)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = float("inf")
    for _ in range(6):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2048 ** 3 / best


def per_round_ms(rt: Runtime, prompt: list[int], max_new: int) -> float:
    rid = rt.add_request(prompt, max_new_tokens=max_new)
    rt.step()  # prefill and the first round
    t, rounds = time.perf_counter(), 0
    while not rt.is_finished(rid):
        rt.step()
        rounds += 1
    ms = (time.perf_counter() - t) / max(rounds, 1) * 1e3
    rt.pop(rid)
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="dflash")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random models of this shape instead of --target/--drafter")
    p.add_argument("--block-size", type=int, default=16, help="the random drafter's block (with --shape) [16]")
    p.add_argument("--drafter-layers", type=int, default=2, help="the random drafter's layers (with --shape) [2]")
    p.add_argument("--device", help="cpu or cuda [CUDA where there is one]")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="[float32 on CPU, bfloat16 on CUDA]")
    p.add_argument("--compiler", default="inductor", help="torch.compile's backend for the compiled rows [inductor]")
    p.add_argument("--verify-width", type=int, nargs="+", default=[4], metavar="K")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--attention", nargs="+", default=["auto"], metavar="IMPL",
                   help="attention implementations (RuntimeConfig.kernels), each a set of Runtimes [auto]")
    p.add_argument("--symbolic-length", action="store_true",
                   help="also each compiled Runtime with length buckets given (its graphs trace the length as a "
                        "symbol), against the one static length a CPU plan picks by default")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    cuda = device.startswith("cuda")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    if args.shape:
        target, drafter = random_models(args.shape, args.block_size, args.drafter_layers, device, dtype)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, target.config.vocab_size - 1, (64,), generator=gen).tolist()
                   for _ in range(args.prompts)]
    else:
        target, drafter, tokenizer = load_models(args.target, args.drafter, device, args.threads, True, args.dtype)
        prompts = suite_prompts(tokenizer, "code", args.prompts)
    compiled = "cudagraph" if cuda else "compile"
    runtimes = {}
    for impl in args.attention:
        tag = "" if args.attention == ["auto"] else f", attention {impl}"
        kw = dict(SIZES, kernels={"attention": impl}, compiler=args.compiler)
        lengths = {"": None, ", symbolic length": BUCKETS} if args.symbolic_length else {"": None}
        for name, buckets in lengths.items():
            runtimes[f"AR, {compiled}{tag}{name}"] = Runtime(target, None, RuntimeConfig(
                **kw, mode=compiled, verify_width=None, length_buckets=buckets))
        for k in args.verify_width:
            for mode, name, buckets in [("eager", "", None)] + [(compiled, n, b) for n, b in lengths.items()]:
                runtimes[f"DFlash k = {k}, {mode}{tag}{name}"] = Runtime(target, drafter, RuntimeConfig(
                    **kw, mode=mode, verify_width=k, length_buckets=buckets))
    times: dict[str, list[float]] = {name: [] for name in runtimes}
    for prompt in prompts:
        for name, rt in runtimes.items():  # interleaved, so that drift reaches all alike
            times[name].append(per_round_ms(rt, prompt, args.max_new_tokens))
    ar = statistics.median(next(t for name, t in times.items() if name.startswith("AR")))
    print(f"{torch.__version__}, {torch.cuda.get_device_name() if cuda else 'CPU'}, {dtype}, "
          f"{args.shape or args.target}, {args.threads} threads")
    for name, ms in times.items():
        print(f"{name}: {statistics.median(ms):.2f} ms a round ({statistics.median(ms) / ar:.2f} AR steps)")
    if not cuda:
        rate = gemm_rate()
        macs = sum(m.weight.numel() for m in target.modules() if isinstance(m, cpu_ops.Linear))
        print(f"floor: {macs / 1e6:.1f} M multiply-adds a position in the target's products; torch's float32 GEMM "
              f"here {rate / 1e9:.1f} G multiply-adds/s")
        for k in args.verify_width:
            floor, extra = k * macs / rate * 1e3, (k - 1) * macs / rate * 1e3
            print(f"k = {k}: the target's products alone need {floor:.2f} ms at that rate ({floor / ar:.2f} AR "
                  f"steps); an AR step plus its k - 1 extra rows' multiply-adds, {(ar + extra) / ar:.2f} AR steps")


if __name__ == "__main__":
    main()
