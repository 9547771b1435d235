"""The KV cache's layout (runtime/kv_cache.py): rows and bytes of each layer, a sliding layer's ring, and torch_model
reading and writing through it (CPU). The megakernel's side is tests/test_gpu_ring.py."""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL_WINDOW, validation_inputs
from tolerances import CONTINUATION_TOL, rel
from mkport.errors import MkportError
from mkport.kernel.gpu import target_for_arch
from mkport.kernel.interface import RING_CHUNK_MAX, RING_CHUNK_MIN, ring_chunk_rows, ring_rows
from mkport.kernel.launch_plan import plan_launch
from mkport.kernel.render import render
from mkport.kernel.spec import load_spec
from mkport.runtime import torch_model
from mkport.runtime.kv_cache import KvCache, KvLayout, cache_rows, write_cache_rows
from mkport.runtime.weights import Checkpoint, load_weights

GEMMA3_1B_KV_HEAD = 256  # one kv head of 256


def test_gemma3_1b_at_8192_allocates_its_rings_only():
    """gemma-3-1b (22 sliding layers of window 512 among 26): a sliding layer keeps 512 - 1 + 256 rows, a full one
    8192; the bytes allocated are the layout's, under a third of full-length caches."""
    spec = load_spec("gemma-3-1b")
    layout = KvLayout.of(spec, 8192)
    sliding = [i for i in range(spec.num_layers) if spec.window(i)]
    assert len(sliding) == 22 and ring_chunk_rows(spec) == RING_CHUNK_MAX
    assert [layout.rows[i] for i in sliding] == [512 - 1 + 256] * 22
    assert all(layout.rows[i] == 8192 for i in range(spec.num_layers) if i not in sliding)
    row_bytes = 2 * 2 * spec.num_kv_heads * spec.head_dim  # K and V, bf16
    assert spec.num_kv_heads * spec.head_dim == GEMMA3_1B_KV_HEAD
    assert layout.sequence_bytes() == (22 * 767 + 4 * 8192) * row_bytes
    cache = KvCache(layout, "cpu")
    assert cache.nbytes == layout.sequence_bytes() < 0.33 * spec.num_layers * 8192 * row_bytes


@pytest.mark.parametrize("case, windows", [("mistral", (5, 5, 5)), ("ministral", (5, 0, 5)), ("smollm3", (5, 0, 0))])
def test_tiny_sliding_specs_keep_window_plus_a_pass(validation_models, case, windows):
    """A window of SMALL_WINDOW: passes of 16 rows (the smallest), rings of 5 - 1 + 16 = 20 rows; a batch's full
    layers keep the spare row, and a ring the decoder's positions would not fill is cut to them."""
    spec = load_spec(validation_models[case])
    assert tuple(spec.window(i) for i in range(spec.num_layers)) == windows
    assert ring_chunk_rows(spec) == RING_CHUNK_MIN
    for batch, full in ((1, 64), (3, 65)):
        layout = KvLayout.of(spec, 64, batch)
        assert layout.rows == tuple(SMALL_WINDOW - 1 + 16 if w else full for w in windows)
        assert layout.chunk_rows == 16 and layout.passes(40) == [(0, 16), (16, 32), (32, 40)]
        assert KvCache(layout, "cpu").nbytes == batch * layout.sequence_bytes()
    short = KvLayout.of(spec, 18)
    assert short.rows == (18,) * 3 and short.chunk_rows == 0 and short.passes(18) == [(0, 18)]
    assert ring_rows(spec) == 20


def test_without_sliding_layers_the_layout_is_the_kernels_strides():
    """Sequence-major [sequence][layer][kv head][row][head_dim], max_seq rows (a batch's + 1): the layout the
    megakernel of a spec without sliding layers strides by itself (its sources are unchanged)."""
    spec = load_spec("qwen3-tts-0.6b-talker")
    for batch, rows in ((1, 100), (4, 101)):
        layout = KvLayout.of(spec, 100, batch)
        cache = KvCache(layout, "cpu")
        dense = cache.k.view(batch, spec.num_layers, spec.num_kv_heads, rows, spec.head_dim)
        dense.copy_(torch.randn(dense.shape))
        for i in range(spec.num_layers):
            assert torch.equal(cache.k_layers[i], dense[:, i])
        assert layout.chunk_rows == 0 and layout.sequence_bytes() == 2 * dense[0].numel() * 2


def _header(spec) -> str:
    return render(spec, plan_launch(spec, target_for_arch("sm_90"))).files["constants.cuh"]


def test_the_kernel_finds_each_layers_rows_as_the_layout_lays_them():
    """A sliding spec's header: the ring's rows and the full layers before each layer, from which attention.cuh
    finds a layer's rows (as KvLayout's offsets); a spec without sliding layers renders neither."""
    gemma = load_spec("gemma-3-1b")
    header = _header(gemma)
    full_before = [sum(not gemma.window(j) for j in range(i)) for i in range(gemma.num_layers)]
    assert "constexpr int KV_RING_ROWS = 767;" in header and "constexpr int KV_FULL_LAYERS = 4;" in header
    assert f"KV_FULL_BEFORE[L] = {{ {', '.join(map(str, full_before))} }};" in header
    layout, head = KvLayout.of(gemma, 8192, batch=4), gemma.num_kv_heads * gemma.head_dim
    for i in range(gemma.num_layers):  # attention.cuh's arithmetic, with max_seq + 1 rows (a batch's spare row)
        ring, full = min(767, 8193), 8193
        assert layout.offsets[i] == (full_before[i] * full + (i - full_before[i]) * ring) * head
        assert layout.sequence_strides[i] == (4 * full + 22 * ring) * head
    assert "KV_RING_ROWS" not in _header(load_spec("qwen3-tts-0.6b-talker"))


