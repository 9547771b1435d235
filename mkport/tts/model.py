"""A Qwen3-TTS-12Hz model folder: config, text tokenizer, talker / code predictor specs and weights, the
text side (embedding + projection) and the speech tokenizer decoder. Also seeded random model folders.

Folder layout (as on the Hugging Face hub): config.json, model.safetensors (or shards + index),
generation_config.json (optional), the text tokenizer (tokenizer.json, or vocab.json + merges.txt), and
speech_tokenizer/{config.json, model.safetensors}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..kernel.cache import RANDOM_TTS, cache_root, write_once
from ..errors import MkportError
from ..kernel.spec import ModelSource, ModelSpec, _bundled_path, open_model, read_config, spec_from_config
from ..runtime.weights import Checkpoint, DecoderWeights, load_weights, random_checkpoint
from .codec import SpeechDecoder, write_random_codec
from .prompt import TextProjector, TtsConfig

CODEC_CONFIG = "qwen3-tts-tokenizer-12hz.json"
RANDOM_SPECS = {
    "0.6b": "qwen3-tts-12hz-0.6b-customvoice.json",
    "1.7b": "qwen3-tts-12hz-1.7b-customvoice.json",
    "tiny": "qwen3-tts-12hz-0.6b-customvoice.json",  # shrunk, see tiny_configs
}
# The official Qwen3TTSTokenizer.from_pretrained loads a feature extractor for its encoder (Mimi, which
# encodes reference audio for Base models and is not used by mkport): 24 kHz mono, as transformers pairs with Mimi.
SPEECH_FEATURE_EXTRACTOR = {"feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1,
                            "sampling_rate": 24000, "padding_side": "right", "padding_value": 0.0,
                            "return_attention_mask": True, "chunk_length_s": None, "overlap": None}
QWEN_ENDOFTEXT_ID = 151643
TINY_ENDOFTEXT_ID = 262  # after the tiny vocabulary's bytes (0..255), specials (256..260) and `assistant` (261)


def _check_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise MkportError(f"model folder not found: {folder}")
    problems = []
    if not (folder / "config.json").exists():
        problems.append("config.json")
    if not list(folder.glob("*.safetensors")):
        problems.append("model.safetensors")
    if not (folder / "tokenizer.json").exists() and not (folder / "vocab.json").exists():
        problems.append("the text tokenizer (tokenizer.json or vocab.json + merges.txt)")
    st = folder / "speech_tokenizer"
    if not (st / "config.json").exists() or not list(st.glob("*.safetensors")):
        problems.append("speech_tokenizer/ (config.json + model.safetensors)")
    if problems:
        raise MkportError(f"model folder {folder} lacks {', '.join(problems)}")


def load_text_tokenizer(folder: Path):
    """encode(str) -> list[int]; special tokens such as <|im_start|> are recognised in the text."""
    path = folder / "tokenizer.json"
    if path.exists():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception for a bad file
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise MkportError(f"{path} is not a valid tokenizer file: {reason}") from None
        return lambda s: tok.encode(s, add_special_tokens=False).ids
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - any loader failure is a bad folder
        raise MkportError(f"cannot load the text tokenizer in {folder}: {e}") from None
    return lambda s: tok(s, add_special_tokens=False)["input_ids"]


@dataclass
class TtsModel:
    folder: Path
    config: TtsConfig
    raw_config: dict
    generation: dict
    talker_spec: ModelSpec
    predictor_spec: ModelSpec
    talker_weights: DecoderWeights  # bf16, CPU (weights_on: a GPU)
    predictor_weights: DecoderWeights
    text: TextProjector
    encode: object
    codec: SpeechDecoder
    # CUDA graphs for the prompt prefill and the codec: each capture costs ~0.3 s, which a process serving many
    # requests earns back and a one-shot `speak` does not
    graphs: bool = True

    @classmethod
    def load(cls, folder: Path, device="cpu", graphs: bool = True, mark=lambda step: None,
             compiled_codec: bool = False) -> "TtsModel":
        """Reads config.json once and indexes the checkpoint once; every part is checked before use.
        mark(step) is called as each step is done (`speak --verbose`). compiled_codec: the speech decoder's graphs
        capture torch.compile's fusion of its calls (codec.compiled_stream; CUDA with graphs only)."""
        folder = Path(folder)
        _check_folder(folder)
        talker = open_model(f"{folder}:talker")
        predictor = talker.with_part("code_predictor")
        raw = talker.config
        cfg = _tts_config(talker)
        if cfg.num_code_groups != 16:
            raise MkportError(f"num_code_groups={cfg.num_code_groups}: the 12 Hz speech tokenizer needs 16")
        gen_path = folder / "generation_config.json"
        generation = read_config(gen_path) if gen_path.exists() else {}
        encode = load_text_tokenizer(folder)
        checkpoint = Checkpoint.open(folder)
        checkpoint.check(text_shapes(cfg))
        mark("config, text tokenizer")
        talker_spec, predictor_spec = talker.spec, predictor.spec
        talker_w = load_weights(talker_spec, checkpoint)
        predictor_w = load_weights(predictor_spec, checkpoint)
        mark("weights: talker, code predictor (to host memory)")
        text = TextProjector(checkpoint.files, device)
        mark("text embedding and projection")
        codec = SpeechDecoder.load(folder / "speech_tokenizer", device, graphs, compiled_codec)
        if codec.codebook_size != predictor_spec.vocab_size:
            raise MkportError(f"speech tokenizer codebook {codec.codebook_size} != code predictor vocab {predictor_spec.vocab_size}")
        mark("speech tokenizer decoder")
        return cls(folder, cfg, raw, generation, talker_spec, predictor_spec, talker_w, predictor_w, text, encode,
                   codec, graphs)

    def weights_on(self, device, talker: bool = True, predictor: bool = True, text: bool = False) -> "TtsModel":
        """This model with the talker's and/or the code predictor's bf16 weights moved to `device` once: every
        decoder made from it then uses those tensors (Decoder's weights.to(device) keeps a tensor already there)
        instead of uploading a copy of its own, which a server of many batches or slots would hold once each.
        text: the text embedding table too (TextProjector.table_on)."""
        move = lambda w, yes: w.to(device) if yes else w  # noqa: E731
        return replace(self, talker_weights=move(self.talker_weights, talker),
                       predictor_weights=move(self.predictor_weights, predictor),
                       text=self.text.table_on(device) if text else self.text)


