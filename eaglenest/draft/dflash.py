"""The DFlash draft (z-lab's block-diffusion drafter, as vLLM 0.32 serves it with ``method: dflash``), in one
file: its config, its layers, the anchored-block forward and loss it trains with, and what it proposes.

Module and parameter names are vLLM's tensor names (``fc.weight``, ``hidden_norm.weight``,
``layers.{l}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{l}.self_attn.{q,k}_norm.weight``,
``layers.{l}.{input,post_attention}_layernorm.weight``, ``layers.{l}.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``), so ``state_dict()`` is the exported checkpoint
(``dflash_format``), but for ``mask_embedding``, which ships as its own file. The equations are vLLM 0.32's
``model_executor/models/qwen3_dflash.py`` fed by ``v1/spec_decode/dflash.py``:

    ctx_p  = hidden_norm(fc(aux_0 ‖ aux_1 ‖ aux_2)_p)     the target's states at context position p     [H]
    x      = e(t_a), e(M), ..., e(M)                      a block of B slots at positions a .. a+B-1: the
                                                          anchor t_a (the token the target sampled last,
                                                          vLLM's "bonus" token), then B-1 mask slots
    for each layer:
      K_p, V_p = rope_p(k_norm(k_proj ctx_p)), v_proj ctx_p          every layer projects the same ctx,
                                                                     without input_layernorm
      h = input_layernorm(x);  q, k, v = rope(q_norm(q_proj h)), rope(k_norm(k_proj h)), v_proj h
      x = x + o_proj(attention(q; K_p, V_p for p < a; the block's own k, v))   non-causal in the block
      x = x + mlp(post_attention_layernorm(x))
    logits_i = lm_head(norm(x_i))                         slot i (1 .. B-1) drafts the token at a+i

``e`` is the target's frozen embedding (vLLM shares it), except for ids equal to ``mask_token_id``, which
take ``mask_embedding``: trained here and shipped as ``mask_embedding.pt``, which vLLM substitutes the same
way (``DFlashQwen3Model.embed_input_ids``). The peers keep the target's row of the mask token instead; a
reserved row may be untrained, and a zero one leaves a one-layer draft no way to tell its slots apart.
q_norm and k_norm are RMSNorms over each head; rope is the target's (neox style).

Alignment: the target has verified tokens 0 .. a-1, its states there are the context (vLLM's KV cache of
the draft holds them), and it sampled t_a; the block proposes t_{a+1} .. t_{a+B-1}. Served with
``num_speculative_tokens`` k, vLLM's block has k+1 slots (the anchor and k masks).

Training (speculators' and z-lab's recipe): each sequence gets up to ``train.dflash_anchors`` anchors drawn at
random among its completion tokens; slot i of the block at anchor a is scored against the target's greedy
token at a+i (the shard's ``target_next`` at a+i-1) where that token is a completion token in the draft
vocabulary, by cross-entropy, weighted exp(-(i-1)/gamma). Slot 0, the anchor, is not scored.
"""

import dataclasses
import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .config import STORED_AS
from .layers import MLP, RMSNorm, rotate_half
from .vllm_format import draft_to_target_ids

KIND = "dflash"


