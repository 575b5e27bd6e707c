"""The decoder-only transformer shared by every role and by the generation engine; each layer's feed-forward block is
a SwiGLU MLP or, in a mixture-of-experts model's MoE layers, an ``moe.MoEBlock``.

Plain ``nn.Module``s with Hugging Face parameter names (``model.layers.3.self_attn.q_proj.weight``), so safetensors
checkpoints load without renaming. No parallelism or rank logic here: tensor / pipeline / data parallelism are applied
from outside by plans in ``parallelize.py``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from spmd_rlhf.models.args import DecoderArgs
from spmd_rlhf.models.attention import AttentionBatch, attend
from spmd_rlhf.models.length_buckets import LengthBuckets, OneLengthClass
from spmd_rlhf.models.merged_linear import MergeableProjections
from spmd_rlhf.models.moe import MoEBlock, SwiGLU
from spmd_rlhf.models.packed_rows import default_position_ids, last_token_index, packed_offsets
from spmd_rlhf.models.paged_kv import PagedKV
from spmd_rlhf.models.rope import RotaryEmbedding, apply_rotary
from spmd_rlhf.models.sequence_parallel import RowPadding, padded_row

HEADS = ("lm", "value", "score")


class RMSNorm(nn.Module):
    """``y = weight * x / sqrt(mean(x^2) + eps)``, normalised in float32, scaled in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm``'s computation with a given ``weight`` (a parallel plan may pass it through an autograd op)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class Attention(MergeableProjections):
    MERGEABLE = ("q_proj", "k_proj", "v_proj")

    def __init__(self, args: DecoderArgs, *, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        """Which layer's blocks of a paged KV cache this attention reads and writes during generation."""
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.attend = attend
        """The attention kernel call ``attend(q, k, v, batch, *, scale, layer_index)``: ``attention.attend``, or one a
        parallel plan puts in its place (context parallelism's, over a sequence split across ranks)."""

    @property
    def scale(self) -> float:
        """The softmax scale, from the int on each use: a float attribute reached compiled blocks as a symbolic input
        that attention's ``scale`` specialised, restarting TorchDynamo's analysis (every block graph traced twice)."""
        return self.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch) -> torch.Tensor:
        q, k, v = self.queries_keys_values(x, rope)
        return self.output(self.attend(q, k, v, batch, scale=self.scale, layer_index=self.layer_index))

    def queries_keys_values(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[batch, seq, heads, head_dim]`` of ``x``: projected, normed (QK-norm models) and rotated (``rope``
        None: not rotated, for the paged decode kernel, which rotates them itself: ``AttentionBatch.rope``)."""
        if self.merged is not None and not hasattr(self, "q_norm"):
            return self._merged_queries_keys_values(x, rope)
        # -1 instead of the configured head counts so a tensor-parallel shard (fewer local heads) runs unchanged; the
        # projections' length, which under sequence parallelism is the whole row's where x holds this rank's chunk.
        q, k, v = (t.view(*t.shape[:2], -1, self.head_dim) for t in self.projections(x))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is None:
            return q, k, v
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _merged_queries_keys_values(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The generation copy's q, k, v from its one merged matmul, q and k rotated as one tensor: in a decode step
        one kernel where two rotations were two (q and k lie side by side in the matmul's output, and the rotation
        is the same for every head). q and k are views of the rotated tensor (``rope`` None: of the matmul's output,
        for the decode kernel to rotate), v of the matmul's output."""
        return self.split_merged_queries_keys_values(self.merged.matmul(x), rope)

    def split_merged_queries_keys_values(
        self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_merged_queries_keys_values`` after its matmul, given the matmul's output ``qkv``."""
        batch_size, seq_len = qkv.shape[:2]
        q_size, k_size, _ = self.merged.sizes  # this rank's rows of each (its heads under tensor parallelism)
        query_key = qkv[..., : q_size + k_size].view(batch_size, seq_len, -1, self.head_dim)
        if rope is not None:
            query_key = apply_rotary(query_key, *rope)
        q, k = query_key.split((q_size // self.head_dim, k_size // self.head_dim), dim=2)
        return q, k, qkv[..., q_size + k_size :].view(batch_size, seq_len, -1, self.head_dim)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention's ``out`` ``[batch, seq, heads, head_dim]``."""
        return self.o_proj(out.reshape(*out.shape[:2], -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs, *, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_index=layer_index)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.moe is not None and layer_index in args.moe.layers:
            self.mlp = MoEBlock(args)
        else:
            self.mlp = SwiGLU(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch) -> torch.Tensor:
        attention = self.self_attn
        q, k, v = self.attention_inputs(x, rope)
        out = attention.attend(q, k, v, batch, scale=attention.scale, layer_index=attention.layer_index)
        return self.attention_outputs(x, out)

    # The block in two pieces around the attention kernel call, which holds all that differs between layers (the
    # layer's KV cache) and between steps (the batch's layout): the generation engine compiles each piece once for
    # every layer (``compile_around_attention``).

    def attention_inputs(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block up to attention: the input norm, then q, k and v (``Attention.queries_keys_values``)."""
        return self.self_attn.queries_keys_values(self.input_layernorm(x), rope)

    def attention_outputs(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The block after attention: the output projection and its residual, then the MLP and its residual."""
        x, mlp_out = self.attention_outputs_apart(x, out)
        return x + mlp_out

    # The same pieces with the residual add after the MLP carried into the next block (``carried_forward``).

    def carried_forward(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` of ``x + pending`` (``pending`` None: of ``x``) with this block's last residual add left to
        the caller: returns ``(x, pending)`` whose sum is ``forward``'s output. Compiled, the add then runs inside
        the next block's input norm (``residual_attention_inputs``): one kernel where two were."""
        attention = self.self_attn
        if pending is None:
            q, k, v = self.attention_inputs(x, rope)
        else:
            x, q, k, v = self.residual_attention_inputs(x, pending, rope)
        out = attention.attend(q, k, v, batch, scale=attention.scale, layer_index=attention.layer_index)
        return self.attention_outputs_apart(x, out)

    def residual_attention_inputs(
        self, x: torch.Tensor, pending: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The previous block's last residual add, then ``attention_inputs``: ``(x + pending, q, k, v)``."""
        x = x + pending
        return (x, *self.self_attn.queries_keys_values(self.input_layernorm(x), rope))

    def attention_outputs_apart(self, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``attention_outputs`` before its last residual add: ``(x + the attention's output, the MLP's output)``."""
        x = x + self.self_attn.output(out)
        return x, self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm: token ids to final hidden states."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        # nn.Embedding's own N(0, 1) initialisation, skipped on the meta device: there torch runs normal_ through a
        # Python reference that imports TorchDynamo, a second of CPU in every process that builds a model shell.
        weight = torch.empty(args.vocab_size, args.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=weight)
        # A ModuleDict keyed by layer index keeps HF names and lets pipeline stages drop layers without renumbering.
        self.layers = nn.ModuleDict(
            {str(index): DecoderLayer(args, layer_index=index) for index in range(args.num_layers)}
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary = RotaryEmbedding(head_dim=args.head_dim, theta=args.rope_theta, scaling=args.rope_scaling)
        self.carry_residuals = False
        """Run the layers through ``DecoderLayer.carried_forward``, each block's last residual add done by the next
        block's first piece and the last one's by ``residual_norm``; set where those pieces are compiled
        (``engine.decode_compile.compile_around_attention``), which fuses each add with the norm after it."""

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Token ids ``[b, s]`` to hidden states ``[b, s, hidden]``. A pipeline stage without the embedding takes
        the previous stage's hidden states instead; one without the final norm returns its last layer's output."""
        x = self.embed_tokens(inputs) if self.embed_tokens is not None else inputs
        rope = self.rotary(position_ids, x.dtype)
        if batch.decode_kernel:
            # The paged decode kernel rotates q and k as it loads them: the layers hand them on unrotated.
            batch, rope = replace(batch, rope=(rope[0][0], rope[1][0])), None  # the one row's tables
        if self.carry_residuals:
            pending = None
            for layer in self.layers.values():
                x, pending = layer.carried_forward(x, pending, rope, batch)
            if pending is not None:
                return self.residual_norm(x, pending)
        else:
            for layer in self.layers.values():
                x = layer(x, rope, batch)
        return self.norm(x) if self.norm is not None else x

    def residual_norm(self, x: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        """The last block's residual add, then the final norm (without one, a pipeline stage's: the sum)."""
        x = x + pending
        return self.norm(x) if self.norm is not None else x


class DecoderLM(nn.Module):
    """Decoder with one head.

    ``head="lm"``: logits ``[batch, seq, vocab]`` (``lm_head``, optionally tied to the embedding);
    ``head="value"``: one value per token ``[batch, seq]`` (``score``: Linear(hidden, 1) with bias, the
    ``*ForTokenClassification`` layout critics use);
    ``head="score"``: one score per sequence ``[batch]`` (or ``[num_seqs]`` when packed) read at its last real token
    (``score``: Linear(hidden, 1) without bias, the ``*ForSequenceClassification`` layout reward models use).
    """

    def __init__(self, args: DecoderArgs, *, head: str = "lm", attention_backend: str = "auto") -> None:
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"head={head!r} is unknown; choose one of {', '.join(HEADS)}")
        self.args, self.head, self.attention_backend = args, head, attention_backend
        self.context_parallel: str | None = None
        """``ulysses`` or ``ring`` once ``models.context_parallel.apply_context_parallel`` has installed it."""
        self.sequence_parallel = 1
        """The TP degree once ``parallelize`` has split the row between the TP regions (``models.tp_plan``): rows are
        padded to a multiple of it (``models.sequence_parallel``)."""
        self.row_padding = RowPadding()
        self.local_tensor_parallel = False
        """Set by ``models.local_tensor_parallel.run_locally``: the TP-split modules compute on local shards with
        explicit collectives (a generation copy), not through DTensor's dispatch."""
        self.skinny_decode = None
        """Set by ``engine.decode_matmul.use_skinny_linear``: its ``(backend, tilings)`` and what it returned."""
        self.model = Backbone(args)
        if head == "lm":
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
            self.tie_weights()
        else:
            self.score = nn.Linear(args.hidden_size, 1, bias=head == "value")

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config says so (call again after re-materialising)."""
        if self.head == "lm" and self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (rotary frequencies) after building on the meta device."""
        self.model.rotary.reset_parameters()

    def compute_dtype(self, inputs: torch.Tensor) -> torch.dtype:
        """The dtype layers compute in: the embedding's, or the incoming hidden states' on a later pipeline stage."""
        if self.model.embed_tokens is not None:
            return self.model.embed_tokens.weight.dtype
        return inputs.dtype

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        *,
        paged: PagedKV | None = None,
        max_seqlen: int | None = None,
        row_length: int | None = None,
        length_classes: LengthBuckets | OneLengthClass | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states ``[batch, seq, hidden]``, before any head.

        ``paged`` (generation engine): ``input_ids`` ``[1, tokens]`` are the new tokens of one engine step with their
        absolute ``position_ids``; each layer writes their K/V into the paged cache and attends over the cached context.
        ``max_seqlen``: the longest packed sequence's length, known on the host, and ``length_classes``: a long
        packed row's length classes, built on the host (``AttentionBatch.build``).
        ``row_length`` (context parallelism): ``input_ids`` ``[1, chunk]`` are one chunk of a packed row of
        ``row_length`` tokens that ``cu_seqlens`` describe; the attention batch is the whole row's (each layer's
        attention, put in place by the plan, gathers the row's keys and values).
        """
        if paged is not None:
            if position_ids is None:
                raise ValueError("a paged KV step needs the new tokens' position_ids (their places in their sequences)")
        else:
            cu_seqlens = packed_offsets(position_ids, attention_mask, cu_seqlens)
        if position_ids is None:
            position_ids = default_position_ids(input_ids, attention_mask, cu_seqlens)
        # The row is the positions' (under sequence parallelism a later pipeline stage's input is this rank's chunk;
        # a later stage's row, and a context-parallel chunk, come padded to a multiple of tp: ``padded_row``).
        tokens = position_ids.shape[1]
        if self.sequence_parallel > 1 and paged is None:
            input_ids, position_ids, cu_seqlens, max_seqlen = padded_row(
                input_ids,
                position_ids,
                attention_mask,
                cu_seqlens,
                max_seqlen,
                self.sequence_parallel,
                chunk=self.model.embed_tokens is None or row_length is not None,
            )
            self.row_padding.tokens = position_ids.shape[1] - tokens  # what the MoE blocks route nowhere
        if row_length is not None and self.context_parallel == "ring":
            # Ring attention reads only the row's offsets: no whole-row mask, which would be [T, T].
            batch = AttentionBatch(cu_seqlens=cu_seqlens.to(input_ids.device), max_seqlen=max_seqlen or 0)
            return self.model(input_ids, position_ids, batch)
        batch = AttentionBatch.build(
            batch_size=input_ids.shape[0],
            seq_len=row_length or position_ids.shape[1],
            attention_mask=attention_mask,
            cu_seqlens=cu_seqlens,
            backend=self.attention_backend,
            device=input_ids.device,
            dtype=self.compute_dtype(input_ids),
            paged=paged,
            max_seqlen=max_seqlen,
            length_classes=length_classes,
        )
        hidden = self.model(input_ids, position_ids, batch)
        return hidden[:, :tokens] if hidden.shape[1] > tokens else hidden  # sequence parallelism's padding dropped

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        output_positions: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        row_length: int | None = None,
        length_classes: LengthBuckets | OneLengthClass | None = None,
    ) -> torch.Tensor:
        """Logits, values or scores for ``input_ids`` ``[batch, seq]`` (see the class docstring).

        Padded rows: ``attention_mask`` ``[batch, seq]`` (1 = real token), left or right padding; position ids
        default to counting real tokens. Packed: ``input_ids`` ``[1, total]`` with ``cu_seqlens`` ``[n + 1]``, or
        with ``position_ids`` that restart at 0 for each sequence; outputs equal the separate forwards of the n
        sequences. ``max_seqlen``: the longest packed sequence's length when the caller packed on the host (saves
        reading it back from ``cu_seqlens``), and ``length_classes``: a row over ``MASK_TOKEN_LIMIT`` tokens grouped
        by length class there (``training.packing.PackedRows`` gives both).

        ``output_positions`` (LM and value heads): flat indices into the ``batch * seq`` positions; the head runs on
        the hidden states of those positions only and the result is ``[len(output_positions), ...]`` (logits
        ``[n, vocab]``, values ``[n]``). A training pass that needs the outputs of response positions only thus never
        computes, or keeps for the backward pass, the logits of the others: at peak ``n * vocab`` logits in the
        compute dtype instead of ``batch * seq * vocab``.

        ``row_length`` (context parallelism through a pipeline): ``input_ids`` are a chunk of a packed row; the
        result is its hidden states, the head being the caller's (which gathers the group's chunks first)."""
        if output_positions is not None and self.head == "score":
            raise ValueError(
                "output_positions selects per-token outputs; the score head reads each sequence's last token"
            )
        cu_seqlens = packed_offsets(position_ids, attention_mask, cu_seqlens)
        hidden = self.hidden_states(
            input_ids,
            position_ids,
            attention_mask,
            cu_seqlens,
            max_seqlen=max_seqlen,
            row_length=row_length,
            length_classes=length_classes,
        )
        if self.model.norm is None or row_length is not None:  # hidden states handed on (the caller's head)
            return hidden
        if output_positions is not None:
            hidden = hidden.flatten(0, 1).index_select(0, output_positions.to(hidden.device))
        elif self.head == "score":
            hidden = hidden.flatten(0, 1)[last_token_index(input_ids, attention_mask, cu_seqlens)]
        return self.head_outputs(hidden)

    def head_outputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head on final-norm hidden states ``[..., hidden]``: logits ``[..., vocab]`` or values / scores
        ``[...]`` (a score head's hidden states being each sequence's last token's)."""
        if self.head == "lm":
            return self.lm_head(hidden)
        return self.score(hidden).squeeze(-1)
