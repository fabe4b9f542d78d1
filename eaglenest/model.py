"""The EAGLE-3 draft model, in one file, with its training-time-test (TTT) forward and loss.

Module and parameter names are vLLM's tensor names (``midlayer.self_attn.q_proj.weight``,
``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``), so ``state_dict()`` is the
exported checkpoint as is. The layer follows vLLM 0.32's ``llama_eagle3.py``:

    h     = fc(aux_0 ‖ aux_1 ‖ aux_2)                  fused target features [.., H]  (step 0)
    e     = input_layernorm(embed(token))              the target's frozen embedding
    r     = h;  h = hidden_norm(h)                     (norm first, r = normed h, if norm_before_residual)
    r     = self_attn(e ‖ h) + r                       q/k/v take 2·H inputs, embedding first
    out   = mlp(post_attention_layernorm(r)) + r       pre-norm sum: the hidden of the next draft step
    logits = lm_head(norm(out))                        over the draft vocabulary

Alignment (vLLM's proposer: ``v1/spec_decode/llm_base_proposer.py`` to 0.33,
``v1/worker/gpu/spec_decode/eagle/`` in 0.34): at target position t the draft gets the target's features at t and the token at t+1, runs at rope position t, and predicts token t+2, i.e.
what the target predicts at t+1. Draft step j (j = 0 .. ttt_length-1) at base position t gets the
token at t+1+j, the previous step's pre-norm output at t (the target features when j = 0) and rope
position t+j (vLLM advances the position one per draft step); it attends to step 0's keys at
positions <= t and to its own chain's keys at t from steps 1..j, exactly the keys vLLM's KV cache
holds when it drafts that token, and to nothing later.
"""

import functools
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from torch.utils.checkpoint import checkpoint

from .vllm_format import draft_to_target_ids

try:
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
except ImportError:  # torch < 2.9: return_lse
    _AuxRequest = None


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's: rows of the shared embedding, length of t2d
    draft_vocab_size: int
    target_hidden_size: int
    num_aux_layers: int = 3
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        # vLLM feeds the draft the target's embedding (no embed_tokens in the checkpoint) and asserts
        # that hidden states and embeddings have the same width (llama_eagle3.py, LlamaModel.forward).
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"draft hidden_size {self.hidden_size} must equal the target's {self.target_hidden_size}: "
                "the draft shares the target's token embedding"
            )

    @classmethod
    def from_target(cls, info: dict, draft_vocab_size: int, **overrides):
        """Sizes default to the target's (``info`` as in target.target_info); ``overrides`` win when not None."""
        cfg = {
            "hidden_size": info["hidden_size"],
            "intermediate_size": info["intermediate_size"],
            "num_attention_heads": info["num_attention_heads"],
            "num_key_value_heads": info["num_key_value_heads"],
            "head_dim": info["head_dim"],
            "vocab_size": info["vocab_size"],
            "draft_vocab_size": draft_vocab_size,
            "target_hidden_size": info["hidden_size"],
            "num_aux_layers": len(info["aux_layers"]),
            "rms_norm_eps": info["rms_norm_eps"],
            "rope_parameters": dict(info["rope_parameters"]),
            "max_position_embeddings": info["max_position_embeddings"],
        }
        cfg.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**cfg)

    def to_dict(self):
        return asdict(self)


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
        q = self.q_proj(x).view(B, S, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
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
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))

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
        return self.o_proj(out.to(q.dtype).reshape(N, nh * hd))

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
        return self.o_proj(out.to(q.dtype).view(B, nh, S, hd).transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


def token_embeds_ids(input_ids, ttt_length):
    """[B, T+ttt_length-1]: the tokens whose embeddings the TTT reads (step j at base t reads the
    token at t+1+j, i.e. column t+j); past the end, token 0, whose rows carry no loss."""
    return F.pad(input_ids, (0, ttt_length))[:, 1:]


def ttt_mask(T, step, device=None):
    """[T, (step+1)*T] bool: step 0's keys causally, then one diagonal block per later step."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    diag = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)


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


@functools.lru_cache(maxsize=None)
def _ttt_mask_mod(T):
    """``ttt_mask``'s pattern over key buffers of any number of steps (step i's keys at i*T..(i+1)*T):
    one function object per T, so a compiled step sees the same mask_mod at every step."""

    def allowed(b, h, q, k):
        return torch.where(k < T, k <= q, (k % T) == q)

    return allowed


@functools.lru_cache(maxsize=32)
def causal_block_mask(T, device):
    """Flex attention's BlockMask of a causal [T, T] mask (``diag_split``'s part over step 0)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q, k):
        return k <= q

    return create_block_mask(causal, None, None, T, T, device=device, BLOCK_SIZE=FLEX_BLOCK)


