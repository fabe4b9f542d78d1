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

Alignment (vLLM's proposer, ``llm_base_proposer.py``): at target position t the draft gets the
target's features at t and the token at t+1, runs at rope position t, and predicts token t+2, i.e.
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

from .vllm_format import draft_to_target_ids


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
        else:
            out = _flex_attention()(q, k, v, block_mask=mask, enable_gqa=self.n_head != self.n_kv)
        B, _, S, _ = q.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


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

    def forward(self, embeds, hidden, cos, sin, past_kv, mask):
        """One draft step. ``past_kv``: (k, v) pairs of earlier steps, prepended to this step's keys
        in order; ``mask`` [S, S_past + S] covers them. Returns the pre-norm output and this step's (k, v)."""
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        q, k, v = self.self_attn.qkv(torch.cat([embeds, hidden], dim=-1), cos, sin)
        keys = torch.cat([kv[0] for kv in past_kv] + [k], dim=2)
        values = torch.cat([kv[1] for kv in past_kv] + [v], dim=2)
        residual = self.self_attn.attend(q, keys, values, mask) + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual, (k, v)


def ttt_mask(T, step, device=None):
    """[T, (step+1)*T] bool: step 0's keys causally, then one diagonal block per later step."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    diag = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)


@functools.lru_cache(maxsize=None)
def _flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=64)
def ttt_block_mask(T, step, device):
    """``ttt_mask`` as a flex-attention BlockMask: only the causal block and the diagonals are computed,
    so step j costs about what step 0 does instead of (j+1) full T x T blocks. GPU only."""
    from torch.nn.attention.flex_attention import create_block_mask

    def allowed(b, h, q, k):
        return torch.where(k < T, k <= q, (k % T) == q)

    return create_block_mask(allowed, None, None, T, (step + 1) * T, device=device)


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

    # "sdpa": a dense boolean mask (any device); "flex": block-sparse flex attention (CUDA; compiled).
    attention = "sdpa"

    def step_mask(self, T, step, device):
        if self.attention == "flex" and device.type == "cuda":
            return ttt_block_mask(T, step, str(device))
        return ttt_mask(T, step, device)

    def draft_ids(self):
        """Target id of every draft id."""
        return draft_to_target_ids(self.d2t)

    def forward(self, input_ids, aux_hidden, targets=None, ttt_length=7, decay=0.8, chunk=4096):
        """Training-time test over ``input_ids`` [B, T] and the target's ``aux_hidden`` [B, T, 3·Ht].

        Without ``targets``: the normed output of every step, a list of ``ttt_length`` [B, T, H].
        With ``targets`` (see ``ttt_loss``): ``(loss, stats)``.
        """
        B, T = input_ids.shape
        tokens = F.pad(input_ids, (0, ttt_length))  # steps read past the end: those rows carry no loss
        hidden = self.fc(aux_hidden)
        base = torch.arange(T, device=input_ids.device)
        past, outs = [], []
        for j in range(ttt_length):
            hidden = self.step(tokens[:, 1 + j : 1 + j + T], hidden, base, j, past)
            outs.append(self.norm(hidden))
        if targets is None:
            return outs
        return ttt_loss(outs, self.lm_head.weight, self.draft_ids(), targets, decay, chunk)

    def step(self, token_ids, hidden, base, j, past):
        """Draft step ``j`` over [B, T] base positions ``base``: ``token_ids`` [B, T] are the tokens it
        reads, ``hidden`` [B, T, H] the previous step's pre-norm output (the fused target features at
        j = 0). Appends this step's (k, v) to ``past``; returns the pre-norm output [B, T, H]."""
        embeds = F.embedding(token_ids, self.embed_weight).to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(hidden, (base + j).unsqueeze(0))
        hidden, kv = self.midlayer(embeds, hidden, cos, sin, past, self.step_mask(len(base), j, base.device))
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
            hidden = self.step(ids, hidden, base, j, past)
            ids = draft_to_target[(self.norm(hidden) @ self.lm_head.weight.T).argmax(-1)]  # [1, T] target ids
            proposals.append(ids[0])
        out = torch.stack(proposals, dim=1).cpu()
        out[T - 1 :] = -1  # no token t+1 to start from
        return out


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
