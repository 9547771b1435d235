"""Timing harness: the megakernel's decode step against two transformers baselines in the same run
(eager with a dynamic cache; a static cache with the decode step captured in a CUDA graph), and the
memory-bandwidth floor from a device-to-device copy measured in the same process."""

from __future__ import annotations

import platform
import statistics
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..check.reference import cache_argument, linear_attention_dispatch
from ..errors import MkportError
from ..kernel.launch_plan import DEFAULT_KERNEL
from ..kernel.spec import ModelSpec

ENGINES = ("megakernel", "hf_graph", "hf_eager")


@dataclass
class EngineTiming:
    engine: str
    context: int
    step_us: list[float] = field(default_factory=list)  # one decode step each, CUDA events
    ttft_ms: float | None = None  # prefill of the prompt plus the first step, host clock
    error: str | None = None
    batch: int = 1  # sequences a step
    kv_bytes: int | None = None  # the megakernel's KV cache as allocated (a sliding layer's ring, not max_seq's rows)
    # a mixture of experts' batch: the weight bytes a timed step read (each sparse layer's union of experts, its mean
    # over the timed steps) and the experts a sparse layer read, the mean over layers and steps
    weight_bytes: int | None = None
    experts_read: float | None = None

    @property
    def median_us(self) -> float:
        return statistics.median(self.step_us)

    def percentile(self, q: float) -> float:
        s = sorted(self.step_us)
        return s[min(len(s) - 1, int(q * len(s)))]

    def summary(self) -> dict:
        if self.error:
            return {"engine": self.engine, "context": self.context, "error": self.error}
        med = self.median_us
        return {
            "engine": self.engine,
            "context": self.context,
            **({"batch": self.batch} if self.batch > 1 else {}),
            "median_us": med,
            "p10_us": self.percentile(0.1),
            "p90_us": self.percentile(0.9),
            "tokens_per_s": self.batch * 1e6 / med,  # every sequence's token
            "ttft_ms": self.ttft_ms,
            **({"kv_bytes": self.kv_bytes} if self.kv_bytes is not None else {}),
            **({"weight_bytes_per_step": self.weight_bytes, "experts_read": self.experts_read}
               if self.weight_bytes is not None else {}),
            "step_us": self.step_us,
        }


def bandwidth_floor(spec: ModelSpec, bandwidth: float) -> dict:
    """The step's floor: the bytes it reads (an MoE step: its chosen experts) at `bandwidth`; for MoE also the size of
    all its experts beside it, what the step would read were every expert chosen."""
    step = spec.weight_bytes_per_step()
    floor = {"weight_bytes_per_step": step, "floor_us": step / bandwidth * 1e6}
    if spec.moe is not None:
        every = spec.weight_bytes_per_step(all_experts=True)
        floor |= {"weight_bytes_all_experts": every, "floor_all_experts_us": every / bandwidth * 1e6}
    return floor


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written (median of reps)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def _time_each(fn, n: int, before=None) -> list[float]:
    """Microseconds of GPU time of each of n calls of fn (events around each; host gaps not counted); `before`, when
    given, runs ahead of each start event, outside the timed span."""
    marks = []
    for _ in range(n):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        marks.append((a, b))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in marks]


