"""Reference adapters: the transformers model classes, run in float32 from the same bf16 weights as the
kernel, with taps at the kernel's trace points.

The transformers config is built from the raw config dict (never from ModelSpec), so that a misreading in
spec.py shows up as a difference. The spec is used only to find and shape-check the checkpoint tensors.

Roles and their reference:
- llm, model_type qwen3 / qwen2 / llama / mistral / ministral / granite / smollm3 / phi3 / gemma / gemma2 / gemma3_text
  / olmo2 / olmo3 and the mixture-of-experts qwen3_moe / qwen2_moe / olmoe / mixtral / granitemoe: AutoConfig.for_model +
  AutoModelForCausalLM (float32, eager attention and eager experts: transformers' loop over the experts hit).
  transformers 5 holds each layer's experts as 3-D parameters (experts.gate_up_proj, experts.down_proj) that a
  released checkpoint's per-expert tensors are fused into here, as its own loading does. The multimodal wrappers
  of WRAPPERS (gemma3, mistral3, qwen3_5, qwen3_5_moe): the wrapper config's text_config (its class defaults filled)
  + AutoModelForCausalLM, the decoder's tensors read from under language_model.
  Qwen3.5's hybrids (qwen3_5_text, qwen3_5_moe_text, and the text_config of their multimodal wrappers qwen3_5 and
  qwen3_5_moe) are among them: transformers' torch paths for the conv and the delta rule (chunked over a sequence, as no
  cache is passed), MRoPE position streams, and (qwen3_5_moe) the experts as its checkpoints hold them.
- llm, Qwen3-VL, Qwen2.5-VL and Qwen2-VL (a qwen3_vl / qwen2_5_vl / qwen2_vl wrapper, with a text_config or, as
  Qwen2(.5)-VL's released configs are, flat; or the text decoder's type itself): that decoder's TextConfig +
  TextModel (VL_TEXT_MODELS), plus a float32 linear head (the embedding when tie_word_embeddings).
- tts_talker: Qwen3VLTextConfig built from talker_config fields (interleaved MRoPE, which is what Qwen3-VL's
  text rotary always does) + Qwen3VLTextModel; codec_embedding -> embed_tokens; codec_head as the head.
- tts_code_predictor: Qwen3Config from code_predictor_config + Qwen3Model; inputs through the codec
  embedding tables (talker width) and small_to_mtp_projection when present, fed as inputs_embeds.

Taps are named by mkport.kernel.interface.Tap, as in mkport.runtime.torch_model.forward; each [N, width] float32.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import MkportError
from ..kernel.interface import Tap
from ..kernel.spec import HYBRID_MODEL_TYPES, LLM_FAMILIES, VL_TEXT_TYPES, WRAPPED_TEXT_TYPES, ModelSource
from ..runtime.rope_switch import recomputes
from ..runtime.weights import EXPERT_NAMES, Checkpoint, checkpoint_shapes, halves_order, read_checkpoint, weight_names


def cache_argument(model: torch.nn.Module) -> str:
    """The name a transformers model's forward takes its KV cache by: `cache` in newer 5.x releases, `past_key_values`
    before (an unknown keyword is swallowed by its **kwargs, so the wrong one would run every step without a cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

# Multimodal wrappers whose text_config is one of LLM_TYPES: their reference is that decoder's causal LM
WRAPPERS = tuple(WRAPPED_TEXT_TYPES)
# Qwen3.5's hybrids (HYBRID_MODEL_TYPES) among them: their RoPE takes three position streams (MRoPE)
LLM_TYPES = tuple(t for t in LLM_FAMILIES if t not in VL_TEXT_TYPES.values())  # the Qwen-VL decoders: built below
# A Qwen-VL text decoder's transformers config and model classes, and whether its MRoPE interleaves the three position
# streams over the frequencies (Qwen3-VL's always does; Qwen2-VL's and Qwen2.5-VL's take them in contiguous sections)
VL_TEXT_MODELS = {"qwen3_vl_text": ("Qwen3VLTextConfig", "Qwen3VLTextModel", True),
                  "qwen2_vl_text": ("Qwen2VLTextConfig", "Qwen2VLTextModel", False),
                  "qwen2_5_vl_text": ("Qwen2_5_VLTextConfig", "Qwen2_5_VLTextModel", False)}


def vl_text_type(config: dict) -> str | None:
    """The Qwen-VL text decoder type a config is or wraps (VL_TEXT_MODELS), None for any other (a wrapper whose
    text_config names another type among them: it has no reference, and says so in one line)."""
    model_type = config.get("model_type", "")
    if model_type in VL_TEXT_TYPES:
        model_type = (config.get("text_config") or {}).get("model_type", VL_TEXT_TYPES[model_type])
    return model_type if model_type in VL_TEXT_MODELS else None


def _closure(fn) -> dict:
    """A function's free variables by name (their cells); none for anything else."""
    code = getattr(fn, "__code__", None)
    return dict(zip(code.co_freevars, fn.__closure__ or ())) if code is not None else {}


def _dispatcher(fn):
    """transformers' kernel dispatcher behind `fn`: since 5.25 a module whose forward calls it as `func`."""
    if isinstance(fn, torch.nn.Module):
        cells = _closure(type(fn).forward)
        if "func" in cells:
            return cells["func"].cell_contents
    return fn


def torch_path(fn):
    """transformers' own torch implementation of a function it dispatches to a kernel package when one is installed
    (flash-linear-attention, causal-conv1d: Triton and CUDA kernels, TF32 matmuls on float32 inputs), so that the
    float32 reference never runs them; keyword arguments the implementation does not take are dropped, as the
    dispatcher drops them. `fn` itself where it is no such dispatcher."""
    fn = _dispatcher(fn)
    inner = inspect.unwrap(fn)  # the dispatcher is functools.wraps(torch_function)
    if inner is fn:
        return fn
    params = inspect.signature(inner).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return inner

    def call(*args, **kwargs):
        return inner(*args, **{k: v for k, v in kwargs.items() if k in params})

    return call


# Kernel packages transformers dispatches Qwen3.5's Gated DeltaNet to where they are installed, by import name
KERNEL_DISTRIBUTIONS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}


