"""Bad input fails with one clear error naming the file and the field, and nothing is half-loaded.

Every case copies the working reference pair into tmp_path, breaks one thing in the copy and
checks the error's type, its `path` and that the message names the field or tensor at fault.
"""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import dflow_rt
import dflow_rt.oracle
from dflow_rt import CheckpointError, InputError

FIXTURES = Path(__file__).parent / "fixtures" / "dflash_reference"
CONFIG, WEIGHTS = "config.json", "model.safetensors"
BAD_JSON_HEADER = (16).to_bytes(8, "little") + b"{not json} xxxxx"  # a plausible length, then junk


@pytest.fixture(scope="module")
def target() -> dflow_rt.Target:
    return dflow_rt.load_target(FIXTURES / "target")


@pytest.fixture
def pair(tmp_path) -> dict[str, Path]:
    """Fresh, writable copies of the reference target and drafter directories."""
    return {kind: Path(shutil.copytree(FIXTURES / kind, tmp_path / kind)) for kind in ("target", "drafter")}


def load(kind: str, directory: Path, target: dflow_rt.Target):
    return dflow_rt.load_target(directory) if kind == "target" else dflow_rt.load_drafter(directory, target)


def fails(call, path: Path, *needles: str) -> str:
    """Run `call`, expect one CheckpointError about `path` whose message holds every needle."""
    with pytest.raises(CheckpointError) as info:
        call()
    message = str(info.value)
    assert info.value.path == str(path), message
    assert message.startswith(f"{path}: "), message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert "\n" not in message  # the CLI prints it as one line
    return message


def edit_config(directory: Path, change) -> Path:
    path = directory / CONFIG
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))
    return path


def set_fields(**fields):
    return lambda cfg: cfg.update(fields)


def set_dflash(**fields):
    return lambda cfg: cfg["dflash_config"].update(fields)


def edit_weights(directory: Path, change) -> Path:
    path = directory / WEIGHTS
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)
    return path


