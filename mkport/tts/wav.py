"""Streaming WAV writer: 16-bit PCM, mono, 24 kHz by default.

To a seekable output (a file) the RIFF and data sizes are fixed up when the writer is closed; to a pipe
the header carries the streaming sizes 0xFFFFFFFF (what players accept for a stream of unknown length).
`open_wav_output` writes a named file as `<name>.partial` and renames it only on success, so a run that
fails never leaves a file that looks complete.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from ..errors import MkportError

SAMPLE_RATE = 24000
STREAMING_SIZE = 0xFFFFFFFF
HEADER_BYTES = 44


def wav_header(sample_rate: int, data_bytes: int | None, channels: int = 1, bits: int = 16) -> bytes:
    """The 44-byte canonical header; data_bytes None gives the streaming form (sizes 0xFFFFFFFF)."""
    block = channels * bits // 8
    if data_bytes is None:
        riff, data = STREAMING_SIZE, STREAMING_SIZE
    else:
        riff, data = 36 + data_bytes, data_bytes
    return (
        b"RIFF" + struct.pack("<I", riff) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, bits)
        + b"data" + struct.pack("<I", data)
    )


def to_pcm16(samples) -> bytes:
    """float samples in [-1, 1] (numpy or torch, any shape, flattened) -> little-endian int16, clipped."""
    if hasattr(samples, "detach"):
        samples = samples.detach().float().cpu().numpy()
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    return (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def _seekable(stream: BinaryIO) -> bool:
    try:
        return stream.seekable()
    except (AttributeError, OSError, ValueError):
        return False


class WavWriter:
    """Writes the header on the first chunk (or on close, for an empty stream) and fixes it up on a clean
    close when the stream is seekable."""

    def __init__(self, stream: BinaryIO, sample_rate: int = SAMPLE_RATE):
        self.stream, self.sample_rate = stream, sample_rate
        self.seekable = _seekable(stream)
        self.start = stream.tell() if self.seekable else 0
        self.data_bytes = 0
        self.samples = 0
        self._header_written = False

    def _header(self) -> None:
        if not self._header_written:
            self.stream.write(wav_header(self.sample_rate, None))
            self._header_written = True

    def write(self, samples) -> None:
        pcm = to_pcm16(samples)
        self._header()
        self.stream.write(pcm)
        self.stream.flush()
        self.data_bytes += len(pcm)
        self.samples += len(pcm) // 2

    def finish(self) -> None:
        """Marks the stream complete: exact sizes where seekable (a pipe keeps the streaming header)."""
        self._header()
        if self.data_bytes > STREAMING_SIZE - 36:
            raise MkportError("audio longer than a WAV file can hold (4 GiB)")
        if self.seekable:
            end = self.stream.tell()
            self.stream.seek(self.start)
            self.stream.write(wav_header(self.sample_rate, self.data_bytes))
            self.stream.seek(end)
        self.stream.flush()


@contextlib.contextmanager
def open_wav_output(out: str, sample_rate: int = SAMPLE_RATE) -> Iterator[WavWriter]:
    """'-' is stdout (refused when it is a terminal); anything else a file path, written as
    `<path>.partial` and renamed on success, removed on failure."""
    if out == "-":
        stream = sys.stdout.buffer
        if stream.isatty():
            raise MkportError("refusing to write WAV audio to a terminal: redirect stdout (> out.wav) or pass --out FILE")
        writer = WavWriter(stream, sample_rate)
        yield writer  # on error a seekable stdout keeps the streaming header: it never claims a length
        writer.finish()
        return
    path = Path(out)
    if path.is_dir():
        raise MkportError(f"--out {out} is a directory; give a file name")
    if not path.parent.exists():
        raise MkportError(f"--out {out}: folder {path.parent} does not exist")
    partial = path.with_name(path.name + ".partial")
    ok = False
    try:
        with open(partial, "wb") as f:
            writer = WavWriter(f, sample_rate)
            yield writer
            writer.finish()
        os.replace(partial, path)
        ok = True
    finally:
        if not ok:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()


def read_wav(path) -> tuple[int, np.ndarray]:
    """(sample rate, float32 samples) of a 16-bit mono WAV written here (tests and tools)."""
    import wave

    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise MkportError(f"{path}: expected 16-bit mono PCM")
        data = w.readframes(w.getnframes())
        return w.getframerate(), np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
