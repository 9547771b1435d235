"""`mkport run`: a ported language model generating text, streamed to stdout. Registered by mkport/cli/__init__.py."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ..errors import MkportError, check_range
from ..kernel.launch_plan import check_kernel_support
from .options import check_seeds, llm_model

# transformers' own defaults for what a folder's generation_config.json leaves out (GenerationConfig's)
GENERATION_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # any one makes a tokenizer


def _generation_config(folder: Path, config: dict) -> dict:
    """The folder's generation_config.json over transformers' defaults; without the file, config.json's EOS, as
    transformers derives it."""
    from ..kernel.spec import read_config

    path = folder / "generation_config.json"
    given = read_config(path) if path.exists() else {"eos_token_id": config.get("eos_token_id")}
    return {**GENERATION_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}


def _number(gen: dict, key: str, kind):
    try:
        return kind(gen[key])
    except (TypeError, ValueError):
        raise MkportError(f"generation_config.json: {key} {gen[key]!r} is not a number") from None


def sampling_params(gen: dict, vocab: int, seed: int, greedy: bool, temperature: float | None, top_k: int | None,
                    top_p: float | None, repetition_penalty: float | None):
    """SamplingParams from the model's generation config with the options given on top: --temperature, --top-k or
    --top-p turn sampling on; --greedy (or temperature 0) takes the argmax. A repetition penalty applies either
    way, as in transformers."""
    from ..runtime.sampling import SamplingParams

    chosen = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items() if v is not None}
    if greedy and chosen:
        raise MkportError(f"--greedy takes the argmax: it takes no --{', --'.join(k.replace('_', '-') for k in chosen)}")
    gen = {**gen, **chosen}
    if repetition_penalty is not None:
        gen["repetition_penalty"] = repetition_penalty
    sample = not greedy and (bool(gen["do_sample"]) or bool(chosen))
    params = SamplingParams(
        temperature=_number(gen, "temperature", float) if sample else 0.0,
        top_k=_number(gen, "top_k", int),
        top_p=_number(gen, "top_p", float),
        repetition_penalty=_number(gen, "repetition_penalty", float),
        seed=seed,
    )
    params.validate(vocab)
    return params


def _reason(e: Exception) -> str:
    """An exception's first line: an error stays one line."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _eos_ids(tokenizer, gen: dict) -> set[int]:
    """The tokenizer's EOS and the generation config's (an id or a list: chat models end a turn with their own)."""
    ids = gen.get("eos_token_id")
    ids = set(ids if isinstance(ids, list) else [ids]) | {tokenizer.eos_token_id}
    return {i for i in ids if isinstance(i, int)}


def load_tokenizer(folder: Path | None, model: str):
    """The model folder's tokenizer (transformers' AutoTokenizer, from local files only)."""
    if folder is None:
        raise MkportError(f"'{model}' is a bundled spec and has no tokenizer: give a model folder (config.json, "
                          "tokenizer files, and safetensors or --random-weights); `mkport bench` times a bundled spec")
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise MkportError(f"{folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}): mkport run reads the model "
                          "folder's own")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any loader failure is a bad folder
        raise MkportError(f"cannot load the tokenizer in {folder}: {_reason(e)}") from None


def prompt_ids(tokenizer, prompt: str | None, chat: str | None, folder: Path) -> list[int]:
    """--prompt as the tokenizer encodes text (with its BOS, if it adds one), or --chat as one user message in the
    tokenizer's chat template, ending with the assistant's turn opened."""
    if (prompt is None) == (chat is None):
        raise MkportError("give exactly one of --prompt TEXT or --chat MESSAGE")
    text = prompt if chat is None else chat
    if not text.strip():
        raise MkportError(f"{'--prompt' if chat is None else '--chat'} is empty: give the text to continue")
    if chat is None:
        return list(tokenizer(prompt)["input_ids"])
    if not tokenizer.chat_template:
        raise MkportError(f"the tokenizer in {folder} has no chat template (chat_template in tokenizer_config.json, "
                          "or chat_template.jinja): use --prompt")
    try:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
    except Exception as e:  # noqa: BLE001 - a template is code from the folder: any failure is the folder's
        raise MkportError(f"the chat template in {folder} fails on one user message: {_reason(e)}") from None
    return list(encoded["input_ids"])


