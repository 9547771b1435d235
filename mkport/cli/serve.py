"""`mkport serve` and `mkport loadtest`, the typer commands (registered by mkport/cli/__init__.py). Nothing heavy is
imported until a command runs."""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import MkportError, check_range
from ..tts.limits import DEFAULT_MAX_FRAMES, RANDOM_WEIGHTS_FRAMES, default_max_frames
from ..serve.config import (DEFAULT_MAX_INPUT_CHARS, DEFAULT_MAX_STREAMS, DEFAULT_PORT,
                     DEFAULT_REQUEST_TIMEOUT_S, MAX_BATCHED_STREAMS, ServeConfig)
from .options import tts_model

# The scheduler thread runs Python between kernel launches almost without pause; with the default 5 ms GIL
# switch interval the event loop could wait that long to answer a request or send a chunk.
GIL_SWITCH_INTERVAL_S = 0.0005


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, made here so that a port in use is a one-line error and port 0 picks a free one."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise MkportError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise MkportError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve_defaults(backend: str, batched: bool | None, max_streams: int | None) -> tuple[bool, int, bool]:
    """(batched, max streams, whether memory bounds them) for what was not given: on the megakernel (a plan runs on
    it too) the batched server, bounded by the GPU's memory (batched.fit_streams, once the weights are loaded); on the
    reference backend, and by turns, DEFAULT_MAX_STREAMS taking turns. The reference's batched codec calls carry every
    slot's row, so a large batch there costs a lone stream as much as a full one (docs/serving.md)."""
    if batched is None:
        batched = backend == "megakernel"
    by_memory = max_streams is None and batched and backend == "megakernel"
    if max_streams is None:
        max_streams = MAX_BATCHED_STREAMS if by_memory else DEFAULT_MAX_STREAMS
    return batched, max_streams, by_memory