@functools.lru_cache(maxsize=32)
def ttt_block_masks(T, ttt_length, device):
    """One flex-attention BlockMask per TTT step j over a key buffer of ``ttt_length * T`` keys: it
    lists only the blocks of steps <= j (the causal blocks of step 0 and one diagonal block row per
    later step), so step j costs about what step 0 does and never reads the unwritten part of the
    buffer. ``T`` must be a multiple of FLEX_BLOCK: then no block straddles two steps and the shared
    mask_mod (``_ttt_mask_mod``) needs no step limit. Same shapes and mask_mod at every j.
    The block lists, not the mask_mod, keep later steps out: only a compiled flex kernel honours
    them (``Attention.attend`` always compiles it on CUDA; an uncompiled call would read later slots)."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    if T % FLEX_BLOCK:
        raise ValueError(f"flex TTT attention needs T a multiple of {FLEX_BLOCK}, got {T} (train pads batches to it)")
    mod = _ttt_mask_mod(T)
    masks = []
    for j in range(ttt_length):
        limit = (j + 1) * T

        def limited(b, h, q, k, limit=limit):
            return (k < limit) & mod(b, h, q, k)

        bm = create_block_mask(limited, None, None, T, ttt_length * T, device=device, BLOCK_SIZE=FLEX_BLOCK)
        masks.append(
            BlockMask.from_kv_blocks(
                bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=mod, seq_lengths=(T, ttt_length * T),
            )
        )
    return masks


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = cfg
        self.fc = nn.Linear(cfg.num_aux_layers * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size)  # matches d2t = 0
        # The target's embedding (set_target): frozen, shared by vLLM at serving time, so neither
        # trained nor saved.
        self.register_buffer("embed_weight", torch.empty(0, cfg.hidden_size), persistent=False)
        # The draft's rope is the target's (vLLM applies the draft config's rope_parameters).
        self.rotary_emb = LlamaRotaryEmbedding(
            LlamaConfig(
                hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads,
                head_dim=cfg.head_dim,
                rope_parameters=dict(cfg.rope_parameters),
                max_position_embeddings=cfg.max_position_embeddings,
            )
        )
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)

    def set_target(self, embed_weight, d2t, t2d, lm_head_weight=None, norm_weight=None):
        """Install the target's embedding and the vocabulary maps; optionally start the head from the
        target's (its lm_head rows of the draft vocabulary, its final norm)."""
        with torch.no_grad():
            self.embed_weight = embed_weight.detach().to(self.embed_weight.device).clone()
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)
            if lm_head_weight is not None:
                self.lm_head.weight.copy_(lm_head_weight[self.draft_ids()])
            if norm_weight is not None:
                self.norm.weight.copy_(norm_weight)

    # How the TTT runs (train.py sets these from the config; the defaults are the reference path):
    # attention "sdpa": a dense boolean mask, keys concatenated step by step (any device);
    #           "flex": fixed-shape steps over a preallocated key buffer with block-sparse flex
    #           attention (T a multiple of FLEX_BLOCK; CUDA for speed, CPU works for tests).
    # compiled: the flex step is one torch.compile'd function (see ``_flex_step``).
    # recompute: each TTT step's activations are recomputed in backward instead of kept.
    # fused_loss: ``ttt_loss_fused`` (lm_head and loss gradient together, no logits kept).
    # split_step_grads: each flex TTT step gets its own alias of the weights the steps share, and
    #   their gradients are summed in one pass when backward is done (``_StepGrads``) instead
    #   of autograd adding them into one buffer step by step (6 bf16 adds at TTT 7, about 4% of a
    #   step at Kimi-K2.5 sizes); costs ttt_length bf16 gradients of the layer at the end of
    #   backward. Not under DDP, whose hooks watch the parameters' own gradients.
    attention = "sdpa"
    compiled = False
    recompute = False
    fused_loss = False
    split_step_grads = False
    # diag_split: flex path: flex attention over step 0's causal keys only, the later steps' keys
    #   (one per query, on the diagonal) merged in elementwise (``Attention.attend_ttt``).
    diag_split = False
    # skip_unscored: with diag_split and targets: the later TTT steps (j >= 1) run only at the base
    #   positions whose chain still has a scored token ahead (``ttt_chains``): not at prompt or
    #   padding positions. Exact: a later step's output at t only feeds its own chain at t.
    skip_unscored = False

    def step_mask(self, T, step, device):
        return ttt_mask(T, step, device)

    def draft_ids(self):
        """Target id of every draft id."""
        return draft_to_target_ids(self.d2t)

    def forward(self, input_ids, aux_hidden, targets=None, ttt_length=7, decay=0.8, chunk=4096, embeds=None):
        """Training-time test over ``input_ids`` [B, T] and the target's ``aux_hidden`` [B, T, 3·Ht].

        Without ``targets``: the normed output of every step, a list of ``ttt_length`` [B, T, H].
        With ``targets`` (see ``ttt_loss``): ``(loss, stats)``. ``embeds`` [B, T+ttt_length-1, H]:
        the target's embeddings of ``token_embeds_ids(input_ids, ttt_length)``, when the caller
        looks them up itself (train.py does, on the host, so the table stays off the GPU).
        """
        if embeds is None:
            if self.embed_weight.shape[0] == 0:
                raise ValueError("Eagle3Draft has no target embedding: call set_target or pass embeds")
            embeds = F.embedding(token_embeds_ids(input_ids, ttt_length), self.embed_weight)
        if self.attention == "flex":
            chains = None
            if self.skip_unscored and self.diag_split and targets is not None and ttt_length > 1:
                plan = targets.get("plan") or {}
                B, T = input_ids.shape
                chains = plan["chains"] if "chains" in plan else ttt_chains(targets["rows"], T, ttt_length, B * T)
            outs = self._ttt_flex(input_ids, aux_hidden, ttt_length, embeds, chains)
        else:
            outs = self._ttt_dense(input_ids, aux_hidden, ttt_length, embeds)
        if targets is None:
            return outs
        if self.fused_loss:
            return ttt_loss_fused(outs, self.lm_head.weight, self.draft_ids(), targets, decay, chunk, compiled=self.compiled)
        return ttt_loss(outs, self.lm_head.weight, self.draft_ids(), targets, decay, chunk)

    def _ttt_dense(self, input_ids, aux_hidden, ttt_length, embeds_all):
        B, T = input_ids.shape
        hidden = self.fc(aux_hidden)
        base = torch.arange(T, device=input_ids.device)
        past, outs = [], []
        for j in range(ttt_length):
            hidden = self.step(embeds_all[:, j : j + T].to(self.fc.weight.dtype), hidden, base, j, past)  # tokens t+1+j
            outs.append(self.norm(hidden))
        return outs

    def _ttt_flex(self, input_ids, aux_hidden, ttt_length, embeds_all, chains=None):
        """The same TTT as ``_ttt_dense`` at fixed shapes: the keys of all steps live in one buffer
        [B, nKV, J·T, hd] allocated up front (step j writes its slot j·T..(j+1)·T out of place) and
        flex attention's per-step block mask skips what is not written yet, so every step calls
        ``_flex_step`` with the same shapes, dtypes and mask_mod. Compiled, that is ONE graph for
        any ttt_length (7 or 10), instead of one per step and a dynamo recompile limit that drops
        the rest to eager; the price is a buffer of J·T keys (tens of MB) per step. With
        ``diag_split`` the mask is step 0's causal one at every step and ``valid`` (values only)
        says which later steps' diagonal keys are written. With ``chains`` (``skip_unscored``) the
        steps after step 0 run at those flat positions only (``_ttt_chains``)."""
        B, T = input_ids.shape
        attn = self.midlayer.self_attn
        hidden = self.fc(aux_hidden)
        device = input_ids.device
        valid = [None] * ttt_length
        if self.diag_split:  # step 0's causal keys through flex, the later steps' on the diagonal
            masks = [causal_block_mask(T, str(device)) if device.type == "cuda" or self.compiled else ttt_mask(T, 0, device)] * ttt_length
            valid = [torch.arange(1, ttt_length, device=device) <= j for j in range(ttt_length)]
        elif device.type == "cuda" or self.compiled:
            masks = ttt_block_masks(T, ttt_length, str(device))
        else:  # CPU (tests): flex has no backward there, and uncompiled it evaluates the mask_mod
            # densely, which the block lists above rely on not happening; the same pattern as dense masks
            masks = [F.pad(ttt_mask(T, j, device), (0, (ttt_length - 1 - j) * T)) for j in range(ttt_length)]
        kv_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else self.fc.weight.dtype
        # requires_grad like the buffers of later steps, so step 0 matches the same compiled graph
        grad = torch.is_grad_enabled()
        k_buf = torch.zeros(B, attn.n_kv, ttt_length * T, attn.head_dim, device=device, dtype=kv_dtype, requires_grad=grad)
        v_buf = torch.zeros_like(k_buf, requires_grad=grad)
        base = torch.arange(T, device=device)
        step = self._compiled_step() if self.compiled else self._flex_step
        shared = self.step_params() if self.split_step_grads and grad else None
        outs = []
        collect = _StepGrads(list(shared.values()), compiled=self.compiled) if shared else None
        for j in range(ttt_length if chains is None else 1):
            cos, sin = self.rotary_emb(hidden, (base + j).unsqueeze(0))
            # the step widens the embeddings itself: the slice (a view) is what a recomputed step keeps
            hidden, normed, k_buf, v_buf = step(embeds_all[:, j : j + T], hidden, cos, sin, k_buf, v_buf, base + j * T, masks[j],
                                                _step_weights(shared, collect), valid[j])
            outs.append(normed)
        if chains is not None:
            outs += self._ttt_chains(hidden, embeds_all, k_buf[:, :, :T], v_buf[:, :, :T], masks[0], chains, ttt_length, shared, collect)
        return outs

    def _ttt_chains(self, hidden, embeds_all, k0, v0, mask, chains, ttt_length, shared, collect):
        """Steps 1..J-1 at the flat positions ``chains`` [N] only, from step 0's pre-norm output
        ``hidden`` [B, T, H] and keys ``k0``, ``v0``; the chains' own keys live in [N, J-1, nKV, hd]
        buffers. Compiled, N is a dynamic dimension: one graph serves every batch of the same [B, T].
        -> the normed outputs of steps 1..J-1, each [B, T, H] (zero off the chains)."""
        B, T, H = hidden.shape
        attn, device, grad = self.midlayer.self_attn, hidden.device, torch.is_grad_enabled()
        pos = chains % T
        e_rows = chains // T * embeds_all.shape[1] + pos  # row of the token step 0 reads, in embeds_all [B·(T+J-1), H]
        flat_embeds = embeds_all.reshape(-1, H)
        h = _GatherRows.apply(hidden.reshape(B * T, H), chains)
        kd = torch.zeros(len(chains), ttt_length - 1, attn.n_kv, attn.head_dim, device=device, dtype=k0.dtype, requires_grad=grad)
        vd = torch.zeros_like(kd, requires_grad=grad)
        steps = torch.arange(1, ttt_length, device=device)
        step = self._compiled_chains_step() if self.compiled else self._chains_step
        outs = []
        for j in range(1, ttt_length):
            cos, sin = self.rotary_emb(h, (pos + j).unsqueeze(0))
            args = (flat_embeds, e_rows + j, h, cos, sin, k0, v0, kd, vd, steps[j - 1 : j] - 1, chains)
            if self.compiled:
                mark_chains_dynamic(args)
            h, normed, kd, vd = step(*args, mask, _step_weights(shared, collect), steps <= j)
            outs.append(normed)
        return outs

    def _chains_step(self, flat_embeds, e_index, hidden, cos, sin, k0, v0, kd, vd, slot, chains, block_mask, weights=None,
                     valid=None):
        """One later TTT step at the chains only (``_ttt_chains``) -> (pre-norm output [N, H], normed
        output scattered to [B, T, H], kd, vd)."""

        def body(flat_embeds, e_index, hidden, cos, sin, k0, v0, kd, vd, slot, chains):
            embeds = flat_embeds.index_select(0, e_index).to(self.fc.weight.dtype)
            out, normed, (kd, vd) = self._layer_and_norm(
                weights, (embeds, hidden, cos, sin, (k0, v0, kd, vd), block_mask), {"slot": slot, "valid": valid, "chains": chains})
            B, T = k0.shape[0], k0.shape[2]
            return out, normed.new_zeros(B * T, normed.shape[-1]).index_copy(0, chains, normed).view(B, T, -1), kd, vd

        args = (flat_embeds, e_index, hidden, cos, sin, k0, v0, kd, vd, slot, chains)
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(body, *args, use_reentrant=False)
        return body(*args)

    def _compiled_chains_step(self):
        # like _compiled_step, but the chains' count N is marked dynamic by the caller
        if getattr(self, "_chains_compiled", None) is None:
            self._chains_compiled = torch.compile(self._chains_step, dynamic=False, fullgraph=True)
        return self._chains_compiled

    def _layer_and_norm(self, weights, args, kwargs):
        """The decoder layer and the final norm -> (pre-norm output, normed output, the layer's kv);
        ``weights``: tensors to use in place of the parameters of the same names (``split_step_grads``)."""
        if weights is None:
            out, kv = self.midlayer(*args, **kwargs)
            return out, self.norm(out), kv
        mid = {n.removeprefix("midlayer."): w for n, w in weights.items() if n.startswith("midlayer.")}
        out, kv = torch.func.functional_call(self.midlayer, mid, args, kwargs)
        norm = {n.removeprefix("norm."): w for n, w in weights.items() if n.startswith("norm.")}
        return out, torch.func.functional_call(self.norm, norm, (out,)), kv

    def step_params(self):
        """The trained parameters every TTT step uses (the decoder layer's and the final norm's), by
        name: what ``split_step_grads`` gives each step an alias of."""
        return {n: p for n, p in self.named_parameters() if n.split(".")[0] in ("midlayer", "norm") and p.requires_grad}

    def _flex_step(self, embeds, hidden, cos, sin, k_buf, v_buf, slot, block_mask, weights=None, valid=None):
        """One fixed-shape TTT step -> (pre-norm output, normed output, k_buf, v_buf). With
        ``recompute`` its activations are recomputed in backward (inside the compiled graph, the
        checkpoint becomes a region the partitioner recomputes). ``weights``: tensors to use in place
        of the parameters of the same names (``split_step_grads``)."""

        def body(embeds, hidden, cos, sin, k_buf, v_buf, slot):
            embeds = embeds.to(self.fc.weight.dtype)
            out, normed, (k_buf, v_buf) = self._layer_and_norm(
                weights, (embeds, hidden, cos, sin, (k_buf, v_buf), block_mask), {"slot": slot, "valid": valid})
            return out, normed, k_buf, v_buf

        if self.recompute and torch.is_grad_enabled():
            return checkpoint(body, embeds, hidden, cos, sin, k_buf, v_buf, slot, use_reentrant=False)
        return body(embeds, hidden, cos, sin, k_buf, v_buf, slot)

    def _compiled_step(self):
        # fullgraph: a graph break raises instead of silently running part of the step eagerly;
        # dynamic=False: one static graph per batch shape (train.py pads batches to few shapes and
        # sets the recompile limit to their number, failing loudly past it: train.configure_compile).
        if getattr(self, "_step_compiled", None) is None:
            self._step_compiled = torch.compile(self._flex_step, dynamic=False, fullgraph=True)
        return self._step_compiled

    def step(self, embeds, hidden, base, j, past):
        """Draft step ``j`` over [B, T] base positions ``base``: ``embeds`` [B, T, H] the target's
        embeddings of the tokens it reads, ``hidden`` [B, T, H] the previous step's pre-norm output
        (the fused target features at j = 0). Appends this step's (k, v) to ``past``; returns the
        pre-norm output [B, T, H]. Under ``recompute`` (training) its activations are recomputed in
        backward instead of kept."""
        cos, sin = self.rotary_emb(hidden, (base + j).unsqueeze(0))
        layer = functools.partial(self.midlayer, past_kv=tuple(past), mask=self.step_mask(len(base), j, base.device))
        if self.recompute and torch.is_grad_enabled():
            hidden, kv = checkpoint(layer, embeds, hidden, cos, sin, use_reentrant=False)
        else:
            hidden, kv = layer(embeds, hidden, cos, sin)
        past.append(kv)
        return hidden

    @torch.no_grad()
    def propose(self, input_ids, aux_hidden, k):
        """What vLLM's EAGLE-3 proposer drafts at every position of one sequence: target ids [T, k].

        ``input_ids`` [T] int64, ``aux_hidden`` [T, 3·Ht] the target's states at the draft's layer ids.
        Row t is the chain drafted after the target has verified tokens 0..t and sampled token t+1:
        step 0 takes the target's fused features at t and token t+1 at position t; step j takes this
        chain's own token of step j-1 and the pre-norm output at position t+j, attending to step 0's
        keys at positions <= t (vLLM's KV cache, always rebuilt from target features at accepted
        positions) plus its own chain's keys (llm_base_proposer.propose): the training-time test with
        the draft's own tokens in place of the sequence's. The last row, which has no token t+1 to
        start from, is -1.
        """
        T = input_ids.shape[0]
        dev, dtype = self.fc.weight.device, self.fc.weight.dtype
        ids = torch.cat([input_ids[1:], input_ids.new_zeros(1)]).to(dev).unsqueeze(0)  # token t+1 at row t
        hidden = self.fc(aux_hidden.to(dev, dtype)).unsqueeze(0)  # [1, T, H]
        base = torch.arange(T, device=dev)
        draft_to_target = self.draft_ids()
        past, proposals = [], []
        for j in range(k):
            hidden = self.step(F.embedding(ids, self.embed_weight).to(dtype), hidden, base, j, past)
            ids = draft_to_target[(self.norm(hidden) @ self.lm_head.weight.T).argmax(-1)]  # [1, T] target ids
            proposals.append(ids[0])
        out = torch.stack(proposals, dim=1).cpu()
        out[T - 1 :] = -1  # no token t+1 to start from
        return out


