"""Default run settings, in a module without heavy imports so the CLI parser builds instantly."""

from dflow_rt.data.synth import MATH_CHAT_PER_EPOCH, MATH_PER_EPOCH

# Settings that define a target run: a resumed run takes them from its checkpoint.
TARGET_DEFAULTS = {"layers": 6, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 768, "seq_len": 256, "lr": 3e-3,
                   "min_lr_ratio": 0.1, "warmup": 100, "weight_decay": 0.1, "clip": 1.0, "seed": 0, "steps": None,
                   "minutes": None, "eval_windows": 32, "math_per_epoch": MATH_PER_EPOCH,
                   "math_chat_per_epoch": MATH_CHAT_PER_EPOCH, "max_files": None}
