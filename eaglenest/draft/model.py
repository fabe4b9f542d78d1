"""The EAGLE-3 (and EAGLE-3.1) draft model, in one file, with its training-time-test (TTT) forward and loss.

Module and parameter names are vLLM's tensor names (``midlayer.self_attn.q_proj.weight``,
``fc.weight``, ``fc_norm.{i}.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``), so
``state_dict()`` is the exported checkpoint as is. The layer follows vLLM 0.32's ``llama_eagle3.py``:

    h     = fc(aux_0 ‖ aux_1 ‖ aux_2)                  fused target features [.., H]  (step 0)
    h     = fc(fc_norm.0(aux_0) ‖ fc_norm.1(aux_1) ‖ fc_norm.2(aux_2))     instead, if fc_norm
            (with norm_before_fc, aux_0 ‖ aux_1 ‖ aux_2 first goes through one input_norm over all 3·Ht)
    e     = input_layernorm(embed(token))              the target's frozen embedding
    r     = h;  h = hidden_norm(h)                     (norm first, r = normed h, if norm_before_residual)
    r     = self_attn(e ‖ h) + r                       q/k/v take 2·H inputs, embedding first
    out   = mlp(post_attention_layernorm(r)) + r       the pre-norm sum
    logits = lm_head(norm(out))                        over the draft vocabulary
    next  = norm(out) if norm_output else out          the hidden of the next draft step

The first ``h`` is vLLM's ``combine_hidden_states`` (each fc_norm.i an RMSNorm over one aux
layer's H_t-wide chunk, ``Eagle3Draft.combine``); ``next`` is the ``aux_output`` vLLM's
``LlamaModel.forward`` returns and its proposer feeds back. EAGLE-3.1 (``config.KINDS``) is
fc_norm and norm_output both on.

Alignment (vLLM's proposer: ``v1/spec_decode/llm_base_proposer.py`` to 0.33,
``v1/worker/gpu/spec_decode/eagle/`` in 0.34): at target position t the draft gets the target's features at t and the token at t+1, runs at rope position t, and predicts token t+2, i.e.
what the target predicts at t+1. Draft step j (j = 0 .. ttt_length-1) at base position t gets the
token at t+1+j, the previous step's ``next`` at t (the fused target features when j = 0) and rope
position t+j (vLLM advances the position one per draft step); it attends to step 0's keys at
positions <= t and to its own chain's keys at t from steps 1..j, exactly the keys vLLM's KV cache
holds when it drafts that token, and to nothing later.

P-EAGLE (``parallel_drafting``, ``config.KINDS["peagle"]``) keeps that layout and drops the chain's
dependence: position j >= 1 at base t reads the mask token's embedding (``mask_token_id``, the target's
row) and ``h = fc(mask_hidden)`` (a learned [1, n_aux·Ht] stand-in for the aux states, through
``combine`` like them) at rope position t+j, instead of the token at t+1+j and step j-1's output. So
all positions run in one forward (``_parallel``), as vLLM's proposer runs them
(``v1/spec_decode/llm_base_proposer.py``, ``set_inputs_first_pass``: the bonus token at t, then k-1
slots of ``parallel_drafting_token_id`` with ``combine_hidden_states(mask_hidden)``, positions t+1..,
one causal pass over the KV cache).
"""


import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import DraftConfig
from .fp8 import weight_casts
from .layers import DecoderLayer, RMSNorm, project
from .losses import COD_FLOOR, COD_RATIO, ttt_loss, ttt_loss_fused
from .runtime import Runtime
from .ttt import (GatherRows, StepGrads, StepWeights, causal_block_mask, mark_chains_dynamic, parallel_block_mask,
                  parallel_mask, parallel_positions, token_embeds_ids, ttt_block_masks, ttt_chains, ttt_mask)