def _tts_config(source: ModelSource) -> TtsConfig:
    try:
        return TtsConfig.from_dict(source.config)
    except MkportError as e:
        raise MkportError(f"{source.path}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise MkportError(f"{source.path}: a Qwen3-TTS field has a wrong type or value: {e}") from None


def text_shapes(cfg: TtsConfig) -> dict[str, tuple[int, ...]]:
    """The text embedding and its projection to the talker's width (TextProjector's tensors)."""
    t = TextProjector.PROJ
    return {
        TextProjector.EMBED: (cfg.text_vocab, cfg.text_hidden),
        t + "linear_fc1.weight": (cfg.text_hidden, cfg.text_hidden),
        t + "linear_fc1.bias": (cfg.text_hidden,),
        t + "linear_fc2.weight": (cfg.talker_hidden, cfg.text_hidden),
        t + "linear_fc2.bias": (cfg.talker_hidden,),
    }


# -- random model folders ------------------------------------------------------------------------------
def tiny_configs() -> tuple[dict, dict]:
    """A small Qwen3-TTS config (2-layer talker, hidden 256; 1-layer predictor, hidden 128, so its input
    projection runs; codec vocab 3072 and the real special codec ids; a 512-entry text vocabulary with the
    text special tokens at 256..260) and a small speech tokenizer decoder (16 codebooks of 2048, the real
    1920x upsampling, thin channels, one transformer layer with a 4-frame window)."""
    cfg = json.loads(_bundled_path(RANDOM_SPECS["tiny"]).read_text())
    t = cfg["talker_config"]
    t.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, text_hidden_size=64, text_vocab_size=512, max_position_embeddings=4096)
    t["code_predictor_config"].update(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      max_position_embeddings=64)
    cfg.update(im_start_token_id=256, im_end_token_id=257, tts_pad_token_id=258, tts_bos_token_id=259,
               tts_eos_token_id=260, assistant_token_id=261)
    codec = codec_config()
    codec["decoder_config"].update(hidden_size=64, latent_dim=32, codebook_dim=32, decoder_dim=16,
                                   intermediate_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                   num_hidden_layers=1, sliding_window=4)
    return cfg, codec


def codec_config() -> dict:
    """The 12 Hz speech tokenizer config (a copy of the released one, shipped next to this module)."""
    path = Path(__file__).with_name(CODEC_CONFIG)
    return json.loads(path.read_text())