def run(
    model: str = typer.Argument(..., help="A local model folder (config.json, tokenizer files, safetensors), or its "
                                "config.json."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Text to continue."),
    chat: Optional[str] = typer.Option(None, "--chat", help="A user message, in the tokenizer's chat template."),
    weights: Optional[Path] = typer.Option(None, "--weights", help="Safetensors folder (default: MODEL's folder)."),
    random_weights: bool = typer.Option(False, "--random-weights", help="Seeded random weights: the text is noise."),
    weights_seed: Optional[int] = typer.Option(None, "--weights-seed", help="Seed of --random-weights (default 0)."),
    backend: str = typer.Option("megakernel", "--backend", help="megakernel (CUDA) or reference (plain torch)."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Stop after this many new tokens (EOS stops earlier)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Sampling temperature; 0 is greedy "
                                                "(default: generation_config.json's)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample from the k most likely (0: all; default: "
                                        "generation_config.json's, else 50)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling, needs --top-k >= 1 (default: "
                                          "generation_config.json's, else 1)."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", help="Divides positive and "
                                                       "multiplies negative logits of seen tokens (default: "
                                                       "generation_config.json's, else 1)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    greedy: bool = typer.Option(False, "--greedy", help="Argmax instead of sampling."),
):
    """Generate text with MODEL's megakernel, streamed to stdout; tokens/s on stderr.

    Sampling follows MODEL's generation_config.json (transformers' defaults without one: greedy); the options
    replace its values."""
    from ..runtime.backends import check_backend
    from ..runtime.decoder import require_gpu

    # every option is checked before anything loads
    llm = llm_model(model, weights, random_weights, weights_seed, own_folder=True)
    source, spec = llm.source, llm.source.spec
    if spec.role != "llm":
        raise MkportError(f"'{model}' is a Qwen3-TTS decoder, not a language model: use mkport speak")
    folder = source.path.parent if source.path is not None else None
    check_seeds(seed=seed)
    tokenizer = load_tokenizer(folder, model)
    ids = prompt_ids(tokenizer, prompt, chat, folder)
    gen = _generation_config(folder, source.config)
    sampling = sampling_params(gen, spec.vocab_size, seed, greedy, temperature, top_k, top_p, repetition_penalty)
    bad = [i for i in ids if not 0 <= i < spec.vocab_size]
    if bad:
        raise MkportError(f"the tokenizer in {folder} makes token id {bad[0]}, outside the model's vocabulary "
                          f"(vocab_size {spec.vocab_size}): tokenizer and config.json do not match")
    # dynamic NTK runs past max_position_embeddings, but a run's KV cache is sized by it: bounded there
    limit = spec.max_position if spec.rope.variant == "dynamic" else spec.max_context
    check_range(max_tokens, "--max-tokens", 1, limit, " (new tokens)")
    room = limit - len(ids) + 1  # new tokens that fit: the last one is never fed back
    where = spec.max_context_text  # dynamic NTK's: max_position_embeddings, the limit here
    if room < 1:
        raise MkportError(f"a prompt of {len(ids)} tokens does not fit {where}: shorten it")
    if max_tokens > room:
        raise MkportError(f"a prompt of {len(ids)} tokens and --max-tokens {max_tokens} exceed {where}; lower "
                          f"--max-tokens to {room} or shorten the prompt")
    if backend == "megakernel":
        check_kernel_support(spec)
    check_backend(backend)  # also: the megakernel needs a CUDA GPU
    if backend == "megakernel":
        require_gpu(spec)
    checkpoint = llm.checkpoint()
    if random_weights:
        print(f"note: random weights (seed {llm.weights_seed}): the text is noise by design", file=sys.stderr)
    run_model(spec, checkpoint, tokenizer, ids, sampling, max_tokens, _eos_ids(tokenizer, gen), backend)


def run_model(spec, checkpoint, tokenizer, ids: list[int], sampling, max_tokens: int, eos: set[int],
              backend: str) -> None:
    """Loads the decoder and streams its text to stdout, then one line of figures to stderr."""
    import torch
    from transformers import TextStreamer

    from ..runtime.backends import make_decoder
    from ..runtime.generate import GenerationStats, generate
    from ..runtime.weights import load_weights

    err = Console(stderr=True)
    status = err.status(f"loading {spec.name}") if err.is_terminal else contextlib.nullcontext()
    positions = len(ids) + max_tokens - 1
    with status:
        # one prompt: the megakernel's prefill runs eagerly, cheaper than capturing its CUDA graph
        decoder = make_decoder(spec, load_weights(spec, checkpoint), backend, positions, prefill_graphs=False)
    streamer = TextStreamer(tokenizer, skip_special_tokens=True)  # holds back text until it cannot change
    stats = GenerationStats()
    interrupted = False
    try:
        for token in generate(decoder, ids, sampling, max_tokens, eos, stats):
            streamer.put(torch.tensor([token]))
    except KeyboardInterrupt:
        interrupted = True
    streamer.end()
    stop = "interrupted" if interrupted else {"eos": "stopped at EOS", "max-tokens": "stopped at --max-tokens"}[stats.stop]
    rate = f"{stats.decode_tokens_per_s:.1f}" if stats.tokens > 1 else "-"
    print(f"mkport run: {stats.tokens} tokens, {stop}; {rate} tokens/s after the first, which took "
          f"{stats.first_token_s:.3f} s (prompt: {stats.prompt_tokens} tokens); backend {backend}", file=sys.stderr)
    if interrupted:
        raise typer.Exit(130)
