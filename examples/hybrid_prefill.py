"""A minimal batched-prefill runtime for Qwen3-Next and Qwen3.5 hybrid models, on q12drv.

It takes a transformers ``Qwen3NextForCausalLM`` or ``Qwen3_5ForCausalLM`` (Gated DeltaNet layers with their short
convolution, gated full-attention layers with partial rotary and per-head q/k norms, GQA; MoE or dense MLPs) and runs
N prompts as one batch, chunk by chunk: each call of :meth:`HybridRuntime.step` is one pass over the layers for a set
of chunks, each continuing its stream from the KV cache and the convolution and SSM states the earlier chunks left (a
chunk of one token is a decode step; prefill chunks and decode tokens mix in one pass).

The two models differ in two places, both kept in :data:`FAMILIES`: the Gated DeltaNet's input projections
(Qwen3-Next fuses q, k, v, z and b, a into two projections grouped per key head; Qwen3.5 has four plain ones) and
the rotation (Qwen3-Next: plain RoPE at the token's position; Qwen3.5: MRoPE with interleaved T/H/W sections, which
for text, where transformers gives T = H = W = the token's position, rotates exactly as plain RoPE does;
:meth:`HybridRuntime.step` takes other T/H/W positions, such as a vision block's, per chunk).

The division of work is the one q12drv is for:

* torch, with the model's own modules and weights: embeddings, norms, projections, gates, MLP / MoE, the LM head
  (everything that works token by token);
* q12drv: the pass's metadata (one staging for all layers), RoPE / MRoPE at each stream's positions, the paged
  KV-cache write, paged attention, the short convolution and Gated DeltaNet over per-stream states (everything that
  crosses tokens or streams), on torch's current stream, with torch tensors as arguments.

On a machine without a GPU the same code runs on CPU tensors and q12drv's emulated driver.

Run it::

    PYTHONPATH=. python3 examples/hybrid_prefill.py                  # a small random Qwen3-Next, 4 prompts, 2 chunks
    PYTHONPATH=. python3 examples/hybrid_prefill.py --model qwen3_5  # the same with a small random Qwen3.5
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

import q12drv

__all__ = ["FAMILIES", "Family", "HybridRuntime", "StreamState", "family_of", "tiny_config", "tiny_model"]


def _fused_projections(g_mod, x: torch.Tensor) -> tuple:
    """Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba``, grouped per key head, ungrouped by the module's own
    ``fix_query_key_value_ordering``."""
    t = x.shape[0]
    q, k, v, z, b, a = g_mod.fix_query_key_value_ordering(g_mod.in_proj_qkvz(x)[None], g_mod.in_proj_ba(x)[None])
    mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
    return mixed, z[0], b[0], a[0]


def _split_projections(g_mod, x: torch.Tensor) -> tuple:
    """Qwen3.5: ``in_proj_qkv`` (already ``[q | k | v]``, the convolution's channel order), ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``."""
    return g_mod.in_proj_qkv(x), g_mod.in_proj_z(x).view(x.shape[0], -1, g_mod.head_v_dim), g_mod.in_proj_b(x), \
        g_mod.in_proj_a(x)


@dataclass(frozen=True)
class Family:
    """What differs between the models the runtime serves; everything else is one code path.

    Parameters
    ----------
    model_type : str
        The text config's ``model_type``.
    causal_lm, config : str
        transformers' text-only causal-LM class and its config class.
    gdn_projections : callable
        ``(linear_attn module, x [T, hidden]) -> (mixed [T, 2 Hk dk + Hv dv] as q | k | v, z [T, Hv, dv],
        b [T, Hv], a [T, Hv])``.
    mrope_mode : int
        The rotary embedding the model computes: ``q12drv.MROPE_OFF`` (RoPE at the token's position) or
        ``q12drv.MROPE_INTERLEAVED`` (MRoPE, the T/H/W sections its rotary embedding's ``mrope_section`` names).
    """

    model_type: str
    causal_lm: str
    config: str
    gdn_projections: Callable
    mrope_mode: int


#: The models the runtime serves, by the name :func:`tiny_model` and the demo take.
FAMILIES = {
    "qwen3_next": Family("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig", _fused_projections, q12drv.MROPE_OFF),
    "qwen3_5": Family("qwen3_5_text", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", _split_projections,
                      q12drv.MROPE_INTERLEAVED),
}


def family_of(config) -> Family:
    """The :class:`Family` of a model's config (by ``config.model_type``)."""
    for f in FAMILIES.values():
        if f.model_type == config.model_type:
            return f
    raise ValueError(f"the runtime serves {sorted(f.causal_lm for f in FAMILIES.values())}; this model's config is "
                     f"{config.model_type!r}")


@dataclass
class StreamState:
    """One prompt's place in the runtime: its slot (the row of every per-stream table), the tokens in its cache, its
    physical KV blocks."""

    slot: int
    cached: int = 0
    blocks: list = field(default_factory=list)


class HybridRuntime:
    """Batched chunked prefill of a Qwen3-Next or Qwen3.5 model: torch for the token-wise work, q12drv for the rest.

    Parameters
    ----------
    model : transformers.Qwen3NextForCausalLM or transformers.Qwen3_5ForCausalLM
        In bf16, on a CUDA device (or the CPU, with q12drv's emulated driver); :data:`FAMILIES` lists what the
        runtime serves.
    max_streams : int
        Streams the runtime holds at once (rows of its state tables).
    max_tokens : int
        Tokens one stream may reach (sizes its block table).
    max_pass_tokens : int
        Tokens one pass may carry (sizes the arena).
    block_size : int
        Tokens per KV-cache block.
    """

    def __init__(self, model, *, max_streams: int = 8, max_tokens: int = 4096, max_pass_tokens: int = 16384,
                 block_size: int = 16):
        cfg = model.config
        self.model, self.cfg, self.family = model, cfg, family_of(cfg)
        self.use_mrope = self.family.mrope_mode != q12drv.MROPE_OFF
        self.tdev = next(model.parameters()).device
        # q12drv on the same device and (on a GPU) the same primary context and stream as torch
        self.dev = q12drv.open_device("cuda" if self.tdev.type == "cuda" else "emu",
                                      self.tdev.index or 0 if self.tdev.type == "cuda" else 0)
        self.block_size = block_size
        self.max_streams, self.max_blocks = max_streams, -(-max_tokens // block_size)
        hd = cfg.head_dim
        rd = int(hd * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
        # the model's own frequencies, exactly, and under MRoPE the sections its rotary embedding uses
        sections = tuple(model.model.rotary_emb.mrope_section) if self.use_mrope else (0, 0, 0)
        self.attn_shape = q12drv.AttentionShape(
            cfg.num_attention_heads, cfg.num_key_value_heads, hd, rd, mrope_mode=self.family.mrope_mode,
            mrope_section=sections, rope_scaling=q12drv.RopeScaling.from_transformers(cfg))
        self.gdn_shape = q12drv.GdnShape(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                         cfg.linear_key_head_dim)
        self.conv_width = cfg.linear_conv_kernel_dim
        self.conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        bf16, f32 = dict(dtype=torch.bfloat16, device=self.tdev), dict(dtype=torch.float32, device=self.tdev)
        # the paged KV cache: block 0 is the dummy block (writes of missing positions land there)
        num_blocks = 1 + max_streams * self.max_blocks
        self.free_blocks = list(range(num_blocks - 1, 0, -1))
        self.layers = []
        for i, layer in enumerate(model.model.layers):
            if cfg.layer_types[i] == "full_attention":
                kv = (num_blocks, block_size, cfg.num_key_value_heads, hd)
                self.layers.append(("attention", layer, torch.zeros(kv, **bf16), torch.zeros(kv, **bf16)))
            else:
                conv = torch.zeros(max_streams, self.conv_width - 1, self.conv_dim, **bf16)
                ssm = torch.zeros(max_streams, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim, **f32)
                weight = layer.linear_attn.conv1d.weight.detach()[:, 0, :].contiguous()  # [C, W]
                self.layers.append(("gdn", layer, conv, ssm, weight))
        # per-stream block tables (the device copy attention reads; the host copy the stager validates); no seq_len
        # words: no q12drv kernel reads them (StreamStageInfo.seq_len_dev stays NULL)
        self.tables = torch.zeros(max_streams, self.max_blocks, dtype=torch.int32, device=self.tdev)
        self.host_tables = np.zeros((max_streams, self.max_blocks), np.int32)
        # any pass of at most max_streams streams and max_pass_tokens tokens, and its state-pointer tables: a conv
        # and an SSM table for every GDN layer, staged once a pass (Q12Pass.stage_states)
        gdn_layers = sum(e[0] == "gdn" for e in self.layers)
        self.arena = q12drv.ScratchArena(self.dev, q12drv.Q12Pass.max_arena_bytes(
            max_streams, max_pass_tokens, use_mrope=self.use_mrope, state_rows=2 * gdn_layers, max_chunk=max_tokens))
        self.workspace = torch.empty(0, dtype=torch.uint8, device=self.tdev)
        self.free_slots = list(range(max_streams - 1, -1, -1))

    # streams ---------------------------------------------------------------------------------------------
    def add_stream(self) -> StreamState:
        """A new, empty stream (its states zeroed)."""
        if not self.free_slots:
            raise RuntimeError(f"the runtime holds {self.max_streams} streams at most")
        s = StreamState(self.free_slots.pop())
        for entry in self.layers:
            if entry[0] == "gdn":
                entry[2][s.slot].zero_()
                entry[3][s.slot].zero_()
        return s

    def release_stream(self, s: StreamState) -> None:
        """Give ``s``'s slot and KV blocks back (the stream is done)."""
        self.free_blocks += reversed(s.blocks)
        s.blocks = []
        self.host_tables[s.slot] = 0
        self.free_slots.append(s.slot)

    def _grow(self, s: StreamState, kv_len: int) -> None:
        need = -(-kv_len // self.block_size)
        if need > self.max_blocks:
            raise ValueError(f"stream {s.slot} would reach {kv_len} tokens; the runtime holds "
                             f"{self.max_blocks * self.block_size}")
        while len(s.blocks) < need:
            s.blocks.append(self.free_blocks.pop())
        self.host_tables[s.slot, :need] = s.blocks
        self.tables[s.slot, :need] = torch.tensor(s.blocks, dtype=torch.int32).to(self.tdev)

    # one pass ---------------------------------------------------------------------------------------------
    def stage(self, chunks: list[tuple[StreamState, list[int]]], *, mode: str = "auto",
              positions: list | None = None) -> q12drv.Q12Pass:
        """The pass of :meth:`step` (same arguments) without its layers: each stream's blocks grown to hold its chunk
        and the metadata staged once for all layers. Single ops (``Q12Pass.rope``, ...) may run over it; the streams'
        ``cached`` counts stay where they were."""
        if len({s.slot for s, _ in chunks}) != len(chunks):
            raise ValueError("one chunk per stream in a pass")
        positions = self._check_positions(chunks, positions)
        infos = []
        for (s, tokens), rows in zip(chunks, positions):
            if not tokens:
                raise ValueError(f"stream {s.slot}: a chunk needs at least one token")
            self._grow(s, s.cached + len(tokens))
            infos.append(q12drv.StreamStageInfo(
                proc_start=s.cached, proc_count=len(tokens), block_table=self.host_tables[s.slot],
                block_table_dev=self.dev.pointer(self.tables[s.slot], "block table", dtype="i32"),
                mrope_positions=rows))
        stream = torch.cuda.current_stream() if self.tdev.type == "cuda" else None
        return q12drv.Q12Pass(self.arena, infos, block_size=self.block_size, use_mrope=self.use_mrope,
                              dummy_kv_block=0, head_dim=self.cfg.head_dim, mode=mode, stream=stream)

    @torch.no_grad()
    def step(self, chunks: list[tuple[StreamState, list[int]]], *, mode: str = "auto",
             positions: list | None = None) -> list[torch.Tensor]:
        """Run one pass over the layers for ``chunks`` (``(stream, new token ids)``, at most one chunk a stream);
        return each chunk's logits ``[len(tokens), vocab]``.

        ``mode``: ``Q12Pass``'s (``"per_stream"`` forces the per-stream path: the same bits).

        ``positions`` (MRoPE models only): one entry per chunk, ``None`` or the chunk's ``[3, len(tokens)]`` T/H/W
        rotary positions (transformers' 3-row ``position_ids[:, 0]``). A chunk without them rotates at its tokens'
        own positions on all three rows, which is what transformers uses for text. Only the rotation reads them:
        the KV cache and attention's causal order follow the tokens' places in the stream.
        """
        step = self.stage(chunks, mode=mode, positions=positions)
        ids = torch.tensor([t for _, tokens in chunks for t in tokens], dtype=torch.long, device=self.tdev)
        h = self.model.model.embed_tokens(ids)  # [T, hidden]
        slots = [s.slot for s, _ in chunks]
        # every GDN layer's per-stream conv and SSM states, one table each, staged with one copy for the pass
        rows = iter(step.stage_states([[states[i] for i in slots] for e in self.layers if e[0] == "gdn"
                                       for states in (e[2], e[3])]))
        for entry in self.layers:
            layer = entry[1]
            x = layer.input_layernorm(h)
            mix = self._attention(step, x, entry) if entry[0] == "attention" else \
                self._gdn(step, x, entry, next(rows), next(rows))
            h = h + mix
            h = h + layer.mlp(layer.post_attention_layernorm(h)[None])[0]
        logits = self.model.lm_head(self.model.model.norm(h))
        for s, tokens in chunks:
            s.cached += len(tokens)
        return list(torch.split(logits, [len(t) for _, t in chunks]))

    def _check_positions(self, chunks, positions) -> list:
        """Each chunk's T/H/W rows as an int64 array (or None), checked before anything is allocated."""
        if positions is None:
            return [None] * len(chunks)
        if not self.use_mrope:
            raise ValueError(f"positions are for MRoPE models; {self.family.causal_lm} rotates at the token positions")
        if len(positions) != len(chunks):
            raise ValueError(f"{len(positions)} positions entries for {len(chunks)} chunks: give one per chunk "
                             f"(or None)")
        rows = [None if p is None else np.asarray(torch.as_tensor(p).cpu(), np.int64) for p in positions]
        for (s, tokens), r in zip(chunks, rows):
            if r is not None and r.shape != (3, len(tokens)):
                raise ValueError(f"stream {s.slot}: positions of shape {r.shape} for a chunk of {len(tokens)} tokens; "
                                 f"give [3, {len(tokens)}] (T, H, W)")
        return rows

    def _attention(self, step, x, entry) -> torch.Tensor:
        _, layer, k_pool, v_pool = entry
        a, t = layer.self_attn, x.shape[0]
        hq, hkv, hd = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        q, gate = torch.chunk(a.q_proj(x).view(t, hq, 2 * hd), 2, dim=-1)
        q = a.q_norm(q).contiguous()
        k = a.k_norm(a.k_proj(x).view(t, hkv, hd)).contiguous()
        v = a.v_proj(x).view(t, hkv, hd)
        o = torch.empty_like(q)
        # RoPE, KV write, paged attention; given a workspace, a decode step of few long streams runs the split-KV
        # decode kernel (0 bytes: a prefill kernel is the faster one for this pass)
        need = step.attention_workspace_bytes(self.attn_shape)
        step.attention_layer(q, k, v, k_pool, v_pool, o, self.attn_shape,
                             workspace=self._scratch(need) if need else None)
        return a.o_proj(o.reshape(t, hq * hd) * torch.sigmoid(gate.reshape(t, hq * hd)))

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """The layers' workspace (GDN's, the decode attention's), grown to ``nbytes``: the layers run one after the
        other on the pass's stream, so one buffer serves them all."""
        if nbytes > self.workspace.numel():
            self.workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.tdev)
        return self.workspace

    def _gdn(self, step, x, entry, conv_row, ssm_row) -> torch.Tensor:
        _, layer, _, _, weight = entry
        g_mod, t = layer.linear_attn, x.shape[0]
        cfg = self.cfg
        hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
            cfg.linear_value_head_dim
        mixed, z, b, a = self.family.gdn_projections(g_mod, x)  # [T, C] as q | k | v; z [T, Hv, dv]; b, a [T, Hv]
        conv_out = torch.empty_like(mixed)
        step.conv1d(conv_row, mixed, conv_out, weight)  # per-stream states (staged rows), in place
        kd = hk * dk
        q = conv_out[:, :kd].reshape(t, hk, dk).contiguous()
        k = conv_out[:, kd:2 * kd].reshape(t, hk, dk).contiguous()
        v = conv_out[:, 2 * kd:].reshape(t, hv, dv).contiguous()
        beta = b.float().sigmoid().contiguous()
        g = (-g_mod.A_log.float().exp() * F.softplus(a.float() + g_mod.dt_bias)).contiguous()
        o = torch.empty_like(v)
        gdn_config = q12drv.GdnConfig()
        need = step.gdn_workspace_bytes(self.gdn_shape, gdn_config)
        step.gdn_layer(ssm_row, q12drv.GdnTensors(q, k, v, g, beta, o), self.gdn_shape,
                       config=gdn_config, workspace=self._scratch(need) if need else None)
        core = g_mod.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(t, hv * dv)
        return g_mod.out_proj(core)


def tiny_config(model: str = "qwen3_next", **overrides):
    """A small config of ``model`` (a :data:`FAMILIES` name) at the real models' per-head shapes (GDN dk = dv = 128
    with Hv = 2 Hk; attention head dim 256, rotary dim 64, GQA 8:1), 4 layers in the 3:1 linear / full pattern,
    dense MLPs; Qwen3.5's with the real models' MRoPE sections, ``[11, 11, 10]`` interleaved."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    kw = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=1, head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
              max_position_embeddings=8192, rope_parameters=rope, attn_implementation="eager")
    if model == "qwen3_next":
        kw["mlp_only_layers"] = list(range(4))  # dense MLPs
    else:
        rope.update(mrope_section=[11, 11, 10], mrope_interleaved=True)
    kw.update(overrides)
    return getattr(transformers, FAMILIES[model].config)(**kw)


def tiny_model(model: str = "qwen3_next", device: str = "cpu", **overrides):
    """:func:`tiny_config`'s model with random weights (from torch's current seed), on ``device``, built in bf16 the
    way ``from_pretrained(..., dtype=torch.bfloat16)`` builds a checkpoint's: bf16 weights, the rotary embedding's
    frequencies in fp32 (``model.to(torch.bfloat16)`` would round those to bf16 as well, which no loaded model does:
    at position 2048 that moves the angles by up to 4 radians)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model, **overrides)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(device).eval()


def _demo(argv: list | None = None) -> None:
    parser = argparse.ArgumentParser(description="A small random hybrid model: 4 prompts batched in 2 chunks each, "
                                                 "compared with transformers' forward per prompt.")
    parser.add_argument("--model", choices=sorted(FAMILIES), default="qwen3_next",
                        help="qwen3_next: Qwen3NextForCausalLM (plain RoPE, fused GDN projections); qwen3_5: "
                             "Qwen3_5ForCausalLM, the Qwen3.5 text model (interleaved MRoPE, split GDN projections); "
                             "default %(default)s")
    name = parser.parse_args(argv).model
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model(name, device)
    rt = HybridRuntime(model, max_streams=4, max_tokens=256, max_pass_tokens=512)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (5, 40, 1, 17)]
    streams = [rt.add_stream() for _ in prompts]
    halves = [(p[:len(p) // 2 or 1], p[len(p) // 2 or 1:]) for p in prompts]
    out = [[] for _ in prompts]
    for part in (0, 1):
        chunks = [(s, h[part]) for s, h in zip(streams, halves) if h[part]]
        for (s, _), logits in zip(chunks, rt.step(chunks)):
            out[streams.index(s)].append(logits)
    for i, (p, parts) in enumerate(zip(prompts, out)):
        ours = torch.cat(parts).float()
        ref = model(torch.tensor([p], device=device)).logits[0].float()
        err = ((ours - ref).norm() / ref.norm()).item()
        print(f"prompt {i}: {len(p)} tokens in {len(parts)} chunk(s), relative L2 against transformers {err:.2e}")


if __name__ == "__main__":
    _demo()
