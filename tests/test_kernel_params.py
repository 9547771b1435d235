"""The kernel's Params on the host (interface.KernelParams), defined once from PARAM_FIELDS: the bytes the kernel
gets, field for field; a name that is not a field is refused, a missing one too; and, through a library built
with nvcc whose launch function keeps the bytes it was given, what reaches the C side of a launch."""

from __future__ import annotations

import ctypes
import random
import shutil
import struct
from types import SimpleNamespace

import pytest

from mkport.kernel.build import KernelLibrary, ensure_library
from mkport.errors import MkportError
from mkport.kernel.interface import PARAM_FIELDS, PREFILL_FUNCTIONS, SEQUENCE_FIELDS, KernelParams, kernel_params


def _values(seed: int) -> dict:
    gen = random.Random(seed)
    return {name: gen.uniform(-1e3, 1e3) if c_type == "double" else gen.randrange(0, 1 << 63 if "*" in c_type else 1 << 40)
            for name, c_type in PARAM_FIELDS}


def _expected_bytes(values: dict, batch: int = 1) -> bytes:
    """The C struct's layout: every value 8 bytes, in PARAM_FIELDS order, little-endian; a per-sequence field's
    `batch` values one after another."""
    def packed(name, c_type):
        each = values[name] if isinstance(values[name], list) else [values[name]] * (batch if name in SEQUENCE_FIELDS else 1)
        return b"".join(struct.pack("<d" if c_type == "double" else "<q", v) for v in each)

    return b"".join(packed(name, c_type) for name, c_type in PARAM_FIELDS)


def test_params_bytes_are_the_c_struct():
    values = _values(1)
    params = kernel_params(values)
    assert ctypes.sizeof(KernelParams) == 8 * len(PARAM_FIELDS)
    assert bytes(params) == _expected_bytes(values)
    params.rng_step[0] = 12345  # one field written: only its 8 bytes change
    assert bytes(params) == _expected_bytes({**values, "rng_step": 12345})
    params.max_seq = 77
    assert bytes(params) == _expected_bytes({**values, "rng_step": 12345, "max_seq": 77})


def test_a_batch_has_one_value_per_sequence_in_each_sequence_field():
    values = _values(5)
    params = kernel_params({**values, "cache_pos": [3, 5, 7, 9]}, batch=4)
    assert ctypes.sizeof(params) == 8 * (len(PARAM_FIELDS) + 3 * len(SEQUENCE_FIELDS))
    assert list(params.cache_pos) == [3, 5, 7, 9] and list(params.seed) == [values["seed"]] * 4
    assert bytes(params) == _expected_bytes({**values, "cache_pos": [3, 5, 7, 9]}, batch=4)


def test_a_field_that_does_not_exist_is_refused():
    params = kernel_params(_values(2))
    with pytest.raises(AttributeError):
        params.rng_stpe = 1  # a typo would otherwise leave rng_step as it was, silently
    with pytest.raises(MkportError, match=r"missing \['k_cache'\]"):
        kernel_params({k: v for k, v in _values(3).items() if k != "k_cache"})
    with pytest.raises(MkportError, match=r"unknown \['kcache'\]"):
        kernel_params({**_values(3), "kcache": 1})


# the host side of a decode step whose launch keeps a copy of the Params it was given
ECHO = """
#include <string.h>
static char kept[%d];
extern "C" {
int mk_params_bytes() { return %d; }
int mk_launch(const char* params, void*) { memcpy(kept, params, sizeof(kept)); return 0; }
void mk_kept(char* out) { memcpy(out, kept, sizeof(kept)); }
int mk_blocks_per_sm(int* blocks) { *blocks = 1; return 0; }
const char* mk_error_string(int) { return "none"; }
long long mk_prefill_delta_floats(int) { return 0; }
%s
}
""" % (8 * len(PARAM_FIELDS), 8 * len(PARAM_FIELDS), "\n".join(f"int {n}() {{ return 0; }}" for n in PREFILL_FUNCTIONS))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_launch_hands_the_c_side_the_params_bytes(tmp_path):
    (tmp_path / "decode_step.cu").write_text(ECHO)
    lib = KernelLibrary(ensure_library(tmp_path, "sm_90")[0])
    values = _values(4)
    params = kernel_params(values)
    lib.launch(params, 0)
    params.seed[0] = 7  # after the launch: the launch had its own copy
    kept = ctypes.create_string_buffer(ctypes.sizeof(KernelParams))
    lib._lib.mk_kept(kept)
    assert kept.raw == _expected_bytes(values)


class _NoLaunch:
    def launch(self, params, stream) -> None:
        pass


