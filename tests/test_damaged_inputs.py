"""Damaged model folders end in one line naming the file and what is wrong (exit code 2 on the command line):
safetensors files, model.safetensors.index.json, config.json, tokenizer.json, tensor shapes, dtypes, and
NaN or Inf weights. Nothing outside the model folder is read."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_validation_model
from mkport.errors import MkportError
from mkport.kernel.spec import load_spec
from mkport.runtime.weights import INDEX, Checkpoint, load_weights

LAYER0_Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A small qwen3 model folder: config.json and model.safetensors (random bf16 weights)."""
    return Path(make_validation_model(tmp_path_factory.mktemp("pristine"), "qwen3"))


@pytest.fixture
def model(pristine, tmp_path) -> Path:
    """A copy of the pristine folder, for a test to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "model"))


def _load(folder: Path):
    return load_weights(load_spec(str(folder)), Checkpoint.open(folder))


def _refused(folder: Path, *fragments: str) -> str:
    with pytest.raises(MkportError) as info:
        _load(folder)
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    return message


def _rewrite(folder: Path, change) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


# -- safetensors files ----------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_safetensors_file(model, damage):
    path = model / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x17" * 4096, "empty": b""}[damage])
    _refused(model, str(path), "not a readable safetensors file")


def _shard(folder: Path, index: dict) -> Path:
    """Splits model.safetensors into two shards with an index (as large checkpoints come)."""
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for shard, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(folder / shard))
    weight_map = {n: shard for shard, part in halves.items() for n in part}
    (folder / INDEX).write_text(json.dumps(index if index is not None else {"weight_map": weight_map}))
    return folder / INDEX


def test_a_sharded_checkpoint_loads_like_one_file(model, pristine):
    _shard(model, None)
    ours, theirs = _load(model), _load(pristine)
    assert torch.equal(ours.layers[1].wqkv, theirs.layers[1].wqkv) and torch.equal(ours.embed, theirs.embed)


@pytest.mark.parametrize(
    "index, fragment",
    [
        ("{not json", "is not valid JSON"),
        ({"metadata": {}}, "has no weight_map"),
        ({"weight_map": [1, 2]}, "has no weight_map"),
        ({"weight_map": {LAYER0_Q: 7}}, f"tensor '{LAYER0_Q}' has shard 7"),
        ({"weight_map": {LAYER0_Q: "model-00003-of-00002.safetensors"}}, "does not exist"),
        ({"weight_map": {LAYER0_Q: "model-00002-of-00002.safetensors"}}, f"tensor '{LAYER0_Q}' is not in"),
    ],
)
def test_a_bad_index(model, index, fragment):
    path = _shard(model, None)
    path.write_text(index if isinstance(index, str) else json.dumps(index))
    _refused(model, str(path), fragment)


@pytest.mark.parametrize("outside", ["../outside.safetensors", "/ABS/outside.safetensors", "sub/../../outside.safetensors"])
def test_shards_outside_the_folder_are_refused(model, tmp_path, outside):
    """A shard named ../x would be read from outside the model folder: refused, even where the file exists."""
    index = _shard(model, None)
    target = tmp_path / "outside.safetensors"
    save_file({LAYER0_Q: torch.zeros(3)}, str(target))
    outside = outside.replace("/ABS", str(tmp_path))
    data = json.loads(index.read_text())
    data["weight_map"][LAYER0_Q] = outside
    index.write_text(json.dumps(data))
    _refused(model, str(index), f"shard '{outside}' is outside the model folder")


# -- tensors: shape, dtype, values ----------------------------------------------------------------------
def test_a_wrong_shape(model):
    _rewrite(model, lambda t: t.update({LAYER0_Q: t[LAYER0_Q].t().contiguous()}))  # q: 8 heads of 64 rows
    _refused(model, f"tensor '{LAYER0_Q}'", str(model / "model.safetensors"), "has shape (256, 512), expected (512, 256)")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_inf_weights_are_refused(model, bad):
    def poison(t):
        t[LAYER0_Q][3, 5] = bad

    _rewrite(model, poison)
    _refused(model, f"tensor '{LAYER0_Q}'", str(model / "model.safetensors"), "NaN or Inf")


def test_a_float32_weight_past_the_bf16_range_is_refused(model):
    def huge(t):
        t[LAYER0_Q] = t[LAYER0_Q].float()
        t[LAYER0_Q][0, 0] = 3.4e38  # finite in float32, Inf once rounded to bf16

    _rewrite(model, huge)
    _refused(model, f"tensor '{LAYER0_Q}'", "NaN or Inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_float_weights_are_converted_with_a_note(model, pristine, dtype, capsys):
    _rewrite(model, lambda t: t.update({n: v.to(dtype) for n, v in t.items()}))
    ours = _load(model)
    expected = _load(pristine).layers[0].wqkv.to(dtype).to(torch.bfloat16)  # float16 has less range than bf16
    assert ours.layers[0].wqkv.dtype == torch.bfloat16 and torch.equal(ours.layers[0].wqkv, expected)
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and str(model) in err and "converted to BF16" in err


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.float8_e4m3fn])
def test_quantized_and_integer_weights_are_refused(model, dtype):
    _rewrite(model, lambda t: t.update({LAYER0_Q: t[LAYER0_Q].to(dtype)}))
    _refused(model, f"tensor '{LAYER0_Q}'", "quantized and integer weights are not supported")


# -- Qwen3-TTS folders, through `mkport speak` ------------------------------------------------------------
@pytest.fixture(scope="module")
def tts_pristine(tmp_path_factory) -> Path:
    """A tiny Qwen3-TTS folder whose speech tokenizer is a stand-in: every damage below is found before the
    speech tokenizer is loaded."""
    import mkport.tts.model as tts_model

    folder = tmp_path_factory.mktemp("tts") / "tiny"
    stub = pytest.MonkeyPatch()

    def stand_in(codec_folder, codec_config, seed=0):
        codec_folder.mkdir(parents=True)
        (codec_folder / "config.json").write_text(json.dumps(codec_config))
        save_file({"decoder.stub": torch.zeros(1)}, str(codec_folder / "model.safetensors"))

    stub.setattr(tts_model, "write_random_codec", stand_in)
    try:
        tts_model.write_random_tts_model(folder, "tiny", seed=0)
    finally:
        stub.undo()
    return folder


def _speak_error(folder: Path, monkeypatch, capsys) -> str:
    import mkport.cli as cli

    monkeypatch.setattr(sys, "argv", ["mkport", "speak", "hi", "--model", str(folder), "--backend", "reference",
                                      "--out", str(folder.parent / "out.wav")])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error:"), err
    assert not (folder.parent / "out.wav").exists()
    return err


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


TTS_DAMAGE = {
    "config_not_json": (lambda f: (f / "config.json").write_text("{\"model_type\": "), "config.json is not valid JSON"),
    "config_string_eps": (
        lambda f: _edit_json(f / "config.json", lambda c: c["talker_config"].update(rms_norm_eps="tiny")),
        "'rms_norm_eps' must be a positive number, got 'tiny'",
    ),
    "config_string_token_id": (
        lambda f: _edit_json(f / "config.json", lambda c: c.update(tts_pad_token_id="pad")),
        "a Qwen3-TTS field has a wrong type or value",
    ),
    "tokenizer_not_json": (lambda f: (f / "tokenizer.json").write_text("{]"), "tokenizer.json is not a valid tokenizer"),
    "text_projection_shape": (
        lambda f: _rewrite(f, lambda t: t.update({
            "talker.text_projection.linear_fc2.weight": t["talker.text_projection.linear_fc2.weight"][:100]})),
        "tensor 'talker.text_projection.linear_fc2.weight'",
    ),
    "truncated_weights": (
        lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:100_000]),
        "model.safetensors is not a readable safetensors file",
    ),
    "int8_text_embedding": (
        lambda f: _rewrite(f, lambda t: t.update({
            "talker.model.text_embedding.weight": t["talker.model.text_embedding.weight"].to(torch.int8)})),
        "is I8: quantized and integer weights are not supported",
    ),
}


@pytest.mark.parametrize("case", list(TTS_DAMAGE))
def test_a_damaged_tts_folder_gives_one_error_line(tts_pristine, tmp_path, monkeypatch, capsys, case):
    damage, fragment = TTS_DAMAGE[case]
    folder = Path(shutil.copytree(tts_pristine, tmp_path / "tiny"))
    damage(folder)
    err = _speak_error(folder, monkeypatch, capsys)
    assert fragment in err and str(folder) in err, err
