"""The planner: for each batch size, which backend runs each group of a Qwen3-TTS frame and how the groups share
the GPU (a composition, after the seed paper "One Megakernel is Not Enough"), chosen by a model of the streaming
schedule from groups timed standalone. docs/planning.md gives every formula and assumption.

Groups: P, the prompt prefill; T, the talker step; L, the code predictor's pass of a frame (16 steps); C, the codec
(speech tokenizer decoder, torch with CUDA graphs). P runs on T's decoder (the fused prefill on the megakernel),
C has one backend. T and L each run on the megakernel or on torch with CUDA graphs ("graphs"). Sharing: "serial",
every group on one CUDA stream, or "split": T and L megakernels on all SMs but k while the codec runs on a second
stream beside them (the megakernel's grid is its SM budget).

This module is the CPU part: compositions, the times they are scored from, the score, the choice, plan files
and their validation against end-to-end runs. mkport.tts.compose measures and runs them on a GPU.
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import MkportError

PLAN_VERSION = 3  # 2: the model's shape (Plan.shape); 3: the codec as one call a frame for every stream
BACKENDS = ("megakernel", "graphs")  # what the planner composes T and L from
SHORT = {"megakernel": "mk", "graphs": "graphs", "reference": "ref"}
SPLIT_FRACTIONS = (1 / 8, 1 / 4, 1 / 2)  # shares of the SMs tried for the codec beside the megakernels
FRAME_AUDIO_MS = 80.0  # audio a frame makes for each stream (12.5 frames a second)
MAX_BATCH = 64  # the largest batch size `mkport plan` takes
TIE = 0.01  # estimated frame times within 1% of the lowest are a tie, broken by the first chunk


@dataclass(frozen=True)
class Composition:
    """T's and L's backends, and the codec's SMs beside them: 0 is serial (one stream)."""

    talker: str
    predictor: str
    codec_sms: int = 0

    def __post_init__(self):
        if self.codec_sms < 0:
            raise MkportError(f"codec_sms {self.codec_sms}: 0 (serial) or the SMs of the codec's share (split)")
        if self.codec_sms and (self.talker, self.predictor) != ("megakernel", "megakernel"):
            raise MkportError("a split of the SMs needs the talker and the predictor on the megakernel (its grid is "
                              "its SM budget)")

    @property
    def sharing(self) -> str:
        return "split" if self.codec_sms else "serial"

    @property
    def label(self) -> str:
        """e.g. `mk+graphs serial` (T on the megakernel, L on graphs), `mk+mk split 33` (the codec on 33 SMs)."""
        share = f"split {self.codec_sms}" if self.codec_sms else "serial"
        return f"{SHORT.get(self.talker, self.talker)}+{SHORT.get(self.predictor, self.predictor)} {share}"

    def producer_sms(self, sm_count: int) -> int:
        """The SMs T and L run on."""
        return sm_count - self.codec_sms

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> "Composition":
        if not isinstance(d, dict) or set(d) != {"talker", "predictor", "codec_sms"}:
            raise MkportError(f"a composition is {{talker, predictor, codec_sms}}, not {d!r}")
        if not isinstance(d["codec_sms"], int):
            raise MkportError(f"codec_sms {d['codec_sms']!r} is not an integer")
        return cls(str(d["talker"]), str(d["predictor"]), d["codec_sms"])


def split_sms(sm_count: int, fractions=SPLIT_FRACTIONS) -> list[int]:
    """The codec's SMs of each split tried: a share of the GPU, at least one SM, and at least one left."""
    return sorted({min(sm_count - 1, max(1, round(sm_count * f))) for f in fractions}) if sm_count > 1 else []


def enumerate_compositions(sm_count: int, backends=BACKENDS, fractions=SPLIT_FRACTIONS) -> list[Composition]:
    """Every composition the planner scores: each backend pair, serial; with the megakernel, each split."""
    out = [Composition(t, l) for t, l in itertools.product(backends, repeat=2)]
    if "megakernel" in backends:
        out += [Composition("megakernel", "megakernel", k) for k in split_sms(sm_count, fractions)]
    return out


def key(*parts) -> str:
    """A GroupTimes entry's name: backend/batch/sms, backend/batch, or batch."""
    return "/".join(map(str, parts))