def dispatch_target(fn) -> str:
    """What transformers runs when its model calls `fn` on a CUDA tensor: "transformers' torch code", the kernel
    package it dispatches to (with its version), or "unknown" where this transformers hides it."""
    cells = _closure(_dispatcher(fn))
    if "implementation" not in cells:
        return "unknown"
    implementation = cells["implementation"].cell_contents
    devices = cells["supported_devices"].cell_contents if "supported_devices" in cells else None
    top = implementation.__module__.split(".")[0]
    if top == "transformers" or (devices is not None and "cuda" not in devices):
        return "transformers' torch code"
    from importlib.metadata import PackageNotFoundError, version

    name = KERNEL_DISTRIBUTIONS.get(top, top)
    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return name


def linear_attention_dispatch(family: str = "qwen3_5") -> dict[str, str]:
    """transformers' Qwen3.5 decode step's per-token Gated DeltaNet ops on a GPU here, as the family's modeling file
    (qwen3_5 or qwen3_5_moe) dispatches them: op -> dispatch_target."""
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")

    return {name: dispatch_target(getattr(modeling, name))
            for name in ("causal_conv1d_update", "torch_recurrent_gated_delta_rule") if hasattr(modeling, name)}


@dataclass
class ReferenceOutput:
    hidden: torch.Tensor  # [N, hidden] float32, after the final norm
    logits: torch.Tensor  # [N, vocab] float32, through output head `head`
    taps: dict  # name -> [N, width] float32