def serve(
    model: Optional[Path] = typer.Option(None, "--model", help="Qwen3-TTS-12Hz model folder (with speech_tokenizer/)."),
    random_weights: Optional[str] = typer.Option(
        None, "--random-weights", help="Seeded random model instead of --model: 0.6b, 1.7b or tiny."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="Port to listen on (0: a free one, printed)."),
    backend: Optional[str] = typer.Option(
        None, "--backend", help="megakernel (CUDA, the default) or reference (plain torch, CPU)."),
    max_streams: Optional[int] = typer.Option(
        None, "--max-streams", help="Streams at once (requests + WebSocket sessions); past it: 503. Default: batched "
        f"on a GPU, as many as its free memory holds (at most {MAX_BATCHED_STREAMS}); else {DEFAULT_MAX_STREAMS}."),
    max_frames: int = typer.Option(
        DEFAULT_MAX_FRAMES, "--max-frames", help="The most 80 ms frames a request may have, and its default ("
        f"{RANDOM_WEIGHTS_FRAMES} with --random-weights: they never pick EOS)."),
    max_input_chars: int = typer.Option(DEFAULT_MAX_INPUT_CHARS, "--max-input-chars", help="Longest `input` accepted."),
    request_timeout: float = typer.Option(
        DEFAULT_REQUEST_TIMEOUT_S, "--request-timeout", help="Seconds a stream may run before it is cut off."),
    shutdown_timeout: float = typer.Option(
        10.0, "--shutdown-timeout", help="On SIGINT/SIGTERM, seconds running streams get to finish before they are cut."),
    batched: Optional[bool] = typer.Option(
        None, "--batched/--by-turns", help="Every stream in batch decoders of --max-streams sequences (each frame "
        "reads the weights once for all), the default on the megakernel; or the streams take turns, a decoder pair "
        "each, the default on the reference backend."),
    fixed_batch: bool = typer.Option(False, "--fixed-batch", help="With --batched: every frame runs the whole "
                                     "batch, not the smallest size that holds the streams (slower under light load; "
                                     "a stream's samples then the same alone and under load on the megakernel too)."),
    batch_invariant: bool = typer.Option(
        False, "--batch-invariant", help="With --batched: frames sized to the live streams whose megakernels sum each "
        "stream's rows as the full batch does, so its samples are the same alone and under load (docs/serving.md: "
        "where it holds, what it costs)."),
    batch_size: Optional[int] = typer.Option(
        None, "--batch-size", help="With --batched: the most streams a batch holds, 1, 2, 4, 8, 16, 24 or 32 (default: "
        "--max-streams, up to what the model fits); more streams take turns in batches of it, each turn one batch's "
        "frame."),
    codec_overlap: bool = typer.Option(
        True, "--codec-overlap/--no-codec-overlap", help="With --batched on a GPU: a turn's chunks leave while the "
        "next frame runs, the host not waiting for the codec (default); off: each leaves as soon as it is decoded."),
    joins_together: Optional[bool] = typer.Option(
        None, "--joins-together/--joins-alone", help="With --batched on the megakernel, frames sized to the streams: "
        "a turn's arrivals prefill their prompts together, the talker's weights read once for up to 32 of them (the "
        "default where it runs; a 32-stream burst's first audio p95 -14% on an H100), or a prefill each. Not with "
        "--fixed-batch or --batch-invariant.", show_default=False),
    frames_per_turn: int = typer.Option(
        1, "--frames-per-turn", help="With --batched: a turn makes N frames of its batch and decodes them in one codec "
        "call (a stream's chunks 1, N-1, N, ... frames: its samples the same alone and under load); 1 to 8."),
    compile_codec: Optional[bool] = typer.Option(
        None, "--compile-codec/--no-compile-codec", help="On a GPU: the codec's calls fused by torch.compile before "
        "their CUDA graphs are captured (half the kernels, a call -23 to -26% on the H200; each call shape compiles "
        "once at start-up, ~30 s with an empty cache, then cached under the mkport cache). Default: on with --batched "
        "on a CUDA GPU whose Triton can build, else off.", show_default=False),
    codec_sms: int = typer.Option(
        0, "--codec-sms", help="With --batched on the megakernel on a CUDA GPU: the codec's calls run beside the next "
        "frame on K SMs of their own, the megakernels on the rest (the composition `mk+mk split K`, as a plan's split "
        "pick); 0: serial, the codec after each frame (default).", metavar="K"),
    frame_lanes: Optional[int] = typer.Option(
        None, "--frame-lanes", help="With --batched on the megakernel on a CUDA GPU: the batches' frames run L at a time, "
        "each lane's megakernels on 1/L of the SMs (a lane alone on all of them) and CUDA streams of its own, its "
        "codec calls beside its frames (more frames a second under load; on an H100 first audio ~3 ms later at 10 "
        "req/s); 1 or 2, 1: one frame at a time on every SM. Default: 2 where lanes run with frames sized to the "
        "streams (not with --fixed-batch, --batch-invariant, --plan, --codec-sms or --frames-per-turn > 1), else 1.",
        metavar="L", show_default=False),
    plan: Optional[Path] = typer.Option(
        None, "--plan", help="A `mkport plan` file: the talker and the code predictor run on the backends it picks "
        "for this server's batch size (instead of --backend)."),
    voice_map: Optional[Path] = typer.Option(
        None, "--voice-map", help="A JSON object of voice names to the model's speakers, instead of the table that "
        "maps OpenAI's voices (docs/serving.md)."),
    weights_seed: int = typer.Option(0, "--weights-seed", help="Seed of --random-weights."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level: debug, info, warning, error; at "
                                  "debug each stream also logs its path to first audio."),
):
    """Serve Qwen3-TTS over HTTP (OpenAI's POST /v1/audio/speech) and a WebSocket, many streams on one GPU
    (docs/serving.md)."""
    import uvicorn

    from ..tts.model import _check_folder
    from ..runtime.backends import check_backend
    from ..serve.app import create_app
    from ..serve.engine import Engine, split_sms_asked
    from ..serve.voices import read_voice_map

    tts_arg = tts_model(model, random_weights, weights_seed, "--model DIR")
    check_range(port, "--port", 0, 65535, " (0: a free one)")  # the resolver would take 70000 as 4464
    if request_timeout <= 0 or shutdown_timeout < 0:
        raise MkportError("--request-timeout must be > 0 and --shutdown-timeout >= 0")
    if max_input_chars < 1:
        raise MkportError(f"--max-input-chars {max_input_chars}: must be at least 1")
    if log_level.lower() not in uvicorn.config.LOG_LEVELS:
        raise MkportError(f"--log-level {log_level} is not supported; supported: {', '.join(uvicorn.config.LOG_LEVELS)}")
    if plan is not None and backend is not None:
        raise MkportError("give --backend or --plan, not both: the plan names the backends")
    if codec_sms < 0:
        raise MkportError(f"--codec-sms {codec_sms}: the codec's SMs, at least 1 (0: serial)")
    backend = backend or "megakernel"
    batched, max_streams, by_memory = serve_defaults(backend, batched, max_streams)
    if fixed_batch and not batched:
        raise MkportError("--fixed-batch sizes the frames of --batched: give both, or neither")
    if plan is None:
        check_backend(backend)  # before a random model is written
    split_sms_asked(ServeConfig(folder=Path(), model_id="", backend=backend, batched=batched, codec_sms=codec_sms,
                                plan=plan))  # so is a split that cannot run
    model_id = f"qwen3-tts-random-{random_weights}" if random_weights else tts_arg.path.resolve().name
    folder = tts_arg.folder()
    _check_folder(Path(folder))  # a wrong folder is an error now, not after the server has started
    voice_map = read_voice_map(voice_map, Path(folder)) if voice_map else None
    engine = Engine(ServeConfig(folder=folder, model_id=model_id, backend=backend, max_streams=max_streams,
                                streams_by_memory=by_memory,
                                max_frames=max_frames, max_input_chars=max_input_chars,
                                default_frames=min(max_frames, default_max_frames(random_weights is not None)),
                                request_timeout_s=request_timeout, batched=batched, sized_batches=not fixed_batch,
                                batch_invariant=batch_invariant,
                                batch_size=batch_size,
                                codec_overlap=codec_overlap, joins_together=joins_together,
                                frames_per_turn=frames_per_turn,
                                compile_codec=compile_codec,
                                codec_sms=codec_sms, frame_lanes=frame_lanes,
                                plan=plan,
                                voice_map=voice_map,
                                random_weights=random_weights is not None))
    sock = _listen(host, port)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    logging.basicConfig(format="mkport serve: %(message)s", level=logging.INFO)
    if log_level.lower() in ("debug", "trace"):  # each stream's path to first audio as it ends
        logging.getLogger("mkport.serve").setLevel(logging.DEBUG)
    logging.getLogger("mkport.serve").info(
        "listening on http://%s:%d; loading %s (%s, %s%s)", host, sock.getsockname()[1], model_id,
        f"{engine.composition.label}, the pick of {plan}" if plan
        else f"{engine.composition.label}, backend {backend}" if codec_sms else f"backend {backend}",
        f"streams as memory holds, up to {max_streams}" if by_memory else f"{max_streams} streams",
        (", batched, batch-invariant" if batch_invariant else ", batched") if batched else "")

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            engine.drain()  # /ready and new requests answer 503 while running streams finish
            await super().shutdown(sockets)

    server = Server(uvicorn.Config(create_app(engine), log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                                   lifespan="on"))
    engine.on_fatal = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
    if engine.error:
        raise MkportError(engine.error)