def mark_chains_dynamic(args):
    """``Eagle3Draft._chains_step``'s arguments: the chains' count N, which varies by batch, made a
    dynamic dimension of the compiled step (one graph per batch shape, not one per N)."""
    _, e_index, hidden, cos, sin, _, _, kd, vd, _, chains = args
    for t, dim in ((e_index, 0), (hidden, 0), (cos, 1), (sin, 1), (kd, 0), (vd, 0), (chains, 0)):
        torch._dynamo.mark_dynamic(t, dim)


def _step_weights(shared, collect):
    """``split_step_grads``: one TTT step's aliases of the ``shared`` parameters (the same storage,
    leaves of their own, so that step's gradients land apart, in ``collect``); None without."""
    if not shared:
        return None
    weights = {n: p.detach().requires_grad_() for n, p in shared.items()}
    for i, w in enumerate(weights.values()):
        w.register_post_accumulate_grad_hook(collect.hook(i))
    return weights


class _StepGrads:
    """``split_step_grads``: collects the step aliases' gradients as autograd stores them (a
    post-accumulate hook takes each alias's ``.grad`` and drops it from the alias: no copy) and, at
    the end of that backward, gives each parameter their sum (added to a gradient it already has,
    as when micro-batches accumulate). Holds no alias, so nothing outlives the backward."""

    def __init__(self, params, compiled=False):
        self.params, self.compiled = params, compiled  # compiled: the sum as one kernel per parameter
        self.parts = [[] for _ in params]
        self.queued = False

    def hook(self, i):
        def take(alias):
            self.parts[i].append(alias.grad)
            alias.grad = None
            if not self.queued:  # once per backward: sum when the engine is done
                self.queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)

        return take

    def finish(self):
        parts, self.parts, self.queued = self.parts, [[] for _ in self.params], False
        for p, total in zip(self.params, (_compiled_sum_parts() if self.compiled else _sum_parts)(parts)):
            if total is None:
                continue
            if p.grad is None:
                p.grad = total
            else:
                p.grad += total