@dataclasses.dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_vocab_size: int  # the target's vocabulary: rows of the shared embedding, length of t2d
    draft_vocab_size: int  # rows of lm_head, length of d2t
    target_hidden_size: int
    mask_token_id: int  # the id of the mask slots (vLLM's dflash_config.mask_token_id)
    num_hidden_layers: int = 5
    block_size: int = 8  # slots of a block in training: the anchor and block_size - 1 masks
    num_aux_layers: int = 3
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = dataclasses.field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    kind: ClassVar[str] = KIND

    def __post_init__(self):
        if self.hidden_size != self.target_hidden_size:  # the block's slots are the target's embeddings
            raise ValueError(f"DFlash hidden_size {self.hidden_size} must equal the target's {self.target_hidden_size}")
        if not 0 <= self.mask_token_id < self.target_vocab_size:
            raise ValueError(f"draft.mask_token_id {self.mask_token_id} is outside the target's vocabulary "
                             f"(0 .. {self.target_vocab_size - 1})")
        if self.block_size < 2:
            raise ValueError(f"draft.dflash.block_size must be at least 2 (the anchor and one mask), got {self.block_size}")

    @classmethod
    def from_target(cls, info, draft_vocab_size: int, draft):
        """The draft of ``draft`` (``settings.DraftSettings``: its ``dflash``, ``mask_token_id`` and size
        fields, None: the target's) for the target ``info`` (``target.TargetFacts``)."""
        dflash, mask = draft.dflash, draft.mask_token_id
        if mask is None:
            raise ValueError("draft.kind dflash needs draft.mask_token_id: a token id the target never "
                             "generates, e.g. its pad token (the toy's <pad> is 2; Qwen3's DFlash drafts use 151669)")
        sizes = {k: getattr(draft, k) for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
                 if getattr(draft, k) is not None}
        return cls(**{"intermediate_size": info.intermediate_size, "num_attention_heads": info.num_attention_heads,
                      "num_key_value_heads": info.num_key_value_heads, "head_dim": info.head_dim, **sizes},
                   hidden_size=info.hidden_size, target_vocab_size=info.vocab_size, draft_vocab_size=draft_vocab_size,
                   target_hidden_size=info.hidden_size, mask_token_id=int(mask),
                   num_hidden_layers=dflash.num_layers, block_size=dflash.block_size,
                   num_aux_layers=len(info.aux_layers), rms_norm_eps=info.rms_norm_eps,
                   rope_parameters=dict(info.rope_parameters), max_position_embeddings=info.max_position_embeddings)

    def to_dict(self) -> dict:
        """The fields under their stored names, and the kind (a checkpoint's ``draft_config``)."""
        return {"kind": KIND, **{STORED_AS.get(k, k): v for k, v in dataclasses.asdict(self).items()}}

    @classmethod
    def from_dict(cls, stored: dict):
        names = {key: name for name, key in STORED_AS.items()}
        return cls(**{names.get(k, k): v for k, v in stored.items() if k != "kind"})


