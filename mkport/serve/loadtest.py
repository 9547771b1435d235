"""`mkport loadtest`: a load on a running `mkport serve`, open or closed loop.

Open loop (`rate`): requests arrive as a Poisson process (exponential gaps with mean 1 / rate) for
`duration_s`; an arrival while `concurrency` requests are in flight is not sent and counted as dropped (arrivals
never wait for answers). Closed loop (`streams` N): N clients each send a request as soon as their last one has
ended, for `duration_s`: N streams open all the time, the way a server's capacity in concurrent streams is stated
(a connection each: `concurrency` bounds the open loop only).
The clients start together (a burst of N arrivals, and with requests of one length they stay in step), or one after
another over `ramp_s` seconds, so that their arrivals spread over the run as independent users' would.
Each request is a sentence of the kind a voice agent says, streamed as PCM. Per request: time to first audio
(request sent to the first audio bytes in), real-time factor (request sent to the last byte / audio seconds) and
underruns: a chunk that arrives after the audio received before it would have finished playing, had playback
started at the first byte, each kept with where it fell (seconds of audio before it) and how long playback was
silent, so that a stream that ran dry at its start (one chunk in hand) is told from one stalled later. Bounded:
requests start until `duration_s` (and at most MAX_REQUESTS of them), and what is still in flight then gets
`timeout_s` more before it is cancelled.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass

import httpx

from ..errors import MkportError

SENTENCES = (
    "Hello! How can I help you today?",
    "Sure, I can help you with that.",
    "Your appointment is confirmed for Tuesday at three in the afternoon.",
    "I'm sorry, I didn't quite catch that. Could you say it again?",
    "The weather tomorrow will be sunny with a high of twenty-four degrees.",
    "Let me check that for you. It will only take a moment.",
    "Your order has shipped and should arrive within two to three business days.",
    "Would you like me to send a confirmation to your email address?",
    "The nearest pharmacy is about half a mile north of your location, on Main Street.",
    "I've added milk, eggs and bread to your shopping list.",
    "Your current balance is one hundred and twenty-three dollars and forty-five cents.",
    "Thanks for calling. Is there anything else I can do for you?",
    "The meeting has been moved to next Monday, and I've updated the invitation for everyone.",
    "Great choice! That table for four is booked for seven thirty tonight.",
    "To reset your password, open the settings page and choose account security.",
    "I found three flights to Chicago on Friday morning. The earliest leaves at six fifteen.",
)
MAX_REQUESTS = 100_000
MAX_STREAMS = 1024
RETRY_S = 0.1  # a closed-loop client's pause after a failed request, so that a refusing server is not hammered
PERCENTILES = (50, 95, 99)
EARLY_AUDIO_S = 1.0  # underruns within this much of a stream's audio are counted apart (its start)


@dataclass(frozen=True)
class LoadSpec:
    url: str
    rate: float = 1.0
    duration_s: float = 30.0
    concurrency: int = 32
    voice: str | None = None
    max_frames: int | None = None
    seed: int = 0
    timeout_s: float = 120.0
    streams: int | None = None  # closed loop: this many clients back to back, instead of Poisson arrivals
    ramp_s: float = 0.0  # closed loop: client k starts at k * ramp_s / streams

    def check(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise MkportError(f"URL '{self.url}' must start with http:// or https://")
        if not (self.rate > 0 and self.duration_s > 0 and self.concurrency >= 1 and self.timeout_s > 0):
            raise MkportError("--rate and --duration must be > 0, --concurrency >= 1, --timeout > 0")
        if self.streams is not None and not 1 <= self.streams <= MAX_STREAMS:
            raise MkportError(f"--streams {self.streams}: must be 1..{MAX_STREAMS}")
        if self.ramp_s and self.streams is None:
            raise MkportError("--ramp spreads the starts of --streams clients: give --streams too")
        if not 0 <= self.ramp_s < self.duration_s:
            raise MkportError(f"--ramp {self.ramp_s:g}: must be >= 0 and shorter than --duration ({self.duration_s:g} s)")
        if self.rate * self.duration_s > MAX_REQUESTS:
            raise MkportError(f"--rate x --duration gives more than {MAX_REQUESTS} requests; lower one of them")


def arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrival times in [0, duration_s)."""
    times, t = [], rng.expovariate(rate)
    while t < duration_s and len(times) < MAX_REQUESTS:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def percentiles(values: list[float]) -> dict:
    """Nearest-rank p50/p95/p99, mean and max (None when there is nothing to summarise)."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None, "max": None}
    v = sorted(values)
    out = {f"p{p}": round(v[max(0, math.ceil(p / 100 * len(v)) - 1)], 4) for p in PERCENTILES}
    return out | {"mean": round(sum(v) / len(v), 4), "max": round(v[-1], 4)}


async def _request(client: httpx.AsyncClient, body: dict, sample_rate: int) -> dict:
    start = time.perf_counter()
    first = play_end = None
    received = 0
    dry: list[list[float]] = []  # each underrun: [seconds of audio before it, ms of silence]
    try:
        async with client.stream("POST", "/v1/audio/speech", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                try:
                    message = resp.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = resp.text[:200]
                return {"error": f"HTTP {resp.status_code}: {message}"}
            async for chunk in resp.aiter_bytes():
                now = time.perf_counter()
                if first is None:
                    first = now
                elif now > play_end:
                    dry.append([round(received / 2 / sample_rate, 3), round((now - play_end) * 1e3, 1)])
                play_end = max(play_end or now, now) + len(chunk) / 2 / sample_rate
                received += len(chunk)
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}".rstrip(": ")}
    end = time.perf_counter()
    audio_s = received / 2 / sample_rate
    if not received:
        return {"error": "no audio in the response"}
    return {"ttfa_ms": round((first - start) * 1e3, 2), "server_ttfa_ms": server_first_audio_ms(resp.headers),
            "audio_s": round(audio_s, 3), "rtf": round((end - start) / audio_s, 4), "underruns": len(dry),
            "underrun_at": dry}


def server_first_audio_ms(headers) -> float | None:
    """The server's own time to first audio from its Server-Timing header (`first-audio;dur=MS`, mkport serve's),
    None where the server sends none."""
    for metric in headers.get("server-timing", "").split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        if name == "first-audio":
            for param in params:
                key, _, value = param.partition("=")
                if key == "dur":
                    try:
                        return float(value)
                    except ValueError:
                        return None
    return None


def schedule(spec: LoadSpec) -> list[tuple[float, str]]:
    """(arrival time, sentence) pairs, the same for the same seed."""
    rng = random.Random(spec.seed)
    return [(t, rng.choice(SENTENCES)) for t in arrivals(spec.rate, spec.duration_s, rng)]


async def _run(spec: LoadSpec, plan: list[tuple[float, str]], tick) -> dict:
    # a connection for each request in flight: closed loop, one a client, whatever --concurrency says (with fewer,
    # the clients past it queued in httpx's pool for a connection, and the pool let a client that had just finished
    # take its connection again: at 64 streams and 32 connections, half the clients waited the whole run, their
    # wait counted as time to first audio, while the server saw 32 streams)
    connections = max(spec.concurrency, spec.streams or 0)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=spec.url.rstrip("/"), limits=limits,
                                 timeout=httpx.Timeout(spec.timeout_s, connect=10.0)) as client:
        try:
            models = (await client.get("/v1/models")).raise_for_status().json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise MkportError(f"{spec.url} is not a ready mkport serve (GET /v1/models: {e})") from None
        sample_rate = int(models["sample_rate"])
        records: list[dict] = []
        in_flight: set[asyncio.Task] = set()

        async def one(at: float, text: str) -> dict:
            body = {"input": text, "response_format": "pcm", "seed": len(records)}
            if spec.voice:
                body["voice"] = spec.voice
            if spec.max_frames:
                body["max_frames"] = spec.max_frames
            record = {"at_s": round(at, 3), "text": text}
            records.append(record)
            record.update(await _request(client, body, sample_rate))
            tick()
            return record

        t0 = time.perf_counter()
        dropped = 0
        if spec.streams:
            await _closed_loop(spec, one, t0)
        for at, text in plan:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            in_flight = {t for t in in_flight if not t.done()}
            if len(in_flight) >= spec.concurrency:
                dropped += 1
                tick()
                continue
            in_flight.add(asyncio.create_task(one(at, text)))
        await asyncio.sleep(max(0.0, t0 + spec.duration_s - time.perf_counter()))
        if in_flight:
            _, late = await asyncio.wait(in_flight, timeout=spec.timeout_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for record in records:
            record.setdefault("error", None if "ttfa_ms" in record else "cancelled: still running at the end")
        wall_s = time.perf_counter() - t0
    ok = [r for r in records if r["error"] is None]
    timed = [r for r in ok if r.get("server_ttfa_ms") is not None]  # the server sent its Server-Timing
    errors: dict[str, int] = {}
    for r in records:
        if r["error"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    summary = {
        "arrivals": len(plan) if plan else len(records),  # closed loop: every request is an arrival
        "sent": len(records), "completed": len(ok), "errors": len(records) - len(ok),
        "dropped": dropped, "wall_s": round(wall_s, 2), "audio_s": round(sum(r["audio_s"] for r in ok), 2),
        "ttfa_ms": percentiles([r["ttfa_ms"] for r in ok]), "rtf": percentiles([r["rtf"] for r in ok]),
        # the server's part of it (Server-Timing), and the rest: the request's way in and the chunk's way out
        "server_ttfa_ms": percentiles([r["server_ttfa_ms"] for r in timed]),
        "outside_server_ms": percentiles([r["ttfa_ms"] - r["server_ttfa_ms"] for r in timed]),
        "underruns": sum(r["underruns"] for r in ok),
        "streams_with_underruns": sum(1 for r in ok if r["underruns"]),
        # within a stream's first second of audio: its start, while it holds a chunk or two, against later stalls
        "underruns_in_first_second": sum(1 for r in ok for at, _ in r["underrun_at"] if at < EARLY_AUDIO_S),
        "silence_ms": percentiles([ms for r in ok for _, ms in r["underrun_at"]]), "error_kinds": errors,
    }
    return {"spec": asdict(spec), "model": models.get("id"), "summary": summary, "requests": records}


async def _closed_loop(spec: LoadSpec, one, t0: float) -> None:
    """spec.streams clients, each sending its next request when the last has ended, until duration_s; client k from
    k * ramp_s / streams on."""
    sent = 0

    async def client(k: int) -> None:
        nonlocal sent
        rng = random.Random(spec.seed * MAX_STREAMS + k)
        await asyncio.sleep(max(0.0, t0 + k * spec.ramp_s / spec.streams - time.perf_counter()))
        while (at := time.perf_counter() - t0) < spec.duration_s and sent < MAX_REQUESTS:
            sent += 1
            if (await one(at, rng.choice(SENTENCES))).get("error"):
                await asyncio.sleep(RETRY_S)

    clients = [asyncio.create_task(client(k)) for k in range(spec.streams)]
    _, late = await asyncio.wait(clients, timeout=spec.duration_s + spec.timeout_s)
    for task in late:  # a request past its time: cancelled, recorded as still running
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)


def run_loadtest(spec: LoadSpec, progress: bool = False) -> dict:
    spec.check()
    plan = [] if spec.streams else schedule(spec)
    if not progress:
        return asyncio.run(_run(spec, plan, lambda: None))
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("loadtest"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("requests", total=None if spec.streams else len(plan))  # closed loop: not known ahead
        return asyncio.run(_run(spec, plan, lambda: bar.advance(task)))


def render_table(result: dict):
    from rich.table import Table

    s, spec = result["summary"], result["spec"]
    ramp = f" (started over {spec['ramp_s']:g} s)" if spec.get("ramp_s") else ""
    load = (f"{spec['streams']} streams back to back{ramp}" if spec.get("streams") else
            f"{spec['rate']:g} req/s, concurrency {spec['concurrency']},")
    table = Table(title=f"mkport loadtest {spec['url']} ({result['model']}): {load} for {spec['duration_s']:g} s")
    for col in ("", "p50", "p95", "p99", "mean", "max"):
        table.add_column(col, justify="left" if not col else "right")
    for name, key in (("time to first audio ms", "ttfa_ms"), ("  the server's (Server-Timing)", "server_ttfa_ms"),
                      ("  outside the server", "outside_server_ms"), ("real-time factor", "rtf")):
        if key in ("server_ttfa_ms", "outside_server_ms") and (s.get(key) or {}).get("p50") is None:
            continue  # a server without Server-Timing, or a result from before it
        table.add_row(name, *["-" if s[key][c] is None else f"{s[key][c]:g}" for c in ("p50", "p95", "p99", "mean", "max")])
    early = (f", {s['underruns_in_first_second']} in a stream's first second, silent p50 {s['silence_ms']['p50']:g} / "
             f"max {s['silence_ms']['max']:g} ms" if s["underruns"] and "silence_ms" in s else "")
    table.caption = (f"sent {s['sent']}, completed {s['completed']}, errors {s['errors']}, dropped {s['dropped']}, "
                     f"underruns {s['underruns']} (in {s['streams_with_underruns']} streams{early}), "
                     f"audio {s['audio_s']} s"
                     + "".join(f"\nerror x{n}: {kind}" for kind, n in s["error_kinds"].items()))
    return table
