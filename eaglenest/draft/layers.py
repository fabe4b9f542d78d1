"""The draft's decoder layer, as vLLM 0.32's ``llama_eagle3.py`` has it (the equations are in
``eaglenest.draft.model``'s docstring): RMSNorm, rope, attention over 2·H inputs (embedding ‖ fused
hidden), the MLP. Module names are vLLM's tensor names."""

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from .config import DraftConfig
from .fp8 import CAST, SCALE, float8_linears

try:
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
except ImportError:  # torch < 2.9: return_lse
    _AuxRequest = None


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention():
    """flex_attention for eager callers on CUDA: compiled into its fused kernel (uncompiled it runs a
    dense reference implementation, far slower, and evaluates the mask_mod on every key)."""
    return torch.compile(flex_attention, dynamic=False)


FLEX_BLOCK = 128  # flex attention's block: the flex path pads T to a multiple of it

# Triton kernel options for flex attention on CUDA (torch's ``kernel_options``; keys with fwd_/bwd_
# apply to one pass); empty: torch's own choice. benchmarks/tune_flex.py measures candidates.
FLEX_KERNEL_OPTIONS = {}


def flex_kernel_options(q):
    return dict(FLEX_KERNEL_OPTIONS) if q.device.type == "cuda" and FLEX_KERNEL_OPTIONS else None