def host_times_ms(fn, reps: int = 5) -> list[float]:
    """Host time of each of `reps` calls of fn() in ms, the GPU drained before and after: what the caller waits for."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def host_ms(fn, reps: int = 5) -> float:
    """Median of host_times_ms."""
    return statistics.median(host_times_ms(fn, reps))


def bench_megakernel(spec, weights, context: int, steps: int, prompt_len: int, warmup: int, log=None,
                     kernel: str = DEFAULT_KERNEL) -> EngineTiming:
    from ..runtime.backends import make_decoder

    gen = torch.Generator().manual_seed(context)
    dec = make_decoder(spec, weights, "megakernel", max(context, prompt_len) + steps + warmup + 1, log=log, kernel=kernel)
    prompt = torch.randint(0, spec.vocab_size, (prompt_len,), generator=gen)

    def first_token():
        dec.reset()
        dec.prefill(prompt[:-1])
        dec.step(int(prompt[-1]))

    ttft = host_ms(first_token)
    dec.reset()
    dec.prefill(torch.randint(0, spec.vocab_size, (context - 1,), generator=gen))
    dec.step(1)
    _time_each(dec.step, warmup)  # tokens are fed back on the device: inputs rotate every step
    return EngineTiming(f"megakernel-{kernel}", context, _time_each(dec.step, steps), ttft, kv_bytes=dec.kv.nbytes)


def bench_megakernel_batch(spec, weights, context: int, steps: int, warmup: int, batch: int, log=None) -> EngineTiming:
    """Steps of `batch` sequences at once, each with its own prompt of context - 1 random tokens;
    the time to first token is not measured (the prefill runs one sequence at a time)."""
    from ..runtime.backends import make_decoder

    gen = torch.Generator().manual_seed(context)
    dec = make_decoder(spec, weights, "megakernel", context + steps + warmup + 1, batch, log=log)
    for b in range(batch):
        dec.prefill_slot(b, tokens=torch.randint(0, spec.vocab_size, (context - 1,), generator=gen))
    dec.step_batch(tokens=list(range(1, batch + 1)))
    _time_each(dec.step_batch, warmup)  # every sequence's token fed back on the device
    counted = getattr(dec, "experts_read", None)  # a mixture of experts: the union each sparse layer read
    if counted is not None:
        counted.zero_()
    timing = EngineTiming(f"megakernel-{DEFAULT_KERNEL}-b{batch}", context, _time_each(dec.step_batch, steps), batch=batch)
    if counted is not None:
        timing.weight_bytes, timing.experts_read = union_bytes(spec, counted.cpu().tolist(), steps)
    return timing


def union_bytes(spec, counts: list[int], steps: int) -> tuple[int, float]:
    """The weight bytes of a batch step that read, in sparse layer i, counts[i] / steps experts (Decoder.experts_read
    after `steps` steps: each layer's union of its sequences' experts), and the experts a sparse layer read, on average."""
    sparse = spec.moe.sparse_layers
    means = {i: counts[i] / steps for i in sparse}
    return spec.weight_bytes_per_step(experts_read=means), sum(means.values()) / len(sparse)


class HFStep:
    """One batch-1 decode step of the reference's transformers modules, in bf16."""

    def __init__(self, source, checkpoint, spec):
        from ..check.reference import Reference

        ref = Reference(source, checkpoint, device="cuda", dtype=torch.bfloat16)  # no float32 copy on the way
        self.base = ref.base.to(torch.bfloat16)  # the roles built in float32 (TTS, Qwen3-VL)
        self.base.config._attn_implementation = "sdpa"  # transformers' default; the reference uses eager
        if spec.moe is not None:
            decoding_experts(ref.causal_lm)
        self.head = ref._head(0).to(torch.bfloat16)
        self.mrope, self.spec = ref.mrope, spec

    def positions(self, start: int, n: int) -> torch.Tensor:
        pos = torch.arange(start, start + n, device="cuda")[None]
        return pos.expand(3, 1, n) if self.mrope else pos

    def forward(self, embeds, cache, start: int):
        n = embeds.shape[1]
        out = self.base(
            inputs_embeds=embeds,
            position_ids=self.positions(start, n),
            **{cache_argument(self.base): cache},
            use_cache=True,
            cache_position=torch.arange(start, start + n, device="cuda"),
        )
        return F.linear(out.last_hidden_state[:, -1], self.head)


def decoding_experts(model) -> None:
    """A mixture of experts' transformers model set to the experts implementation its generate() decodes with on a
    GPU, 'batched_mm': each token's chosen experts gathered and applied in batched matmuls, with no loop over experts
    on the host, so a CUDA graph captures the step (hf_graph). The reference keeps 'eager', a loop over the experts
    hit, the modeling file's own math."""
    model.set_experts_implementation("batched_mm")


def dynamic_cache(model):
    """transformers' DynamicCache for `model`, made from its config: a hybrid's linear-attention layers need their own
    kind of cache layer (on an empty DynamicCache() Qwen3.5 raises IndexError)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def bench_hf_eager(hf: HFStep, context: int, steps: int, prompt_len: int, warmup: int) -> EngineTiming:
    h = hf.spec.hidden_size
    emb = torch.randn(1, max(context, prompt_len) + steps + warmup, h, device="cuda", dtype=torch.bfloat16)

    def first_token():
        hf.forward(emb[:, :prompt_len], dynamic_cache(hf.base), 0)

    with torch.no_grad():
        ttft = host_ms(first_token, reps=3)
        cache = dynamic_cache(hf.base)
        hf.forward(emb[:, : context - 1], cache, 0)
        pos = [context - 1]

        def step():
            hf.forward(emb[:, pos[0] : pos[0] + 1], cache, pos[0])
            pos[0] += 1

        _time_each(step, warmup)
        return EngineTiming("hf_eager", context, _time_each(step, steps), ttft)


def _undecorated_rope_forward(fn):
    """The rotary forward beneath transformers' dynamic_rope_update (functools.wraps keeps it as __wrapped__, under
    torch.no_grad's own wrapper where a version adds one), or None for a forward without that decorator."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    update = dynamic_rope_update(lambda self, x, position_ids: None).__code__  # every decorated forward's code
    while fn is not None and getattr(fn, "__code__", None) is not update:
        fn = getattr(fn, "__wrapped__", None)
    return fn and fn.__wrapped__


