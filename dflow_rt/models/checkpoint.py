"""Reading and writing model directories: HF targets and z-lab-layout drafters.

Only safetensors are read (never pickles). Every problem raises `CheckpointError` naming
the file and the field, before any model is returned, so nothing is ever half-loaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflow_rt.errors import CheckpointError
from dflow_rt.models import exact_codes
from dflow_rt.models.bounds import MAX_JSON_BYTES, bound, check_parameters, regular_file
from dflow_rt.models.draft_vocab import load_draft_vocab, save_draft_vocab
from dflow_rt.models.drafter import RELAY_INPUTS, Drafter, DrafterConfig, build_target_layer_ids
from dflow_rt.models.target import ARCHITECTURES, Target, TargetConfig, rope_settings

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DRAFTER_ARCHITECTURES = ("DFlashDraftModel",)
INDEX = "model.safetensors.index.json"
# Config fields targets and drafters share: read by shared_fields, written by *_hf_config.
SHARED = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
          "num_hidden_layers", "vocab_size", "rope_theta", "rope_scaling", "rms_norm_eps",
          "max_position_embeddings", "attention_bias")


def read_config(directory: str | Path) -> tuple[Path, dict]:
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise CheckpointError(directory, "not a model directory")
    regular_file(path, MAX_JSON_BYTES)
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except (OSError, ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
        raise CheckpointError(path, f"not valid JSON ({type(err).__name__})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(path, f"must hold a JSON object, got {type(cfg).__name__}")
    return path, cfg


def positive_int(cfg: dict, path: object, name: str, default: float | None = None, kind: type = int) -> Any:
    """Config field `name` as a positive int (or float); a missing field without a default is an error."""
    value = cfg.get(name, default)
    if value is None:
        raise CheckpointError(path, f"field '{name}' is missing")
    if type(value) not in (int, kind) or not 0 < value < math.inf:  # JSON true is no size
        noun = "integer" if kind is int else "number"
        raise CheckpointError(path, f"field '{name}' must be a positive {noun}, got {value!r}")
    return bound(name, value, path) if kind is int else kind(value)


def rope(cfg: dict, path: object) -> tuple[float, dict | None]:
    """Checked rotary settings: an unknown scaling type would load and then generate garbage."""
    try:
        theta, scaling = rope_settings(cfg)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    except (AttributeError, TypeError, ValueError) as err:
        raise CheckpointError(path, f"field 'rope_theta'/'rope_parameters'/'rope_scaling' ({err})") from None
    if kind not in ("default", "llama3") or not 0 < theta < math.inf:
        raise CheckpointError(path, f"field 'rope_scaling' type {kind!r} (theta {theta}) is not supported")
    if kind == "llama3":
        factors = [positive_int(scaling, path, f, kind=float) for f in ("factor", "low_freq_factor",
                                                                          "high_freq_factor")]
        positive_int(scaling, path, "original_max_position_embeddings")
        if not factors[2] > factors[1]:
            raise CheckpointError(path, "field 'rope_scaling': high_freq_factor must exceed low_freq_factor")
    return theta, scaling


def shared_fields(cfg: dict, path: object) -> dict:
    """Fields of both targets and drafters, checked so that the layers they build can run at all."""
    hidden, heads = positive_int(cfg, path, "hidden_size"), positive_int(cfg, path, "num_attention_heads")
    kv = positive_int(cfg, path, "num_key_value_heads", default=heads)
    if heads % kv:
        raise CheckpointError(path, f"field 'num_key_value_heads' {kv} does not divide {heads} heads")
    head_dim = positive_int(cfg, path, "head_dim",  # transformers' Qwen3 defaults it to 128, Llama to hidden // heads
                            default=128 if cfg.get("model_type") == "qwen3" else max(hidden // heads, 1))
    if head_dim % 2:
        raise CheckpointError(path, f"field 'head_dim' must be even (rotary pairs), got {head_dim}")
    theta, scaling = rope(cfg, path)
    return dict(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        intermediate_size=positive_int(cfg, path, "intermediate_size"),
        num_hidden_layers=positive_int(cfg, path, "num_hidden_layers"),
        vocab_size=positive_int(cfg, path, "vocab_size"), rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=positive_int(cfg, path, "rms_norm_eps", 1e-6, float),
        max_position_embeddings=positive_int(cfg, path, "max_position_embeddings", default=4096),
        attention_bias=bool(cfg.get("attention_bias", False)),
    )


def weight_files(directory: Path) -> list[Path]:
    """The files to read: the shards an index lists, else every *.safetensors; never a pickle."""
    index = directory / INDEX
    if index.exists():
        regular_file(index, MAX_JSON_BYTES)
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(index, f"field 'weight_map' unreadable ({err!r})") from None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(s, str) and s and Path(s).name == s for s in weight_map.values()):
            raise CheckpointError(index, "field 'weight_map' must map tensors to file names in its directory")
        for name, shard in weight_map.items():
            if not (directory / shard).exists():
                raise CheckpointError(directory / shard, f"missing: field 'weight_map' of {INDEX} "
                                                         f"lists it for tensor '{name}'")
            regular_file(directory / shard)
        return [directory / s for s in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    for file in files:
        regular_file(file)
    if files:
        return files
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(directory / pickles[0], "not a safetensors file; pickled weights "
                                                      "are never loaded")
    raise CheckpointError(directory / "model.safetensors", f"missing (no *.safetensors and no {INDEX})")


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(file, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises several types for bad files
        with open(file, "rb") as fh:  # peeked at only to word the error: torch.save writes zip or pickle
            pickled = fh.read(2) in (b"PK", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
        problem = "a torch.save/pickle file, never unpickled" if pickled else "corrupt or truncated"
        raise CheckpointError(file, f"{problem}, not a valid safetensors file ({err})") from None


@torch.inference_mode(False)  # parameters are ordinary tensors (with versions) even when loaded in inference mode
def load_weights(cls: type, config, directory: Path, dtype: torch.dtype | None, skip: tuple[str, ...] = (),
                 coded: bool = False):
    """Build `cls(config)` from the directory's safetensors after checking every name and shape.

    The module is built on the meta device and the checked tensors are assigned in, so a large
    model is never initialised at random first, nor returned half-filled. With `coded`, every
    float32 matrix with exact codes is held as them (`_hold_coded`).
    """
    files = weight_files(directory)
    index = directory / INDEX
    listing = files[0] if len(files) == 1 else index if index.exists() else directory
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}  # errors name the file holding the tensor, or the index if none does
    for file in files:
        for name, tensor in read_safetensors(file).items():
            if name in origin:
                raise CheckpointError(file, f"tensor '{name}' is also in {origin[name].name}")
            tensors[name], origin[name] = tensor, file
    check_parameters(config, sum(t.numel() for t in tensors.values()), directory / "config.json")
    with torch.device("meta"):
        module = cls(config)
    expected = {k: v for k, v in module.state_dict().items() if k not in skip}
    for name, ref in expected.items():
        if name not in tensors:
            raise CheckpointError(listing, f"tensor '{name}' is missing")
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise CheckpointError(origin[name], f"tensor '{name}' has shape {tuple(tensors[name].shape)}, "
                                                f"expected {tuple(ref.shape)}")
        if not tensors[name].is_floating_point():
            raise CheckpointError(origin[name], f"tensor '{name}' has dtype {tensors[name].dtype}, "
                                                f"expected floats")
    extra = sorted(set(tensors) - set(expected) - set(skip))
    if extra:
        raise CheckpointError(origin[extra[0]], f"unexpected tensor '{extra[0]}' ({len(extra)} in all)")
    codes = _hold_coded(tensors, origin, dtype) if coded else {}
    module.load_state_dict({k: tensors[k].to(dtype or tensors[k].dtype) for k in expected}, strict=False,
                           assign=True)
    for name, c in codes.items():
        owner = module.get_submodule(name.removesuffix(".weight"))
        owner.codes = c._replace(ptr=owner.weight.data_ptr(), version=owner.weight._version)
    return module


def _hold_coded(tensors: dict[str, torch.Tensor], origin: dict[str, Path], dtype: torch.dtype | None) -> dict:
    """Exact codes of each float32 matrix of `tensors` that has some (`exact_codes.encode`), its tensor
    replaced by a held one (`exact_codes.placeholder`). Each is read from its file on its own, not
    through the file's mapping (whose pages, once read, stay resident while any tensor of the file
    lives): at most one float32 matrix is resident at a time."""
    out = {}
    headers: dict[Path, tuple[int, dict]] = {}
    for name, t in tensors.items():
        if not name.endswith(".weight") or t.dim() != 2 or t.dtype != torch.float32 or (dtype or t.dtype) != t.dtype:
            continue
        file = origin[name]
        if file not in headers:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                headers[file] = 8 + size, json.loads(f.read(size))
        start, header = headers[file]
        begin, end = header[name]["data_offsets"]
        own = torch.empty(t.shape, dtype=t.dtype)
        with open(file, "rb") as f:
            f.seek(start + begin)
            if f.readinto(memoryview(own.numpy()).cast("B")) != end - begin:
                raise CheckpointError(file, f"tensor '{name}' is truncated")
        codes = exact_codes.encode(own)
        if codes is not None:
            out[name], tensors[name] = codes, exact_codes.placeholder(own)
    return out


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def target_config(cfg: dict, path: object) -> TargetConfig:
    """Listed architectures decide the family; `model_type` only stands in when there are none."""
    archs = cfg.get("architectures")
    known = [a for a in archs if a in tuple(ARCHITECTURES)] if type(archs) is list else []
    if archs and not known:
        raise CheckpointError(path, f"field 'architectures' {archs!r} is not supported "
                                    f"(supported: {', '.join(ARCHITECTURES)})")
    model_type = ARCHITECTURES[known[0]] if known else cfg.get("model_type")
    if model_type not in ARCHITECTURES.values():
        raise CheckpointError(path, f"field 'model_type' {model_type!r} is not supported "
                                    f"(supported: {', '.join(ARCHITECTURES.values())})")
    return TargetConfig(
        **shared_fields(cfg, path), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)), model_type=model_type,
    )


def load_target(directory: str | Path, dtype: torch.dtype | None = None,
                device: str | torch.device = "cpu") -> Target:
    """Load a Hugging Face Qwen3 or Llama checkpoint directory."""
    directory, device = Path(directory), torch.device(device)
    path, cfg = read_config(directory)
    config = target_config(cfg, path)
    skip = ("lm_head.weight",) if config.tie_word_embeddings else ()
    dtype = dtype or default_dtype(device)
    # a CPU float32 target is held as its exact codes where it has them (`dflow_rt.models.exact_codes`),
    # coded one weight at a time as it loads: the whole float32 model is never resident
    coded = device.type == "cpu" and dtype == torch.float32 and exact_codes.enabled()
    model = load_weights(Target, config, directory, dtype, skip, coded)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.source = directory
    model = model.to(device).eval()
    if coded:
        exact_codes.attach(model)  # the tied head shares its table's codes; projections stacked
        exact_codes.trim()  # the float32 read buffers, freed inside the C heap, back to the system
    return model


def drafter_config(cfg: dict, path: object) -> DrafterConfig:
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not any(a in DRAFTER_ARCHITECTURES for a in archs):
        raise CheckpointError(path, f"field 'architectures' {archs!r} is not a drafter "
                                    f"(expected one of {', '.join(DRAFTER_ARCHITECTURES)})")
    dflash = cfg.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise CheckpointError(path, f"field 'dflash_config' must be an object, got {dflash!r}")
    shared = shared_fields(cfg, path)
    num_target = positive_int(cfg, path, "num_target_layers")
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None:
        layer_ids = build_target_layer_ids(num_target, shared["num_hidden_layers"])
    if type(layer_ids) is not list or not layer_ids or any(type(i) is not int for i in layer_ids):
        raise CheckpointError(path, f"field 'dflash_config.target_layer_ids' must be a non-empty list of "
                                    f"integers, got {layer_ids!r}")
    mask = dflash.get("mask_token_id")
    if type(mask) is not int:
        raise CheckpointError(path, "field 'dflash_config.mask_token_id' is missing" if mask is None else
                              f"field 'dflash_config.mask_token_id' must be an integer, got {mask!r}")
    dflow = cfg.get("dflow_config") or {}
    if not isinstance(dflow, dict):
        raise CheckpointError(path, f"field 'dflow_config' must be an object, got {dflow!r}")
    return DrafterConfig(
        **shared, block_size=positive_int(dflash, path, "block_size", default=cfg.get("block_size")),
        mask_token_id=mask, target_layer_ids=tuple(layer_ids), num_target_layers=num_target,
        relay_hidden=positive_int(dflow, path, "relay_hidden") if dflow else 0,
        relay_input=relay_input(dflow, path), draft_whole_block=dflash_flag(dflash, path, "draft_whole_block"),
    )


def dflash_flag(dflash: dict, path: Path, name: str) -> bool:
    value = dflash.get(name, False)
    if type(value) is not bool:
        raise CheckpointError(path, f"field 'dflash_config.{name}' must be true or false, got {value!r}")
    return value


def relay_input(dflow: dict, path: Path) -> str:
    value = dflow.get("relay_input", "mask_embedding")
    if value not in RELAY_INPUTS:
        raise CheckpointError(path, f"field 'dflow_config.relay_input' must be one of {', '.join(RELAY_INPUTS)}, "
                                    f"got {value!r}")
    return value


def check_fits(config: DrafterConfig, target: Target, path: Path) -> None:
    """The drafter reads the target's features, embeddings and lm_head: every size must agree."""
    t = target.config
    for name, mine, theirs in (("hidden_size", config.hidden_size, t.hidden_size),
                               ("vocab_size", config.vocab_size, t.vocab_size),
                               ("num_target_layers", config.num_target_layers, t.num_hidden_layers)):
        if mine != theirs:
            raise CheckpointError(path, f"field '{name}' is {mine} but the target has {theirs}")
    if not all(0 <= i < t.num_hidden_layers for i in config.target_layer_ids):
        raise CheckpointError(path, f"field 'dflash_config.target_layer_ids' {list(config.target_layer_ids)} "
                                    f"must name layers 0..{t.num_hidden_layers - 1} of the target")
    if not 0 <= config.mask_token_id < t.vocab_size:
        raise CheckpointError(path, f"field 'dflash_config.mask_token_id' {config.mask_token_id} is outside "
                                    f"the target vocabulary of {t.vocab_size}")


