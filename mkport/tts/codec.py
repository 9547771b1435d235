"""The 12 Hz speech tokenizer's decoder (16 codebooks a frame -> 24 kHz PCM, 1920 samples a frame) as mkport
runs it: loaded from a `speech_tokenizer/` folder into mkport's own torch implementation
(codec_decoder.CodecDecoder), decoded whole or streamed, with CUDA graphs on CUDA; and seeded random
codec weights.

Streaming (StreamingCodec): each chunk decodes only its own frames, with what the decoder keeps of the frames before
(codec_decoder.StreamState: the input tails of the causal convolutions, the keys and values of the attention window,
the frames seen), so the streamed audio is the whole-utterance decode up to float32 rounding (the convolutions of
another length sum in another order) and no frame is decoded twice. Each StreamingCodec owns its state, one row of
the state's tensors (5.2 MB for the released decoder, 4.7 MB of it the attention's keys and values); SpeechDecoder
runs every stream's calls on one static state of its own: zeroed for a stream's first chunk, otherwise the stream's
row copied into it before the call, and copied out after it. So a StreamingCodec costs no capture and holds nothing
that must be given back (a server makes one a request, and a cancelled stream never flushes), for two copies of the
row a chunk.

CUDA graphs: on CUDA, SpeechDecoder replays a graph of that stateful call for each chunk length a StreamingCodec
decodes (1, 2, 4, 8 and 16 frames with the defaults), captured once per SpeechDecoder when the first StreamingCodec
is made. A chunk in mid-stream is never padded (padding frames would enter the state); a length without a graph
runs eagerly. The flush, after which nothing is decoded, is padded at the end with code 0 up to the smallest
captured length that holds it and the samples of the padding are dropped: the decoder is causal (every stride-1
causal convolution pads on the left only, a transposed convolution's output for frame t depends on frames <= t
and its right trim removes only samples past the last frame, attention is causal within its window, and the rest
is per frame), so the samples of the real frames do not depend on the padding.

Many streams at once (CodecStreams, a batched server): each stream's frames are decoded as they come, a chunk of
one or more frames a call (turn_chunk: 1, N - 1, N, N, ... with a batched turn of N frames), with the same state kept
per stream (a row each of one StreamState), and the chunks of every stream that made one of a length go through in
one call of a fixed shape: its ~470 kernels serve them all, and a stream's samples do not depend on the others.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Iterator

import torch

from ..errors import MkportError
from ..kernel.cache import COMPILED, cache_root
from ..runtime.graphs import capture, pad_rows
from .codec_decoder import CodecDecoder, CodecDecoderConfig, StreamState

DEFAULT_FIRST_CHUNK = 1
DEFAULT_CHUNK = 16


def read_codec_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise MkportError(f"speech tokenizer config missing: {path}")
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise MkportError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise MkportError(f"{path}: not a JSON object")
    if cfg.get("model_type") != "qwen3_tts_tokenizer_12hz":
        raise MkportError(
            f"{path}: model_type '{cfg.get('model_type')}' is not supported; supported: qwen3_tts_tokenizer_12hz"
        )
    return cfg


def build_decoder(path: Path, cfg: dict, device=None) -> CodecDecoder:
    """The decoder described by the `decoder_config` of `cfg` (read from `path`), weights as initialised.
    device="meta": shapes only, for a module that load_state_dict(assign=True) fills (skips the random
    initialisation, 0.8 s for the released size)."""
    if "decoder_config" not in cfg:
        raise MkportError(f"{path}: no decoder_config")
    config = CodecDecoderConfig.from_dict(cfg["decoder_config"], where=str(path))
    with torch.device(device or "cpu"):
        return CodecDecoder(config).eval()


class SpeechDecoder:
    """codes [T, 16] -> float32 PCM [T * upsample] on `device`: decode() of a whole utterance (eager), stream() of a
    stream's next frames with its state kept; on CUDA (unless graphs=False) the stream calls of the lengths in
    `graph_frames` run as CUDA graph replays (see the module docstring)."""

    def __init__(self, module, upsample: int, sample_rate: int, device="cpu", graphs: bool = True,
                 compiled: bool = False):
        self.module = module.to(device).float().eval()
        self.upsample, self.sample_rate, self.device = upsample, sample_rate, torch.device(device)
        self.num_quantizers = module.config.num_quantizers
        self.codebook_size = module.config.codebook_size
        self.graphs = graphs and self.device.type == "cuda"
        if compiled and not self.graphs:
            raise MkportError("a compiled speech decoder needs CUDA graphs (a CUDA device, graphs on): its calls "
                              "are compiled as they are captured")
        # the call captured in each graph: the module's own, or torch.compile's fusion of it (compiled_stream)
        self.captured_call = compiled_stream(self.module) if compiled else self.module.stream
        self.graph_frames: set[int] = set()  # the stream call lengths replayed as graphs (StreamingCodec's chunks)
        self._graphs: dict[int, tuple] = {}  # frames -> (graph, static codes [1, Q, frames], wav)
        self._graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None
        # every stream call runs on row 0 of this state (its views in _row); made on first use, so in the dtype the
        # module has then
        self._state: StreamState | None = None
        self._row: list[torch.Tensor] = []

    @classmethod
    def load(cls, folder: Path, device="cpu", graphs: bool = True, compiled: bool = False) -> "SpeechDecoder":
        """From a speech_tokenizer/ folder: config.json and safetensors with `decoder.*` tensors (the encoder's
        tensors, if any, are not read)."""
        from safetensors import SafetensorError, safe_open

        folder = Path(folder)
        cfg = read_codec_config(folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise MkportError(f"no *.safetensors files in {folder}")
        module = build_decoder(folder / "config.json", cfg, device="meta")
        expected = module.state_dict()
        state = {}
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        name = key.removeprefix("decoder.")
                        if name == key:
                            continue
                        if name not in expected:
                            raise MkportError(f"{path}: tensor '{key}' is not part of the speech tokenizer decoder")
                        tensor = f.get_tensor(key)
                        if tensor.shape != expected[name].shape:
                            raise MkportError(f"{path}: tensor '{key}' has shape {tuple(tensor.shape)}, the decoder "
                                              f"config gives {tuple(expected[name].shape)}")
                        state[name] = tensor
            except SafetensorError as e:
                raise MkportError(f"{path}: not a readable safetensors file ({e})") from None
        missing = [name for name in expected if name not in state]
        if missing:
            raise MkportError(f"speech tokenizer tensor 'decoder.{missing[0]}' missing in {folder} ({len(missing)} missing)")
        module.load_state_dict(state, assign=True)
        upsample = int(cfg.get("decode_upsample_rate", module.samples_per_frame))
        if upsample != module.samples_per_frame:
            raise MkportError(f"{folder / 'config.json'}: decode_upsample_rate {upsample} != the decoder's upsampling "
                              f"{module.samples_per_frame} (the product of upsample_rates and upsampling_ratios)")
        return cls(module, upsample, int(cfg.get("output_sample_rate", 24000)), device, graphs, compiled)

    def prepare(self, lengths) -> None:
        """Registers stream call lengths to replay as graphs and captures those not captured yet, so that only
        the first stream on this decoder pays for the captures."""
        self.graph_frames.update(lengths)
        if not self.graphs:
            return
        for frames in sorted(set(lengths) - set(self._graphs)):
            self._graph(frames)

    def graph_length(self, frames: int) -> int | None:
        """The captured length a last call of `frames` frames is padded to, or None when it runs eagerly."""
        if not self.graphs:
            return None
        return min((f for f in self.graph_frames if f >= frames), default=None)

    def _on_device(self, codes) -> torch.Tensor:
        """codes [T, Q] as a long tensor on the device, checked."""
        codes = torch.as_tensor(codes)
        if codes.device != self.device and self.device.type == "cuda":
            # through pinned memory, without waiting for the stream: the host goes on queuing work (a codec on a
            # stream of its own beside the frames, mkport.tts.compose) while the copy waits its turn
            codes = codes.long().pin_memory().to(self.device, non_blocking=True)
        codes = codes.to(self.device, torch.long)
        if codes.dim() != 2 or codes.shape[1] != self.num_quantizers:
            raise MkportError(f"codes must be [frames, {self.num_quantizers}], got {tuple(codes.shape)}")
        return codes

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [T, Q] (Q = 16 codebooks), a whole utterance -> [T * upsample] float32 in [-1, 1]."""
        codes = self._on_device(codes)
        if codes.shape[0] == 0:
            return torch.zeros(0, device=self.device)
        return self.module(codes.t().unsqueeze(0)).reshape(-1).float()  # module output [1, 1, frames * upsample]

    def new_stream(self) -> list[torch.Tensor]:
        """A stream's own state for stream(), with no frames seen: empty until its first call keeps one row of every
        tensor of a StreamState (a first chunk then only zeroes the static row, a few launches)."""
        return []

    @torch.no_grad()
    def stream(self, codes: torch.Tensor, kept: list[torch.Tensor], last: bool = False) -> torch.Tensor:
        """codes [T, Q]: a stream's frames after those its state `kept` (new_stream()) has seen -> their samples
        [T * upsample], those a decode() of all the stream's frames gives them; `kept` goes on past them. `last`:
        nothing follows, so the call may be padded up to a graph's length (graph_length) and `kept` is left as it
        was (the padding went through the state)."""
        codes = self._on_device(codes)
        frames = codes.shape[0]
        if frames == 0:
            return torch.zeros(0, device=self.device)
        if last:
            length = self.graph_length(frames)
        else:  # never padded: the padding would enter the state
            length = frames if self.graphs and frames in self.graph_frames else None
        padded = pad_rows(codes, length or frames).t().unsqueeze(0)  # [1, Q, length]
        state = self._static_state()
        if kept:  # one launch or a few for the ~40 tensors, not one each
            torch._foreach_copy_(self._row, kept)
        else:
            torch._foreach_zero_(self._row)
        if length is None:
            wav = self.module.stream(padded, state)
        else:
            graph, static_codes, wav = self._graph(length)
            static_codes.copy_(padded)
            graph.replay()
        # copied out before any other graph of the pool runs (graphs.capture)
        wav = wav.reshape(-1)[:frames * self.upsample].float().clone()
        if not last:  # queued behind the decode: the host does this while the device decodes
            if not kept:
                kept.extend(torch.empty_like(t) for t in self._row)
            torch._foreach_copy_(kept, self._row)
        return wav

    def _static_state(self) -> StreamState:
        if self._state is None:
            self._state = StreamState(self.module, 1)
            self._state.rows = None  # row 0 alone: views, no gather and scatter a tensor
            self._row = self._state.row(0)
        return self._state

    def _graph(self, frames: int) -> tuple:
        """(graph, static codes, wav) of the stream call of `frames` frames on the static state, captured on first
        use."""
        if frames not in self._graphs:
            static_codes = torch.zeros(1, self.num_quantizers, frames, dtype=torch.long, device=self.device)
            state = self._static_state()
            graph, wav = capture(lambda: self.captured_call(static_codes, state), self._graph_pool)
            self._graphs[frames] = (graph, static_codes, wav)
        return self._graphs[frames]