def _rope_switch(rotary, layer_type, first: int, last: int) -> str | None:
    """What in dynamic_rope_update's state would change between positions first and last (the update already run
    at first), or None: longrope's short/long choice, or dynamic NTK growing past its cached length."""
    rope_type = rotary.rope_type if layer_type is None else rotary.rope_type[layer_type]
    if rope_type == "longrope":  # the update's own test: max(position_ids) + 1 > original length
        params = rotary.config.rope_parameters if layer_type is None else rotary.config.rope_parameters[layer_type]
        switch = params["original_max_position_embeddings"]
        if (first + 1 > switch) != (last + 1 > switch):
            return f"longrope takes its long factors from position {switch} (original_max_position_embeddings)"
    elif "dynamic" in rope_type:
        cached = getattr(rotary, f"{layer_type}_max_seq_len_cached" if layer_type else "max_seq_len_cached",
                         rotary.max_seq_len_cached)
        if last + 1 > cached:
            return f"dynamic RoPE recomputes its frequencies from position {cached}"
    return None


def _updates(rope_type) -> bool:
    """Whether dynamic_rope_update changes a rotary module of this type: its own test."""
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


def _fixed_rope_forward(rotary, forward):
    def fixed(x, position_ids, layer_type=None):
        with torch.no_grad():
            return forward(rotary, x, position_ids, **({"layer_type": layer_type} if layer_type else {}))

    return fixed


@contextmanager
def rope_frozen(model, x, position_ids, last: int):
    """Capture-safe rotary embeddings for a CUDA graph whose replays see positions max(position_ids) .. last.
    transformers' dynamic_rope_update (longrope, dynamic NTK) picks its frequencies from max(position_ids) + 1 with a
    Python branch on a device tensor, a host sync that fails the capture. Here the update runs once, eagerly, at the
    capture's positions; then, while the context is open, each such rotary module's forward is the one beneath the
    decorator, which reads the frequencies and attention scaling just chosen: the same numbers transformers computes,
    as long as no position up to `last` would choose others. If one would, MkportError, in one line."""
    first = int(position_ids.max())
    frozen = []
    for rotary in model.modules():
        types = getattr(rotary, "rope_type", None)
        layer_types = list(types) if isinstance(types, dict) else [None]
        if not any(_updates(types[t] if t else types) for t in layer_types):
            continue
        forward = _undecorated_rope_forward(type(rotary).forward)
        if forward is None:
            continue
        for layer_type in layer_types:
            rotary(x, position_ids, **({"layer_type": layer_type} if layer_type else {}))  # the update, eagerly
            why = _rope_switch(rotary, layer_type, first, last)
            if why:
                raise MkportError(f"hf_graph cannot capture positions {first}..{last}: {why}, and a captured graph "
                                  "keeps one choice; use contexts and --steps that stay on one side")
        frozen.append((rotary, forward))
    for rotary, forward in frozen:  # an instance attribute: nn.Module.__call__ finds it before the class's forward
        rotary.forward = _fixed_rope_forward(rotary, forward)
    try:
        yield
    finally:
        for rotary, _ in frozen:
            del rotary.forward


def bench_hf_graph(hf: HFStep, context: int, steps: int, warmup: int) -> EngineTiming:
    """Static cache, decode step captured once in a CUDA graph and replayed with the position updated in place;
    length-dependent RoPE held to the choice at the capture's position (rope_frozen: refused if a replay's differs)."""
    from transformers import StaticCache

    h = hf.spec.hidden_size
    with torch.no_grad():
        max_len = context + steps + warmup + 1
        cache = StaticCache(config=hf.base.config, max_cache_len=max_len)
        prompt = torch.randn(1, context - 1, h, device="cuda", dtype=torch.bfloat16)
        hf.forward(prompt, cache, 0)
        emb = torch.randn(1, 1, h, device="cuda", dtype=torch.bfloat16)
        cache_position = torch.tensor([context - 1], device="cuda")
        position_ids = cache_position.view(1, 1).expand(3, 1, 1) if hf.mrope else cache_position.view(1, 1)
        # A prepared 4D mask is used as-is; building one inside the graph would copy from the host.
        mask = torch.full((1, 1, 1, max_len), float("-inf"), device="cuda", dtype=torch.bfloat16)
        mask[..., :context] = 0

        def step_body():
            out = hf.base(
                inputs_embeds=emb,
                attention_mask=mask,
                position_ids=position_ids,
                **{cache_argument(hf.base): cache},
                use_cache=True,
                cache_position=cache_position,
            )
            return F.linear(out.last_hidden_state[:, -1], hf.head)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step_body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with rope_frozen(hf.base, emb, position_ids, last=context - 1 + warmup + steps), torch.cuda.graph(graph):
            step_body()

        def step():
            cache_position.add_(1)
            mask.index_fill_(3, cache_position, 0)
            graph.replay()

        _time_each(step, warmup)
        return EngineTiming("hf_graph", context, _time_each(step, steps))