from .vllm_format import draft_to_target_ids


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, runtime: Runtime = Runtime()):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = cfg
        self.runtime = runtime  # how the TTT runs (``Runtime``): read at each forward
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.num_aux_layers * cfg.target_hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:  # ones, like every RMSNorm here: at initialisation a plain RMS normalisation
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux_layers))
        self.fc = nn.Linear(cfg.num_aux_layers * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        if cfg.parallel_drafting:
            # vLLM's buffer of this name is [1, n_aux·Ht] (llama_eagle3.py); speculators starts it at randn
            self.mask_hidden = nn.Parameter(torch.randn(1, cfg.num_aux_layers * cfg.target_hidden_size))
            # the target's embedding of mask_token_id, frozen and not saved like the table (set_target)
            self.register_buffer("mask_embed", torch.empty(0, cfg.hidden_size), persistent=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(cfg.target_vocab_size) < cfg.draft_vocab_size)  # matches d2t = 0
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

    def set_target(self, embed_weight, d2t, t2d, lm_head_weight=None, norm_weight=None, keep_embedding=True):
        """Install the target's embedding and the vocabulary maps; optionally start the head from the
        target's (its lm_head rows of the draft vocabulary, its final norm). ``keep_embedding`` False:
        only the mask token's row is kept (P-EAGLE), the caller looks the tokens' embeddings up itself
        (train.py does, on the host) and passes them as ``embeds``."""
        with torch.no_grad():
            self.set_embedding(embed_weight, keep_embedding)
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)
            if lm_head_weight is not None:
                self.lm_head.weight.copy_(lm_head_weight[self.draft_ids()])
            if norm_weight is not None:
                self.norm.weight.copy_(norm_weight)

    def set_embedding(self, embed_weight, keep=True):
        """The target's token embedding [V, H] (kept only where ``keep``), and a P-EAGLE draft's mask
        token row of it."""
        with torch.no_grad():
            if self.config.parallel_drafting:
                self.mask_embed = embed_weight[self.config.mask_token_id : self.config.mask_token_id + 1].detach().to(
                    self.mask_embed.device).clone()
            table = embed_weight if keep else embed_weight[:0]
            self.embed_weight = table.detach().to(self.embed_weight.device).clone()

    def step_mask(self, T, step, device):
        return ttt_mask(T, step, device)

    def draft_ids(self):
        """Target id of every draft id."""
        return draft_to_target_ids(self.d2t)

    def combine(self, aux_hidden):
        """The fused target features [.., H] of ``aux_hidden`` [.., n_aux·Ht] (vLLM's
        ``combine_hidden_states``): with ``norm_before_fc``, the whole input through ``input_norm`` first; with
        ``fc_norm``, then each aux layer's chunk through its own RMSNorm."""
        if self.config.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        if self.config.fc_norm:
            chunks = aux_hidden.chunk(self.config.num_aux_layers, dim=-1)
            aux_hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks)], dim=-1)
        return project(aux_hidden, self.fc)[0]

    def fed_forward(self, out, normed):
        """The hidden the next draft step gets from a step's pre-norm ``out`` and its ``normed`` output."""
        return normed if self.config.norm_output else out

    def forward(self, input_ids, aux_hidden, targets=None, ttt_length=7, decay=0.8, chunk=4096, embeds=None):
        """Training-time test over ``input_ids`` [B, T] and the target's ``aux_hidden`` [B, T, 3·Ht].

        Without ``targets``: the normed output of every step, a list of ``ttt_length`` [B, T, H].
        With ``targets`` (see ``ttt_loss``): ``(loss, stats)``, step j weighing ``decay``**j (a P-EAGLE
        draft's position j: the recipe's max(0.7**j, 0.2), ``losses.COD_RATIO``). ``embeds``
        [B, T+ttt_length-1, H]: the target's embeddings of ``token_embeds_ids(input_ids, ttt_length)``,
        when the caller looks them up itself (train.py does, on the host, so the table stays off the GPU).
        """
        if embeds is None:
            if self.embed_weight.shape[0] == 0:
                raise ValueError("Eagle3Draft has no target embedding: call set_target or pass embeds")
            embeds = F.embedding(token_embeds_ids(input_ids, ttt_length), self.embed_weight)
        floor = 0.0
        if self.config.parallel_drafting:
            outs = self._parallel(input_ids, aux_hidden, ttt_length, embeds)
            decay, floor = COD_RATIO, COD_FLOOR  # the P-EAGLE recipe's weights max(0.7**j, 0.2), not decay**j
        elif self.runtime.attention == "flex":
            chains = None
            if self.runtime.runs_chains and targets is not None and ttt_length > 1:
                plan = targets.get("plan") or {}
                B, T = input_ids.shape
                chains = plan["chains"] if "chains" in plan else ttt_chains(targets["rows"], T, ttt_length, B * T)
            outs = self._ttt_flex(input_ids, aux_hidden, ttt_length, embeds, chains)
        else:
            outs = self._ttt_dense(input_ids, aux_hidden, ttt_length, embeds)
        if targets is None:
            return outs
        if self.runtime.fused_loss:
            return ttt_loss_fused(outs, self.lm_head.weight, self.draft_ids(), targets, decay, chunk, compiled=self.runtime.compiled,
                                  fp8=getattr(self.lm_head, "fp8", False), floor=floor)
        return ttt_loss(outs, self.lm_head.weight, self.draft_ids(), targets, decay, chunk, floor)

    def masked_inputs(self, B, n, dtype):
        """What a P-EAGLE draft's positions not yet drafted read, for ``n`` positions of each of ``B``
        rows: the mask token's embedding and the fused ``mask_hidden``, each [B, n, H]."""
        if self.mask_embed.shape[0] == 0:
            raise ValueError("Eagle3Draft (P-EAGLE) has no mask token embedding: call set_target")
        fused = self.combine(self.mask_hidden.to(dtype))  # [1, H]
        return self.mask_embed.to(self.fc.weight.dtype).expand(B, n, -1), fused.expand(B, n, -1)

    def _parallel(self, input_ids, aux_hidden, ttt_length, embeds_all):
        """P-EAGLE: the ``ttt_length`` positions of every base position t in ONE layer call over
        [B, J·T] (position j of base t at column j·T + t): position 0 is the TTT's step 0 (the token at
        t+1 from ``embeds_all``, the fused target features at t, rope position t); position j >= 1 reads
        ``masked_inputs`` at rope position t+j. Each attends to position 0's keys at bases <= t and to its
        own chain's positions 1..j (``parallel_mask``: the TTT's keys, all steps at once). -> the J
        positions' normed outputs, each [B, T, H], as ``_ttt_dense`` returns steps.

        Off the flex path the same outputs come from ``_ttt_dense`` step by step (its later steps fed
        ``masked_inputs``), whose dense masks are J times smaller than [J·T, J·T]."""
        if self.runtime.attention != "flex":
            return self._ttt_dense(input_ids, aux_hidden, ttt_length, embeds_all)
        B, T = input_ids.shape
        mask_embeds, mask_hidden = self.masked_inputs(B, (ttt_length - 1) * T, aux_hidden.dtype)
        embeds = torch.cat([embeds_all[:, :T].to(self.fc.weight.dtype), mask_embeds], dim=1)
        hidden = torch.cat([self.combine(aux_hidden), mask_hidden], dim=1)
        cos, sin = self.rotary_emb(hidden, parallel_positions(T, ttt_length, input_ids.device).unsqueeze(0))
        if input_ids.device.type == "cuda":
            mask = parallel_block_mask(T, ttt_length, str(input_ids.device))
        else:  # CPU (tests), where flex attention has no backward: the same pattern, dense
            mask = parallel_mask(T, ttt_length, input_ids.device)
        layer = functools.partial(self.midlayer, past_kv=(), mask=mask)
        if self.runtime.recompute and torch.is_grad_enabled():
            out, _ = checkpoint(layer, embeds, hidden, cos, sin, use_reentrant=False)
        else:
            out, _ = layer(embeds, hidden, cos, sin)
        return list(self.norm(out).split(T, dim=1))

    def _ttt_dense(self, input_ids, aux_hidden, ttt_length, embeds_all):
        B, T = input_ids.shape
        hidden = self.combine(aux_hidden)
        base = torch.arange(T, device=input_ids.device)
        masked = self.masked_inputs(B, T, aux_hidden.dtype) if self.config.parallel_drafting else None
        past, outs = [], []
        for j in range(ttt_length):
            embeds = embeds_all[:, j : j + T]  # tokens t+1+j
            if masked and j:  # P-EAGLE: the mask's inputs in place of the chain's token and state
                embeds, hidden = masked
            hidden, normed = self.step(embeds.to(self.fc.weight.dtype), hidden, base, j, past)
            outs.append(normed)
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
        hidden = self.combine(aux_hidden)
        device = input_ids.device
        valid = [None] * ttt_length
        if self.runtime.diag_split:  # step 0's causal keys through flex, the later steps' on the diagonal
            masks = [causal_block_mask(T, str(device)) if device.type == "cuda" or self.runtime.compiled else ttt_mask(T, 0, device)] * ttt_length
            valid = [torch.arange(1, ttt_length, device=device) <= j for j in range(ttt_length)]
        elif device.type == "cuda" or self.runtime.compiled:
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
        step = self._compiled_step() if self.runtime.compiled else self._flex_step
        shared = self.step_params() if self.runtime.split_step_grads and grad else None
        outs = []
        collect = StepGrads(list(shared.values()), compiled=self.runtime.compiled) if shared else None
        if shared:  # FP8 Linears: their weights cast once for all the steps, handed over like the aliases
            shared = StepWeights(shared, collect, weight_casts(self))
        for j in range(ttt_length if chains is None else 1):
            cos, sin = self.rotary_emb(hidden, (base + j).unsqueeze(0))
            # the step widens the embeddings itself: the slice (a view) is what a recomputed step keeps
            hidden, normed, k_buf, v_buf = step(embeds_all[:, j : j + T], hidden, cos, sin, k_buf, v_buf, base + j * T, masks[j],
                                                shared and shared.weights(), valid[j])
            outs.append(normed)
        if chains is not None:
            outs += self._ttt_chains(hidden, embeds_all, k_buf[:, :, :T], v_buf[:, :, :T], masks[0], chains, ttt_length, shared)
        return outs

    def _ttt_chains(self, hidden, embeds_all, k0, v0, mask, chains, ttt_length, shared):
        """Steps 1..J-1 at the flat positions ``chains`` [N] only, from step 0's fed-forward output
        ``hidden`` [B, T, H] (``fed_forward``) and keys ``k0``, ``v0``; the chains' own keys live in [N, J-1, nKV, hd]
        buffers. Compiled, N is a dynamic dimension: one graph serves every batch of the same [B, T].
        -> the normed outputs of steps 1..J-1, each [B, T, H] (zero off the chains)."""
        B, T, H = hidden.shape
        attn, device, grad = self.midlayer.self_attn, hidden.device, torch.is_grad_enabled()
        pos = chains % T
        e_rows = chains // T * embeds_all.shape[1] + pos  # row of the token step 0 reads, in embeds_all [B·(T+J-1), H]
        flat_embeds = embeds_all.reshape(-1, H)
        h = GatherRows.apply(hidden.reshape(B * T, H), chains)
        kd = torch.zeros(len(chains), ttt_length - 1, attn.n_kv, attn.head_dim, device=device, dtype=k0.dtype, requires_grad=grad)
        vd = torch.zeros_like(kd, requires_grad=grad)
        steps = torch.arange(1, ttt_length, device=device)
        step = self._compiled_chains_step() if self.runtime.compiled else self._chains_step
        outs = []
        for j in range(1, ttt_length):
            cos, sin = self.rotary_emb(h, (pos + j).unsqueeze(0))
            args = (flat_embeds, e_rows + j, h, cos, sin, k0, v0, kd, vd, steps[j - 1 : j] - 1, chains)
            if self.runtime.compiled:
                mark_chains_dynamic(args)
            h, normed, kd, vd = step(*args, mask, shared and shared.weights(), steps <= j)
            outs.append(normed)
        return outs

    def _chains_step(self, flat_embeds, e_index, hidden, cos, sin, k0, v0, kd, vd, slot, chains, block_mask, weights=None,
                     valid=None):
        """One later TTT step at the chains only (``_ttt_chains``) -> (fed-forward output [N, H], normed
        output scattered to [B, T, H], kd, vd)."""

        def body(flat_embeds, e_index, hidden, cos, sin, k0, v0, kd, vd, slot, chains):
            embeds = flat_embeds.index_select(0, e_index).to(self.fc.weight.dtype)
            out, normed, (kd, vd) = self._layer_and_norm(
                weights, (embeds, hidden, cos, sin, (k0, v0, kd, vd), block_mask), {"slot": slot, "valid": valid, "chains": chains})
            B, T = k0.shape[0], k0.shape[2]
            return out, normed.new_zeros(B * T, normed.shape[-1]).index_copy(0, chains, normed).view(B, T, -1), kd, vd

        args = (flat_embeds, e_index, hidden, cos, sin, k0, v0, kd, vd, slot, chains)
        if self.runtime.recompute and torch.is_grad_enabled():
            return checkpoint(body, *args, use_reentrant=False)
        return body(*args)

    def _compiled_chains_step(self):
        # like _compiled_step, but the chains' count N is marked dynamic by the caller
        if getattr(self, "_chains_compiled", None) is None:
            self._chains_compiled = torch.compile(self._chains_step, dynamic=False, fullgraph=True)
        return self._chains_compiled

    def _layer_and_norm(self, weights, args, kwargs):
        """The decoder layer and the final norm -> (the output the next step gets (``fed_forward``), normed
        output, the layer's kv); ``weights``: tensors to use in place of the parameters of the same names
        (``split_step_grads``)."""
        if weights is None:
            out, kv = self.midlayer(*args, **kwargs)
            normed = self.norm(out)
            return self.fed_forward(out, normed), normed, kv
        mid = {n.removeprefix("midlayer."): w for n, w in weights.items() if n.startswith("midlayer.")}
        out, kv = torch.func.functional_call(self.midlayer, mid, args, kwargs)
        norm = {n.removeprefix("norm."): w for n, w in weights.items() if n.startswith("norm.")}
        normed = torch.func.functional_call(self.norm, norm, (out,))
        return self.fed_forward(out, normed), normed, kv

    def step_params(self):
        """The trained parameters every TTT step uses (the decoder layer's and the final norm's), by
        name: what ``split_step_grads`` gives each step an alias of."""
        return {n: p for n, p in self.named_parameters() if n.split(".")[0] in ("midlayer", "norm") and p.requires_grad}

    def _flex_step(self, embeds, hidden, cos, sin, k_buf, v_buf, slot, block_mask, weights=None, valid=None):
        """One fixed-shape TTT step -> (fed-forward output, normed output, k_buf, v_buf). With
        ``recompute`` its activations are recomputed in backward (inside the compiled graph, the
        checkpoint becomes a region the partitioner recomputes). ``weights``: tensors to use in place
        of the parameters of the same names (``split_step_grads``)."""

        def body(embeds, hidden, cos, sin, k_buf, v_buf, slot):
            embeds = embeds.to(self.fc.weight.dtype)
            out, normed, (k_buf, v_buf) = self._layer_and_norm(
                weights, (embeds, hidden, cos, sin, (k_buf, v_buf), block_mask), {"slot": slot, "valid": valid})
            return out, normed, k_buf, v_buf

        if self.runtime.recompute and torch.is_grad_enabled():
            return checkpoint(body, embeds, hidden, cos, sin, k_buf, v_buf, slot, use_reentrant=False)
        return body(embeds, hidden, cos, sin, k_buf, v_buf, slot)

    def _compiled_step(self):
        # fullgraph: a graph break raises instead of silently running part of the step eagerly;
        # dynamic=False: one static graph per batch shape (train.py pads batches to few shapes and
        # sets the recompile limit to their number, failing loudly past it: device.configure_compile).
        if getattr(self, "_step_compiled", None) is None:
            self._step_compiled = torch.compile(self._flex_step, dynamic=False, fullgraph=True)
        return self._step_compiled

    def step(self, embeds, hidden, base, j, past):
        """Draft step ``j`` over [B, T] base positions ``base``: ``embeds`` [B, T, H] the target's
        embeddings of the tokens it reads, ``hidden`` [B, T, H] the previous step's fed-forward output
        (the fused target features at j = 0). Appends this step's (k, v) to ``past``; returns this
        step's fed-forward output (``fed_forward``) and its normed output, each [B, T, H]. Under
        ``recompute`` (training) the layer's activations are recomputed in backward instead of kept."""
        cos, sin = self.rotary_emb(hidden, (base + j).unsqueeze(0))
        layer = functools.partial(self.midlayer, past_kv=tuple(past), mask=self.step_mask(len(base), j, base.device))
        if self.runtime.recompute and torch.is_grad_enabled():
            hidden, kv = checkpoint(layer, embeds, hidden, cos, sin, use_reentrant=False)
        else:
            hidden, kv = layer(embeds, hidden, cos, sin)
        past.append(kv)
        normed = self.norm(hidden)
        return self.fed_forward(hidden, normed), normed

    @torch.no_grad()
    def propose(self, input_ids, aux_hidden, k):
        """What vLLM's EAGLE-3 proposer drafts at every position of one sequence: target ids [T, k].

        ``input_ids`` [T] int64, ``aux_hidden`` [T, 3·Ht] the target's states at the draft's layer ids.
        Row t is the chain drafted after the target has verified tokens 0..t and sampled token t+1
        (a P-EAGLE draft: its k positions of ``_parallel``, one forward, the masked ones in place of the chain):
        step 0 takes the target's fused features at t and token t+1 at position t; step j takes this
        chain's own token of step j-1 and step j-1's fed-forward output at position t+j, attending to step 0's
        keys at positions <= t (vLLM's KV cache, always rebuilt from target features at accepted
        positions) plus its own chain's keys (llm_base_proposer.propose): the training-time test with
        the draft's own tokens in place of the sequence's. The last row, which has no token t+1 to
        start from, is -1.
        """
        T = input_ids.shape[0]
        dev, dtype = self.fc.weight.device, self.fc.weight.dtype
        ids = torch.cat([input_ids[1:], input_ids.new_zeros(1)]).to(dev).unsqueeze(0)  # token t+1 at row t
        draft_to_target = self.draft_ids()
        if self.config.parallel_drafting:  # one forward drafts all k: vLLM's parallel drafting
            outs = self._parallel(ids, aux_hidden.to(dev, dtype).unsqueeze(0), k, F.embedding(ids, self.embed_weight))
            proposals = [draft_to_target[(normed[0] @ self.lm_head.weight.T).argmax(-1)] for normed in outs]
        else:
            hidden = self.combine(aux_hidden.to(dev, dtype)).unsqueeze(0)  # [1, T, H]
            base = torch.arange(T, device=dev)
            past, proposals = [], []
            for j in range(k):
                hidden, normed = self.step(F.embedding(ids, self.embed_weight).to(dtype), hidden, base, j, past)
                ids = draft_to_target[(normed @ self.lm_head.weight.T).argmax(-1)]  # [1, T] target ids
                proposals.append(ids[0])
        out = torch.stack(proposals, dim=1).cpu()
        out[T - 1 :] = -1  # no token t+1 to start from
        return out