def _host_batch_decoder(batch: int, spec=None):
    """A runtime.Decoder with only what step_batch reads and writes on the host (the real one needs a GPU for its
    buffers and kernel); its kernel does not launch. `spec`: a code predictor's unless given."""
    import torch

    from mkport.kernel.gpu import target_for_arch
    from mkport.runtime.decoder import Decoder, SequenceState
    from mkport.kernel.spec import load_spec
    from mkport.kernel.launch_plan import plan_launch
    from mkport.runtime.kv_cache import KvLayout

    spec = spec or load_spec("qwen3-tts-0.6b-code-predictor")
    dec = Decoder.__new__(Decoder)
    dec.spec, dec.device, dec.max_seq, dec.batch = spec, torch.device("cpu"), 40, batch
    dec.plan = plan_launch(spec, target_for_arch("sm_90"), batch=batch)
    dec.kv = SimpleNamespace(layout=KvLayout.of(spec, dec.max_seq, batch))  # step_batch reads only its rows
    dec.sequences = [SequenceState(length=3 * b, steps=5 + b) for b in range(batch)]
    dec.token_in, dec.token_out = torch.zeros(batch, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32)
    dec.input_embed = torch.zeros(batch * spec.input_dim)
    dec.seen = torch.zeros(batch * spec.vocab_size, dtype=torch.uint8)
    dec.logit_bias = torch.zeros(batch, spec.vocab_size) if batch > 1 else None
    dec._params = kernel_params({name: 0 for name, _ in PARAM_FIELDS}, batch)
    dec.rope_table = None  # dynamic NTK's (test_a_dynamic_rope_step_needs_a_row_of_its_table)
    dec.early_inputs = None  # no Phi-3 longrope switch (runtime.rope_switch)
    dec.linear_state = None  # a hybrid's (the code predictor has none)
    dec.kernel = _NoLaunch()
    return dec


def test_step_batch_writes_each_sequence_its_own_fields(monkeypatch):
    """step_batch's Params, sequence by sequence: its cache position and positions (its length, an int, or a
    triplet as given), attention splits for its context, its sampler (greedy when left out), its step counter."""
    import torch

    from mkport.runtime.sampling import SamplingParams

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: type("Stream", (), {"cuda_stream": 0})())
    dec = _host_batch_decoder(4)
    lengths, steps = [q.length for q in dec.sequences], [q.steps for q in dec.sequences]
    sampling = [SamplingParams(temperature=0.5 + b, top_k=[1, 3, 1024, 50][b], top_p=0.9, repetition_penalty=1.1,
                               seed=100 + b) for b in range(4)]
    positions = [None, 7, (9, 2, 4), None]
    active = [True, True, True, False]
    dec.step_batch(table=2, head=3, sampling=sampling, positions=positions, active=active)
    p, greedy, vocab = dec._params, SamplingParams(), dec.spec.vocab_size
    for b in range(4):
        sp = sampling[b] if active[b] else greedy
        pos = [lengths[b]] * 3 if positions[b] is None else [positions[b]] * 3 if isinstance(positions[b], int) \
            else list(positions[b])
        assert (p.input_kind[b], p.table[b], p.head[b]) == (0, 2, 3)
        assert (p.cache_pos[b], p.pos_t[b], p.pos_h[b], p.pos_w[b]) == (lengths[b], *pos)
        assert p.attn_splits[b] == dec.plan.attention_splits(lengths[b] + 1)
        assert (p.top_k[b], p.seed[b], p.rng_step[b]) == (min(sp.top_k, vocab), sp.seed, steps[b])
        assert (p.temperature[b], p.top_p[b], p.rep_penalty[b]) == (sp.temperature, sp.top_p, sp.repetition_penalty)
    assert list(p.advances) == [1, 1, 1, 0]  # a hybrid's linear state is kept by the sequence left out
    assert [q.length for q in dec.sequences] == [n + a for n, a in zip(lengths, active)]
    assert [q.steps for q in dec.sequences] == [n + a for n, a in zip(steps, active)]
    dec.step_batch(embeds=torch.zeros(4, dec.spec.input_dim), sampling=sampling)
    assert list(p.input_kind) == [1] * 4 and list(p.head) == [0] * 4


@pytest.mark.parametrize("position,want", [(None, [6, 6, 6]), (11, [11, 11, 11]), ((9, 2, 4), [9, 2, 4])])
def test_step_writes_its_position_sampler_and_counters(monkeypatch, position, want):
    import torch

    from mkport.runtime.sampling import SamplingParams

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: type("Stream", (), {"cuda_stream": 0})())
    dec = _host_batch_decoder(1)
    dec.trace_enabled, dec.sequences[0].length, dec.sequences[0].steps = False, 6, 4
    sampling = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.2, seed=9)
    dec.step(table=1, head=2, position=position, sampling=sampling)
    p = dec._params
    assert (p.input_kind[0], p.table[0], p.head[0], p.cache_pos[0]) == (0, 1, 2, 6)
    assert [p.pos_t[0], p.pos_h[0], p.pos_w[0]] == want and p.attn_splits[0] == dec.plan.attention_splits(7)
    assert (p.top_k[0], p.seed[0], p.rng_step[0], p.temperature[0], p.top_p[0], p.rep_penalty[0]) == (20, 9, 4, 0.7, 0.8, 1.2)
    assert (dec.length, dec.steps) == (7, 5)