class MarkerPayload:
    """Unpickling this creates `marker`: proof, by its absence, that nothing was unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


# --- a drafter that does not fit its target ------------------------------------------------------

@pytest.mark.parametrize("change, field", [
    (set_fields(hidden_size=32), "'hidden_size' is 32 but the target has 64"),
    (set_fields(vocab_size=32), "'vocab_size' is 32 but the target has 24"),
    (set_fields(num_target_layers=8), "'num_target_layers' is 8 but the target has 6"),
    (set_dflash(target_layer_ids=[1, 6]), "'dflash_config.target_layer_ids' [1, 6]"),
    (set_dflash(target_layer_ids=[-1, 3]), "'dflash_config.target_layer_ids' [-1, 3]"),
    (set_dflash(target_layer_ids=[]), "'dflash_config.target_layer_ids' must be a non-empty list"),
    (set_dflash(target_layer_ids=[1.0, 3]), "'dflash_config.target_layer_ids' must be a non-empty list"),
    (set_dflash(target_layer_ids="1,3"), "'dflash_config.target_layer_ids' must be a non-empty list"),
    (set_dflash(mask_token_id=24), "'dflash_config.mask_token_id' 24 is outside the target vocabulary of 24"),
    (set_dflash(mask_token_id=-1), "'dflash_config.mask_token_id' -1 is outside"),
    (set_dflash(mask_token_id=2.5), "'dflash_config.mask_token_id' must be an integer"),
    (set_dflash(mask_token_id="23"), "'dflash_config.mask_token_id' must be an integer"),
    (set_dflash(mask_token_id=True), "'dflash_config.mask_token_id' must be an integer"),
    (lambda cfg: cfg["dflash_config"].pop("mask_token_id"), "'dflash_config.mask_token_id' is missing"),
    (lambda cfg: cfg.pop("dflash_config"), "'dflash_config.mask_token_id' is missing"),
    (set_fields(dflash_config=[23]), "'dflash_config' must be an object"),
])
def test_drafter_that_does_not_fit_the_target(pair, target, change, field):
    path = edit_config(pair["drafter"], change)
    fails(lambda: dflow_rt.load_drafter(pair["drafter"], target), path, field)


def test_failed_drafter_load_leaves_target_and_files_untouched(pair, target):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    path = edit_config(pair["drafter"], set_fields(hidden_size=32))
    listing = sorted((p.name, p.stat().st_size) for p in pair["drafter"].iterdir())
    fails(lambda: dflow_rt.load_drafter(pair["drafter"], target), path, "'hidden_size'")
    assert sorted((p.name, p.stat().st_size) for p in pair["drafter"].iterdir()) == listing
    after = target.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# --- architectures and config.json ---------------------------------------------------------------

@pytest.mark.parametrize("kind, change, field", [
    ("target", set_fields(architectures=["GPT2LMHeadModel"]), "'architectures' ['GPT2LMHeadModel']"),
    ("target", set_fields(architectures="Qwen3ForCausalLM"), "'architectures' 'Qwen3ForCausalLM'"),
    ("target", set_fields(architectures=None, model_type="gpt2"), "'model_type' 'gpt2'"),
    ("target", set_fields(architectures=["DFlashDraftModel"]), "'architectures' ['DFlashDraftModel']"),
    ("drafter", set_fields(architectures=["Qwen3ForCausalLM"]), "'architectures' ['Qwen3ForCausalLM']"),
    ("drafter", set_fields(architectures=[]), "'architectures' [] is not a drafter"),
])
def test_unknown_architecture(pair, target, kind, change, field):
    path = edit_config(pair[kind], change)
    fails(lambda: load(kind, pair[kind], target), path, field)


def test_each_directory_refuses_the_other_kind(pair, target):
    fails(lambda: dflow_rt.load_target(pair["drafter"]), pair["drafter"] / CONFIG,
          "'architectures'", "DFlashDraftModel")
    fails(lambda: dflow_rt.load_drafter(pair["target"], target), pair["target"] / CONFIG,
          "'architectures'", "not a drafter")


@pytest.mark.parametrize("kind, field", [
    ("target", "hidden_size"), ("target", "vocab_size"), ("target", "num_hidden_layers"),
    ("target", "intermediate_size"), ("target", "num_attention_heads"),
    ("drafter", "num_target_layers"), ("drafter", "block_size"), ("drafter", "hidden_size"),
])
def test_missing_required_config_field(pair, target, kind, field):
    path = edit_config(pair[kind], lambda cfg: cfg.pop(field))
    fails(lambda: load(kind, pair[kind], target), path, f"field '{field}' is missing")


@pytest.mark.parametrize("kind, change, field", [
    ("target", set_fields(hidden_size="64"), "'hidden_size' must be a positive integer, got '64'"),
    ("target", set_fields(num_hidden_layers=True), "'num_hidden_layers' must be a positive integer"),
    ("target", set_fields(vocab_size=0), "'vocab_size' must be a positive integer, got 0"),
    ("target", set_fields(intermediate_size=-128), "'intermediate_size' must be a positive integer"),
    ("target", set_fields(num_key_value_heads=3), "'num_key_value_heads' 3 does not divide 4"),
    ("target", set_fields(rms_norm_eps="tiny"), "'rms_norm_eps' must be a positive number"),
    ("target", set_fields(rope_parameters={"rope_theta": "big"}), "'rope_theta'"),
    ("target", set_fields(rope_parameters="default"), "'rope_parameters'"),
    ("target", set_fields(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'rope_scaling' type 'yarn'"),
    ("drafter", set_fields(rope_scaling={"type": "dynamic"}), "'rope_scaling' type 'dynamic'"),
    ("drafter", set_fields(block_size=0), "'block_size' must be a positive integer"),
    ("drafter", set_fields(head_dim=None, num_attention_heads="4"), "'num_attention_heads'"),
    ("drafter", set_fields(dflow_config={"relay_hidden": 8, "relay_input": "keys"}),
     "'dflow_config.relay_input' must be one of mask_embedding, kv, got 'keys'"),
    ("drafter", set_dflash(draft_whole_block="yes"), "'dflash_config.draft_whole_block' must be true or false"),
])
def test_invalid_config_field(pair, target, kind, change, field):
    path = edit_config(pair[kind], change)
    fails(lambda: load(kind, pair[kind], target), path, field)


@pytest.mark.parametrize("kind", ["target", "drafter"])
@pytest.mark.parametrize("content, problem", [
    (b"{ not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"[1, 2, 3]", "must hold a JSON object"),
])
def test_config_that_is_not_a_json_object(pair, target, kind, content, problem):
    (pair[kind] / CONFIG).write_bytes(content)
    fails(lambda: load(kind, pair[kind], target), pair[kind] / CONFIG, problem)


def test_missing_config_or_directory(pair, target, tmp_path):
    (pair["target"] / CONFIG).unlink()
    fails(lambda: dflow_rt.load_target(pair["target"]), pair["target"] / CONFIG, "missing")
    nowhere = tmp_path / "nowhere"
    fails(lambda: dflow_rt.load_drafter(nowhere, target), nowhere, "not a model directory")


# --- weight files -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_missing_weights(pair, target, kind):
    (pair[kind] / WEIGHTS).unlink()
    fails(lambda: load(kind, pair[kind], target), pair[kind] / WEIGHTS, "missing", "*.safetensors")


@pytest.mark.parametrize("kind", ["target", "drafter"])
@pytest.mark.parametrize("cut", [0, 7, 8, 100, "half", -1])
def test_truncated_weights(pair, target, kind, cut):
    file = pair[kind] / WEIGHTS
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2 if cut == "half" else cut])
    fails(lambda: load(kind, pair[kind], target), file, "corrupt or truncated", "safetensors")


@pytest.mark.parametrize("kind", ["target", "drafter"])
@pytest.mark.parametrize("garbage", [b"\xde\xad\xbe\xef" * 64, BAD_JSON_HEADER])
def test_corrupt_header(pair, target, kind, garbage):
    file = pair[kind] / WEIGHTS
    data = file.read_bytes()
    file.write_bytes(garbage + data[len(garbage):])
    fails(lambda: load(kind, pair[kind], target), file, "corrupt", "header")


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_truncation_or_header_byte_flip_gives_one_checkpoint_error(pair, target, data):
    """A damaged drafter file either still loads or raises CheckpointError: never anything else."""
    file = pair["drafter"] / WEIGHTS
    original = (FIXTURES / "drafter" / WEIGHTS).read_bytes()
    header_end = 8 + int.from_bytes(original[:8], "little")
    if data.draw(st.booleans(), label="truncate"):
        damaged = original[:data.draw(st.integers(0, len(original) - 1), label="cut")]
    else:
        at = data.draw(st.integers(0, header_end - 1), label="at")
        damaged = original[:at] + bytes([data.draw(st.integers(0, 255), label="byte")]) + original[at + 1:]
    file.write_bytes(damaged)
    try:
        dflow_rt.load_drafter(pair["drafter"], target)
    except CheckpointError as err:
        assert err.path == str(file)
    else:
        assert len(damaged) == len(original)  # a harmless flip, e.g. one padding space for another


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_pickled_weights_are_refused_and_never_unpickled(pair, target, kind, tmp_path, monkeypatch):
    marker = tmp_path / "unpickled.marker"
    (pair[kind] / WEIGHTS).unlink()
    torch.save({"weights": MarkerPayload(marker)}, pair[kind] / "pytorch_model.bin")
    for module, name in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("a pickle was opened"))
    fails(lambda: load(kind, pair[kind], target), pair[kind] / "pytorch_model.bin",
          "not a safetensors file; pickled weights are never loaded")
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["target", "drafter"])
@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_pickle_named_safetensors_is_never_unpickled(pair, target, kind, writer, tmp_path):
    marker = tmp_path / "unpickled.marker"
    file = pair[kind] / WEIGHTS
    if writer == "torch.save":
        torch.save({"weights": MarkerPayload(marker)}, file)
    else:
        file.write_bytes(pickle.dumps({"weights": MarkerPayload(marker)}, protocol=4))
    fails(lambda: load(kind, pair[kind], target), file, "torch.save/pickle file, never unpickled")
    assert not marker.exists()


def test_marker_payload_does_fire_when_unpickled(tmp_path):
    """Control for the two tests above: the payload really runs on unpickling, with either reader."""
    torch.save({"weights": MarkerPayload(tmp_path / "a")}, tmp_path / "a.bin")
    torch.load(tmp_path / "a.bin", weights_only=False)["weights"].close()
    pickle.loads(pickle.dumps(MarkerPayload(tmp_path / "b"))).close()
    assert (tmp_path / "a").exists() and (tmp_path / "b").exists()


def shard(directory: Path) -> tuple[str, str]:
    """Split model.safetensors into two shards plus an index, as HF writes large checkpoints."""
    tensors = load_file(directory / WEIGHTS)
    (directory / WEIGHTS).unlink()
    names, weight_map = sorted(tensors), {}
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for i, file in enumerate(files):
        part = names[i::2]
        save_file({n: tensors[n] for n in part}, directory / file)
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return files


def test_sharded_checkpoint_loads(pair, target):
    """Control for the shard errors below: the same weights split in two load identically."""
    shard(pair["target"])
    loaded = dflow_rt.load_target(pair["target"])
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_index_pointing_at_a_missing_shard(pair):
    _, second = shard(pair["target"])
    (pair["target"] / second).unlink()
    index = json.loads((pair["target"] / "model.safetensors.index.json").read_text())
    tensor = next(n for n, f in sorted(index["weight_map"].items()) if f == second)
    fails(lambda: dflow_rt.load_target(pair["target"]), pair["target"] / second, "missing",
          "'weight_map'", "model.safetensors.index.json", f"'{tensor}'")


@pytest.mark.parametrize("content, problem", [
    ("{ nope", "field 'weight_map' unreadable"),
    (json.dumps({"metadata": {}}), "field 'weight_map' unreadable"),
    (json.dumps({"weight_map": {}}), "field 'weight_map' must map"),
    (json.dumps({"weight_map": {"lm_head.weight": "../drafter/model.safetensors"}}), "'weight_map' must map"),
    (json.dumps({"weight_map": {"lm_head.weight": 3}}), "field 'weight_map' must map"),
])
def test_unreadable_index(pair, content, problem):
    shard(pair["target"])
    index = pair["target"] / "model.safetensors.index.json"
    index.write_text(content)
    fails(lambda: dflow_rt.load_target(pair["target"]), index, problem)


def test_tensor_in_two_shards(pair):
    first, second = shard(pair["target"])
    tensors = load_file(pair["target"] / second)
    tensors["lm_head.weight"] = load_file(pair["target"] / first)["lm_head.weight"]
    save_file(tensors, pair["target"] / second)
    fails(lambda: dflow_rt.load_target(pair["target"]), pair["target"] / second,
          f"tensor 'lm_head.weight' is also in {first}")


# --- tensors ------------------------------------------------------------------------------------

def transpose(name):
    return lambda t: t.update({name: t[name].T.contiguous()})


def drop(name):
    return lambda t: t.pop(name)


def put(name, shape):
    return lambda t: t.update({name: torch.zeros(shape)})


@pytest.mark.parametrize("kind, change, needles", [
    ("target", put("model.layers.0.self_attn.q_proj.weight", (32, 64)),
     ("tensor 'model.layers.0.self_attn.q_proj.weight' has shape (32, 64), expected (64, 64)",)),
    ("target", transpose("model.layers.2.mlp.up_proj.weight"),
     ("tensor 'model.layers.2.mlp.up_proj.weight' has shape (64, 128), expected (128, 64)",)),
    ("drafter", transpose("fc.weight"), ("tensor 'fc.weight' has shape (128, 64), expected (64, 128)",)),
    ("target", drop("model.norm.weight"), ("tensor 'model.norm.weight' is missing",)),
    ("target", drop("lm_head.weight"), ("tensor 'lm_head.weight' is missing",)),
    ("drafter", drop("layers.1.self_attn.k_norm.weight"),
     ("tensor 'layers.1.self_attn.k_norm.weight' is missing",)),
    ("target", put("model.layers.6.mlp.gate_proj.weight", (128, 64)),
     ("unexpected tensor 'model.layers.6.mlp.gate_proj.weight'",)),
    ("drafter", put("relay.weight", (4,)), ("unexpected tensor 'relay.weight'",)),
    ("drafter", lambda t: t.update({"norm.weight": torch.ones(64, dtype=torch.int32)}),
     ("tensor 'norm.weight' has dtype torch.int32, expected floats",)),
])
def test_tensor_that_does_not_fit(pair, target, kind, change, needles):
    path = edit_weights(pair[kind], change)
    fails(lambda: load(kind, pair[kind], target), path, *needles)


# --- requests -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def drafter(target) -> dflow_rt.Drafter:
    return dflow_rt.load_drafter(FIXTURES / "drafter", target)


@pytest.mark.parametrize("use_drafter", [True, False])
def test_prompt_longer_than_the_cache(target, drafter, use_drafter):
    with pytest.raises(InputError) as info:
        dflow_rt.oracle.generate(target, drafter if use_drafter else None, list(range(20)) * 2, max_new_tokens=4,
                                    config=dflow_rt.RuntimeConfig(max_len=32, verify_width=None))
    assert "prompt of 40 tokens" in str(info.value) and "does not fit max_len 32" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_prompt_that_just_fits_the_cache(target, drafter):
    """The bound is exact: prompt + max_new_tokens + one block fills the cache without error."""
    fit = 3 + 4 + drafter.block_size
    for generate in (dflow_rt.oracle.generate, dflow_rt.generate):
        config = dflow_rt.RuntimeConfig(max_len=fit, mode="eager", verify_width=None)
        assert len(generate(target, drafter, [1, 2, 3], max_new_tokens=4, config=config).token_ids) == 4
        with pytest.raises(InputError, match=f"does not fit max_len {fit - 1}"):
            generate(target, drafter, [1, 2, 3], max_new_tokens=4, config=replace(config, max_len=fit - 1))


@pytest.mark.parametrize("prompt", [[], (), torch.empty(0, dtype=torch.long)])
def test_empty_prompt(target, drafter, prompt):
    with pytest.raises(InputError, match="prompt_ids is empty"):
        dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens=4)


@pytest.mark.parametrize("prompt", [[24], [-1], [1, 2, 99], torch.tensor([3, 24])])
def test_out_of_vocab_prompt_ids(target, drafter, prompt):
    with pytest.raises(InputError, match=r"prompt_ids must be integers in 0\.\.23"):
        dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens=4)
