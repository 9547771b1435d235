"""`mkport run` on the CPU (--backend reference): a tiny random-weights model folder with a tokenizer built with
`tokenizers` and a chat template. The reference backend's greedy tokens must be transformers' own greedy generate's
on the same weights, for every LLM family; the command streams the text, stops at EOS or --max-tokens, samples
the same text for a seed, applies the chat template, and refuses bad input in one line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import make_validation_model
from mkport.cli import app, main
from mkport.kernel.spec import open_model
from mkport.runtime.sampling import SamplingParams
from mkport.runtime.generate import GenerationStats, generate
from mkport.runtime.weights import Checkpoint, load_weights
from mkport.tts.model import write_char_tokenizer
from mkport.runtime.torch_decoder import TorchDecoder

runner = CliRunner()
SPECIALS = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
WORDS = {f"w{i}": i for i in range(259, 512)}  # the rest of the tiny models' vocabulary of 512
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
END = SPECIALS["<|im_end|>"]
LLM_CASES = ("qwen3", "llama", "qwen2", "mistral", "ministral", "granite", "smollm3", "phi3")
# the reference backend only here: qwen3_5's megakernel (batch 1) is tests/test_gpu_qwen35.py's
TORCH_ONLY_CASES = ("qwen3_5",)


def add_tokenizer(folder: Path, eos: str = "<|im_end|>", chat_template: str | None = CHAT_TEMPLATE) -> None:
    """Byte-level tokenizer.json (a token a byte, ids 0..255, plus the specials and words above), its
    tokenizer_config.json, and a generation_config.json that ends a turn at <|im_end|>, as chat models' do."""
    write_char_tokenizer(folder, SPECIALS, WORDS)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
    if chat_template:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": END}))


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("run_models")
    return {case: make_validation_model(root, case, seed=i) for i, case in enumerate(LLM_CASES + TORCH_ONLY_CASES)}


@pytest.fixture(scope="module")
def folder(family_models) -> Path:
    """The llama model folder, complete: config.json, model.safetensors, tokenizer, generation config."""
    path = Path(family_models["llama"]).parent / "llama-run"
    shutil.copytree(family_models["llama"], path)
    add_tokenizer(path)
    return path


def tokenizer_of(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def reference_tokens(model: str, prompt: list[int], n: int, sampling=SamplingParams(), eos=()) -> list[int]:
    spec = open_model(model).spec
    decoder = TorchDecoder(spec, load_weights(spec, Checkpoint.open(Path(model))), len(prompt) + n)
    return list(generate(decoder, prompt, sampling, n, eos))


def transformers_greedy(model: str, prompt: list[int], n: int, repetition_penalty: float = 1.0) -> list[int]:
    """transformers' own greedy generate, float32 from the same bf16 weights, never stopping early."""
    from transformers import AutoModelForCausalLM

    from mkport.check.reference import own_default_rope

    with own_default_rope():  # not qwen-tts's, if another test loaded it in this process
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, repetition_penalty=repetition_penalty)
    return out[0, len(prompt):].tolist()