def project(x, *linears):
    """``x`` through each of ``linears`` (bias-free nn.Linear) -> a tuple of outputs; in FP8 products,
    with ``x`` cast once for all of them, where ``fp8.use_fp8`` switched every one of them."""
    if all(getattr(m, "fp8", False) for m in linears):
        casts = [t for m in linears for t in (getattr(m, CAST), getattr(m, SCALE))]
        return float8_linears(x, *(m.weight for m in linears), casts=casts if all(c.numel() for c in casts) else ())
    return tuple(m(x) for m in linears)


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        """x [B, S, 2H] -> q [B, nH, S, hd], k and v [B, nKV, S, hd], rope (neox style) applied."""
        B, S, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(B, S, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B|1, 1, S, hd]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, q, k, v, mask):
        """Queries over the given keys; ``mask`` [S, S_k] bool (True = may attend) or a flex-attention
        BlockMask of the same pattern (``ttt_block_mask``). -> [B, S, H]."""
        if isinstance(mask, torch.Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_head != self.n_kv)
        elif torch.compiler.is_compiling() or q.device.type != "cuda":  # the enclosing graph compiles it
            out = flex_attention(q, k, v, block_mask=mask, enable_gqa=self.n_head != self.n_kv, kernel_options=flex_kernel_options(q))
        else:
            out = _compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=self.n_head != self.n_kv,
                                             kernel_options=flex_kernel_options(q))
        B, _, S, _ = q.shape
        return project(out.transpose(1, 2).reshape(B, S, -1), self.o_proj)[0]

    def causal_lse(self, q, k0, v0, causal):
        """Attention of ``q`` [B, nH, S, hd] over step 0's keys [B, nKV, S, hd] under ``causal`` (a
        [S, S] bool mask or a flex BlockMask of it) -> (out [B, nH, S, hd], log-sum-exp [B, nH, S])."""
        g, hd = q.shape[1] // self.n_kv, q.shape[-1]
        if isinstance(causal, torch.Tensor):  # CPU (tests): the same thing in plain ops
            scores = (q.float() @ k0.float().repeat_interleave(g, 1).transpose(-1, -2)) / hd**0.5
            scores = scores.masked_fill(~causal, float("-inf"))
            return torch.softmax(scores, -1) @ v0.float().repeat_interleave(g, 1), scores.logsumexp(-1)
        flex = flex_attention if torch.compiler.is_compiling() or q.device.type != "cuda" else _compiled_flex_attention()
        kw = {"block_mask": causal, "enable_gqa": g > 1, "kernel_options": flex_kernel_options(q)}
        if _AuxRequest is not None:  # return_lse is deprecated where AuxRequest exists
            out, aux = flex(q, k0, v0, return_aux=_AuxRequest(lse=True), **kw)
            return out, aux.lse
        return flex(q, k0, v0, return_lse=True, **kw)

    def attend_chains(self, q, k0, v0, kd, vd, causal, valid, chains):
        """``attend_ttt`` for a later TTT step run only at some chains: ``q`` [N, nH, hd] at the flat
        positions ``chains`` [N] (b·T + t, distinct) of step 0's keys ``k0``, ``v0`` [B, nKV, T, hd];
        ``kd``, ``vd`` [N, J-1, nKV, hd] the chains' own keys of steps 1..J-1 (``valid`` [J-1]: written
        and seen). The causal part runs over all B·T query positions (the chains' queries scattered
        into place, the rest zero and discarded), so it is step 0's flex call as is. -> [N, H]."""
        N, nh, hd = q.shape
        B, _, T, _ = k0.shape
        g = nh // self.n_kv
        q_all = q.new_zeros(B * T, nh, hd).index_copy(0, chains, q).view(B, T, nh, hd).transpose(1, 2)
        out_c, lse = self.causal_lse(q_all, k0, v0, causal)
        out_c = out_c.transpose(1, 2).reshape(B * T, nh, hd).index_select(0, chains)
        lse_c = lse.transpose(1, 2).reshape(B * T, nh).index_select(0, chains).float().view(N, self.n_kv, g)
        qg = q.view(N, self.n_kv, g, hd).float()
        s = (qg.unsqueeze(1) * kd.float().unsqueeze(3)).sum(-1) / hd**0.5  # [N, J-1, nKV, g]
        s = s.masked_fill(~valid.view(1, -1, 1, 1), float("-inf"))
        m = torch.cat([lse_c.unsqueeze(1), s], dim=1).logsumexp(1)  # [N, nKV, g]
        out = torch.exp(lse_c - m).unsqueeze(-1) * out_c.view(N, self.n_kv, g, hd).float()
        out = out + (torch.exp(s - m.unsqueeze(1)).unsqueeze(-1) * vd.float().unsqueeze(3)).sum(1)
        return project(out.to(q.dtype).reshape(N, nh * hd), self.o_proj)[0]

    def attend_ttt(self, q, keys, values, causal, valid):
        """TTT attention over the key buffer [B, nKV, J·S, hd] in two parts: the causal part over
        step 0's keys (slot 0, ``causal`` a [S, S] bool mask or a flex BlockMask of it) with its
        log-sum-exp, and the diagonal part, one key per later step i at the query's own position
        (slots 1..J-1, ``valid`` [J-1] bool: step i's key is written and seen), merged exactly by
        their log-sum-exps. The diagonal keys are then elementwise products instead of flex blocks
        of which only the diagonal counts (a quarter of the blocks at TTT 7). -> [B, S, H]."""
        B, nh, S, hd = q.shape
        g, J = nh // self.n_kv, keys.shape[2] // S
        out_c, lse = self.causal_lse(q, keys[:, :, :S], values[:, :, :S], causal)
        qg = q.view(B, self.n_kv, g, S, hd).float()
        kd = keys.view(B, self.n_kv, J, S, hd)[:, :, 1:].float()
        vd = values.view(B, self.n_kv, J, S, hd)[:, :, 1:].float()
        s = (qg.unsqueeze(3) * kd.unsqueeze(2)).sum(-1) / hd**0.5  # [B, nKV, g, J-1, S]
        s = s.masked_fill(~valid.view(1, 1, 1, -1, 1), float("-inf"))
        lse_c = lse.view(B, self.n_kv, g, S).float()
        m = torch.cat([lse_c.unsqueeze(3), s], dim=3).logsumexp(3)  # [B, nKV, g, S]
        out = torch.exp(lse_c - m).unsqueeze(-1) * out_c.view(B, self.n_kv, g, S, hd).float()
        out = out + (torch.exp(s - m.unsqueeze(3)).unsqueeze(-1) * vd.unsqueeze(2)).sum(3)
        return project(out.to(q.dtype).view(B, nh, S, hd).transpose(1, 2).reshape(B, S, -1), self.o_proj)[0]


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = project(x, self.gate_proj, self.up_proj)
        return project(F.silu(gate) * up, self.down_proj)[0]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, cos, sin, past_kv, mask, slot=None, valid=None, chains=None):
        """One draft step. ``past_kv``: (k, v) pairs of earlier steps, prepended to this step's keys
        in order; ``mask`` [S, S_past + S] covers them. Returns the pre-norm output and this step's (k, v).

        With ``slot`` (int64 [S]): ``past_kv`` is one (k, v) pair of full-length buffers
        [B, nKV, J·S, hd] and this step's keys go to positions ``slot`` of a copy of them (the keys
        seen are then the whole buffer, ``mask`` a BlockMask that skips the unwritten part);
        returns the pre-norm output and the updated buffers. With ``valid`` too: ``mask`` is step 0's
        causal mask only and the later steps' keys are attended on the diagonal (``attend_ttt``).

        With ``chains`` (int64 [N], flat positions of [B, T]): a later step run at those chains only
        (``Attention.attend_chains``): ``embeds``, ``hidden`` [N, H], ``cos``, ``sin`` [1, N, hd],
        ``past_kv`` = (k0, v0, kd, vd), step 0's keys and the chains' own later keys, ``slot`` [1]
        this step's index in kd/vd; returns the pre-norm output [N, H] and the updated (kd, vd)."""
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        x = torch.cat([embeds, hidden], dim=-1)
        q, k, v = self.self_attn.qkv(x if chains is None else x.unsqueeze(0), cos, sin)  # chains: a batch of one
        if chains is not None:
            k0, v0, kd, vd = past_kv
            kd = kd.index_copy(1, slot, k[0].transpose(0, 1).unsqueeze(1).to(kd.dtype))
            vd = vd.index_copy(1, slot, v[0].transpose(0, 1).unsqueeze(1).to(vd.dtype))
            q = q[0].transpose(0, 1).to(k0.dtype)  # [N, nH, hd]
            residual = self.self_attn.attend_chains(q, k0, v0, kd, vd, mask, valid, chains) + residual
            return self.mlp(self.post_attention_layernorm(residual)) + residual, (kd, vd)
        if slot is None:
            keys = torch.cat([kv[0] for kv in past_kv] + [k], dim=2)
            values = torch.cat([kv[1] for kv in past_kv] + [v], dim=2)
        else:  # out of place: the earlier steps' buffers stay intact for their backward
            keys = past_kv[0].index_copy(2, slot, k.to(past_kv[0].dtype))
            values = past_kv[1].index_copy(2, slot, v.to(past_kv[1].dtype))
            k, v = keys, values
            q = q.to(keys.dtype)
        if valid is not None:
            residual = self.self_attn.attend_ttt(q, keys, values, mask, valid) + residual
        else:
            residual = self.self_attn.attend(q, keys, values, mask) + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual, (k, v)