def phase_shares(spec, weights, context: int, steps: int = 5, plan=None, kernel: str = DEFAULT_KERNEL) -> dict:
    """Where a megakernel step's time goes: SM cycles of each phase kind summed over layers (profile build: block
    0 reads its clock after every grid barrier). `plan` replaces the launch-plan rule's."""
    from ..runtime.backends import make_decoder

    dec = make_decoder(spec, weights, "megakernel", context + steps + 1, profile=True, plan=plan, kernel=kernel)
    dec.prefill(torch.randint(0, spec.vocab_size, (context - 1,)))
    dec.step(1)
    for _ in range(steps):
        dec.step()
    torch.cuda.synchronize()
    kinds: dict[str, int] = {}
    for name, cycles in dec.phase_cycles().items():
        kind = name.rsplit(".", 1)[-1]
        kinds[kind] = kinds.get(kind, 0) + cycles
    return {"context": context, "cycles": kinds, "total_cycles": sum(kinds.values())}


def layer_timeline(spec, weights, context: int, plan=None, kernel: str = DEFAULT_KERNEL) -> dict:
    """Where a middle layer's time goes in every block (profile build's timeline): for each event, the median over
    layers 1 .. L-2 of the blocks' median and latest time, in SM cycles from the layer's start (the first block out
    of the barrier before its qkv)."""
    from ..kernel.interface import TIMELINE_EVENTS
    from ..runtime.backends import make_decoder

    dec = make_decoder(spec, weights, "megakernel", context + 2, profile=True, plan=plan, kernel=kernel)
    dec.prefill(torch.randint(0, spec.vocab_size, (context - 1,)))
    dec.step(1)
    torch.cuda.synchronize()
    t = dec.timeline()  # [layer, block, event]
    middle = t[1:-1] if spec.num_layers > 2 else t
    rel = (middle - middle[:, :, :1].amin(dim=1, keepdim=True)).double()
    out = {}
    for e, name in enumerate(TIMELINE_EVENTS):
        stamped = rel[:, :, e] >= 0
        if not bool(stamped.any()):
            continue
        col = rel[:, :, e].masked_fill(~stamped, float("nan"))
        out[name] = {"median": float(col.nanmedian(dim=1).values.median()),
                     "latest": float(torch.nan_to_num(col, nan=-1.0).amax(dim=1).median())}
    return out


def environment() -> dict:
    import transformers

    from .. import __version__

    props = torch.cuda.get_device_properties(0)
    env = {
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "mkport": __version__,
        "python": platform.python_version(),
    }
    try:
        q = "clocks.sm,clocks.mem,clocks.max.sm,driver_version,temperature.gpu,power.draw"
        line = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        env["nvidia_smi"] = dict(zip(q.split(","), [v.strip() for v in line.split(",")]))
    except (OSError, subprocess.SubprocessError):
        env["nvidia_smi"] = None
    return env


def check_bench_lengths(spec, contexts: list[int], steps: int, prompt_len: int, warmup: int = 10) -> None:
    """--contexts, --steps and --prompt-len, before anything is built or loaded."""
    if not contexts or min(contexts) < 2 or prompt_len < 2 or steps < 1:
        raise MkportError("contexts must be >= 2 tokens, --prompt-len >= 2 and --steps >= 1")
    longest = max(contexts + [prompt_len]) + steps + warmup + 1
    if longest > spec.max_context:
        raise MkportError(
            f"context {max(contexts)} plus {steps + warmup + 1} timed steps passes {spec.max_context_text}; use "
            "smaller --contexts or --steps"
        )


