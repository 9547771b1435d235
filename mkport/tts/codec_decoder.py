"""mkport's own decoder of the Qwen3-TTS 12 Hz speech tokenizer: 16 codes a frame -> 1920 samples at 24 kHz.

The data path, one block class each:
  codes [B, 16, T]
  -> SplitCodebooks: codebook 0 and the sum of codebooks 1..15, each group through its own 1x1 projection
  -> CausalConv1d (kernel 3) to latent_dim
  -> CodecTransformer: input projection, layers of (RMSNorm, sliding-window causal attention with RoPE,
     layer scale) and (RMSNorm, SiLU-gated MLP, layer scale), final RMSNorm, output projection
  -> per `upsampling_ratios` entry: CausalConvTranspose1d (x ratio) and ConvNeXtBlock
  -> CausalConv1d (kernel 7) to decoder_dim, then per `upsample_rates` entry a WaveformBlock (Snake,
     CausalConvTranspose1d halving the channels, three ResidualUnits with dilations 1, 3, 9)
  -> Snake, CausalConv1d to one channel, clamped to [-1, 1]: [B, 1, T * 1920].

Every part is causal, so the samples of frame t depend on frames <= t only (codec.py relies on it for
streaming and for padding at the end). `CodecDecoder.stream` decodes a stream's frames a few at a time with what
the layers need of the frames before kept in a StreamState (the input tail of each convolution, the keys and
values in the attention window): the same samples as one call on all the frames, without decoding any frame
twice. Module and parameter names follow the released checkpoint
(`speech_tokenizer/model.safetensors`, tensors `decoder.<name>`), so `load_state_dict` takes its tensors as
they are. The official implementation (PyPI `qwen-tts-hf`) is the oracle in tests/test_codec_decoder.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MkportError


@dataclass(frozen=True)
class CodecDecoderConfig:
    """The `decoder_config` of a speech tokenizer's config.json. Defaults are the released decoder's
    configuration class defaults; `codebook_dim` has none there and is required."""

    codebook_dim: int
    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    latent_dim: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    attention_bias: bool = False
    sliding_window: int = 72
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    decoder_dim: int = 1536
    upsample_rates: tuple = (8, 5, 4, 3)
    upsampling_ratios: tuple = (2, 2)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "decoder_config") -> "CodecDecoderConfig":
        """Keys this decoder does not use (max_position_embeddings, semantic_codebook_size, ...) are ignored,
        as the official code ignores them; a value of the wrong kind or out of range is an error."""
        if not isinstance(raw, dict):
            raise MkportError(f"{where}: decoder_config must be an object, got {type(raw).__name__}")
        if "codebook_dim" not in raw:
            raise MkportError(f"{where}: decoder_config lacks codebook_dim")
        if raw.get("rope_scaling"):
            raise MkportError(f"{where}: rope_scaling {raw['rope_scaling']} is not supported; supported: plain RoPE")
        values = {}
        for f in fields(cls):
            if raw.get(f.name) is None:  # absent, or null as transformers writes an unset head_dim
                continue
            value = raw[f.name]
            if f.name in ("upsample_rates", "upsampling_ratios"):
                ok = isinstance(value, (list, tuple)) and all(_is_int(v) and v > 0 for v in value)
                value = tuple(value) if ok else value
            elif f.name == "attention_bias":
                ok = isinstance(value, bool)
            elif f.name == "hidden_act":
                ok = value == "silu"
            elif f.name in ("rope_theta", "rms_norm_eps"):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
                value = float(value) if ok else value
            else:
                ok = _is_int(value) and value > 0
            if not ok:
                supported = "silu" if f.name == "hidden_act" else "a positive number or list of them"
                raise MkportError(f"{where}: decoder_config {f.name}={value!r} is not supported; supported: {supported}")
            values[f.name] = value
        cfg = cls(**values)
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise MkportError(f"{where}: num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {cfg.num_key_value_heads}")
        if cfg.codebook_dim % 2 or cfg.decoder_dim % 2 ** len(cfg.upsample_rates):
            raise MkportError(f"{where}: codebook_dim must be even and decoder_dim divisible by "
                              f"2^{len(cfg.upsample_rates)} (one halving per upsample rate)")
        if cfg.num_quantizers < 2:
            raise MkportError(f"{where}: num_quantizers {cfg.num_quantizers}: at least 2 are needed")
        return cfg

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def derived(module: nn.Module, name: str, params: tuple[torch.Tensor, ...], compute):
    """compute() of a module's parameters, kept on the module until one of them changes (another tensor, device,
    dtype, or an in-place write, which bumps its version): a decode would otherwise launch a few small kernels
    for such weight-only values at every call (29 Snakes, 16 codebooks). Kept outside the module's state
    (not in state_dict, not moved by .to(), which makes new parameter tensors and so a recomputation)."""
    if torch.compiler.is_compiling():  # a compiled call fuses them into the kernels that use them
        return compute()
    key = tuple((p.data_ptr(), p.device, p.dtype, p._version) for p in params)
    kept = module.__dict__.get(name)
    if kept is None or kept[0] != key:
        with torch.no_grad():
            kept = (key, compute())
        module.__dict__[name] = kept
    return kept[1]


# -- convolutions ---------------------------------------------------------------------------------------
class CausalConv1d(nn.Module):
    """A stride-1 convolution padded on the left only: output t sees inputs t - reach .. t. The convolution pads
    both sides itself (no padded copy of the input) and the `reach` outputs past the input's end are dropped."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.reach = (kernel - 1) * dilation
        self.conv = nn.Conv1d(channels_in, channels_out, kernel, dilation=dilation, groups=groups, padding=self.reach)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., : x.shape[-1]] if self.reach else y

    def state_shapes(self) -> list[tuple]:
        return [(self.conv.in_channels, self.reach)] if self.reach else []

    def stream(self, x: torch.Tensor, state: "StreamState") -> torch.Tensor:
        """forward() of the frames after those already seen, whose last `reach` inputs the state keeps."""
        if not self.reach:
            return self.conv(x)
        (tail,) = state.of(self)
        x = torch.cat((state.take(tail), x), dim=-1)
        state.put(tail, x[..., -self.reach:])
        conv = self.conv
        return F.conv1d(x, conv.weight, conv.bias, dilation=conv.dilation, groups=conv.groups)