def _sum_parts(parts):
    """Each list's sum, in fp32, rounded once to the parts' dtype and written into its first part."""
    out = []
    for ps in parts:
        if not ps:
            out.append(None)
            continue
        total = ps[0].float()
        for g in ps[1:]:
            total = total + g.float()
        out.append(ps[0].copy_(total))
    return out


@functools.lru_cache(maxsize=None)
def _compiled_sum_parts():
    # one kernel per parameter reading every step's gradient once; static shapes: one graph a run
    return torch.compile(_sum_parts, dynamic=False)


# ----------------------------------------------------------------------------- loss


def soft_cross_entropy(hidden, weight, target_probs, row_weight, chunk=4096):
    """Sum over rows of ``row_weight * CE(target_probs, softmax(hidden @ weight.T))`` and each row's
    argmax, ``chunk`` rows at a time; with several chunks each is recomputed in backward rather than
    kept, so memory holds one chunk of logits."""

    def piece(h, p, w):
        logits = (h @ weight.T).float()
        return (w * -(p * F.log_softmax(logits, dim=-1)).sum(-1)).sum(), logits.argmax(-1)

    n = hidden.shape[0]
    if n <= chunk or not torch.is_grad_enabled():
        pieces = [piece(hidden[s : s + chunk], target_probs[s : s + chunk], row_weight[s : s + chunk]) for s in range(0, max(n, 1), chunk)]
    else:
        from torch.utils.checkpoint import checkpoint

        pieces = [
            checkpoint(piece, hidden[s : s + chunk], target_probs[s : s + chunk], row_weight[s : s + chunk], use_reentrant=False)
            for s in range(0, n, chunk)
        ]
    return sum(p[0] for p in pieces), torch.cat([p[1] for p in pieces])