@dataclass
class GroupTimes:
    """Each group timed alone (ms, medians), as mkport.tts.compose.measure_groups times them.

    talker, predictor: key(backend, batch, sms), one talker step / one predictor pass of a frame for every
    sequence of the batch, the megakernel's grid `sms` SMs. prefill: key(backend, batch), one request's prompt into
    a slot of the talker. codec: key(batch), the codec's call for a frame of each of `batch` streams (one call of
    `batch` rows, its state kept: mkport.tts.codec.CodecStreams, as a batched server decodes), on the whole GPU.
    overhead: key(batch), what a whole frame (FrameBatch.step) takes beyond its talker step and predictor pass (the
    host's turn between frames). notes: why a backend was not timed at a batch (key(backend, batch))."""

    gpu: str
    sm_count: int
    talker: dict[str, float] = field(default_factory=dict)
    predictor: dict[str, float] = field(default_factory=dict)
    prefill: dict[str, float] = field(default_factory=dict)
    codec: dict[str, float] = field(default_factory=dict)
    overhead: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> "GroupTimes":
        if not isinstance(d, dict):
            raise MkportError("times: not an object")
        tables = ("talker", "predictor", "prefill", "codec", "overhead")
        missing = [f for f in ("gpu", "sm_count") + tables + ("notes",) if f not in d]
        if missing:
            raise MkportError(f"times: {missing[0]} missing")
        if not isinstance(d["sm_count"], int) or d["sm_count"] < 1:
            raise MkportError(f"times: sm_count {d['sm_count']!r} is not an integer >= 1")
        for name in tables:
            table = d[name]
            if not isinstance(table, dict) or not all(isinstance(v, (int, float)) and v >= 0 for v in table.values()):
                raise MkportError(f"times: {name} is not a table of times in ms")
        if not isinstance(d["notes"], dict):
            raise MkportError("times: notes is not an object")
        return cls(**{k: d[k] for k in ("gpu", "sm_count", "notes") + tables})


@dataclass(frozen=True)
class Estimate:
    """What the schedule model expects of a composition at a batch size (ms)."""

    frame_ms: float  # a steady frame of every stream: each stream's 80 ms of audio takes this long
    first_chunk_ms: float  # a stream joining the batch: its prompt in, to its first frame's samples
    producer_ms: float  # T + L + the host's turn, a frame
    codec_ms: float  # the codec's work a frame, on its SMs

    @property
    def rtf(self) -> float:
        return self.frame_ms / FRAME_AUDIO_MS

    def to_dict(self) -> dict:
        return {**asdict(self), "rtf": self.rtf}


def score(comp: Composition, times: GroupTimes, batch: int) -> Estimate | None:
    """The schedule model (docs/planning.md); None when a group of `comp` was not timed at `batch` (unsupported)."""
    sms = comp.producer_sms(times.sm_count)
    parts = (times.talker.get(key(comp.talker, batch, sms)), times.predictor.get(key(comp.predictor, batch, sms)),
             times.prefill.get(key(comp.talker, batch)), times.overhead.get(key(batch)), times.codec.get(key(batch)))
    if None in parts:
        return None
    talker, predictor, prefill, overhead, codec = parts
    # split: the codec has k of the S SMs; its kernels are taken to slow down in proportion
    codec *= times.sm_count / comp.codec_sms if comp.codec_sms else 1.0
    producer = talker + predictor + overhead
    # frame i's codec call overlaps frame i+1's production (split), or follows it (serial); a joining stream's first
    # audio is its prompt, its first frame and that frame's codec call
    frame = max(producer, codec) if comp.codec_sms else producer + codec
    return Estimate(frame, prefill + producer + codec, producer, codec)


def pick_best(candidates: list[tuple[Composition, float, float]]) -> Composition | None:
    """Of (composition, frame ms, first chunk ms): the lowest frame time that is real time (below 80 ms), a tie
    (within TIE) going to the lower first chunk; None when none is real time."""
    real = [c for c in candidates if c[1] < FRAME_AUDIO_MS]
    if not real:
        return None
    lowest = min(c[1] for c in real)
    return min((c for c in real if c[1] <= lowest * (1 + TIE)), key=lambda c: (c[2], c[1]))[0]


@dataclass
class Choice:
    """The compositions scored at one batch size (lowest estimated frame time first) and the one picked."""

    batch: int
    pick: Composition | None
    estimates: list[tuple[Composition, Estimate]]

    def to_dict(self) -> dict:
        return {"batch": self.batch, "pick": self.pick and self.pick.to_dict(),
                "estimates": [{"composition": c.to_dict(), **e.to_dict()} for c, e in self.estimates]}

    @classmethod
    def from_dict(cls, d) -> "Choice":
        try:
            estimates = [(Composition.from_dict(e["composition"]),
                          Estimate(*(float(e[f]) for f in ("frame_ms", "first_chunk_ms", "producer_ms", "codec_ms"))))
                         for e in d["estimates"]]
            pick = None if d["pick"] is None else Composition.from_dict(d["pick"])
            batch = d["batch"]
        except (KeyError, TypeError, ValueError) as e:
            raise MkportError(f"batches: an entry is malformed ({type(e).__name__}: {e})") from None
        if not isinstance(batch, int) or batch < 1:
            raise MkportError(f"batches: batch {batch!r} is not a batch size")
        if pick is not None and pick not in [c for c, _ in estimates]:
            raise MkportError(f"batch {batch}: the pick {pick.label} is not among its scored compositions")
        return cls(batch, pick, estimates)


