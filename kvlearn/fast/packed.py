"""Packed weights: the fast path's own copy of a Llama-like model, and a forward over the KV pool.

Chapter 5's runner calls the Hugging Face model, which is the readable path. Decoding a batch is
bound by reading the weights once per step (~540 MB in float32 for SmolLM2-135M), and how fast a
matrix product reads them depends on their layout. `FastLlama` copies the weights once:

- Q, K and V projections concatenated into one matrix, gate and up into another, so each layer
  runs four products instead of seven;
- each RMSNorm's weight g folded into the columns of the product it feeds: (x / rms(x) * g) @ W.T
  equals (x / rms(x)) @ (W * g).T, so a norm is one multiplication of the activations fewer (it
  rounds differently: the logits move by up to about 5e-5, as far as oneDNN's products already are
  from Hugging Face's, and stay within the tests' 1e-4 of them);
- on a CPU with oneDNN, each matrix reordered into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied with `_linear_pointwise`, which reads
  the weights several times faster than MKL's `linear` at decode-batch sizes; elsewhere (CUDA, no
  oneDNN, other dtypes) the concatenated matrices go through plain `F.linear`.

Its forward is the Llama layer loop written out (RMSNorm, RoPE from the model's own rotary module,
SiLU-gated MLP), calling `kvlearn.fast.attention.fast_paged_attention` directly. It has the
signature of the runner's `model_forward` hook, so the engine hands `FastLlama(model).forward` to
`ModelRunner`. The model is only read: its modules, parameters and attention implementation stay as
they were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlearn.fast.attention import FastStep, fast_paged_attention

# oneDNN picks its blocked weight layout for an expected number of rows (any row count still works).
# Tuned for a decode batch: a product with few rows is bound by reading the weights, where the layout
# matters; a prefill has hundreds of rows and is bound by arithmetic instead.
PACK_ROWS_HINT = 16


def mkldnn_usable(weight: torch.Tensor) -> bool:
    """Whether the oneDNN product applies: float32 weights on a CPU with oneDNN in this torch."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear:
    """`x @ weight.T` with `weight` (out_features x in_features, no bias) held in the fastest
    layout this device offers. Holds its own copy: the source tensor is never changed."""

    def __init__(self, weight: torch.Tensor):
        weight = weight.detach()
        if mkldnn_usable(weight):
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
            self.kind = "onednn"
        else:
            self.weight = weight.clone()
            self.kind = "linear"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


def signed_sine(sin: torch.Tensor) -> torch.Tensor:
    """The sine with the first half of its last dimension negated, as `apply_rope` takes it."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, signed_sin: [T, 1, head_dim] (`signed_sine(sin)`). Hugging Face
    Llama's rotation, x * cos + rotate_half(x) * sin, to the bit: rotate_half(x) is x rolled by half
    with its first half negated, and the sign moves to sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class _Layer:
    """One decoder layer's packed products, the norm before each of qkv and gate_up folded in."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        self.qkv = PackedLinear(qkv * layer.input_layernorm.weight)
        self.o = PackedLinear(attn.o_proj.weight)
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.gate_up = PackedLinear(gate_up * layer.post_attention_layernorm.weight)
        self.down = PackedLinear(mlp.down_proj.weight)


class FastLlama:
    """A Llama-like causal LM (RMSNorm, RoPE, GQA attention without bias, SiLU-gated MLP without
    bias) with packed weights, run over a `KVPool`. Raises ValueError for other architectures."""

    def __init__(self, model):
        cfg = model.config
        self._check_supported(model)
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = model.model.layers[0].self_attn.scaling
        self.rotary = model.model.rotary_emb
        self.embed = model.model.embed_tokens.weight.detach()
        with torch.no_grad():
            self.layers = [_Layer(layer) for layer in model.model.layers]
            self.lm_head = PackedLinear(model.lm_head.weight * model.model.norm.weight)

    @staticmethod
    def _check_supported(model) -> None:
        cfg, inner = model.config, getattr(model, "model", None)
        problems = []
        if getattr(cfg, "hidden_act", None) != "silu":
            problems.append(f"activation {getattr(cfg, 'hidden_act', None)!r} (needs 'silu')")
        if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
            problems.append("no model.model.layers / rotary_emb (not a Llama-like layout)")
        else:
            # These RoPE types recompute their frequencies inside forward, i.e. they change the model.
            if getattr(inner.rotary_emb, "rope_type", "default") in ("dynamic", "longrope"):
                problems.append(f"RoPE type {inner.rotary_emb.rope_type!r}")
            layer = inner.layers[0]
            linears = [getattr(layer.self_attn, f"{n}_proj", None) for n in "qkvo"] + \
                [getattr(layer.mlp, f"{n}_proj", None) for n in ("gate", "up", "down")]
            if any(lin is None or getattr(lin, "bias", None) is not None for lin in linears):
                problems.append("attention or MLP projections with a bias, or missing")
        if problems:
            raise ValueError(f"The fast path runs Llama-like models only; {type(model).__name__} has "
                             + "; ".join(problems) + ". Use the plain path: Engine(..., fast=False).")

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, query_lens: list[int], kv_indices: list[torch.Tensor],
                kv_pool) -> torch.Tensor:
        """One packed step, as `ModelRunner.run`: input_ids [T] the new tokens of every sequence in a
        row, `query_lens[i]` of them sequence i's, whose whole context sits at `kv_indices[i]`.
        Returns [B, vocab] float32 logits of each sequence's last new token."""
        step = FastStep.build(query_lens, kv_indices, device=kv_pool.device)
        md = step.md
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(h, md.positions[None])
        cos, signed_sin = cos[0, :, None], signed_sine(sin)[0, :, None]
        tokens, hidden = h.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(F.rms_norm(h, (hidden,), None, self.eps))   # the norm's weight is in qkv
            # Q and K heads sit side by side in the product: one rotation for both.
            qk = apply_rope(qkv[:, :q_size + kv_size].view(tokens, heads + kv_heads, dim), cos, signed_sin)
            v = qkv[:, q_size + kv_size:].view(tokens, kv_heads, dim)
            a = fast_paged_attention(qk[:, :heads], qk[:, heads:], v, i, kv_pool, step, self.scale)
            h = h + layer.o(a.reshape(tokens, q_size))
            gate, up = layer.gate_up(F.rms_norm(h, (hidden,), None, self.eps)).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return self.lm_head(F.rms_norm(h[md.last_token], (hidden,), None, self.eps)).float()