def compile_unavailable() -> str | None:
    """Why torch.compile cannot build the codec's GPU kernels here, or None: Triton compiles a launcher for its
    kernels with the host's C compiler against Python's headers."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    compilers = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    if not any(shutil.which(c) for c in compilers):
        return f"no C compiler ({', '.join(compilers)}) for Triton's launchers"
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        return "Python's headers (Python.h), which Triton's launchers need, are not installed"
    return None


def compiled_stream(module: CodecDecoder, mode: str | None = None, dynamic_rows: bool = False):
    """module.stream compiled by torch.compile (inductor) into one graph a call shape: the ~470 small kernels of a
    1-frame call, latency-bound, become its convolutions, matmuls and attention plus ~75 fused elementwise
    kernels (counted on the CPU). Each shape (rows, frames) compiles once, on its capture's eager run, with the
    shapes static; torch.compile's cache goes under the mkport cache (`compiled/`) unless TORCHINDUCTOR_CACHE_DIR
    says otherwise, so a later start reuses it. `mode` (torch.compile's) and `dynamic_rows` (one compile for the
    calls of 2 rows and more, fewer compiles at start-up) are what scripts/codec_compile_ab.py times against the
    default; the server runs the default."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / COMPILED))
    compiled = torch.compile(module.stream, fullgraph=True, dynamic=None if dynamic_rows else False, mode=mode)

    def call(codes, state):
        if dynamic_rows and codes.shape[0] > 1:  # a 1-row call keeps its own specialised compile
            torch._dynamo.mark_dynamic(codes, 0)
            if state.rows is not None:
                torch._dynamo.mark_dynamic(state.rows, 0)
        # every captured shape compiles once: more than dynamo's default of 8 recompilations of one function
        with torch._dynamo.config.patch(recompile_limit=256):
            try:
                return compiled(codes, state)
            except torch._dynamo.exc.TorchDynamoException as e:  # its message runs to pages; the cause's first line
                cause = getattr(e, "inner_exception", None) or e  # a backend's failure wraps the error that says why
                lines = str(cause).strip().splitlines()
                first = f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
                raise MkportError(f"--compile-codec: torch.compile failed on a codec call of {tuple(codes.shape)} "
                                  f"codes ({first}); serve with --no-compile-codec") from None

    return call