def loadtest(
    url: str = typer.Argument(..., help="The mkport serve to load, e.g. http://127.0.0.1:8000."),
    rate: Optional[float] = typer.Option(None, "--rate", help="Mean arrivals a second (Poisson; default 1)."),
    streams: Optional[int] = typer.Option(
        None, "--streams", help="Closed loop instead of --rate: this many clients, each sending its next request when "
        "its last has ended (N streams open all the time)."),
    ramp: float = typer.Option(
        0.0, "--ramp", help="With --streams: start the clients one after another over this many seconds (default 0: "
        "all at once, a burst of N arrivals that requests of one length keep in step)."),
    duration: float = typer.Option(30.0, "--duration", help="Seconds during which requests arrive."),
    concurrency: int = typer.Option(
        32, "--concurrency", help="Requests in flight at most; an arrival beyond it is counted as dropped (open loop; --streams opens a "
        "connection a client)."),
    voice: Optional[str] = typer.Option(None, "--voice", help="Voice for every request (default: the server's)."),
    max_frames: Optional[int] = typer.Option(None, "--max-frames", help="max_frames of each request."),
    seed: int = typer.Option(0, "--seed", help="Seed of the arrivals and of the sentences chosen."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds one request may take."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a table."),
):
    """Load a running mkport serve: Poisson arrivals (or --streams clients back to back) of realistic sentences;
    time to first audio, real-time factor, underruns and errors, with p50/p95/p99."""
    import json

    from rich.console import Console

    from ..serve.loadtest import LoadSpec, render_table, run_loadtest

    if rate is not None and streams is not None:
        raise MkportError("give --rate (open loop) or --streams (closed loop), not both")
    spec = LoadSpec(url=url, rate=1.0 if rate is None else rate, duration_s=duration, concurrency=concurrency, voice=voice,
                    max_frames=max_frames, seed=seed, timeout_s=timeout, streams=streams, ramp_s=ramp)
    result = run_loadtest(spec, progress=not as_json)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        Console().print(render_table(result))
    if result["summary"]["errors"] or result["summary"]["completed"] == 0:
        raise typer.Exit(1)