class CausalConvTranspose1d(nn.Module):
    """Upsampling by `stride` with a transposed convolution whose tail (kernel - stride samples that belong
    to frames after the last one) is cut, so output frame t depends on input frames <= t."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(channels_in, channels_out, kernel, stride=stride)
        self.stride, self.tail = stride, kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., : y.shape[-1] - self.tail] if self.tail else y

    def state_shapes(self) -> list[tuple]:
        # an input reaches `tail` samples past its own stride: the inputs whose reach is not all out are kept
        return [(self.conv.in_channels, -(-self.tail // self.stride))] if self.tail else []

    def stream(self, x: torch.Tensor, state: "StreamState") -> torch.Tensor:
        """forward() of the frames after those already seen: the kept inputs go through again, and the outputs
        of their own frames (out already) are dropped."""
        if not self.tail:
            return self.conv(x)
        (before,) = state.of(self)
        kept = before.shape[-1]
        x = torch.cat((state.take(before), x), dim=-1)
        state.put(before, x[..., -kept:])
        start = kept * self.stride
        return self.conv(x)[..., start : start + (x.shape[-1] - kept) * self.stride]


class Snake(nn.Module):
    """x + sin^2(a x) / b per channel, with a = exp(alpha) and b = exp(beta) (both stored as logarithms)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freq, inv_mag = derived(self, "_factors", (self.alpha, self.beta), lambda: (
            self.alpha.exp()[:, None],
            1.0 / (self.beta.exp()[:, None] + 1e-9),  # the small term keeps b = 0 finite
        ))
        return torch.addcmul(x, inv_mag, torch.sin(x * freq).square())


