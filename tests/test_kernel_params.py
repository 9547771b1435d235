"""The kernel's Params on the host (render.KernelParams), defined once from PARAM_FIELDS: the bytes the kernel
gets, field for field; a name that is not a field is refused, a missing one too; and, through a library built
with nvcc whose launch function keeps the bytes it was given, what reaches the C side of a launch."""

from __future__ import annotations

import ctypes
import random
import shutil
import struct

import pytest

from mkport.build import PREFILL_FUNCTIONS, KernelLibrary, ensure_library
from mkport.errors import MkportError
from mkport.render import PARAM_FIELDS, SEQUENCE_FIELDS, KernelParams, kernel_params


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