def rope(x, cos, sin):
    """Neox-style rotary embedding of ``x`` [B, n, S, hd] with ``cos``/``sin`` [B|1, S, hd]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def block_attention(q, k, v, ctx_k, ctx_v, seen, S):
    """Each block's slots over the context keys it sees and over its own block's keys, non-causally.

    ``q`` [B, nH, N·S, hd] and ``k``, ``v`` [B, nKV, N·S, hd]: N blocks of S slots; ``ctx_k``, ``ctx_v``
    [B, nKV, T, hd]; ``seen`` [B, N, T] bool: block n sees context position p (p < its anchor). One softmax
    over both parts, in float; memory N·S·(T+S) scores a head, not N·S·(T+N·S). -> [B, nH, N·S, hd]."""
    B, nH, NS, hd = q.shape
    N, T, g = NS // S, ctx_k.shape[2], nH // k.shape[1]
    qf = q.float() * hd**-0.5
    ctx_k, ctx_v, k, v = (t.float().repeat_interleave(g, 1) for t in (ctx_k, ctx_v, k, v))
    s_ctx = (qf @ ctx_k.transpose(-1, -2)).view(B, nH, N, S, T).masked_fill(~seen[:, None, :, None, :], float("-inf"))
    s_blk = qf.view(B, nH, N, S, hd) @ k.view(B, nH, N, S, hd).transpose(-1, -2)  # [B, nH, N, S, S]
    p = torch.softmax(torch.cat([s_ctx, s_blk], -1), -1)
    out = p[..., :T].reshape(B, nH, NS, T) @ ctx_v + (p[..., T:] @ v.view(B, nH, N, S, hd)).view(B, nH, NS, hd)
    return out.to(q.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _heads(self, y, n):
        B, S, _ = y.shape
        return y.view(B, S, n, self.head_dim).transpose(1, 2)

    def keys(self, x, cos, sin):
        """``(k, v)`` [B, nKV, S, hd] of ``x`` [B, S, H]: k normed per head and roped."""
        return rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv)), cos, sin), self._heads(self.v_proj(x), self.n_kv)

    def forward(self, x, cos, sin, ctx_kv, seen, S):
        """``x`` [B, N·S, H] the blocks' slots (input_layernorm applied), ``ctx_kv`` the context's ``keys``."""
        B, NS, _ = x.shape
        q = rope(self.q_norm(self._heads(self.q_proj(x), self.n_head)), cos, sin)
        out = block_attention(q, *self.keys(x, cos, sin), *ctx_kv, seen, S)
        return self.o_proj(out.transpose(1, 2).reshape(B, NS, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, ctx, rope_slots, rope_ctx, seen, S):
        ctx_kv = self.self_attn.keys(ctx, *rope_ctx)
        x = x + self.self_attn(self.input_layernorm(x), *rope_slots, ctx_kv, seen, S)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_inputs(input_ids, anchors, S, mask_token_id):
    """The blocks at ``anchors`` [B, N] of ``input_ids`` [B, T]: their tokens and positions [B, N, S] (the
    anchor's token, then mask ids; positions a .. a+S-1) and which context positions each sees [B, N, T]."""
    T = input_ids.shape[1]
    ids = torch.full((*anchors.shape, S), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[..., 0] = input_ids.gather(1, anchors)
    positions = anchors.unsqueeze(-1) + torch.arange(S, device=anchors.device)
    seen = torch.arange(T, device=anchors.device) < anchors.unsqueeze(-1)
    return ids, positions, seen


def sample_anchors(loss_mask, n, generator=None):
    """Up to ``n`` anchors per row of ``loss_mask`` [B, T] (True on completion tokens), drawn at random among
    the completion tokens that have a next token (all of them where there are fewer), ascending -> ``(anchors,
    valid)`` [B, N]: N the most any row got, padding anchors 0 and not valid."""
    cand = loss_mask.clone()
    cand[:, -1] = False
    cand[:, :-1] &= loss_mask[:, 1:]  # the next token exists (padding is not a completion token)
    rows = []
    for row in cand.cpu():
        pos = row.nonzero().squeeze(1)
        if len(pos) > n:
            pos = pos[torch.randperm(len(pos), generator=generator)[:n]].sort().values
        rows.append(pos)
    N = max(1, max(len(r) for r in rows))
    anchors = torch.zeros(len(rows), N, dtype=torch.int64)
    valid = torch.zeros(len(rows), N, dtype=torch.bool)
    for b, r in enumerate(rows):
        anchors[b, : len(r)], valid[b, : len(r)] = r, True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = cfg
        self.fc = nn.Linear(cfg.num_aux_layers * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))  # set_target: the target's row to start
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(cfg.target_vocab_size) < cfg.draft_vocab_size)  # matches d2t = 0
        # The target's embedding (set_target): frozen and shared by vLLM, neither trained nor saved.
        self.register_buffer("embed_weight", torch.empty(0, cfg.hidden_size), persistent=False)
        self.rotary_emb = LlamaRotaryEmbedding(LlamaConfig(
            hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
            rope_parameters=dict(cfg.rope_parameters), max_position_embeddings=cfg.max_position_embeddings))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=cfg.initializer_range)

    def set_target(self, embed_weight, d2t, t2d, lm_head_weight=None, norm_weight=None):
        """Install the target's embedding (the mask embedding starts as its row of the mask token) and the
        vocabulary maps; optionally start the head from the target's (its draft-vocabulary rows, its norm)."""
        with torch.no_grad():
            self.embed_weight = embed_weight.detach().to(self.embed_weight.device).clone()
            self.mask_embedding.copy_(embed_weight[self.config.mask_token_id])
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)
            if lm_head_weight is not None:
                self.lm_head.weight.copy_(lm_head_weight[self.draft_ids()])
            if norm_weight is not None:
                self.norm.weight.copy_(norm_weight)

    def draft_ids(self):
        """Target id of every draft id."""
        return draft_to_target_ids(self.d2t)

    def embed(self, ids):
        """The slots' inputs: the target's embedding, ``mask_embedding`` where the id is the mask token."""
        if self.embed_weight.shape[0] == 0:
            raise ValueError("DFlashDraft has no target embedding: call set_target")
        x = F.embedding(ids, self.embed_weight).to(self.fc.weight.dtype)
        return torch.where((ids == self.config.mask_token_id).unsqueeze(-1), self.mask_embedding.to(x.dtype), x)

    def context(self, aux_hidden):
        """``hidden_norm(fc(aux_hidden))``: the context states [B, T, H] of the target's [B, T, n_aux·Ht]."""
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def forward(self, ctx, ids, positions, seen):
        """The normed outputs [B, N·S, H] of blocks ``ids`` at ``positions`` [B, N, S] (``block_inputs``) over
        the context states ``ctx`` [B, T, H] (``context``), block n seeing context position p where ``seen``."""
        B, N, S = ids.shape
        x = self.embed(ids.reshape(B, N * S))
        rope_slots = self.rotary_emb(x, positions.reshape(B, N * S))
        rope_ctx = self.rotary_emb(ctx, torch.arange(ctx.shape[1], device=ctx.device).unsqueeze(0))
        for layer in self.layers:
            x = layer(x, ctx, rope_slots, rope_ctx, seen, S)
        return self.norm(x)

    def loss(self, input_ids, aux_hidden, target_next, loss_mask, anchors, valid, gamma):
        """Cross-entropy of the blocks at ``anchors`` [B, N] (``valid``) against the target's greedy tokens
        (``target_next`` [B, T], target ids), slot i weighted exp(-(i-1)/gamma) -> ``(loss, stats)``: loss =
        sum_i w_i * mean CE_i; stats [S-1, 4] per scored slot: CE sum, rows in the draft vocabulary, top-1
        hits, scored rows (``metrics.Metrics``' columns, as the EAGLE TTT steps')."""
        S, T = self.config.block_size, input_ids.shape[1]
        ids, positions, seen = block_inputs(input_ids, anchors, S, self.config.mask_token_id)
        normed = self(self.context(aux_hidden), ids, positions, seen).view(*ids.shape, -1)
        at = positions.clamp(max=T - 1)
        scored = valid.unsqueeze(-1) & (positions < T) & loss_mask.gather(1, at.flatten(1)).view_as(at)
        # a slot is scored only while the block is still in the anchor's answer: past the first unscored
        # position (a later turn's user or tool tokens, padding) the block would draft text it never saw
        scored = scored.int().cumprod(-1).bool()
        scored[..., 0] = False  # the anchor is given, not drafted
        label = target_next.long().gather(1, (at - 1).clamp(min=0).flatten(1)).view_as(at)[scored]
        slot = torch.arange(S, device=ids.device).expand_as(at)[scored] - 1  # 0 .. S-2
        logits = self.lm_head(normed[scored]).float()
        to_draft = torch.full((self.config.target_vocab_size,), -1, dtype=torch.int64, device=ids.device)
        to_draft[self.draft_ids()] = torch.arange(self.config.draft_vocab_size, device=ids.device)
        in_draft = self.t2d[label]
        ce = F.cross_entropy(logits, to_draft[label].clamp(min=0), reduction="none") * in_draft
        hits = (self.draft_ids()[logits.argmax(-1)] == label).float()

        def per_slot(values):
            return torch.zeros(S - 1, device=ids.device).index_add(0, slot, values.float())

        stats = torch.stack([per_slot(ce), per_slot(in_draft), per_slot(hits), per_slot(torch.ones_like(ce))], 1)
        weights = torch.exp(-torch.arange(S - 1, device=ids.device) / gamma)
        return (weights * stats[:, 0] / stats[:, 1].clamp(min=1)).sum(), stats.detach()

    @torch.no_grad()
    def propose(self, input_ids, aux_hidden, k, chunk=256):
        """What vLLM's DFlash proposer drafts at every position of one sequence with ``k`` speculative tokens:
        target ids [T, k]. ``input_ids`` [T] int64, ``aux_hidden`` [T, n_aux·Ht] the target's states at the
        draft's layers. Row t is the block drafted once the target has verified tokens 0..t and sampled token
        t+1: the anchor t+1 and k masks, over the context 0..t (the same rows as ``Eagle3Draft.propose``). The
        last row, which has no token t+1, is -1. ``chunk`` anchors run at once."""
        T, dev = input_ids.shape[0], self.fc.weight.device
        ids_all, ctx = input_ids.to(dev).unsqueeze(0), self.context(aux_hidden.to(dev).unsqueeze(0))
        out = torch.full((T, k), -1, dtype=torch.int64)
        for s in range(1, T, chunk):
            anchors = torch.arange(s, min(T, s + chunk), device=dev).unsqueeze(0)
            ids, positions, seen = block_inputs(ids_all, anchors, k + 1, self.config.mask_token_id)
            normed = self(ctx, ids, positions, seen).view(*ids.shape, -1)[0, :, 1:]  # [n, k, H]
            out[s - 1 : s - 1 + anchors.shape[1]] = self.draft_ids()[self.lm_head(normed).argmax(-1)].cpu()
        return out


def loss_weight_decay(gamma: float) -> float:
    """The ratio of consecutive slots' loss weights: ``metrics.Metrics`` weighs its columns by its powers."""
    return math.exp(-1 / gamma)