def write_char_tokenizer(folder: Path, specials: dict[str, int], words: dict[str, int] | None = None) -> Path:
    """A byte-level tokenizer without merges (one token per UTF-8 byte, ids 0..255) with the given special
    tokens, and whole `words` as single tokens, at the given ids; saved as tokenizer.json (the `tokenizers`
    format)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    words = words or {}
    vocab.update(specials)
    vocab.update(words)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    for s, i in {**specials, **words}.items():
        if tok.token_to_id(s) != i:
            raise MkportError(f"tokenizer: special token {s} got id {tok.token_to_id(s)}, expected {i}")
    path = Path(folder) / "tokenizer.json"
    tok.save(str(path))
    return path


def write_random_tts_model(folder: Path, which: str = "tiny", seed: int = 0) -> Path:
    """A complete random model folder: config.json, model.safetensors (talker, code predictor, text
    embedding and projection), generation_config.json, tokenizer.json and speech_tokenizer/ (with the
    preprocessor_config.json that the official loader reads)."""
    from safetensors.torch import save_file

    if which not in RANDOM_SPECS:
        raise MkportError(f"unknown random TTS spec '{which}'; supported: {', '.join(RANDOM_SPECS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if which == "tiny":
        cfg, codec_cfg = tiny_configs()
    else:
        cfg = json.loads(_bundled_path(RANDOM_SPECS[which]).read_text())
        codec_cfg = codec_config()
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    tensors = {}
    for i, part in enumerate(("talker", "code_predictor")):
        spec = spec_from_config(cfg, f"random-{part.replace('_', '-')}", part)
        tensors.update(random_checkpoint(spec, seed + i))
    t = cfg["talker_config"]
    text_h, hid, vocab = int(t["text_hidden_size"]), int(t["hidden_size"]), int(t["text_vocab_size"])
    gen = torch.Generator().manual_seed(seed + 2)
    rnd = lambda *shape, std: (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)  # noqa: E731
    tensors["talker.model.text_embedding.weight"] = rnd(vocab, text_h, std=1.0)
    tensors["talker.text_projection.linear_fc1.weight"] = rnd(text_h, text_h, std=text_h**-0.5)
    tensors["talker.text_projection.linear_fc1.bias"] = rnd(text_h, std=0.1)
    tensors["talker.text_projection.linear_fc2.weight"] = rnd(hid, text_h, std=0.5 * text_h**-0.5)
    tensors["talker.text_projection.linear_fc2.bias"] = rnd(hid, std=0.02)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"mkport_seed": str(seed), "spec": which})
    (folder / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
        "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0, "subtalker_top_k": 50,
        "max_new_tokens": 8192}, indent=1))
    names = {"<|im_start|>": cfg["im_start_token_id"], "<|im_end|>": cfg["im_end_token_id"],
             "<|tts_pad|>": cfg["tts_pad_token_id"], "<|tts_text_bos|>": cfg["tts_bos_token_id"],
             "<|tts_text_eod|>": cfg["tts_eos_token_id"]}
    # <|endoftext|> is the padding token (at Qwen's id), which the official processor asks for
    names["<|endoftext|>"] = TINY_ENDOFTEXT_ID if which == "tiny" else QWEN_ENDOFTEXT_ID
    # `assistant` as one token (at the Qwen id) makes the chat template split as the Qwen tokenizer does
    # (role 3 tokens, suffix 5): the official code slices the prompt at those fixed counts
    write_char_tokenizer(folder, names, {"assistant": cfg["assistant_token_id"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}, indent=1))
    write_random_codec(folder / "speech_tokenizer", codec_cfg, seed + 3)
    (folder / "speech_tokenizer" / "preprocessor_config.json").write_text(json.dumps(SPEECH_FEATURE_EXTRACTOR, indent=1))
    return folder


def random_model_folder(which: str, seed: int = 0) -> Path:
    """A random model folder cached under $MKPORT_CACHE/tts-random/<which>-<seed> (written once)."""
    if which not in RANDOM_SPECS:
        raise MkportError(f"unknown --random-weights '{which}'; supported: {', '.join(RANDOM_SPECS)}")
    folder = cache_root() / RANDOM_TTS / f"{which}-{seed}"
    return write_once(folder, lambda tmp: write_random_tts_model(tmp, which, seed))
