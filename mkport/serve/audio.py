"""A response's audio, chunk by chunk: the scheduler's int16 PCM in, the bytes of the request's `response_format`
out as soon as the encoder gives them (docs/serving.md). Encoding and the tempo change of `speed` are FFmpeg's,
through PyAV (its wheels ship the codecs): the atempo filter changes the tempo and keeps the pitch."""

from __future__ import annotations

import av
import numpy as np

from ..tts.wav import wav_header

# response_format -> (media type, PyAV container, codec); wav and pcm need no encoder
FORMATS = {
    "mp3": ("audio/mpeg", "mp3", "libmp3lame"),
    "opus": ("audio/ogg", "ogg", "libopus"),
    "aac": ("audio/aac", "adts", "aac"),
    "flac": ("audio/flac", "flac", "flac"),
    "wav": ("audio/wav", None, None),
    "pcm": ("audio/pcm", None, None),
}
SPEEDS = (0.25, 4.0)  # OpenAI's range of `speed`
MIN_ATEMPO = 0.5  # one atempo filter slows down to half speed at most; slower takes two in a row
# Ogg's muxer writes a page a second by default: a page every 20 ms of audio lets the chunks leave as they come
MUXER_OPTIONS = {"ogg": {"page_duration": "20000"}}


class _Sink:
    """The file PyAV's muxer writes to: what it wrote since the last take()."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


def _frame(samples: np.ndarray, sample_rate: int, pts: int) -> av.AudioFrame:
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate, frame.pts = sample_rate, pts
    return frame


class AudioEncoder:
    """push(pcm) -> the bytes to send now (possibly none); finish() -> the rest. 16-bit mono in; `fmt` a key of
    FORMATS; `speed` in SPEEDS (1.0: the samples untouched)."""

    def __init__(self, fmt: str, sample_rate: int, speed: float = 1.0):
        _, container, codec = FORMATS[fmt]
        self.rate = sample_rate
        self.pts = 0
        self.header = wav_header(sample_rate, None) if fmt == "wav" else b""
        self.tempo = self._tempo(speed) if speed != 1.0 else None
        self.sink = self.muxer = None
        if container:
            self.sink = _Sink()
            self.muxer = av.open(self.sink, mode="w", format=container, options=MUXER_OPTIONS.get(container, {}))
            self.stream = self.muxer.add_stream(codec, rate=sample_rate, layout="mono")
        # FFmpeg does work for each chunk (mp3 ~2 ms of a CPU for 80 ms of audio, opus and aac ~0.6, flac 0.1):
        # worth a worker thread, where PyAV lets go of the GIL
        self.works = self.muxer is not None or self.tempo is not None

    def _tempo(self, speed: float) -> av.filter.Graph:
        graph = av.filter.Graph()
        chain = [graph.add_abuffer(sample_rate=self.rate, format="s16", layout="mono", time_base=f"1/{self.rate}")]
        while speed < MIN_ATEMPO:
            chain.append(graph.add("atempo", str(MIN_ATEMPO)))
            speed /= MIN_ATEMPO
        chain += [graph.add("atempo", str(speed)), graph.add("abuffersink")]
        for a, b in zip(chain, chain[1:]):
            a.link_to(b)
        graph.configure()
        return graph

    def push(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, dtype="<i2")
        frame = _frame(samples, self.rate, self.pts)
        self.pts += samples.size
        return self._out(self._stretch(frame) if self.tempo else [frame])

    def finish(self) -> bytes:
        out = self._out(self._stretch(None)) if self.tempo else b""
        if self.muxer:
            for packet in self.stream.encode(None):
                self.muxer.mux(packet)
            self.muxer.close()
            out += self.sink.take()
        return out

    def _stretch(self, frame: av.AudioFrame | None) -> list[av.AudioFrame]:
        """The frames atempo gives for `frame` (None: the end of the audio)."""
        self.tempo.push(frame)
        frames = []
        while True:
            try:
                frames.append(self.tempo.pull())
            except (av.error.BlockingIOError, av.error.EOFError):
                return frames

    def _out(self, frames: list[av.AudioFrame]) -> bytes:
        if self.muxer is None:
            out = self.header + b"".join(f.to_ndarray().astype("<i2").tobytes() for f in frames)
            self.header = b""
            return out
        for frame in frames:
            for packet in self.stream.encode(frame):
                self.muxer.mux(packet)
        return self.sink.take()