def choose(times: GroupTimes, batches, compositions: list[Composition]) -> list[Choice]:
    """Per batch size: every composition whose groups were timed, scored, and the pick (pick_best)."""
    out = []
    for batch in batches:
        scored = [(c, e) for c in compositions if (e := score(c, times, batch)) is not None]
        scored.sort(key=lambda ce: (ce[1].frame_ms, ce[1].first_chunk_ms))
        out.append(Choice(batch, pick_best([(c, e.frame_ms, e.first_chunk_ms) for c, e in scored]), scored))
    return out


# -- validation: every composition end to end --------------------------------------------------------------
@dataclass
class Measured:
    """One composition run end to end at a batch size, `repeats` times (mkport.tts.compose.run_composition)."""

    composition: Composition
    frame_ms: list[float]
    first_chunk_ms: list[float]

    @property
    def frame(self) -> float:
        return statistics.median(self.frame_ms)

    @property
    def first_chunk(self) -> float:
        return statistics.median(self.first_chunk_ms)

    @property
    def spread(self) -> float:
        """The run-to-run spread of its frame time, over its median (the noise of the measurement)."""
        return (max(self.frame_ms) - min(self.frame_ms)) / self.frame

    def to_dict(self) -> dict:
        return {"composition": self.composition.to_dict(), "frame_ms": self.frame_ms,
                "first_chunk_ms": self.first_chunk_ms}

    @classmethod
    def from_dict(cls, d) -> "Measured":
        try:
            frame, first = [float(v) for v in d["frame_ms"]], [float(v) for v in d["first_chunk_ms"]]
            comp = Composition.from_dict(d["composition"])
        except (KeyError, TypeError, ValueError) as e:
            raise MkportError(f"validation: a run is malformed ({type(e).__name__}: {e})") from None
        if not frame or len(first) != len(frame) or min(frame) <= 0:
            raise MkportError(f"validation: {comp.label} has no runs, or runs of no time")
        return cls(comp, frame, first)


@dataclass
class Validation:
    """The planner's pick at one batch size against every supported composition measured end to end."""

    batch: int
    pick: Composition | None
    runs: list[Measured]

    @property
    def best(self) -> Composition | None:
        """The measured best, by the rule that picks from estimates."""
        return pick_best([(m.composition, m.frame, m.first_chunk) for m in self.runs])

    def measured(self, comp: Composition | None) -> Measured | None:
        return next((m for m in self.runs if m.composition == comp), None)

    @property
    def regret(self) -> float | None:
        """How much slower the pick's frame is than the measured best's (0.1 = 10%); None without both."""
        pick, best = self.measured(self.pick), self.measured(self.best)
        return None if pick is None or best is None else pick.frame / best.frame - 1

    @property
    def pick_is_best(self) -> bool:
        """The pick is the measured best, or slower by less than the two's run-to-run spread (noise)."""
        pick, best = self.measured(self.pick), self.measured(self.best)
        if pick is None or best is None:
            return self.pick == self.best
        return pick is best or self.regret <= max(pick.spread, best.spread)

    def to_dict(self) -> dict:
        return {"batch": self.batch, "pick": self.pick and self.pick.to_dict(),
                "runs": [m.to_dict() for m in self.runs],
                "best": self.best and self.best.to_dict(), "regret": self.regret, "pick_is_best": self.pick_is_best}

    @classmethod
    def from_dict(cls, d) -> "Validation":
        try:
            batch, pick, runs = d["batch"], d["pick"], list(d["runs"])
        except (KeyError, TypeError) as e:
            raise MkportError(f"validation: an entry is malformed ({type(e).__name__}: {e})") from None
        if not isinstance(batch, int) or batch < 1:
            raise MkportError(f"validation: batch {batch!r} is not a batch size")
        return cls(batch, None if pick is None else Composition.from_dict(pick), [Measured.from_dict(m) for m in runs])


# -- plan files ------------------------------------------------------------------------------------------
def model_shape(talker, predictor) -> str:
    """What a plan's times hold for (the ModelSpecs of the talker and the code predictor), in words: another
    model of this shape runs at the same speed, whatever its weights or folder."""
    return (f"talker {talker.num_layers} layers x {talker.hidden_size}, "
            f"code predictor {predictor.num_layers} layers x {predictor.hidden_size}")


