"""Streaming WAV writer: 16-bit PCM, mono, 24 kHz by default.

To a seekable output (a file) the RIFF and data sizes are fixed up when the writer is closed; to a pipe
the header carries the streaming sizes 0xFFFFFFFF (what players accept for a stream of unknown length).

`open_wav_output` is entered before anything heavy runs, so that a bad output ends the command at once:
- stdout is refused when it is a terminal, or a file opened for append (`>>`): a WAV cannot follow other
  bytes, and the header fixed up at the end would land after the audio;
- a named file is written as a hidden temp file with a unique name next to it, fsynced, and moved onto the
  name only when complete; an existing file is replaced only with `force`. The temp file is removed on any
  failure and on SIGINT, SIGTERM and SIGHUP (exit 128 + the signal). A problem with the path (missing
  folder, no permission, read-only file system, a folder or device at the name) is one MkportError.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import signal
import stat
import struct
import sys
import threading
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
    close when the stream is seekable. `name` says what is written in an error (`--out FILE`, `stdout`)."""

    def __init__(self, stream: BinaryIO, sample_rate: int = SAMPLE_RATE, name: str = "the WAV output"):
        self.stream, self.sample_rate, self.name = stream, sample_rate, name
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
        with _os_errors(self.name):
            self._header()
            self.stream.write(pcm)
            self.stream.flush()
        self.data_bytes += len(pcm)
        self.samples += len(pcm) // 2

    def finish(self) -> None:
        """Marks the stream complete: exact sizes where seekable (a pipe keeps the streaming header)."""
        if self.data_bytes > STREAMING_SIZE - 36:
            raise MkportError("audio longer than a WAV file can hold (4 GiB)")
        with _os_errors(self.name):
            self._header()
            if self.seekable:
                end = self.stream.tell()
                self.stream.seek(self.start)
                self.stream.write(wav_header(self.sample_rate, self.data_bytes))
                self.stream.seek(end)
            self.stream.flush()


@contextlib.contextmanager
def _os_errors(name: str) -> Iterator[None]:
    """An OSError of the output as one line: what was written to, and the system's reason."""
    try:
        yield
    except OSError as e:
        raise MkportError(f"{name}: {e.strerror or e}") from None


@contextlib.contextmanager
def open_wav_output(out: str, sample_rate: int = SAMPLE_RATE, force: bool = False) -> Iterator[WavWriter]:
    """'-' is stdout; anything else a file path (see the module docstring). Enter it before the heavy work:
    the writer's sample_rate can still be set before the first write."""
    if out == "-":
        writer = WavWriter(_checked_stdout(), sample_rate, "stdout")
        yield writer  # on error a seekable stdout keeps the streaming header: it never claims a length
        writer.finish()
        return
    name = f"--out {out}"
    path = _checked_path(out, force)
    tmp = path.with_name(f".{path.name[:100]}.{secrets.token_hex(8)}.partial")
    with _os_errors(name):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    published = False
    try:
        with _exit_on_signals(out), os.fdopen(fd, "wb") as f:
            writer = WavWriter(f, sample_rate, name)
            yield writer
            writer.finish()
            with _os_errors(name):
                os.fsync(f.fileno())
                f.close()
                _publish(tmp, path, force, out)
            published = True
    finally:
        if not published:
            with contextlib.suppress(OSError):  # the error being reported is the first one, not this
                tmp.unlink()


def _checked_stdout() -> BinaryIO:
    stream = sys.stdout.buffer
    if stream.isatty():
        raise MkportError("refusing to write WAV audio to a terminal: redirect stdout (> out.wav) or pass --out FILE")
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file descriptor (an in-memory stream): nothing to check
        return stream
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND and stat.S_ISREG(os.fstat(fd).st_mode):
        raise MkportError("stdout is a file opened for append (>>): a WAV cannot be appended to other bytes; "
                          "use > FILE or --out FILE")
    return stream


def _checked_path(out: str, force: bool) -> Path:
    path = Path(out)
    if path.is_dir():
        raise MkportError(f"--out {out} is a folder; give a file name")
    if not path.parent.is_dir():
        what = "is not a folder" if path.parent.exists() else "does not exist"
        raise MkportError(f"--out {out}: {path.parent} {what}")
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise MkportError(f"--out {out} is not a regular file; give a file name (or - for stdout)")
        if not force:
            raise MkportError(f"--out {out} exists; pass --force to replace it")
    return path


def _publish(tmp: Path, path: Path, force: bool, out: str) -> None:
    """Moves the complete temp file onto the name; without force never over a file, even one that
    appeared while this ran (a hard link fails when the name is taken; rename would replace it)."""
    taken = f"--out {out} appeared while this ran; not replaced (pass --force to replace it)"
    if force:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise MkportError(taken) from None
    except OSError:  # a file system without hard links: check, then rename
        if path.exists():
            raise MkportError(taken) from None
        os.replace(tmp, path)
    else:
        tmp.unlink()


OUTPUT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _exit_on_signals(out: str) -> Iterator[None]:
    """SIGINT, SIGTERM or SIGHUP while the temp file exists: say so and exit with 128 + the signal, through
    SystemExit, so that open_wav_output's clean-up removes the file. Python runs handlers in the main thread
    only, and only there can they be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        with contextlib.suppress(OSError):  # a hung-up terminal
            print(f"error: stopped by {signal.Signals(signum).name}; {out} was not written", file=sys.stderr)
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, stop) for s in OUTPUT_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def read_wav(path) -> tuple[int, np.ndarray]:
    """(sample rate, float32 samples) of a 16-bit mono WAV written here (tests and tools)."""
    import wave

    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise MkportError(f"{path}: expected 16-bit mono PCM")
        data = w.readframes(w.getnframes())
        return w.getframerate(), np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