def invoke(*args: str):
    result = runner.invoke(app, ["run", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def refused(monkeypatch, capsys, *args: str) -> str:
    """mkport run through main(), which turns an MkportError into one line: that line."""
    monkeypatch.setattr(sys, "argv", ["mkport", "run", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert exit_info.value.code == 2 and captured.out == "", captured
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


def text_of(folder: Path, tokens: list[int]) -> str:
    """The text for tokens as the command prints it: up to EOS, special tokens left out, a newline at the end."""
    if END in tokens:
        tokens = tokens[: tokens.index(END)]
    return tokenizer_of(folder).decode(tokens, skip_special_tokens=True) + "\n"


# -- the reference backend is transformers' greedy decoding ---------------------------------------------------
@pytest.mark.parametrize("penalty", [1.0, 1.5])
@pytest.mark.parametrize("case", LLM_CASES + TORCH_ONLY_CASES)
def test_reference_greedy_tokens_are_transformers_generate(family_models, case, penalty):
    """A penalty of 1.5 also breaks the loops some random models fall into (one token again and again) and checks
    the penalty as transformers applies it in greedy decoding, prompt tokens included."""
    prompt = [5, 100, 300, 7, 42, 256, 11, 300]
    ours = reference_tokens(family_models[case], prompt, 16, SamplingParams(repetition_penalty=penalty))
    assert ours == transformers_greedy(family_models[case], prompt, 16, penalty)


def test_cli_prints_the_text_of_transformers_greedy_tokens(folder):
    ids = tokenizer_of(folder)("Hello there")["input_ids"]
    expected = transformers_greedy(str(folder), ids, 12)
    result = invoke(str(folder), "--prompt", "Hello there", "--backend", "reference", "--max-tokens", "12")
    assert result.stdout == text_of(folder, expected)
    n, stop = (expected.index(END), "EOS") if END in expected else (12, "--max-tokens")
    stats = result.stderr.strip().splitlines()[-1]
    assert stats.startswith(f"mkport run: {n} tokens, stopped at {stop}; ") and "tokens/s" in stats, stats
    assert stats.endswith("backend reference")


# -- streaming, stopping ---------------------------------------------------------------------------------------
def test_text_streams_while_tokens_are_generated(folder, monkeypatch):
    """Text reaches stdout between decode steps, not all at the end. The streamer holds text back to a word's end, so
    the steps' tokens are shown as words of a fixed text (random weights' tokens need hold no space at all)."""
    import mkport.runtime.generate as generation

    events = []
    original = generation.generate
    words = tokenizer_of(folder).encode("ab cd ef g", add_special_tokens=False)
    assert len(words) == 10  # a token a byte

    def counting(*args, **kwargs):
        for i, _ in enumerate(original(*args, **kwargs)):
            events.append("token")
            yield words[i]

    class Stdout:
        def write(self, s):
            if s:
                events.append("text")

        def flush(self):
            pass

    monkeypatch.setattr(generation, "generate", counting)
    monkeypatch.setattr(sys, "stdout", Stdout())
    monkeypatch.setattr(sys, "argv", ["mkport", "run", str(folder), "--prompt", "Hi", "--backend", "reference",
                                      "--max-tokens", "10", "--temperature", "1"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 0
    last_token = max(i for i, e in enumerate(events) if e == "token")
    assert events.count("token") == 10 and events.index("text") < last_token, events


def test_stops_at_the_tokenizers_eos(folder, tmp_path):
    """The tokenizer's EOS set to a word the greedy model says a few tokens in: the text ends just before it."""
    ids = tokenizer_of(folder)("Hello there")["input_ids"]
    tokens = reference_tokens(str(folder), ids, 16)
    k = next(i for i, t in enumerate(tokens) if i >= 2 and t in WORDS.values() and t not in tokens[:i])
    assert END not in tokens[:k]
    other = tmp_path / "other-eos"
    shutil.copytree(folder, other)
    add_tokenizer(other, eos=f"w{tokens[k]}")
    result = invoke(str(other), "--prompt", "Hello there", "--backend", "reference", "--max-tokens", "16")
    assert result.stdout == tokenizer_of(other).decode(tokens[:k], skip_special_tokens=True) + "\n"
    assert f"mkport run: {k} tokens, stopped at EOS" in result.stderr


def test_generate_stops_at_eos_and_at_max_tokens(folder):
    spec = open_model(str(folder)).spec
    weights = load_weights(spec, Checkpoint.open(folder))
    prompt = [5, 6, 7]

    def tokens(max_tokens, eos=()):
        stats = GenerationStats()
        out = list(generate(TorchDecoder(spec, weights, 16), prompt, SamplingParams(), max_tokens, eos, stats))
        assert stats.tokens == len(out) and stats.prompt_tokens == 3
        return out, stats.stop

    full, stop = tokens(8)
    assert len(full) == 8 and stop == "max-tokens"
    assert tokens(5) == (full[:5], "max-tokens")
    k = full.index(full[3])  # where that token first comes
    assert tokens(8, eos=[full[3]]) == (full[:k], "eos")


# -- sampling ---------------------------------------------------------------------------------------------------
def test_a_seed_gives_the_same_text_and_another_seed_other_text(folder):
    def text(seed):
        return invoke(str(folder), "--prompt", "Hello", "--backend", "reference", "--max-tokens", "24",
                      "--temperature", "1.5", "--seed", str(seed)).stdout

    first = text(1)
    assert first == text(1)
    assert first != text(2)
    greedy = invoke(str(folder), "--prompt", "Hello", "--backend", "reference", "--max-tokens", "24").stdout
    assert first != greedy  # sampling happened


def test_sampling_follows_generation_config_and_options():
    from mkport.cli.run import GENERATION_DEFAULTS, sampling_params

    qwen3 = {**GENERATION_DEFAULTS, "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert sampling_params(qwen3, 512, 7, False, None, None, None, None) == SamplingParams(0.6, 20, 0.95, 1.0, 7)
    assert sampling_params(qwen3, 512, 7, True, None, None, None, 1.1) == SamplingParams(0.0, 20, 0.95, 1.1, 7)
    # transformers' defaults: greedy; an option that samples turns sampling on
    assert sampling_params(GENERATION_DEFAULTS, 512, 0, False, None, None, None, None).temperature == 0.0
    assert sampling_params(GENERATION_DEFAULTS, 512, 0, False, None, 5, None, None) == SamplingParams(1.0, 5, 1.0, 1.0, 0)


# -- the chat template --------------------------------------------------------------------------------------------
def test_chat_applies_the_folders_chat_template(folder):
    chat = invoke(str(folder), "--chat", "hi", "--backend", "reference", "--max-tokens", "8").stdout
    templated = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat == invoke(str(folder), "--prompt", templated, "--backend", "reference", "--max-tokens", "8").stdout
    assert chat != invoke(str(folder), "--prompt", "hi", "--backend", "reference", "--max-tokens", "8").stdout


# -- random weights, refusals --------------------------------------------------------------------------------------
def test_random_weights_say_the_text_is_noise(folder):
    args = (str(folder), "--prompt", "Hi", "--backend", "reference", "--max-tokens", "8")
    result = invoke(*args, "--random-weights")
    assert "note: random weights (seed 0): the text is noise by design" in result.stderr
    assert "mkport run: 8 tokens" in result.stderr
    own = invoke(*args)
    assert "noise" not in own.stderr and own.stdout != result.stdout  # the folder's weights were made with seed 1


@pytest.mark.parametrize("args, message", [
    (["qwen3-0.6b", "--random-weights", "--prompt", "hi"], "bundled spec and has no tokenizer"),
    (["{folder}", "--prompt", "hi", "--chat", "hi"], "exactly one of --prompt TEXT or --chat MESSAGE"),
    (["{folder}"], "exactly one of --prompt TEXT or --chat MESSAGE"),
    (["{folder}", "--prompt", "  "], "--prompt is empty"),
    (["{folder}", "--prompt", "hi", "--top-p", "1.5"], "top_p=1.5: must be in (0, 1]"),
    (["{folder}", "--prompt", "hi", "--top-p", "0.9", "--top-k", "0"], "top_p=0.9 needs top_k between 1 and"),
    (["{folder}", "--prompt", "hi", "--top-k", "5000"], "top_k=5000: supported 0 (off) to"),
    (["{folder}", "--prompt", "hi", "--temperature", "-1"], "temperature=-1.0: must be a finite number >= 0"),
    (["{folder}", "--prompt", "hi", "--repetition-penalty", "0"], "repetition_penalty=0.0: must be > 0"),
    (["{folder}", "--prompt", "hi", "--greedy", "--temperature", "0.7"], "--greedy takes the argmax"),
    (["{folder}", "--prompt", "hi", "--seed", "-1"], "--seed -1: a seed is an integer from 0 to 2**63-1"),
    (["{folder}", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens 0: must be 1.."),
    (["{folder}", "--prompt", "hi", "--max-tokens", "2048"], "--max-tokens 2048 exceed the model's 2048 positions"),
    (["{folder}", "--prompt", "hi " * 1100], "does not fit the model's 2048 positions (max_position_embeddings)"),
    (["{folder}", "--prompt", "hi", "--weights-seed", "3"], "--weights-seed is for --random-weights"),
    (["{folder}", "--prompt", "hi", "--weights", "{folder}", "--random-weights", "--backend", "reference"],
     "give exactly one of --weights DIR or --random-weights"),
    (["{folder}", "--prompt", "hi", "--backend", "fast"], "backend 'fast' is not supported; supported: megakernel, "
                                                          "reference"),
    (["{tts}:talker", "--prompt", "hi"], "is a Qwen3-TTS decoder, not a language model: use mkport speak"),
])
def test_bad_input_is_one_line(folder, validation_tts, monkeypatch, capsys, args, message):
    """Each is refused before anything loads (and before the megakernel backend looks for a GPU)."""
    line = refused(monkeypatch, capsys, *(a.format(folder=folder, tts=validation_tts) for a in args))
    assert message in line, line


@pytest.fixture(scope="module")
def validation_tts(tmp_path_factory) -> str:
    return make_validation_model(tmp_path_factory.mktemp("tts"), "tts_talker").rsplit(":", 1)[0]


def test_a_folder_without_tokenizer_or_chat_template_is_refused(family_models, folder, tmp_path, monkeypatch, capsys):
    bare = family_models["qwen3"]  # config.json and model.safetensors only
    assert "has no tokenizer (tokenizer.json" in refused(monkeypatch, capsys, bare, "--prompt", "hi")
    plain = tmp_path / "no-template"
    shutil.copytree(folder, plain)
    add_tokenizer(plain, chat_template=None)
    line = refused(monkeypatch, capsys, str(plain), "--chat", "hi", "--backend", "reference")
    assert "has no chat template" in line and "use --prompt" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_the_megakernel_without_a_gpu_names_the_reference_backend(folder):
    """Through the installed entry point, in a fresh process: the default backend, one line, exit code 2."""
    import os
    import subprocess

    env = dict(os.environ, NO_COLOR="1", TERM="dumb")
    proc = subprocess.run([sys.executable, "-m", "mkport.cli", "run", str(folder), "--prompt", "hi"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("error: the megakernel backend needs a CUDA GPU; none is visible "
                                   "(use --backend reference)")