class ResidualUnit(nn.Module):
    """x + conv1x1(snake(dilated conv7(snake(x))))."""

    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.act1 = Snake(channels)
        self.conv1 = CausalConv1d(channels, channels, 7, dilation=dilation)
        self.act2 = Snake(channels)
        self.conv2 = CausalConv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))

    def stream(self, x: torch.Tensor, state: "StreamState") -> torch.Tensor:
        return x + self.conv2.stream(self.act2(self.conv1.stream(self.act1(x), state)), state)


class WaveformBlock(nn.Module):
    """One upsampling stage of the waveform decoder: Snake, a transposed convolution by `rate` that halves
    the channels, then residual units with growing dilation."""

    def __init__(self, channels_in: int, rate: int):
        super().__init__()
        out = channels_in // 2
        units = [ResidualUnit(out, dilation) for dilation in (1, 3, 9)]
        self.block = nn.Sequential(Snake(channels_in), CausalConvTranspose1d(channels_in, out, 2 * rate, rate), *units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)

    def stream(self, x: torch.Tensor, state: "StreamState") -> torch.Tensor:
        return stream_through(self.block, x, state)


class ConvNeXtBlock(nn.Module):
    """x + gamma * MLP(LayerNorm(depthwise causal conv7(x))), the MLP 4x wide with exact GELU."""

    def __init__(self, channels: int):
        super().__init__()
        self.dwconv = CausalConv1d(channels, channels, 7, groups=channels)
        self.norm = nn.LayerNorm(channels, eps=1e-6)
        self.pwconv1 = nn.Linear(channels, 4 * channels)
        self.pwconv2 = nn.Linear(4 * channels, channels)
        self.gamma = nn.Parameter(torch.full((channels,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._after_dwconv(x, self.dwconv(x))

    def stream(self, x: torch.Tensor, state: "StreamState") -> torch.Tensor:
        return self._after_dwconv(x, self.dwconv.stream(x, state))

    def _after_dwconv(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h.transpose(1, 2)))))
        return torch.addcmul(x, self.gamma[:, None], h.transpose(1, 2))


# -- codebooks ------------------------------------------------------------------------------------------
class Codebook(nn.Module):
    """Entries stored as a running sum and a usage count (as trained); an entry is sum / max(usage, 1e-5)."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def entries(self) -> torch.Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class CodebookSlot(nn.Module):
    """The checkpoint keeps each codebook one level down (`layers.<i>._codebook.*`)."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self._codebook = Codebook(size, dim)


class CodebookGroup(nn.Module):
    """Residual codebooks whose entries are summed and projected (1x1) from dim to dim_out."""

    def __init__(self, count: int, size: int, dim: int, dim_out: int):
        super().__init__()
        # the encoder's projection into the codebooks: unused in decoding, kept so checkpoints round-trip
        self.input_proj = nn.Conv1d(dim_out, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, dim_out, 1, bias=False)
        self.vq = nn.Module()
        self.vq.layers = nn.ModuleList(CodebookSlot(size, dim) for _ in range(count))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, count, T] -> [B, dim_out, T]: every codebook's entries gathered at once from one table (the
        codebooks' entries one after another), then summed."""
        books = [slot._codebook for slot in self.vq.layers]
        params = tuple(p for book in books for p in (book.embedding_sum, book.cluster_usage))
        table = derived(self, "_table", params, lambda: torch.cat([book.entries() for book in books]))
        first = derived(self, "_first_rows", params, lambda: torch.arange(len(books), device=table.device)[:, None]
                        * books[0].embedding_sum.shape[0])  # where each codebook starts in the table
        picked = F.embedding(codes + first, table)  # [B, count, T, dim]
        return self.output_proj(picked.sum(1).transpose(1, 2))