def ttt_loss(outs, lm_head_weight, draft_ids, targets, decay=0.8, chunk=4096):
    """Weighted soft cross-entropy of the TTT steps against the target's distribution.

    ``targets`` (from the target's last hidden state, computed once per batch, see train.py), over
    the ``Nq`` flat positions q of [B, T] whose next token is a completion token:
        rows      int64 [Nq]      flat index b*T + q
        probs     float [Nq, Vd]  the target's distribution at q restricted to the draft vocabulary
        argmax    int64 [Nq]      the target's top-1 over its full vocabulary (a target id)
        in_draft  bool  [Nq]      argmax is in the draft vocabulary: positions without it carry no loss
    Step j at base position t predicts what the target predicts at q = t+1+j.
    Returns ``(loss, stats)``: loss = sum_j decay^j * mean CE_j; stats [J, 4] = CE sum, loss rows,
    top-1 hits, rows (accuracy counts every row, in the draft vocabulary or not).
    """
    B, T, H = outs[0].shape
    rows = targets["rows"]
    loss = outs[0].new_zeros((), dtype=torch.float32)
    stats = []
    for j, out in enumerate(outs):
        sel = rows % T >= 1 + j  # q = t+1+j needs t >= 0
        w = targets["in_draft"][sel].float()
        ce, top = soft_cross_entropy(out.reshape(B * T, H)[rows[sel] - 1 - j], lm_head_weight, targets["probs"][sel], w, chunk)
        hits = (draft_ids[top] == targets["argmax"][sel]).sum()
        loss = loss + decay**j * ce / w.sum().clamp(min=1)
        stats.append(torch.stack([ce.detach(), w.sum(), hits.float(), torch.tensor(float(sel.sum()), device=w.device)]))
    return loss, torch.stack(stats)


