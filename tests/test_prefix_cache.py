"""The prefix KV cache on CPU (reference backend, tiny random model): the prompt's prefix rows and key, the
frames with the cache on and off, invalidation on another voice, the LRU bounds, the decoders' row copies."""

from __future__ import annotations

import dataclasses
import gc
import itertools

import pytest
import torch

from mkport.errors import MkportError
from mkport.tts.model import TtsModel, write_random_tts_model
from mkport.runtime.torch_decoder import TorchDecoder
from mkport.tts.pipeline import TtsSampling, generate_frames, synthesize
from mkport.tts.prefix_cache import SHARED_CACHE, PrefixCache
from mkport.tts.prompt import build_prompt

FRAMES = 8
TEXT = "Hi there"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prefix") / "tiny-0"
    write_random_tts_model(folder, "tiny", seed=0)
    return TtsModel.load(folder)


def _prompt(tiny, text=TEXT, speaker="vivian", language="english", instruct=None, text_mode="non-streaming",
            cfg=None):
    return build_prompt(cfg or tiny.config, tiny.encode, tiny.text, tiny.talker_weights.embed[0], text, speaker,
                        language, instruct, text_mode)


class CountingDecoder(TorchDecoder):
    """Records the rows of each prefill and each load_rows."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = []

    def prefill(self, *args, embeds=None, **kwargs):
        self.calls.append(("prefill", embeds.shape[0]))
        return super().prefill(*args, embeds=embeds, **kwargs)

    def load_rows(self, rows):
        self.calls.append(("load", rows[0].shape[2]))
        super().load_rows(rows)


def _decoders(tiny):
    return (CountingDecoder(tiny.talker_spec, tiny.talker_weights, 64),
            TorchDecoder(tiny.predictor_spec, tiny.predictor_weights, 17))


def _frames(tiny, prompt, decoders, cache):
    """Greedy codes [F, 16] and the talker's hidden of each frame [F, H]; the talker's calls of this run."""
    talker, predictor = decoders
    talker.calls = []
    sampling = TtsSampling.from_generation_config(tiny.generation, seed=3, greedy=True)
    codes, hidden = [], []
    # nothing queued ahead of a frame handed out, so talker.hidden is the one that produced its codebook 0
    for frame in generate_frames(tiny, prompt, talker, predictor, sampling, FRAMES, caller_decodes=lambda k: True,
                                 prefix_cache=cache):
        codes.append(frame)
        hidden.append(talker.hidden.clone())
    return torch.stack(codes), torch.stack(hidden), talker.calls


# -- the prompt's prefix --------------------------------------------------------------------------------
def test_prefix_rows_cover_what_comes_before_the_text(tiny):
    role = len(tiny.encode("<|im_start|>assistant\n"))
    p = _prompt(tiny)  # english, vivian: think, think_bos, lang, think_eos, speaker, codec_pad
    assert p.prefix_rows == role + 6 == p.embeds.shape[0] - len(p.text_ids) - 2
    s = _prompt(tiny, language="auto", speaker=None, text_mode="streaming")  # nothink, think_bos, think_eos, pad
    assert s.prefix_rows == role + 4 == s.embeds.shape[0] - 1


def test_same_key_iff_same_prefix_rows(tiny):
    """Over voices, texts and text modes: prompts with one key have identical prefix rows, and prompts with
    different rows have different keys."""
    by_key: dict[tuple, torch.Tensor] = {}
    keys_by_rows: dict[bytes, set] = {}
    for speaker, language, text, mode in itertools.product(["vivian", "aiden", None], ["auto", "english", "german"],
                                                           [TEXT, "Something else, longer."],
                                                           ["non-streaming", "streaming"]):
        p = _prompt(tiny, text, speaker, language, text_mode=mode)
        rows = p.embeds[: p.prefix_rows]
        if p.prefix_key in by_key:
            assert torch.equal(by_key[p.prefix_key], rows), p.prefix_key
        by_key[p.prefix_key] = rows
        keys_by_rows.setdefault(rows.numpy().tobytes(), set()).add(p.prefix_key)
    assert len(by_key) == 3 * 3  # voices; neither the text nor the text mode changes the key
    assert all(len(keys) == 1 for keys in keys_by_rows.values())


def test_instruct_is_part_of_the_prefix(tiny):
    cfg = dataclasses.replace(tiny.config, model_size="1b7")  # the 0.6B models take no instruction
    plain = _prompt(tiny, cfg=cfg)
    calm, loud = (_prompt(tiny, instruct=i, cfg=cfg) for i in ("Speak calmly.", "Shout it."))
    instruct_rows = len(tiny.encode("<|im_start|>user\nSpeak calmly.<|im_end|>\n"))
    assert calm.prefix_rows == plain.prefix_rows + instruct_rows
    assert len({plain.prefix_key, calm.prefix_key, loud.prefix_key}) == 3
    assert _prompt(tiny, "Other words.", instruct="Speak calmly.", cfg=cfg).prefix_key == calm.prefix_key


# -- the frame loop -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["non-streaming", "streaming"])
def test_frames_with_the_cache_equal_those_without(tiny, mode):
    """Off: one prefill. On, first request: the prefix alone, then the rest; second request on the same
    decoders: the prefix loaded, only the rest prefilled (none in streaming mode, where the prefix is all
    but the last row). Same codes, hidden states within float rounding of prefills of other row counts."""
    prompt = _prompt(tiny, text_mode=mode)
    n, rows = prompt.prefix_rows, prompt.embeds.shape[0] - 1
    decoders, cache = _decoders(tiny), PrefixCache()
    off = _frames(tiny, prompt, decoders, None)
    miss = _frames(tiny, prompt, decoders, cache)
    hit = _frames(tiny, prompt, decoders, cache)
    rest = [("prefill", rows - n)] if rows > n else []
    assert off[2] == [("prefill", rows)]
    assert miss[2] == [("prefill", n)] + rest
    assert hit[2] == [("load", n)] + rest
    assert (cache.misses, cache.hits, len(cache)) == (1, 1, 1)
    assert off[0].shape == (FRAMES, 16) and len({tuple(c.tolist()) for c in off[0]}) > 1
    for run in (miss, hit):
        assert torch.equal(run[0], off[0])
        torch.testing.assert_close(run[1], off[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(hit[1], miss[1])  # the loaded rows are the stored ones


def test_another_voice_does_not_reuse_the_prefix(tiny):
    decoders, cache = _decoders(tiny), PrefixCache()
    first = _frames(tiny, _prompt(tiny), decoders, cache)
    for voice in (dict(speaker="aiden"), dict(language="german")):
        prompt = _prompt(tiny, **voice)
        other = _frames(tiny, prompt, decoders, cache)
        assert other[2][0] == ("prefill", prompt.prefix_rows)  # a miss: computed, not loaded
        assert torch.equal(other[0], _frames(tiny, prompt, _decoders(tiny), None)[0])
        assert not torch.equal(other[0], first[0])
    assert (len(cache), cache.hits, cache.misses) == (3, 0, 3)
    # the first voice again, another text: a hit, whose rows replace the other voice's in the talker's cache
    prompt = _prompt(tiny, "Other words.")
    again = _frames(tiny, prompt, decoders, cache)
    assert again[2][0][0] == "load" and cache.hits == 1
    assert torch.equal(again[0], _frames(tiny, prompt, _decoders(tiny), None)[0])


def test_entries_belong_to_one_decoder(tiny):
    """Another decoder does not read a decoder's rows, and a collected decoder's rows are dropped."""
    cache, prompt = PrefixCache(), _prompt(tiny)
    a = _decoders(tiny)
    _frames(tiny, prompt, a, cache)
    b = _decoders(tiny)
    assert _frames(tiny, prompt, b, cache)[2][0][0] == "prefill" and len(cache) == 2
    del a
    gc.collect()
    assert cache.get(b[0], prompt.prefix_key) is not None and len(cache) == 1


def test_lru_bounds(tiny):
    talker = _decoders(tiny)[0]
    talker.prefill(embeds=torch.zeros(4, tiny.talker_spec.input_dim))
    rows = talker.cached_rows(3)
    size = sum(t.numel() * t.element_size() for t in rows)
    cache = PrefixCache(max_entries=2)
    for key in ("a", "b"):
        cache.put(talker, (key,), talker.cached_rows(3))
    assert cache.get(talker, ("a",)) is not None  # now "b" is the least recently used
    cache.put(talker, ("c",), rows)
    assert len(cache) == 2 and cache.get(talker, ("b",)) is None and cache.get(talker, ("a",)) is not None
    assert cache.bytes == 2 * size

    by_bytes = PrefixCache(max_bytes=size * 3 // 2)
    by_bytes.put(talker, ("a",), rows)
    by_bytes.put(talker, ("b",), rows)
    assert len(by_bytes) == 1 and by_bytes.get(talker, ("b",)) is not None and by_bytes.bytes == size
    small = PrefixCache(max_bytes=size - 1)
    small.put(talker, ("a",), rows)
    assert len(small) == 0 and small.bytes == 0
    small.clear()
    by_bytes.clear()
    assert len(by_bytes) == 0 and by_bytes.bytes == 0
    with pytest.raises(MkportError, match="max_entries=0"):
        PrefixCache(max_entries=0)


def test_synthesize_uses_the_shared_cache_unless_turned_off(tiny):
    decoders = _decoders(tiny)
    prompt = _prompt(tiny, speaker="serena")
    n, rows = prompt.prefix_rows, prompt.embeds.shape[0] - 1
    request = dict(speaker="serena", language="english", max_frames=3, greedy=True, decoders=decoders)
    off = list(synthesize(tiny, TEXT, prefix_cache=None, **request))
    assert decoders[0].calls == [("prefill", rows)]
    assert SHARED_CACHE.get(decoders[0], prompt.prefix_key) is None
    decoders[0].calls = []
    on = list(synthesize(tiny, TEXT, **request))
    assert decoders[0].calls == [("prefill", n), ("prefill", rows - n)]
    assert SHARED_CACHE.get(decoders[0], prompt.prefix_key) is not None
    assert torch.equal(torch.cat(on), torch.cat(off))


def test_cached_rows_round_trip_and_bad_use(tiny):
    spec = tiny.talker_spec
    a, b = (TorchDecoder(spec, tiny.talker_weights, 16) for _ in range(2))
    x = torch.randn(6, spec.input_dim, generator=torch.Generator().manual_seed(0))
    whole = a.prefill(embeds=x)
    b.load_rows(a.cached_rows(4))
    assert b.length == 4
    torch.testing.assert_close(b.prefill(embeds=x[4:]), whole[4:], rtol=1e-5, atol=1e-5)
    with pytest.raises(MkportError, match="empty KV cache"):
        b.load_rows(a.cached_rows(4))
    with pytest.raises(MkportError, match="holds 6 rows"):
        a.cached_rows(7)
    with pytest.raises(MkportError, match="past the KV cache length"):
        TorchDecoder(spec, tiny.talker_weights, 3).load_rows(a.cached_rows(4))
    k, v = a.cached_rows(4)
    with pytest.raises(MkportError, match="do not fit"):
        TorchDecoder(spec, tiny.talker_weights, 16).load_rows((k[:1], v[:1]))