def run_bench(
    source,
    checkpoint,
    contexts: list[int],
    steps: int = 100,
    prompt_len: int = 32,
    warmup: int = 10,
    engines: tuple[str, ...] = ENGINES,
    phases: bool = False,
    progress=None,
    kernels: tuple[str, ...] = (DEFAULT_KERNEL,),
    batches: tuple[int, ...] = (1,),
) -> dict:
    """Every engine at every context, plus the bandwidth floor; returns every raw number. The megakernel
    engine runs once per kernel design in `kernels` (rows megakernel-v20) and once per batch size
    above 1 in `batches` (rows megakernel-v20-b8: a step of 8 sequences); ratios are to the first kernel at batch
    1, and each batch row has its step time over batch 1's (`batch_step_ratio`)."""
    from ..runtime.weights import load_weights

    spec = source.spec
    check_bench_lengths(spec, contexts, steps, prompt_len, warmup)
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise MkportError(f"unknown engine(s) {sorted(unknown)}; supported: {', '.join(ENGINES)}")
    tick = progress or (lambda message: None)
    tick("measuring copy bandwidth")
    bandwidth = copy_bandwidth()
    floor = bandwidth_floor(spec, bandwidth)
    floor_us = floor["floor_us"]
    tick(f"loading weights of {spec.name}")
    weights = load_weights(spec, checkpoint)
    timings: list[EngineTiming] = []
    hf = None
    for ctx in contexts:
        for engine in engines:
            tick(f"{engine} at context {ctx}")
            try:
                if engine == "megakernel":
                    for kernel in kernels:
                        tick(f"megakernel {kernel} at context {ctx}")
                        timings.append(bench_megakernel(spec, weights, ctx, steps, prompt_len, warmup, log=tick,
                                                        kernel=kernel))
                    for batch in (b for b in batches if b > 1):
                        tick(f"megakernel {DEFAULT_KERNEL}, batch {batch}, at context {ctx}")
                        try:
                            timings.append(bench_megakernel_batch(spec, weights, ctx, steps, warmup, batch, log=tick))
                        except MkportError as e:  # a batch that does not fit this model: its row says why
                            timings.append(EngineTiming(f"megakernel-{DEFAULT_KERNEL}-b{batch}", ctx, error=str(e), batch=batch))
                    continue
                hf = hf or HFStep(source, checkpoint, spec)
                if engine == "hf_eager":
                    timings.append(bench_hf_eager(hf, ctx, steps, prompt_len, warmup))
                else:
                    try:
                        timings.append(bench_hf_graph(hf, ctx, steps, warmup))
                    except MkportError as e:  # positions a captured graph cannot follow: its row says why
                        timings.append(EngineTiming(engine, ctx, error=str(e)))
            except MkportError:
                raise
            except Exception as e:  # a baseline that cannot run here is reported, not fatal
                import traceback

                frame = traceback.extract_tb(e.__traceback__)[-1]
                where = f" ({frame.filename.rsplit('/', 2)[-1]}:{frame.lineno})"
                timings.append(EngineTiming(engine, ctx, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}{where}"))
            torch.cuda.empty_cache()
    results = [t.summary() for t in timings]
    if phases:
        tick("profiling the megakernel's phases")
        phase_report = {k: phase_shares(spec, weights, contexts[0], kernel=k) for k in kernels}
    by = {(r["engine"], r["context"]): r for r in results if "error" not in r}
    for r in results:
        mk = by.get((f"megakernel-{kernels[0]}", r["context"]))
        if "error" in r:
            continue
        # a mixture of experts' batch row: the floor of the bytes it read (its union of experts), not batch 1's
        r["floor_fraction"] = (r["weight_bytes_per_step"] / bandwidth * 1e6 if "weight_bytes_per_step" in r
                               else floor_us) / r["median_us"]
        if "batch" in r:
            if mk:
                r["batch_step_ratio"] = r["median_us"] / mk["median_us"]
        elif mk and r is not mk:
            r["megakernel_speedup"] = r["median_us"] / mk["median_us"]
    return {
        "spec": spec.name,
        "environment": environment(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        **floor,
        "steps": steps,
        "prompt_len": prompt_len,
        "warmup": warmup,
        "results": results,
        "phases": phase_report if phases else None,
        # a hybrid's transformers rows: its Gated DeltaNet decode ops ran these (a kernel package, or its torch code)
        "transformers_linear_attention": (linear_attention_dispatch(spec.family)
                                          if spec.linear_layers and set(engines) - {"megakernel"} else None),
    }


def plot(result: dict, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MkportError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    for engine in ENGINES:
        pts = sorted((r["context"], r["median_us"]) for r in result["results"] if r["engine"] == engine and "error" not in r)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o", label=engine)
    ax.axhline(result["floor_us"] / 1e3, linestyle="--", color="gray", label="bandwidth floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(f"{result['spec']} on {result['environment']['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