def ttt_loss_plan(rows, T, ttt_length, n_flat, chains=False):
    """Which (step, base position) rows ``ttt_loss_fused`` scores, from ``targets["rows"]`` (any
    device; train.py makes it on the host, in the loader thread, so the step never waits on it).

    Step j scores base t = q-1-j for each loss position q with q % T >= 1+j. Returns int64 tensors
    over those N rows: ``h_index`` into the steps' outputs stacked [J·n_flat] (n_flat = B·T),
    ``p_index`` into the targets' rows, ``step`` the step j; with ``chains`` (``skip_unscored``)
    also ``chains``, the positions the later steps run at (``ttt_chains``)."""
    t = rows % T
    h_index, p_index, step = [], [], []
    for j in range(ttt_length):
        sel = (t >= 1 + j).nonzero().squeeze(1)
        p_index.append(sel)
        h_index.append(rows[sel] - 1 - j + j * n_flat)
        step.append(torch.full_like(sel, j))
    plan = {"h_index": torch.cat(h_index), "p_index": torch.cat(p_index), "step": torch.cat(step)}
    if chains:
        plan["chains"] = ttt_chains(rows, T, ttt_length, n_flat)
    return plan


def ttt_chains(rows, T, ttt_length, n_flat, multiple=16):
    """The flat base positions (b·T + t, sorted) at which the TTT steps after step 0 run under
    ``skip_unscored``: those whose chain scores a token at some step j >= 1 (a loss row q = t+1+j
    in ``rows`` with q % T >= 1+j, as ``ttt_loss_plan``). Padded with unscored positions to a
    multiple of ``multiple`` (at least ``multiple``, at most n_flat): rounder matrix shapes."""
    need = torch.zeros(n_flat, dtype=torch.bool, device=rows.device)
    t = rows % T
    for j in range(1, ttt_length):
        need[rows[t >= 1 + j] - 1 - j] = True
    n = int(need.sum())
    extra = min(n_flat, max(multiple, -(-n // multiple) * multiple)) - n
    if extra:
        need[(~need).nonzero().squeeze(1)[:extra]] = True
    return need.nonzero().squeeze(1)


class _GatherRows(torch.autograd.Function):
    """``x.index_select(0, index)`` for an ``index`` without repeats: its backward copies the rows
    back (index_copy) instead of index_select's atomic index_add (about 1 ms a step at Kimi-K2.5
    sizes, TTT 7, on an H200)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.new_zeros((ctx.rows, *grad.shape[1:])).index_copy_(0, index, grad), None


class _LinearSoftCE(torch.autograd.Function):
    """``sum(row_weight * CE(probs[p_index], softmax(hidden @ weight.T)))`` with both gradients
    computed in forward, ``chunk`` rows at a time: the logits of one chunk are alive at once and
    none are kept for backward (only d loss / d hidden [N, H] and d loss / d weight [V, H])."""

    @staticmethod
    def forward(ctx, hidden, weight, probs, p_index, row_weight, chunk, need_h, need_w, compiled=False):
        w = weight.to(hidden.dtype)
        n = hidden.shape[0]
        ce = torch.empty(n, device=hidden.device, dtype=torch.float32)
        top = torch.empty(n, device=hidden.device, dtype=torch.int64)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
        for s in range(0, n, chunk):
            h = hidden[s : s + chunk]
            if compiled:  # one fused kernel set for the elementwise part; n is a multiple of chunk
                ce[s : s + chunk], top[s : s + chunk], g = _compiled_soft_ce_grad()(h @ w.T, probs[p_index[s : s + chunk]], row_weight[s : s + chunk])
                if need_h:
                    grad_h[s : s + chunk] = g @ w
                if need_w:
                    grad_w += (g.T @ h).float()
                continue
            logp = (h @ w.T).float()
            top[s : s + chunk] = logp.argmax(-1)
            logp -= logp.logsumexp(-1, keepdim=True)  # in place: one [chunk, V] fp32 buffer
            p = probs[p_index[s : s + chunk]]
            ce[s : s + chunk] = -torch.linalg.vecdot(p, logp)
            if need_h or need_w:
                # d CE / d logits = softmax * sum(p) - p, weighted per row
                g = logp.exp_().mul_(p.sum(-1, keepdim=True)).sub_(p).mul_(row_weight[s : s + chunk, None])
                del p, logp
                g = g.to(hidden.dtype)
                if need_h:
                    grad_h[s : s + chunk] = g @ w
                if need_w:
                    grad_w += (g.T @ h).float()
        ctx.save_for_backward(grad_h, grad_w)
        loss = (ce * row_weight).sum()
        ctx.mark_non_differentiable(ce, top)
        return loss, ce, top

    @staticmethod
    def backward(ctx, g_loss, _g_ce, _g_top):
        grad_h, grad_w = ctx.saved_tensors  # scaled in place: no second copy of d loss / d weight
        gh = grad_h.mul_(g_loss.to(grad_h.dtype)) if grad_h is not None else None
        gw = grad_w.mul_(g_loss) if grad_w is not None else None
        return gh, gw, None, None, None, None, None, None, None


def _soft_ce_grad(logits, p, row_weight):
    """One chunk of ``_LinearSoftCE`` past its matmul: logits [n, V], target probs p [n, V] ->
    CE [n], argmax [n], d loss / d logits [n, V] in the logits' dtype (the same math as the eager
    in-place path, written plainly for the compiler to fuse)."""
    x = logits.float()
    logp = x - x.logsumexp(-1, keepdim=True)
    ce = -(p * logp).sum(-1)
    g = (logp.exp() * p.sum(-1, keepdim=True) - p) * row_weight[:, None]
    return ce, x.argmax(-1), g.to(logits.dtype)


@functools.lru_cache(maxsize=None)
def _compiled_soft_ce_grad():
    # static shapes: ttt_loss_fused pads the rows to a multiple of the chunk, so one graph serves
    return torch.compile(_soft_ce_grad, dynamic=False, fullgraph=True)


def ttt_loss_fused(outs, lm_head_weight, draft_ids, targets, decay=0.8, chunk=4096, compiled=False):
    """``ttt_loss`` computed in one pass over all steps' rows (``_LinearSoftCE``): the same loss and
    stats, no logits kept for backward, no host synchronisation when ``targets["plan"]``
    (``ttt_loss_plan``, made on the host) is given."""
    J = len(outs)
    B, T, H = outs[0].shape
    plan = targets.get("plan")
    if plan is None:
        plan = ttt_loss_plan(targets["rows"], T, J, B * T)
    hidden = _GatherRows.apply(torch.stack(outs).reshape(J * B * T, H), plan["h_index"])
    p_index, step = plan["p_index"], plan["step"]
    w = targets["in_draft"][p_index].float()
    def per_step(x):
        return torch.zeros(J, device=x.device, dtype=torch.float32).index_add_(0, step, x)

    w_sum = per_step(w)
    decay_j = decay ** torch.arange(J, device=w.device, dtype=torch.float32)
    row_weight = w * (decay_j / w_sum.clamp(min=1))[step]
    need_h = torch.is_grad_enabled() and hidden.requires_grad
    need_w = torch.is_grad_enabled() and lm_head_weight.requires_grad
    n = len(p_index)
    if compiled:  # rows padded to a multiple of chunk (weight 0, so no loss and no gradient);
        chunk = min(chunk, 1024)  # small chunks: little padding, and the matmuls stay large enough
        pad = (-n) % chunk
        hidden = F.pad(hidden, (0, 0, 0, pad))
        loss, ce, top = _LinearSoftCE.apply(hidden, lm_head_weight, targets["probs"], F.pad(p_index, (0, pad)),
                                            F.pad(row_weight, (0, pad)), chunk, need_h, need_w, True)
        ce, top = ce[:n], top[:n]
    else:
        loss, ce, top = _LinearSoftCE.apply(hidden, lm_head_weight, targets["probs"], p_index, row_weight, chunk, need_h, need_w)
    hits = (draft_ids[top] == targets["argmax"][p_index]).float()
    stats = torch.stack([per_step(ce * w), w_sum, per_step(hits), per_step(torch.ones_like(w))], dim=1)
    return loss, stats