class StreamingCodec:
    """Frames in, audio chunks out: each chunk decodes its own frames only, with this stream's decoder state kept
    (SpeechDecoder.stream), so the audio is the whole-utterance decode. Chunks grow from `first_chunk` frames to
    `chunk`: each is as long as the audio already out (1, 1, 2, 4, 8, 16, 16, ... with the defaults), so the first
    audio waits for one frame only, and while frames come faster than real time the next chunk is ready before the
    audio out so far has played. One utterance: after flush() it takes no more frames."""

    def __init__(self, decoder: SpeechDecoder, first_chunk=DEFAULT_FIRST_CHUNK, chunk=DEFAULT_CHUNK):
        if first_chunk < 1 or chunk < 1:
            raise MkportError("streaming codec: first_chunk >= 1 and chunk >= 1 are needed")
        self.decoder, self.first_chunk, self.chunk = decoder, first_chunk, chunk
        self.kept = decoder.new_stream()
        self.frames: list[torch.Tensor] = []  # pushed, not decoded yet
        self.emitted = 0  # frames turned into audio
        self.flushed = False
        # a graph for every chunk length, captured by the first StreamingCodec on the decoder: a chunk in
        # mid-stream cannot be padded to a longer graph (the padding would enter the state)
        decoder.prepare(self.chunk_lengths())

    def chunk_size(self, emitted: int) -> int:
        return min(self.chunk, max(self.first_chunk, emitted))

    def chunk_lengths(self) -> list[int]:
        """The chunk lengths a stream decodes before the flush, in order, up to the steady one: with the defaults 1,
        2, 4, 8, 16. The decoder has a graph for each (SpeechDecoder.prepare); the flush is padded to one of them."""
        lengths, emitted = [], 0
        while not lengths or lengths[-1] < self.chunk:
            size = self.chunk_size(emitted)
            if size not in lengths:
                lengths.append(size)
            emitted += size
        return lengths

    def _emit(self, last: bool) -> torch.Tensor:
        codes = torch.stack(self.frames)
        self.frames = []
        self.emitted += codes.shape[0]
        return self.decoder.stream(codes, self.kept, last=last)

    def next_push_emits(self) -> bool:
        """Whether the next push returns audio (the frame loop queues no work ahead of that decode)."""
        return len(self.frames) + 1 >= self.chunk_size(self.emitted)

    def push(self, frame: torch.Tensor) -> torch.Tensor | None:
        """Adds one frame [16]; returns an audio chunk when one is due."""
        if self.flushed:
            raise MkportError("streaming codec: a frame after flush(); each utterance needs a StreamingCodec of its own")
        emits = self.next_push_emits()
        self.frames.append(torch.as_tensor(frame).reshape(-1).long().cpu())
        return self._emit(last=False) if emits else None

    def flush(self) -> torch.Tensor | None:
        """The audio of the frames not decoded yet, if any; the stream ends."""
        self.flushed = True
        return self._emit(last=True) if self.frames else None


