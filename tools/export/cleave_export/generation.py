"""Stages for split generation: a causal language model whose attention layers take their
key/value cache as an input, so that a server keeps each session's cache and every step sends
only the new tokens.

`--generation` writes them beside the inference stages (which stay as they are), one stage
per layer so that every cut between layers serves generation:

- `embed(input_ids [B, S] int64, positions [B, S] int64) -> hidden [B, S, D]`
- `layer(hidden, positions, cache [2, B, kv heads, L, head_dim]) -> hidden`: writes the new
  tokens' keys and values into `cache` at `positions`, in place, and attends to every
  cached position up to its own (the last `window` of them, with Mistral's sliding window).
  `L` is the session's `max_len`, chosen when the cache is allocated: one stage serves a
  prefill of S tokens and a decode step of one, and each row of a batch may stand at another
  position (sessions batched together).
- `head(hidden) -> logits [B, S, vocab]`

Attention runs over all `L` cached positions, the later ones masked: the time per token does
not grow with the position, and no shape depends on it. The exporter checks the stages
against the transformers model with its own cache (a prompt, then one token at a time, the
tokens given) and writes that as the bundle's generation reference.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from cleave_export import ExportError

REFERENCE_FILE = "generation_reference.safetensors"

TOLERANCE = 1e-4
"""Largest difference from transformers' logits, relative to their largest magnitude."""


class _Conv1D(nn.Module):
    """transformers' `Conv1D` (GPT-2's linear layers, weight [in, out]) as TorchScript can
    compile it; it shares the model's parameters."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.weight = conv.weight
        self.bias = conv.bias

    def forward(self, x: Tensor) -> Tensor:
        return torch.matmul(x, self.weight) + self.bias


class _GPT2Embed(nn.Module):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class _GPT2MLP(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.c_fc, self.c_proj = _Conv1D(mlp.c_fc), _Conv1D(mlp.c_proj)
        self.act, self.dropout = mlp.act, mlp.dropout

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class _GPT2Layer(nn.Module):
    """A GPT-2 block reading and writing its cache (`GPT2Attention` with `GPT2Block`'s
    residuals; the eager attention of transformers, the mask over positions)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        attn = block.attn
        if attn.reorder_and_upcast_attn:
            raise ExportError("--generation: GPT-2 with reorder_and_upcast_attn is not supported")
        self.ln_1, self.ln_2, self.mlp = block.ln_1, block.ln_2, _GPT2MLP(block.mlp)
        self.c_attn, self.c_proj = _Conv1D(attn.c_attn), _Conv1D(attn.c_proj)
        self.attn_dropout, self.resid_dropout = attn.attn_dropout, attn.resid_dropout
        self.heads: int = attn.num_heads
        self.kv_heads: int = attn.num_heads
        self.head_dim: int = attn.head_dim
        self.scaling: float = float(attn.scaling)

    def forward(self, hidden: Tensor, positions: Tensor, cache: Tensor) -> Tensor:
        batch, new = hidden.size(0), hidden.size(1)
        q, k, v = self.c_attn(self.ln_1(hidden)).split(self.heads * self.head_dim, dim=2)
        q = q.view(batch, new, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, new, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, new, self.heads, self.head_dim).transpose(1, 2)
        out = _attend(q, k, v, positions, cache, self.scaling, 1, 0)
        out = out.transpose(1, 2).reshape(batch, new, self.heads * self.head_dim)
        hidden = hidden + self.resid_dropout(self.c_proj(self.attn_dropout(out)))
        return hidden + self.mlp(self.ln_2(hidden))