class SplitCodebooks(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic) are separate groups; their outputs add up."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = CodebookGroup(1, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = CodebookGroup(cfg.num_quantizers - 1, cfg.codebook_size, dim, cfg.codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] -> [B, codebook_dim, T]."""
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


# -- transformer ----------------------------------------------------------------------------------------
class LayerScale(nn.Module):
    """A residual branch's per-channel scale (TransformerLayer adds scale * branch in one addcmul)."""

    def __init__(self, channels: int):
        super().__init__()
        self.scale = nn.Parameter(torch.full((channels,), 0.01))


class Attention(nn.Module):
    """Multi-head (or grouped-query) self-attention, RoPE on q and k (halves rotated), each position
    attending to itself and the sliding_window - 1 positions before it (the mask comes from CodecTransformer)."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_head_dim
        self.window = cfg.sliding_window
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """visible [T, T]: sliding_window_mask(T)."""
        q, k, v = self._project(x, cos, signed_sin)
        return self._attend(x, q, k, v, visible)

    def state_shapes(self) -> list[tuple]:
        return [(self.kv_heads, self.window - 1, self.head_dim)] * 2  # keys (rotated) and values

    def stream(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, visible: torch.Tensor,
               state: "StreamState") -> torch.Tensor:
        """forward() of the frames after those already seen, with the keys and values of the window - 1 frames
        before them from the state; visible [B, 1, T, window - 1 + T] (CodecTransformer.stream)."""
        q, k, v = self._project(x, cos, signed_sin)
        kept_k, kept_v = state.of(self)
        k = torch.cat((state.take(kept_k), k), dim=2)
        v = torch.cat((state.take(kept_v), v), dim=2)
        state.put(kept_k, k[:, :, -kept_k.shape[2]:])
        state.put(kept_v, v[:, :, -kept_v.shape[2]:])
        return self._attend(x, q, k, v, visible)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> tuple:
        b, t, _ = x.shape
        projs = (self.q_proj, self.k_proj, self.v_proj)  # one matmul for the three, their weights stacked
        params = tuple(p for proj in projs for p in (proj.weight, proj.bias) if p is not None)
        weight, bias = derived(self, "_qkv", params, lambda: (
            torch.cat([proj.weight for proj in projs]),
            torch.cat([proj.bias for proj in projs]) if self.q_proj.bias is not None else None))
        q, k, v = F.linear(x, weight, bias).split([proj.out_features for proj in projs], dim=-1)
        q = _rotate(q.reshape(b, t, self.heads, self.head_dim).transpose(1, 2), cos, signed_sin)
        k = _rotate(k.reshape(b, t, self.kv_heads, self.head_dim).transpose(1, 2), cos, signed_sin)
        return q, k, v.reshape(b, t, self.kv_heads, self.head_dim).transpose(1, 2)

    def _attend(self, x: torch.Tensor, q, k, v, visible: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def sliding_window_mask(t: int, window: int, device) -> torch.Tensor:
    """[T, T] bool: query i sees keys i - window + 1 .. i."""
    pos = torch.arange(t, device=device)
    back = pos[:, None] - pos[None, :]  # query - key
    return (back >= 0) & (back < window)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE with halves rotated: x * cos + (-second, first) * sin, the swap a roll and its sign in signed_sin
    (CodecTransformer.forward)."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)


class Mlp(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = derived(self, "_gate_up", (self.gate_proj.weight, self.up_proj.weight),
                         lambda: torch.cat([self.gate_proj.weight, self.up_proj.weight]))  # one matmul for both
        gate, up = F.linear(x, weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = Mlp(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, visible: torch.Tensor,
                state: "StreamState | None" = None) -> torch.Tensor:
        """With a state: the frames after those already seen (Attention.stream)."""
        normed = self.input_layernorm(x)
        attended = (self.self_attn(normed, cos, signed_sin, visible) if state is None
                    else self.self_attn.stream(normed, cos, signed_sin, visible, state))
        x = torch.addcmul(x, self.self_attn_layer_scale.scale, attended)
        return torch.addcmul(x, self.mlp_layer_scale.scale, self.mlp(self.post_attention_layernorm(x)))


class CodecTransformer(nn.Module):
    """[B, T, latent_dim] -> [B, T, latent_dim] through hidden_size-wide layers; positions 0..T-1."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.window = cfg.sliding_window
        self.register_buffer("inv_freq", self.rope_inv_freq(cfg), persistent=False)  # not in the checkpoint

    @staticmethod
    def rope_inv_freq(cfg: CodecDecoderConfig) -> torch.Tensor:
        """On the CPU even when the module is built on the meta device: no checkpoint holds it."""
        dim = cfg.attention_head_dim
        return 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_proj(x)
        cos, signed_sin = self._rotation(torch.arange(h.shape[1], device=h.device), h.dtype)
        visible = sliding_window_mask(h.shape[1], self.window, h.device)  # once for every layer
        for layer in self.layers:
            h = layer(h, cos, signed_sin, visible)
        return self.output_proj(self.norm(h))

    def stream(self, x: torch.Tensor, state: "StreamState") -> torch.Tensor:
        """forward() of each row's frames after the state.position[row] it has seen: positions go on from there,
        and each frame sees the window - 1 frames before it, as in one call on all of them."""
        h = self.input_proj(x)
        seen = state.take(state.position)[:, None]  # [B, 1]
        positions = seen + torch.arange(h.shape[1], device=h.device)  # [B, T]
        cos, signed_sin = self._rotation(positions, h.dtype)
        keys = torch.cat((seen - (self.window - 1) + torch.arange(self.window - 1, device=h.device), positions), dim=1)
        back = positions[:, :, None] - keys[:, None, :]  # [B, T, window - 1 + T]: query - key
        visible = ((back >= 0) & (back < self.window) & (keys[:, None, :] >= 0))[:, None]
        for layer in self.layers:
            h = layer(h, cos[:, None], signed_sin[:, None], visible, state)
        state.put(state.position, positions[:, -1] + 1)
        return self.output_proj(self.norm(h))

    def _rotation(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and signed sin [..., head_dim] at `positions` (any shape)."""
        # angles in float32 whatever the module's dtype, as the released model computes them
        angles = positions.to(torch.float32)[..., None] * self.inv_freq.float()
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # the rotation's sign (_rotate)


# -- the decoder ----------------------------------------------------------------------------------------
class CodecDecoder(nn.Module):
    """codes [B, num_quantizers, T] (long) -> waveform [B, 1, T * samples_per_frame] in [-1, 1]."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.config = cfg
        self.pre_transformer = CodecTransformer(cfg)
        self.quantizer = SplitCodebooks(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, 3)
        self.upsample = nn.ModuleList(
            nn.Sequential(CausalConvTranspose1d(cfg.latent_dim, cfg.latent_dim, r, r), ConvNeXtBlock(cfg.latent_dim))
            for r in cfg.upsampling_ratios
        )
        rates = cfg.upsample_rates
        blocks = [WaveformBlock(cfg.decoder_dim // 2**i, rate) for i, rate in enumerate(rates)]
        out = cfg.decoder_dim // 2 ** len(rates)
        self.decoder = nn.Sequential(CausalConv1d(cfg.latent_dim, cfg.decoder_dim, 7), *blocks, Snake(out),
                                     CausalConv1d(out, 1, 7))

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame


    def latents(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] -> the upsampled latents [B, latent_dim, T * prod(upsampling_ratios)] that the
        waveform decoder (`self.decoder`) turns into samples."""
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise MkportError(f"codes must be [batch, {self.config.num_quantizers}, frames], got {tuple(codes.shape)}")
        h = self.pre_conv(self.quantizer(codes))
        h = self.pre_transformer(h.transpose(1, 2)).transpose(1, 2)
        for stage in self.upsample:
            h = stage(h)
        return h

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.latents(codes)).clamp(-1.0, 1.0)

    def stream(self, codes: torch.Tensor, state: "StreamState") -> torch.Tensor:
        """forward() of the frames codes [B, Q, T] that come after those each row of state.rows has seen: the
        samples one call on all of them would give for these frames, [B, 1, T * samples_per_frame]."""
        h = self.pre_conv.stream(self.quantizer(codes), state)
        h = self.pre_transformer.stream(h.transpose(1, 2), state).transpose(1, 2)
        for stage in self.upsample:
            h = stream_through(stage, h, state)
        return stream_through(self.decoder, h, state).clamp(-1.0, 1.0)


def stream_through(layers: nn.Sequential, x: torch.Tensor, state: "StreamState") -> torch.Tensor:
    """A sequence of layers, each with its state where it keeps one."""
    for layer in layers:
        x = layer.stream(x, state) if hasattr(layer, "stream") else layer(x)
    return x


class StreamState:
    """What CodecDecoder.stream keeps of the frames each stream has decoded, for `streams` streams at once (a row
    each, and a spare row that a CUDA graph's unused rows write to): the last inputs of every convolution that
    reaches back, the last window - 1 keys and values of every attention layer, and the frames seen. A call
    decodes the streams of `rows` (set before it, a long tensor on the module's device), or row 0 alone when
    `rows` is None: views of it instead of a gather and a scatter a tensor (SpeechDecoder's one-stream state)."""

    def __init__(self, module: CodecDecoder, streams: int):
        weight = next(module.parameters())
        device = weight.device
        self.spare = streams
        self.rows = torch.arange(streams, device=device)
        self.position = torch.zeros(streams + 1, dtype=torch.long, device=device)
        self._kept = {layer: [torch.zeros(streams + 1, *shape, device=device, dtype=weight.dtype)
                              for shape in shapes] for layer, shapes in self._shapes(module)}

    @staticmethod
    def _shapes(module: CodecDecoder) -> list[tuple[nn.Module, list[tuple]]]:
        """The layers that keep state, each with the shapes of a row's tensors."""
        return [(layer, layer.state_shapes()) for layer in module.modules() if hasattr(layer, "state_shapes")]

    @staticmethod
    def row_bytes(module: CodecDecoder) -> int:
        """The bytes of one stream's row (what a stream adds to a state of many: mkport.serve.batched.stream_bytes)."""
        size = next(module.parameters()).element_size()
        kept = sum(math.prod(shape) for _, shapes in StreamState._shapes(module) for shape in shapes)
        return kept * size + 8  # and its position, an int64

    def of(self, layer: nn.Module) -> list[torch.Tensor]:
        return self._kept[layer]

    def take(self, kept: torch.Tensor) -> torch.Tensor:
        """The rows of this call of a kept tensor."""
        return kept[:1] if self.rows is None else kept[self.rows]

    def put(self, kept: torch.Tensor, value: torch.Tensor) -> None:
        """Stores `value` as the rows of this call of a kept tensor."""
        if self.rows is None:
            kept[:1].copy_(value)
        else:
            kept[self.rows] = value

    def row(self, row: int) -> list[torch.Tensor]:
        """Views [1, ...] of row `row` of every tensor kept, the frames seen included: all a stream's state, to copy in
        and out (tts.codec.SpeechDecoder.stream)."""
        return [t[row:row + 1] for kept in self._kept.values() for t in kept] + [self.position[row:row + 1]]

    def reset(self, row: int) -> None:
        """Row `row` starts a new stream: no frames seen (zeros are what the layers pad a first frame with)."""
        torch._foreach_zero_(self.row(row))  # a few launches for the ~40 tensors, not one each