def load_drafter(directory: str | Path, target: Target | None, dtype: torch.dtype | None = None,
                 draft_vocab: bool = True) -> Drafter:
    """Load a z-lab-layout DFlash drafter (a DFlow one if it has `dflow_config`) for `target`, with its
    draft vocabulary when the directory has one and `draft_vocab` (`dflow_rt.models.draft_vocab`).

    `target=None` skips the fit checks and keeps the file's dtype: for conversion tools only.
    """
    directory = Path(directory)
    path, cfg = read_config(directory)
    config = drafter_config(cfg, path)
    if target is not None:
        check_fits(config, target, path)
        dtype = dtype or target.lm_head.weight.dtype
    model = load_weights(Drafter, config, directory, dtype)
    model.source = directory
    model = model.to(target.lm_head.weight.device if target is not None else "cpu").eval()
    ids = load_draft_vocab(directory, config.vocab_size) if draft_vocab and target is not None else None
    if ids is not None:
        model.restrict_vocab(target, ids)
    return model


def target_hf_config(c: TargetConfig) -> dict:
    arch = {v: k for k, v in ARCHITECTURES.items()}[c.model_type]
    return {"architectures": [arch], "model_type": c.model_type, **{k: getattr(c, k) for k in SHARED},
            "hidden_act": "silu", "tie_word_embeddings": c.tie_word_embeddings, "mlp_bias": c.mlp_bias,
            "torch_dtype": "float32"}


def drafter_hf_config(c: DrafterConfig) -> dict:
    """z-lab layout; a DFlow drafter adds `dflow_config` (reference tools ignore it and `relay.*`)."""
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": c.block_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "num_target_layers": c.num_target_layers, **{k: getattr(c, k) for k in SHARED}, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    if c.draft_whole_block:
        cfg["dflash_config"]["draft_whole_block"] = True
    if c.relay_hidden:
        cfg["dflow_config"] = {"relay_hidden": c.relay_hidden, "relay_input": c.relay_input}
    return cfg


def save_model(model: Target | Drafter, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors in the layout the reference tools read (and a drafter's
    draft vocabulary, if it has one)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    is_target = isinstance(model, Target)
    cfg = target_hf_config(model.config) if is_target else drafter_hf_config(model.config)
    state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    if is_target and model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    cfg["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if not is_target and model.vocab_ids is not None:
        save_draft_vocab(directory, model.vocab_ids.cpu())
    return directory