@dataclass
class Plan:
    model: str  # the folder it was made from
    shape: str  # model_shape
    times: GroupTimes
    choices: list[Choice]
    validation: list[Validation] = field(default_factory=list)

    def pick(self, batch: int) -> Composition | None:
        """The composition picked for `batch` (None: none is real time there); an error if it was not planned."""
        for c in self.choices:
            if c.batch == batch:
                return c.pick
        raise MkportError(f"the plan has no batch {batch}; it has {', '.join(str(c.batch) for c in self.choices)}")

    def composition_for(self, batch: int, shape: str, gpu: str, sm_count: int) -> Composition:
        """The pick for `batch` on a model of `shape` and a device `gpu` of `sm_count` SMs; an error when the plan
        was made for another model or device (its times do not hold there) or picked nothing at `batch`."""
        if shape != self.shape:
            raise MkportError(f"made for a model of {self.shape}, not this one ({shape}): run mkport plan for it")
        if (gpu, sm_count) != (self.times.gpu, self.times.sm_count):
            raise MkportError(f"made on {self.times.gpu} ({self.times.sm_count} SMs), not on this {gpu} ({sm_count} "
                              "SMs): run mkport plan here")
        pick = self.pick(batch)
        if pick is None:
            raise MkportError(f"no composition is real time at batch {batch}, so none is picked there")
        return pick

    def to_dict(self) -> dict:
        return {"version": PLAN_VERSION, "model": self.model, "shape": self.shape, "times": self.times.to_dict(),
                "batches": [c.to_dict() for c in self.choices], "validation": [v.to_dict() for v in self.validation]}

    @classmethod
    def from_dict(cls, d) -> "Plan":
        if not isinstance(d, dict):
            raise MkportError("not a JSON object")
        if d.get("version") != PLAN_VERSION:
            raise MkportError(f"plan version {d.get('version')!r}; this mkport reads version {PLAN_VERSION} "
                              "(run mkport plan again)")
        for name, kind in (("model", str), ("shape", str), ("times", dict), ("batches", list), ("validation", list)):
            if not isinstance(d.get(name), kind):
                raise MkportError(f"{name} missing or not a {kind.__name__}")
        return cls(d["model"], d["shape"], GroupTimes.from_dict(d["times"]),
                   [Choice.from_dict(c) for c in d["batches"]], [Validation.from_dict(v) for v in d["validation"]])


def write_plan(plan: Plan, path: Path) -> None:
    Path(path).write_text(json.dumps(plan.to_dict(), indent=2) + "\n")


def read_plan(path: Path) -> Plan:
    """A plan file written by write_plan, checked; any problem is one line naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise MkportError(f"plan file not found: {path}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise MkportError(f"{path}: not a plan file (not valid JSON: {e})") from None
    try:
        return Plan.from_dict(data)
    except MkportError as e:
        raise MkportError(f"{path}: not a usable plan file: {e}") from None


# -- tables ------------------------------------------------------------------------------------------------
PLAN_COLUMNS = ("batch", "composition", "frame ms", "RTF", "first chunk ms", "measured frame ms",
                "measured first chunk ms", "chosen")


def plan_rows(plan: Plan) -> list[list[str]]:
    """One row per batch size and scored composition: the estimate, what validation measured (if it ran) and
    whether it is the pick and/or the measured best."""
    checked = {v.batch: v for v in plan.validation}
    rows = []
    for choice in plan.choices:
        v = checked.get(choice.batch)
        for comp, est in choice.estimates:
            m = v.measured(comp) if v else None
            marks = [name for name, hit in (("pick", comp == choice.pick), ("best", v and comp == v.best)) if hit]
            rows.append([str(choice.batch), comp.label, f"{est.frame_ms:.2f}", f"{est.rtf:.3f}",
                         f"{est.first_chunk_ms:.1f}", f"{m.frame:.2f}" if m else "-",
                         f"{m.first_chunk:.1f}" if m else "-", ", ".join(marks)])
        if not choice.estimates:
            rows.append([str(choice.batch), "(no composition could be timed)", *["-"] * 5, ""])
    return rows


VALIDATION_COLUMNS = ("batch", "pick", "measured best", "regret", "pick is best")


def validation_rows(plan: Plan) -> list[list[str]]:
    rows = []
    for v in plan.validation:
        regret = "-" if v.regret is None else f"{100 * v.regret:.1f}%"
        rows.append([str(v.batch), v.pick.label if v.pick else "none", v.best.label if v.best else "none", regret,
                     "yes" if v.pick_is_best else "no"])
    return rows