class _Head(nn.Module):
    """The final norm and the LM head, of any family. The logits are `weight @ hidden^T`, not
    `hidden @ weight^T`: with a vocabulary of tens of thousands, MKL multiplies a batch of
    rows this way round without repacking the weight each call (eight rows of GPT-2's head on
    one thread: 7.1 ms against 11.6)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm = norm
        self.weight = lm_head.weight
        self.bias = lm_head.bias

    def forward(self, hidden: Tensor) -> Tensor:
        x = self.norm(hidden)
        logits = torch.matmul(self.weight, x.reshape(-1, x.size(-1)).t()).t()
        if self.bias is not None:
            logits = logits + self.bias
        return logits.reshape(x.size(0), x.size(1), logits.size(-1))


def _attend(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cache: Tensor, scaling: float, groups: int, window: int) -> Tensor:
    """Writes `k` and `v` ([B, kv heads, S, head_dim]) into `cache` at `positions` ([B, S]) and
    attends from `q` ([B, heads, S, head_dim]; `groups` query heads share each key/value head)
    to every cached position up to each query's own (the last `window` only, where not 0), in
    one fused operation that reads the cache in place, without repeating it for each group."""
    index = positions[:, None, :, None].expand(k.size(0), k.size(1), k.size(2), k.size(3))
    cache[0].scatter_(2, index, k)
    cache[1].scatter_(2, index, v)
    key_positions = torch.arange(cache.size(3), device=q.device)[None, None, None, :]
    query_positions = positions[:, None, :, None]
    visible = key_positions <= query_positions
    if window > 0:
        visible = visible & (key_positions > query_positions - window)
    # A query always sees its own position, so no row of the mask is all False.
    return F.scaled_dot_product_attention(q, cache[0], cache[1], attn_mask=visible, scale=scaling, enable_gqa=groups > 1)


def _gpt2(model: nn.Module) -> list[tuple[str, nn.Module]]:
    t = model.transformer
    layers = [(f"transformer.h.{i}", _GPT2Layer(block)) for i, block in enumerate(t.h)]
    return [("embed", _GPT2Embed(t)), *layers, ("head", _Head(t.ln_f, model.lm_head))]


class _LlamaEmbed(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.embed_tokens = inner.embed_tokens

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)


class _Linear(nn.Module):
    """Linear layers that read the same input, as one product with their weights side by side
    and stored [in, out]: one call instead of several, and for one row (a decode step) MKL
    reads a weight of many outputs laid out this way up to three times as fast as nn.Linear's
    [out, in] (two Llama layers of width 256, one token, one thread, caches cold: 1.85 ms
    against 2.02 with the rest of this layer's changes)."""

    def __init__(self, *linears: nn.Module):
        super().__init__()
        weight = torch.cat([linear.weight.detach() for linear in linears]).t().contiguous()
        self.weight = nn.Parameter(weight, requires_grad=False)
        biases = [linear.bias for linear in linears]
        self.bias: Optional[Tensor] = None
        if any(b is not None for b in biases):
            zeros = [torch.zeros(linear.weight.size(0), dtype=weight.dtype) for linear in linears]
            self.bias = nn.Parameter(torch.cat([b.detach() if b is not None else z for b, z in zip(biases, zeros)]), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.matmul(x, self.weight)
        bias = self.bias
        return out if bias is None else out + bias


class _RMSNorm(nn.Module):
    """Llama's RMSNorm (Mistral's and Qwen2's too) as ATen's fused operation: in float32, then
    scaled by the weight in the model's dtype, as transformers computes it."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps: float = float(norm.variance_epsilon)

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * F.rms_norm(x.float(), [x.size(-1)], None, self.eps).to(x.dtype)


class _LlamaLayer(nn.Module):
    """A Llama decoder layer (also Mistral's and Qwen2's) reading and writing its cache:
    rotary position embeddings computed from the positions, grouped key/value heads, and
    Mistral's and Qwen2's sliding window where the layer has one. The query, key and value
    projections are one product, as are the MLP's gate and up projections."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = _RMSNorm(layer.input_layernorm), _RMSNorm(layer.post_attention_layernorm)
        self.qkv_proj, self.o_proj = _Linear(attn.q_proj, attn.k_proj, attn.v_proj), _Linear(attn.o_proj)
        self.gate_up_proj, self.down_proj, self.act_fn = _Linear(mlp.gate_proj, mlp.up_proj), _Linear(mlp.down_proj), mlp.act_fn
        self.intermediate: int = mlp.gate_proj.weight.size(0)
        self.head_dim: int = attn.head_dim
        self.heads: int = config.num_attention_heads
        self.kv_heads: int = config.num_key_value_heads
        self.scaling: float = float(attn.scaling)
        window = getattr(attn, "sliding_window", None) if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
        self.window: int = int(window or 0)
        self.register_buffer("inv_freq", rotary.inv_freq.detach().clone(), persistent=False)
        self.rope_scaling: float = float(rotary.attention_scaling)

    def forward(self, hidden: Tensor, positions: Tensor, cache: Tensor) -> Tensor:
        batch, new = hidden.size(0), hidden.size(1)
        x = self.input_layernorm(hidden)
        kv_width = self.kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.heads * self.head_dim, kv_width, kv_width], dim=2)
        q = q.view(batch, new, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, new, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, new, self.kv_heads, self.head_dim).transpose(1, 2)
        freqs = positions[:, :, None].float() * self.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.rope_scaling).to(x.dtype)[:, None]
        sin = (angles.sin() * self.rope_scaling).to(x.dtype)[:, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = _attend(q, k, v, positions, cache, self.scaling, self.heads // self.kv_heads, self.window)
        hidden = hidden + self.o_proj(out.transpose(1, 2).reshape(batch, new, self.heads * self.head_dim))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(hidden)).split(self.intermediate, dim=2)
        return hidden + self.down_proj(self.act_fn(gate) * up)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _llama(model: nn.Module) -> list[tuple[str, nn.Module]]:
    inner = model.model
    rope = getattr(inner.rotary_emb, "rope_type", "default")
    if rope in ("dynamic", "longrope"):
        raise ExportError(f"--generation: rotary embeddings of type {rope!r} change with the length, which the stages cannot follow")
    layers = [(f"model.layers.{i}", _LlamaLayer(layer, inner.rotary_emb, model.config)) for i, layer in enumerate(inner.layers)]
    return [("embed", _LlamaEmbed(inner)), *layers, ("head", _Head(inner.norm, model.lm_head))]


FAMILIES = {"GPT2LMHeadModel": _gpt2, "LlamaForCausalLM": _llama, "MistralForCausalLM": _llama, "Qwen2ForCausalLM": _llama}
"""Causal language models `--generation` takes, by class, each with the stages it is cut into
(Mistral and Qwen2 have Llama's layers, with a sliding window where configured)."""


def check_generation(model: nn.Module) -> None:
    """Raises ExportError unless `--generation` knows the model's family."""
    if type(model).__name__ not in FAMILIES:
        raise ExportError(
            f"--generation takes a causal language model of the classes {', '.join(FAMILIES)}; {type(model).__name__} is none "
            "of them; what to try: export it without --generation (whole-sequence inference)"
        )


def write_generation(model: nn.Module, out, seed: int) -> dict:
    """Writes the generation stages and their reference into the bundle directory `out`;
    returns the manifest's `generation` section."""
    check_generation(model)
    family = FAMILIES[type(model).__name__]
    model.eval()
    stages = [(name, _frozen(module)) for name, module in family(model)]
    config = model.config
    dtype = next(model.parameters()).dtype
    entries = []
    for i, (name, scripted) in enumerate(stages):
        file = f"generation_{i:03d}.pt"
        scripted.save(str(out / file))
        takes_cache = 0 < i < len(stages) - 1
        heads, head_dim = (scripted.kv_heads, scripted.head_dim) if takes_cache else (0, 0)
        cache = {"dtype": str(dtype).removeprefix("torch."), "heads": heads, "head_dim": head_dim,
                 "bytes_per_token": 2 * heads * head_dim * dtype.itemsize}
        entries.append({"name": name, "file": file} | ({"cache": cache} if takes_cache else {}))
    reference, error = _reference(model, [s for _, s in stages], seed)
    save_file(reference, str(out / REFERENCE_FILE))
    hidden = {"type": "tensor", "dtype": str(dtype).removeprefix("torch."), "shape": ["B", "S", config.hidden_size]}
    return {
        "family": type(model).__name__,
        "max_positions": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "inputs": [{"name": "input_ids", "range": [0, config.vocab_size - 1]}, {"name": "positions"}],
        "hidden": hidden,
        "stages": entries,
        "reference": {"file": REFERENCE_FILE, "prompt": _PROMPT, "steps": _STEPS, "max_len": _MAX_LEN, "relative_error": error},
    }


def _frozen(module: nn.Module) -> torch.jit.ScriptModule:
    """`module` scripted and frozen: its weights and settings inlined as constants, so the
    interpreter spends less on each of a step's many small operations (four Llama layers of
    width 256, one token on one thread: 2.1 ms against 2.7). The cache's shape and the
    sliding window stay attributes, readable and settable."""
    scripted = torch.jit.script(module.eval())
    kept = [name for name in ("kv_heads", "head_dim", "window") if hasattr(scripted, name)]
    return torch.jit.freeze(scripted, preserved_attrs=kept)


_BATCH, _PROMPT, _STEPS, _MAX_LEN = 2, 7, 32, 48
"""The reference: two sequences, a prompt of 7 tokens, then 32 steps of one token, teacher
forced, in a cache of 48 positions."""


def run_generation(stages: list, input_ids: Tensor, prompt: int, max_len: int) -> Tensor:
    """Logits for every position of `input_ids` [B, T]: the prompt in one step, then one token
    per step, every layer with a cache of `max_len` positions (what a split run does, in one
    process)."""
    batch, total = input_ids.shape
    caches: list[Tensor] = []
    logits = []
    with torch.no_grad():
        for start, end in [(0, prompt), *((t, t + 1) for t in range(prompt, total))]:
            positions = torch.arange(start, end).expand(batch, end - start)
            hidden = stages[0](input_ids[:, start:end], positions)
            # Of the hidden states' dtype (frozen stages have no parameters to ask).
            if not caches:
                caches = [torch.zeros(2, batch, layer.kv_heads, max_len, layer.head_dim, dtype=hidden.dtype) for layer in stages[1:-1]]
            for layer, cache in zip(stages[1:-1], caches):
                hidden = layer(hidden, positions, cache)
            logits.append(stages[-1](hidden))
    return torch.cat(logits, dim=1)


def _reference(model: nn.Module, stages: list, seed: int) -> tuple[dict[str, Tensor], float]:
    """Token ids and transformers' logits for them with its own cache (the prompt, then one
    token at a time), checked against the stages; and the stages' largest difference from them,
    relative to their largest magnitude."""
    from transformers.cache_utils import DynamicCache

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (_BATCH, _PROMPT + _STEPS), generator=generator)
    with torch.no_grad():
        out = model(input_ids=input_ids[:, :_PROMPT], past_key_values=DynamicCache(config=model.config), use_cache=True)
        want = [out.logits]
        for t in range(_PROMPT, _PROMPT + _STEPS):
            out = model(input_ids=input_ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            want.append(out.logits)
    want = torch.cat(want, dim=1)
    got = run_generation(stages, input_ids, _PROMPT, _MAX_LEN)
    error = ((got - want).abs().max() / want.abs().max()).item()
    if error > TOLERANCE:
        raise ExportError(f"--generation: the stages' logits differ from transformers' with its cache by {error:.2e} (relative)")
    return {"input_ids": input_ids, "logits": want.contiguous()}, error