def test_a_ring_holds_each_position_at_its_row():
    """Positions past the ring's rows overwrite the oldest; reads and writes across the wrap."""
    cache = torch.zeros(2, 7, 3)
    values = torch.arange(2 * 23 * 3, dtype=torch.float32).view(2, 23, 3)
    write_cache_rows(cache, 0, values[:, :5])
    write_cache_rows(cache, 5, values[:, 5:12])  # wraps: positions 7..11 at rows 0..4
    assert torch.equal(cache[:, 0], values[:, 7]) and torch.equal(cache[:, 6], values[:, 6])
    assert torch.equal(cache_rows(cache, 5, 12), values[:, 5:12])
    write_cache_rows(cache, 12, values[:, 12:23])  # more than the ring: its last 7 rows
    assert torch.equal(cache_rows(cache, 16, 23), values[:, 16:23])
    assert torch.equal(cache_rows(cache, 20, 23), values[:, 20:23])
    with pytest.raises(MkportError, match="holds 7"):
        cache_rows(cache, 15, 23)


def _sliding_model(validation_models, case):
    spec = load_spec(validation_models[case])
    return spec, load_weights(spec, Checkpoint.open(validation_models[case]))


def _run(spec, w, caches, x, pos, passes, steps):
    """A prompt prefilled in passes [first, end), then `steps` single rows, through torch_model.forward on caches
    (k, v); the hidden states of every row."""
    out = [torch_model.forward(spec, w, x[a:b], pos[:, a:b], *caches, start=a) for a, b in passes]
    n = passes[-1][1]
    for t in range(n, n + steps):
        out.append(torch_model.forward(spec, w, x[t : t + 1], pos[:, t : t + 1], *caches, start=t))
    return torch.cat(out)


@pytest.mark.parametrize("case", ["mistral", "ministral"])
def test_a_ring_gives_what_a_full_length_cache_gives(validation_models, case):
    """A 40-row prompt (8 windows) in the ring's passes, then 24 decode steps (the 20-row rings wrap three times
    more): the same bits as full-length caches, and near one fp32 pass over every row (1e-2: the later passes and
    steps read the earlier rows as bf16)."""
    spec, w = _sliding_model(validation_models, case)
    n, steps = 40, 24
    inp = validation_inputs(spec, case, n=n + steps)
    x = torch_model.embed_inputs(spec, w, inp["tokens"])
    pos = inp["positions"]
    layout = KvLayout.of(spec, 96)
    ring = KvCache(layout, "cpu")
    full_length = 2 * 2 * spec.num_layers * 96 * spec.num_kv_heads * spec.head_dim  # K and V, bf16
    assert min(layout.rows) == 20 and ring.nbytes < 0.5 * full_length
    full = [torch.zeros(spec.num_layers, spec.num_kv_heads, 96, spec.head_dim, dtype=torch.bfloat16) for _ in range(2)]
    got = _run(spec, w, ring.sequence(0), x, pos, layout.passes(n), steps)
    want = _run(spec, w, full, x, pos, layout.passes(n), steps)
    assert torch.equal(got, want)
    one_pass = torch_model.forward(spec, w, x, pos)  # every row attends in fp32
    assert rel(got, one_pass) < 1e-2  # bf16 K/V of the rows before each pass and step


def test_a_padded_pass_needs_the_whole_ring(validation_models):
    """A graph's pass is padded to its bucket, and the padding writes too: the ring's W - 1 + C rows keep what the
    real rows read (the padded pass equals the plain one); one row fewer and the padding overwrites keys its own
    rows still read."""
    spec, w = _sliding_model(validation_models, "mistral")
    chunk, window = ring_chunk_rows(spec), SMALL_WINDOW
    inp = validation_inputs(spec, "mistral", n=20)
    x = torch_model.embed_inputs(spec, w, inp["tokens"])
    pos = inp["positions"]

    def second_pass(rows: int, padded: bool) -> torch.Tensor:
        caches = [torch.zeros(spec.num_layers, spec.num_kv_heads, rows, spec.head_dim, dtype=torch.bfloat16)
                  for _ in range(2)]
        torch_model.forward(spec, w, x[:16], pos[:, :16], *caches, start=0)
        if not padded:  # rows 16..19 alone
            return torch_model.forward(spec, w, x[16:], pos[:, 16:], *caches, start=16)
        extra = torch.arange(20, 16 + chunk)  # padding up to the bucket: positions 20..31
        xs = torch.cat([x[16:], torch.zeros(len(extra), x.shape[1])])
        ps = torch.cat([pos[:, 16:], pos[:, -1:] + 1 + extra[None] - 20], dim=1)
        return torch_model.forward(spec, w, xs, ps, *caches, start=16)[:4]

    rows = window - 1 + chunk
    assert rel(second_pass(rows, True), second_pass(rows, False)) < CONTINUATION_TOL
    assert rel(second_pass(rows - 1, True), second_pass(rows - 1, False)) > 1e-3