def turn_chunk(decoded: int, per_turn: int) -> int:
    """The frames of a stream's next chunk when its frames come `per_turn` at a time (a batched server's turn of N
    frames, its first turn starting at its first frame): 1 (its first audio, decoded on its own), N - 1 (the rest
    of its first turn), then N, N, ...; with N = 1, one frame a chunk. `decoded`: its frames decoded so far. The
    schedule follows the stream's own count, never the load, so its calls have the same lengths alone and under
    load."""
    if decoded == 0 or per_turn == 1:
        return 1
    return per_turn - 1 if decoded == 1 else per_turn


def turn_chunk_lengths(per_turn: int) -> list[int]:
    """The call lengths turn_chunk gives: 1, N - 1 and N (those of them that are distinct and not 0)."""
    return sorted({1, per_turn - 1, per_turn} - {0})


class CodecStreams:
    """Up to `streams` streams decoded chunk by chunk, with their state kept, any of them together: decode() takes the
    next frames of each stream named (the same count for each) and gives their samples; a decode of each stream's
    frames in one call would give the same up to float32 rounding (the convolutions of another length sum in
    another order: a call of N frames equals N calls of one only to that rounding, so a stream's samples are
    reproducible only with the same chunk lengths, in the same order). Every call of a length has the same shape,
    `streams` rows (the rows of streams not in it decode frames nobody hears, into a spare row of the state), so
    that a stream's samples do not depend on which other streams share its calls: the same arithmetic whoever they
    are. With `sized`, a call has instead the fewest rows of call_sizes() that hold its streams: a call of one stream
    costs what one row costs (on the H200 2.5 ms against 4.7 for 16 rows), and a stream's samples may then differ
    in their last bits with how many share its calls (the batched server sizes them where its frames are sized
    already: mkport.serve.batched.sized_codec). On CUDA each call is a replay of one graph of its length and rows
    (prepare() captures them up front)."""

    def __init__(self, decoder: SpeechDecoder, streams: int, sized: bool = False, pool=None,
                 capture_stream: torch.cuda.Stream | None = None):
        if streams < 1:
            raise MkportError(f"codec streams: at least 1, not {streams}")
        self.decoder, self.streams, self.sized = decoder, streams, sized
        # the CUDA graphs' memory pool and capture stream: the decoder's pool and torch's capture stream, unless
        # calls run on another CUDA stream at the same time as those of other CodecStreams (graphs of one pool
        # reuse each other's intermediates; graphs captured on one stream share cuBLAS's workspace: graphs.capture)
        self.pool = decoder._graph_pool if pool is None else pool
        self.capture_stream = capture_stream
        self.state = StreamState(decoder.module, streams)
        # (frames a row, rows) -> (static codes [rows, Q, frames], the call's state rows [rows], graph, wav)
        self._calls: dict[tuple[int, int], tuple] = {}

    def call_sizes(self) -> list[int]:
        """The rows a call may have: `streams`, or sized, the powers of two below it as well."""
        if not self.sized:
            return [self.streams]
        return [1 << k for k in range(self.streams.bit_length()) if 1 << k < self.streams] + [self.streams]

    def call_rows(self, n: int) -> int:
        """The rows of a call of n streams."""
        return next(size for size in self.call_sizes() if size >= n)

    def prepare(self, lengths=(1,)) -> None:
        """The calls of these lengths (frames a row) at every size, on CUDA their graphs captured, so that no request
        pays for it."""
        for frames in lengths:
            for rows in self.call_sizes():
                self._call(frames, rows)

    def _call(self, frames: int, size: int) -> tuple:
        if (frames, size) not in self._calls:
            dec = self.decoder
            codes = torch.zeros(size, dec.num_quantizers, frames, dtype=torch.long, device=dec.device)
            rows = torch.full((size,), self.state.spare, dtype=torch.long, device=dec.device)
            graph = wav = None
            if dec.graphs:
                # capture() runs the call once eagerly: every row spare, so no stream's state moves
                self.state.rows = rows
                graph, wav = capture(lambda: dec.captured_call(codes, self.state), self.pool, self.capture_stream)
            self._calls[frames, size] = (codes, rows, graph, wav)
        return self._calls[frames, size]

    def reset(self, stream: int) -> None:
        """Stream `stream` (0 .. streams - 1) starts a new utterance."""
        if not 0 <= stream < self.streams:
            raise MkportError(f"codec stream {stream} is not one of 0..{self.streams - 1}")
        self.state.reset(stream)

    @torch.no_grad()
    def decode(self, streams: list[int], frames: torch.Tensor) -> torch.Tensor:
        """frames [n, L, Q] (or [n, Q]: L = 1): the next L frames of each of `streams` (distinct) -> their samples
        [n, L * upsample]."""
        n, dec = len(streams), self.decoder
        if frames.dim() == 2:
            frames = frames[:, None]
        if frames.dim() != 3 or frames.shape[0] != n or frames.shape[1] < 1 or frames.shape[2] != dec.num_quantizers \
                or len(set(streams)) != n:
            raise MkportError(f"codec streams: {n} distinct streams and frames [{n}, {dec.num_quantizers}] or [{n}, "
                              f"L, {dec.num_quantizers}] are needed, got {tuple(frames.shape)}")
        if not all(0 <= s < self.streams for s in streams):
            raise MkportError(f"codec streams: {streams} are not all of 0..{self.streams - 1}")
        static, rows, graph, wav = self._call(frames.shape[1], self.call_rows(n))
        # through pinned memory, without waiting for the stream (as SpeechDecoder.decode)
        pinned = dec.device.type == "cuda"
        ids, codes = torch.tensor(streams, dtype=torch.long), frames.long().transpose(1, 2).contiguous()
        rows[:n].copy_(ids.pin_memory() if pinned else ids, non_blocking=pinned)
        rows[n:] = self.state.spare
        static[:n].copy_(codes.pin_memory() if pinned else codes, non_blocking=pinned)
        if graph is not None:
            graph.replay()
        else:
            self.state.rows = rows
            wav = dec.module.stream(static, self.state)
        return wav[:n].reshape(n, -1).clone()