def _strip(config: dict) -> dict:
    """Drops keys that describe the file rather than the decoder."""
    drop = ("architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "auto_map")
    return {k: v for k, v in config.items() if k not in drop}


def _vl_text_config(fields: dict, text_type: str = "qwen3_vl_text"):
    import transformers

    cfg = getattr(transformers, VL_TEXT_MODELS[text_type][0])(**fields)
    cfg._attn_implementation = "eager"
    return cfg


def _mrope_parameters(config: dict, text_type: str = "qwen3_vl_text") -> dict:
    """rope_parameters for a Qwen-VL TextConfig from a config's rope_theta / rope_scaling / rope_parameters (the
    theta left out: the TextConfig class's own default)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta"))
    theta = float(_vl_text_config({}, text_type).rope_parameters["rope_theta"] if theta is None else theta)
    section = params.get("mrope_section")
    if not section:
        raise MkportError("the Qwen-VL text reference needs rope mrope_section in the config")
    if not VL_TEXT_MODELS[text_type][2]:  # Qwen2(.5)-VL: contiguous sections, whatever a flag says
        return {"rope_type": "default", "rope_theta": theta, "mrope_section": list(section)}
    interleaved = params.get("mrope_interleaved", params.get("interleaved", True))
    if not interleaved:
        # Qwen3VLTextRotaryEmbedding always interleaves; a chunked-MRoPE config has no reference here.
        raise MkportError("mrope with interleaved=false has no transformers reference in mkport (Qwen3-VL interleaves)")
    return {"rope_type": "default", "rope_theta": theta, "mrope_section": list(section), "mrope_interleaved": True}


@contextlib.contextmanager
def own_default_rope():
    """transformers' own default RoPE while a model is built. qwen-tts-hf registers a "default" initialiser in
    transformers' global ROPE_INIT_FUNCTIONS (mkport.tts.official loads it in the process), which transformers then
    prefers to a model's own compute_default_rope_parameters when it initialises inv_freq; that one ignores
    partial_rotary_factor, so a Qwen3.5 built after it would rotate all of head_dim."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    registered = ROPE_INIT_FUNCTIONS.pop("default", None)
    try:
        yield
    finally:
        if registered is not None:
            ROPE_INIT_FUNCTIONS["default"] = registered


def _as_layer_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def router_outputs(out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A transformers router's (logits, top-k weights, top-k ids): 5.2x returns them so, 5.17's Granite router as
    (ids, weights, logits). Told apart by dtype, and the logits by their width (every expert's)."""
    floats = sorted((t.detach() for t in out if t.is_floating_point()), key=lambda t: -t.shape[-1])
    return floats[0], floats[1], next(t.detach() for t in out if not t.is_floating_point())


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[1, N, ...] -> [N, width] float32 copy."""
    return t.detach()[0].reshape(t.shape[1], -1).float().clone()


def _load_into(module: torch.nn.Module, state: dict, allow_missing=(), assign: bool = False) -> None:
    missing, unexpected = module.load_state_dict(state, strict=False, assign=assign)
    missing = [m for m in missing if m not in allow_missing]
    if missing or unexpected:
        raise MkportError(
            f"reference weight mapping mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


def _fuse_experts(state: dict, module_keys: set, spec, layers=None) -> None:
    """A checkpoint's per-expert tensors (EXPERT_NAMES) as transformers 5's modules hold them: experts.gate_up_proj
    [experts, 2 x width, hidden] (each expert's gate rows, then its up rows) and experts.down_proj, the router as
    mlp.gate. Layers whose module keeps one module an expert (transformers before 5) keep the checkpoint's names.
    Fused checkpoints' tensors are renamed where the modules name them otherwise (ExpertNames.modules)."""
    names = EXPERT_NAMES[spec.family]
    for i in spec.moe.sparse_layers if layers is None else [i for i in layers if spec.sparse(i)]:
        p = f"model.layers.{i}."
        if names.fused:  # fused as the modules hold them (Qwen3.5), under other names (Granite's)
            for ours, theirs in zip((names.router, names.gate, names.down), names.modules or ()):
                state[p + theirs] = state.pop(p + ours)
            continue
        if p + "mlp.experts.gate_up_proj" not in module_keys:
            continue
        experts = range(spec.moe.num_experts)
        gate_up = [torch.cat([state.pop(p + names.gate.format(e=e)), state.pop(p + names.up.format(e=e))]) for e in experts]
        state[p + "mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        state[p + "mlp.experts.down_proj"] = torch.stack([state.pop(p + names.down.format(e=e)) for e in experts])
        state[p + "mlp.gate.weight"] = state.pop(p + names.router)


def can_layer(source: ModelSource) -> bool:
    """Whether Reference(..., layered=True) builds this model: the causal-LM families (and the multimodal WRAPPERS,
    whose text decoder is one), whose decoder layers it fills."""
    return source.config.get("model_type", "") in (*LLM_TYPES, *WRAPPERS) and not source.part


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside keep their parameters on the meta device (no memory: each is allocated only while its
    module is built) and their buffers (RoPE's inv_freq) as usual."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _to_meta(module: torch.nn.Module) -> None:
    """Frees a module's parameters (its buffers stay)."""
    for m in module.modules():
        for name, param in m._parameters.items():
            if param is not None:
                m._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)


class Reference:
    """One decoder, in float32 through transformers' own modeling code. `layered` builds the model with its decoder
    layers empty and fills each one from the checkpoint just before it runs, freeing it right after: the same
    modules and the same arithmetic (so the same taps, bit for bit) in the memory of one float32 layer plus the
    embeddings and head, for models whose float32 copy does not fit (the causal-LM families of LLM_TYPES).
    `dtype` other than float32 (bench's transformers baseline in bf16) builds those families' modules empty too and
    fills every layer at once in that dtype, one layer at a time: no float32 copy of the model in host or device
    memory (a 30B mixture of experts has 61 GB of bf16 weights, 122 GB in float32). The other roles are built in
    float32 and cast."""

    def __init__(self, source: ModelSource, checkpoint: Checkpoint, device: str = "cpu", layered: bool = False,
                 dtype: torch.dtype = torch.float32):
        import transformers

        config, part = source.config, source.part
        self.spec = source.spec  # only for the checkpoint's tensor names and shapes
        self.device, self.dtype = torch.device(device), dtype
        model_type = config.get("model_type", "")
        if layered and not can_layer(source):
            raise MkportError(f"a layer-at-a-time reference is built for model_type {', '.join(LLM_TYPES)}; "
                              f"'{model_type}' has none")
        filled = layered or (dtype != torch.float32 and can_layer(source))  # modules built empty, filled by layer
        if filled:  # the embeddings, final norm and head now; the layers as they run, or one by one below
            prefix = checkpoint.model_prefix(self.spec)
            layer_prefix = weight_names(self.spec, prefix).layer.split("{i}")[0]
            shapes = checkpoint_shapes(self.spec, weight_names(self.spec, prefix))
            outside = {n: s for n, s in shapes.items() if not n.startswith(layer_prefix)}
            tensors = {k: v.to(self.device, dtype) for k, v in checkpoint.read(outside).items()}
        else:
            tensors = {k: v.float() for k, v in read_checkpoint(self.spec, checkpoint).items()}
        self.tables: list[torch.Tensor] = []  # input embedding tables (talker width) when not embed_tokens
        self.in_proj: torch.nn.Linear | None = None
        self.causal_lm: torch.nn.Module | None = None
        self.heads: list[torch.Tensor] = []
        self.mrope = False

        if model_type == "qwen3_tts":
            talker = config["talker_config"]
            if part == "talker":
                self.role = "tts_talker"
                fields = {
                    k: talker[k]
                    for k in (
                        "hidden_size",
                        "intermediate_size",
                        "num_hidden_layers",
                        "num_attention_heads",
                        "num_key_value_heads",
                        "head_dim",
                        "rms_norm_eps",
                        "vocab_size",
                        "max_position_embeddings",
                        "hidden_act",
                        "attention_bias",
                    )
                    if k in talker
                }
                fields["rope_parameters"] = _mrope_parameters(talker)
                self.base = transformers.Qwen3VLTextModel(_vl_text_config(fields))
                self.mrope = True
                state = {}
                for name, t in tensors.items():
                    if name.startswith("talker.model.layers."):
                        state[name[len("talker.model.") :]] = t
                state["embed_tokens.weight"] = tensors["talker.model.codec_embedding.weight"]
                state["norm.weight"] = tensors["talker.model.norm.weight"]
                _load_into(self.base, state)
                self.heads = [tensors["talker.codec_head.weight"]]
            elif part == "code_predictor":
                self.role = "tts_code_predictor"
                pred = _strip(talker["code_predictor_config"])
                cfg = transformers.Qwen3Config(**pred)
                cfg._attn_implementation = "eager"
                self.base = transformers.Qwen3Model(cfg)
                prefix = "talker.code_predictor."
                state = {}
                for name, t in tensors.items():
                    if name.startswith(prefix + "model.layers."):
                        state[name[len(prefix + "model.") :]] = t
                state["norm.weight"] = tensors[prefix + "model.norm.weight"]
                # embed_tokens (vocab x predictor hidden) is unused: inputs come from the talker-width tables
                _load_into(self.base, state, allow_missing=("embed_tokens.weight",))
                n_groups = int(pred.get("num_code_groups", talker.get("num_code_groups", 16)))
                self.tables = [tensors[f"{prefix}model.codec_embedding.{j}.weight"] for j in range(n_groups - 1)]
                self.heads = [tensors[f"{prefix}lm_head.{j}.weight"] for j in range(n_groups - 1)]
                if prefix + "small_to_mtp_projection.weight" in tensors:
                    w = tensors[prefix + "small_to_mtp_projection.weight"]
                    self.in_proj = torch.nn.Linear(w.shape[1], w.shape[0], bias=True)
                    self.in_proj.load_state_dict({"weight": w, "bias": tensors[prefix + "small_to_mtp_projection.bias"]})
            else:
                raise MkportError("a qwen3_tts config needs MODEL:talker or MODEL:code_predictor")
        elif (text_type := vl_text_type(config)) is not None:
            self.role = "llm"
            text = dict(config["text_config"]) if "text_config" in config else dict(config)
            text.pop("vision_config", None)  # a flat Qwen2(.5)-VL config's
            tie = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
            fields = _strip(text)
            fields.pop("rope_scaling", None)
            fields.pop("rope_theta", None)
            fields["rope_parameters"] = _mrope_parameters(text, text_type)
            self.base = getattr(transformers, VL_TEXT_MODELS[text_type][1])(_vl_text_config(fields, text_type))
            self.mrope = True
            prefix = checkpoint.model_prefix(self.spec)
            state = {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}
            _load_into(self.base, state)
            self.heads = [self.base.embed_tokens.weight.detach() if tie else tensors["lm_head.weight"]]
        elif model_type in LLM_TYPES or model_type in WRAPPERS:
            self.role = "llm"
            cfg = transformers.AutoConfig.for_model(model_type, **_strip(config))
            if model_type in WRAPPERS:  # the text decoder of a multimodal wrapper, as the wrapper's config reads it
                cfg = cfg.text_config
                if model_type.startswith("qwen3_5"):  # its head is tied as the wrapper says where the decoder does not
                    text = config["text_config"]
                    cfg.tie_word_embeddings = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
            self.mrope = cfg.model_type in HYBRID_MODEL_TYPES
            if model_type == "gemma" and cfg.hidden_act == "gelu":
                # the released configs' legacy value means the tanh form: GemmaConfig says so since 5.2x, 5.17 ran erf
                cfg.hidden_act = "gelu_pytorch_tanh"
            experts = {"experts_implementation": "eager"} if self.spec.moe is not None else {}
            with own_default_rope(), _parameters_on_meta() if filled else contextlib.nullcontext():
                self.causal_lm = transformers.AutoModelForCausalLM.from_config(
                    cfg, attn_implementation="eager", dtype=torch.float32, **experts
                )
            prefix = checkpoint.model_prefix(self.spec)
            state = {}
            for name, t in tensors.items():
                key = "model." + name[len(prefix) :] if name.startswith(prefix) else name.removeprefix("language_model.")
                state[key] = t
            if self.spec.moe is not None and not filled:  # filled: each layer's as it is filled
                _fuse_experts(state, set(self.causal_lm.state_dict()), self.spec)
            tied = bool(getattr(cfg, "tie_word_embeddings", False))
            allowed = {"lm_head.weight"} if tied else set()
            if filled:
                allowed |= {k for k in self.causal_lm.state_dict() if k.startswith("model.layers.")}
            _load_into(self.causal_lm, state, allow_missing=allowed, assign=filled)
            if tied and filled:  # assign replaced embed_tokens' parameter: tie lm_head to the new one
                self.causal_lm.lm_head.weight = self.causal_lm.model.embed_tokens.weight
            if filled:
                fill = self._layer_filler(checkpoint, prefix)
                for i, layer in enumerate(self.causal_lm.model.layers):
                    if layered:  # filled before it runs, freed after
                        layer.register_forward_pre_hook(lambda m, args, i=i: fill(m, i))
                        layer.register_forward_hook(lambda m, a, out: _to_meta(m))
                    else:
                        fill(layer, i)
            if tied:
                lm, emb = self.causal_lm.lm_head.weight, self.causal_lm.model.embed_tokens.weight
                if lm.data_ptr() != emb.data_ptr():
                    raise MkportError("tie_word_embeddings=true but transformers did not tie lm_head to embed_tokens")
            self.base = self.causal_lm.model
        else:
            raise MkportError(f"model_type '{model_type}' has no reference; supported: {', '.join(LLM_TYPES)}, {', '.join(VL_TEXT_TYPES)}, qwen3_tts")

        def placed(t):  # as Module.to(device, dtype) does it, but the empty layers stay on meta
            return t if t.is_meta else t.to(self.device, dtype if t.is_floating_point() else t.dtype)

        for m in (self.base, self.causal_lm, self.in_proj):
            if m is not None and filled:
                m._apply(placed).eval()
            elif m is not None:
                m.to(device=self.device, dtype=dtype).eval()
        self.heads = [h.to(self.device) for h in self.heads]
        self.tables = [t.to(self.device) for t in self.tables]

    def _layer_filler(self, checkpoint: Checkpoint, prefix: str):
        """fill(module, i): decoder layer i's weights read from the checkpoint into its empty module, in self.dtype
        on self.device."""
        spec = self.spec
        names = weight_names(spec, prefix)
        shapes = checkpoint_shapes(spec, names)
        module_keys = set(self.causal_lm.state_dict())

        def fill(module, i):
            p = names.layer.format(i=i)
            wanted = {n: s for n, s in shapes.items() if n.startswith(p)}
            state = {f"model.layers.{i}." + n[len(p) :]: t.to(self.device, self.dtype)
                     for n, t in checkpoint.read(wanted).items()}
            if spec.moe is not None:
                _fuse_experts(state, module_keys, spec, layers=[i])
            _load_into(module, {k[len(f"model.layers.{i}.") :]: v for k, v in state.items()}, assign=True)

        return fill

    @property
    def num_layers(self) -> int:
        return len(self.base.layers)

    def _head(self, index: int) -> torch.Tensor:
        if self.causal_lm is not None:
            return self.causal_lm.lm_head.weight
        return self.heads[index]

    def _fresh_dynamic_rope(self) -> None:
        """transformers' dynamic RoPE keeps the longest length a forward had and its frequencies, from one run to the
        next: each run starts as a freshly loaded model does (and as mkport, whose frequencies follow each forward's
        own length)."""
        for m in self.base.modules():
            if getattr(m, "rope_type", None) == "dynamic":
                m.max_seq_len_cached = m.original_max_seq_len
                m.register_buffer("inv_freq", m.original_inv_freq.clone(), persistent=False)

    @contextlib.contextmanager
    def _tapping(self, taps: dict):
        """Hooks the transformers modules and wraps apply_rotary_pos_emb; all undone on exit."""
        handles = []
        current = {"layer": None}
        layers = self.base.layers

        def hidden_arg(args, kwargs):
            return args[0] if args else kwargs["hidden_states"]

        def on_embed(module, args, kwargs):
            taps[Tap.EMBED] = _flat(hidden_arg(args, kwargs))

        handles.append(layers[0].register_forward_pre_hook(on_embed, with_kwargs=True))
        for i, layer in enumerate(layers):

            def enter(module, args, kwargs, i=i):
                current["layer"] = i

            def attn_norm(module, args, out, i=i):
                taps[Tap.layer(i, Tap.ATTN_NORM)] = _flat(out)

            def attn(module, args, i=i):
                taps[Tap.layer(i, Tap.ATTN)] = _flat(args[0])

            def attn_residual(module, args, i=i):
                taps[Tap.layer(i, Tap.ATTN_RESIDUAL)] = _flat(args[0])

            def mlp_residual(module, args, kwargs, out, i=i):
                taps[Tap.layer(i, Tap.MLP_RESIDUAL)] = _flat(_as_layer_output(out))

            def unrotated(op, i=i):  # q or k before RoPE, as normed or projected: the tap of a layer without RoPE
                # [1, N, heads * head_dim] as projected, [1, heads, N, head_dim] as EXAONE 4 norms them (the other
                # families' norms feed RoPE, whose wrapper replaces the tap)
                def hook(module, args, out):
                    taps[Tap.layer(i, op)] = _flat(out.transpose(1, 2) if out.dim() == 4 else out)
                return hook

            handles.append(layer.register_forward_pre_hook(enter, with_kwargs=True))
            input_norm = getattr(layer, "input_layernorm", None)  # OLMo 2/3 have none: no attn_norm state
            if input_norm is not None:
                handles.append(input_norm.register_forward_hook(attn_norm))
            # The residual stream where the MLP block reads it. Gemma 2/3's and OLMo 2/3's post_attention_layernorm norm
            # the attention output: the residual enters Gemma's pre_feedforward_layernorm, and OLMo's MLP itself
            mlp_input = getattr(layer, "pre_feedforward_layernorm", None) or (
                layer.mlp if input_norm is None else layer.post_attention_layernorm)
            handles.append(mlp_input.register_forward_pre_hook(attn_residual))
            handles.append(layer.register_forward_hook(mlp_residual, with_kwargs=True))
            block = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)  # Granite's MoE: the latter
            if hasattr(block, "experts"):  # a sparse layer: its router (logits, weights, top-k ids) and block
                def routed(module, args, out, i=i):
                    logits, weights, ids = router_outputs(out)
                    ids, order = ids.sort(dim=-1)  # ascending expert index, as mkport's taps
                    taps[Tap.layer(i, Tap.ROUTER)] = logits.float().clone()
                    taps[Tap.layer(i, Tap.EXPERTS)] = ids.float()
                    taps[Tap.layer(i, Tap.EXPERT_WEIGHTS)] = weights.gather(-1, order).float()

                def moe(module, args, out, i=i):
                    taps[Tap.layer(i, Tap.MOE)] = _flat(out)

                router = getattr(block, "gate", None) or block.router
                handles.append(router.register_forward_hook(routed))
                handles.append(block.register_forward_hook(moe))
            if hasattr(layer, "linear_attn"):  # Qwen3.5's Gated DeltaNet: the conv and delta rule are tapped below
                def gated_norm(module, args, i=i):
                    taps[Tap.layer(i, Tap.GATED_NORM)] = _flat(args[0])

                handles.append(layer.linear_attn.out_proj.register_forward_pre_hook(gated_norm))
                continue
            handles.append(layer.self_attn.o_proj.register_forward_pre_hook(attn))
            # q and k as they enter RoPE; the rotary wrapper below replaces them where transformers rotates, so a layer
            # keeps these where it does not (SmolLM3's NoPE layers, EXAONE 4's full layers beside sliding ones; Phi-3's
            # fused qkv_proj, always rotated, has neither module)
            for op, norm, proj in ((Tap.Q, "q_norm", "q_proj"), (Tap.K, "k_norm", "k_proj")):
                module = getattr(layer.self_attn, norm, None) or getattr(layer.self_attn, proj, None)
                if module is not None:
                    handles.append(module.register_forward_hook(unrotated(op)))

        def final(module, args, out):
            taps[Tap.FINAL_NORM] = _flat(out)

        handles.append(self.base.norm.register_forward_hook(final))

        modeling = sys.modules[type(layers[0]).__module__]
        original = modeling.apply_rotary_pos_emb

        # RoPE on adjacent pairs: q and k tapped in the order the kernel holds them (weights.pairs_to_halves)
        order = halves_order(self.spec.head_dim, self.spec.rotary_dim) if self.spec.rope.adjacent_pairs else slice(None)

        def rotary(q, k, cos, sin, *args, **kwargs):
            q_out, k_out = original(q, k, cos, sin, *args, **kwargs)
            i = current["layer"]
            # [1, heads, N, head_dim] -> [N, heads * head_dim], head-major
            for op, out in ((Tap.Q, q_out), (Tap.K, k_out)):
                rows = out.detach()[0, ..., order].transpose(0, 1)
                taps[Tap.layer(i, op)] = rows.reshape(out.shape[2], -1).float().clone()
            return q_out, k_out

        # Qwen3.5's linear attention calls these module functions: wrapped for the taps, and always run by
        # transformers' own torch code (torch_path), also where a kernel package it would dispatch to is installed
        wrapped = {"apply_rotary_pos_emb": rotary}
        if hasattr(modeling, "torch_chunk_gated_delta_rule"):
            conv_fn, chunk_fn = torch_path(modeling.causal_conv1d_fn), torch_path(modeling.torch_chunk_gated_delta_rule)

            def conv(*args, **kwargs):
                out = conv_fn(*args, **kwargs)  # [1, channels, N]
                taps[Tap.layer(current["layer"], Tap.CONV)] = _flat(out.transpose(1, 2))
                return out

            def delta_rule(query, key, value, g, beta, *args, **kwargs):
                out = chunk_fn(query, key, value, g, beta, *args, **kwargs)
                i = current["layer"]
                taps[Tap.layer(i, Tap.GATES)] = _flat(torch.cat([g, beta], dim=-1))
                taps[Tap.layer(i, Tap.STATE_OUT)] = _flat(out[0])
                return out

            wrapped.update(causal_conv1d_fn=conv, torch_chunk_gated_delta_rule=delta_rule)
        originals = {name: getattr(modeling, name) for name in wrapped}
        for name, fn in wrapped.items():
            setattr(modeling, name, fn)
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(modeling, name, fn)
            for h in handles:
                h.remove()

    @torch.no_grad()
    def run(
        self,
        tokens: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        table: int = 0,
        head: int = 0,
        steps_from: int | None = None,
        switch_recompute: bool = False,
    ) -> ReferenceOutput:
        """One sequence of N tokens, full causal attention: in one pass without a KV cache, or, with `steps_from`, its
        first steps_from rows in one pass and then each row alone with transformers' KV cache, as a decoder prefills and
        steps (longrope and dynamic RoPE pick a forward's frequencies by its length, so the two differ there).
        `switch_recompute` (stepped): at the step where Phi3ForCausalLM's generate drops its cache (runtime.rope_switch,
        as mkport's decoders do), that step runs every row again without the cache, and gives its own row's taps."""
        if (tokens is None) == (embeds is None):
            raise MkportError("give exactly one of tokens or embeds")
        if tokens is not None:
            tokens = tokens.to(self.device).long()
            n = tokens.shape[0]
            if self.tables:
                if not 0 <= table < len(self.tables):
                    raise MkportError(f"embedding table {table} out of range 0..{len(self.tables) - 1}")
                embeds = F.embedding(tokens, self.tables[table])
        else:
            embeds = embeds.to(self.device).float()
            n = embeds.shape[0]
        if self.in_proj is not None and embeds is not None:
            embeds = self.in_proj(embeds)
        if positions is None:
            positions = torch.arange(n).expand(3, n)
        positions = positions.to(self.device).long()
        if tuple(positions.shape) != (3, n):
            raise MkportError(f"positions must be [3, {n}], got {list(positions.shape)}")
        if self.mrope:
            position_ids = positions[:, None, :]  # [3, batch, N]: t, h, w streams
        else:
            if not bool((positions == positions[0]).all()):
                raise MkportError("distinct position streams need an MRoPE model")
            position_ids = positions[:1]
        inputs = {"input_ids": tokens[None]} if embeds is None else {"inputs_embeds": embeds[None]}
        if self.causal_lm is None and not 0 <= head < len(self.heads):
            raise MkportError(f"output head {head} out of range 0..{len(self.heads) - 1}")
        self._fresh_dynamic_rope()
        bounds = [0, n] if steps_from is None else [0, *range(max(steps_from, 1), n), n]
        cache, parts = None, []
        for a, b in zip(bounds, bounds[1:]):
            part: dict[str, torch.Tensor] = {}
            # the first row this forward runs: 0 where the cache is dropped and every row run again
            first = 0 if steps_from is not None and switch_recompute and recomputes(self.spec, a, b - a) else a
            cache = None if first == 0 else cache
            rows = {k: v[:, first:b] for k, v in inputs.items()}
            with self._tapping(part):
                model = self.causal_lm if self.causal_lm is not None else self.base
                stepping = {"use_cache": False} if steps_from is None else {cache_argument(model): cache, "use_cache": True}
                out = model(**rows, position_ids=position_ids[..., first:b], **stepping)
            cache = out.past_key_values if steps_from is not None else None
            part = {name: value[a - first :] for name, value in part.items()}
            parts.append((part, out.logits[0, a - first :].float() if self.causal_lm is not None else None))
        taps = {name: torch.cat([part[name] for part, _ in parts]) for name in parts[0][0]}
        logits = None if self.causal_lm is None else torch.cat([logits for _, logits in parts])
        hidden = taps[Tap.FINAL_NORM]
        if logits is None:
            logits = F.linear(hidden, self._head(head).float())
        return ReferenceOutput(hidden=hidden, logits=logits, taps=taps)