def test_step_and_step_batch_advance_one_state_of_the_sequence(monkeypatch):
    """At batch 1 the front (step) and the batch API (step_batch) write and advance the same sequence's state (cache
    row, sampler counter, length); the front alone reads the last token where the kernel wrote it and skips the
    repetition history when no penalty applies."""
    import torch

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: type("Stream", (), {"cuda_stream": 0})())
    dec = _host_batch_decoder(1)  # length 0, 5 steps
    dec.trace_enabled = False
    p = dec._params
    dec.step()
    assert (p.cache_pos[0], p.rng_step[0], dec.length, dec.steps) == (0, 5, 1, 6)
    assert (p.token_in, p.seen) == (dec.token_out.data_ptr(), 0)
    dec.step_batch()
    assert (p.cache_pos[0], p.rng_step[0], dec.length, dec.steps) == (1, 6, 2, 7)
    assert (p.token_in, p.seen) == (dec.token_in.data_ptr(), dec.seen.data_ptr())


def test_a_hybrid_s_one_sequence_is_not_left_out_of_a_step():
    """The batch-1 kernel advances a hybrid's linear-attention state at every step (it reads no `advances`): a
    decoder of one sequence refuses to leave it out, in one line."""
    from mkport.kernel.spec import load_spec

    dec = _host_batch_decoder(1, load_spec("qwen3.5-0.8b"))
    dec.linear_state = object()  # present: a hybrid's
    with pytest.raises(MkportError, match="advances its linear-attention state at every step") as e:
        dec.step_batch(active=[False])
    assert "\n" not in str(e.value)


def test_a_dynamic_rope_step_needs_a_row_of_its_table(monkeypatch):
    """Dynamic NTK's table (Params::rope_table) has a row for each step length up to max_seq (40 here, past the
    original length 16): a step at a position past it, given explicitly, is refused in one line before the launch."""
    import numpy as np
    import torch

    from mkport.kernel.render import dynamic_rope_table, rope_tables
    from mkport.kernel.spec import spec_from_config
    from test_rope_scaling import _config

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: type("Stream", (), {"cuda_stream": 0})())
    spec = spec_from_config(_config("llama", "dynamic"), "d")
    dec = _host_batch_decoder(2, spec)
    dec.rope_table = torch.from_numpy(dynamic_rope_table(spec, dec.max_seq))
    assert dec.rope_table.shape == (40 - 16 + 1, 32)
    np.testing.assert_array_equal(dec.rope_table[-1].numpy(), rope_tables(spec, 40)[0])  # position 39's
    dec.step_batch(positions=[39, 0])
    assert list(dec._params.pos_t) == [39, 0]
    with pytest.raises(MkportError, match="^position 40: dynamic RoPE's frequencies are made for positions below 40 "
                                          r"\(raise max_seq\)$"):
        dec.step_batch(positions=[3, 40])


def test_prefill_functions_are_the_cuda_signatures():
    """PREFILL_FUNCTIONS (the ctypes side) against the extern "C" entry points of cuda/prefill.cuh,
    gated_delta_net_prefill.cuh and delta_rule_prefill.cuh, parameter by parameter: a parameter added, dropped or
    retyped on one side alone would shift every argument after it."""
    import re

    from mkport.kernel.render import kernel_dir

    source = "".join((kernel_dir() / name).read_text()
                     for name in ("prefill.cuh", "gated_delta_net_prefill.cuh", "delta_rule_prefill.cuh"))
    c_types = {ctypes.c_void_p: "pointer", ctypes.c_int: "int", ctypes.c_longlong: "long", ctypes.c_float: "float"}
    found = {}
    for name, params in re.findall(r'extern "C" int (mk_prefill_\w+)\(([^)]*)\)', source):
        if name in ("mk_prefill_attn_smem", "mk_prefill_delta_smem"):  # size queries, without a stream (KernelLibrary)
            continue
        kinds = ["pointer" if "*" in p else p.split()[-2] for p in (" ".join(p.split()) for p in params.split(","))]
        assert kinds[-1] == "cudaStream_t", name
        found[name] = kinds[:-1]
    assert found == {name: [c_types[t] for t in args] for name, args in PREFILL_FUNCTIONS.items()}