def stream_decode(decoder: SpeechDecoder, codes: torch.Tensor, **kw) -> Iterator[torch.Tensor]:
    """All of `codes` [T, 16] through a StreamingCodec, chunk by chunk (tests and tools)."""
    codec = StreamingCodec(decoder, **kw)
    for frame in codes:
        out = codec.push(frame)
        if out is not None:
            yield out
    out = codec.flush()
    if out is not None:
        yield out


# -- random weights -------------------------------------------------------------------------------------
@torch.no_grad()
def randomize_decoder(module: CodecDecoder, seed: int = 0, target_std: float = 0.1) -> None:
    """Seeded random weights scaled like a working decoder: unit-variance projections, codebooks with
    unit-norm entries, active snake and layer-scale paths; the last convolution is rescaled so the output
    has about `target_std` (well inside the [-1, 1] clamp)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "cluster_usage":
            p.fill_(1.0)
        elif leaf == "embedding_sum":
            p.copy_(torch.randn(p.shape, generator=gen))
        elif leaf in ("alpha", "beta"):  # SnakeBeta, log scale
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif leaf == "scale":  # transformer layer scale
            p.copy_(0.1 + 0.02 * torch.randn(p.shape, generator=gen))
        elif leaf == "gamma":  # ConvNeXt layer scale
            p.copy_(0.1 + 0.02 * torch.randn(p.shape, generator=gen))
        elif "norm" in name and p.dim() == 1:
            p.copy_((1.0 if leaf == "weight" else 0.0) + 0.05 * torch.randn(p.shape, generator=gen))
        elif leaf == "bias":
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        else:
            fan_in = math.prod(p.shape[1:])
            owner = module.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(owner, torch.nn.ConvTranspose1d):  # [in, out/groups, k]: each output sees in * k / stride
                fan_in = p.shape[0] * p.shape[2] / owner.stride[0]
            elif isinstance(owner, torch.nn.Conv1d) and owner.groups > 1:
                fan_in = p.shape[1] * p.shape[2]
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
    # calibrate the output level on random codes
    cfg = module.config
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, 8), generator=gen)
    last = module.decoder[-1].conv
    hidden = module.decoder(module.latents(codes))  # before the clamp
    std = float(hidden.std())
    if std > 0 and math.isfinite(std):
        last.weight.mul_(target_std / std)
        last.bias.mul_(target_std / std)


def write_random_codec(folder: Path, codec_config: dict, seed: int = 0) -> Path:
    """<folder>/config.json and model.safetensors (decoder.* tensors only) with seeded random weights."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    module = build_decoder(folder / "config.json", codec_config)
    randomize_decoder(module, seed)
    state = {f"decoder.{k}": v.contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"mkport_seed": str(seed)})
    (folder / "config.json").write_text(json.dumps(codec_config, indent=1))
    return folder
