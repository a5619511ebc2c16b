"""DecoderModel: what the generation loop needs of a model, and nothing more (DESIGN.md,
Decode loop). A second model family plugs in by providing these, without touching the loop."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class DecoderModel(Protocol):
    """A decoder over per-layer caches the loop owns.

    config: read for the cache geometry and the limits: num_layers, num_kv_heads, head_dim,
        vocab_size, max_position_embeddings (None: unbounded), eos_token_ids.
    params: the weights pytree, passed back to prefill_packed / decode_step as their first argument
        (an argument of the jitted step, not a constant baked into it).
    dtype: the activations' and the caches' dtype.
    tokenizer: a `tokenizers.Tokenizer` or None (then prompts are token ids).

    prefill_packed(params, tokens [N], cu_seqlens [B+1], caches, lengths [B], *, layout,
        committed) -> (logits [B, V] of each row's last new token, caches, status [B]): the
        real new tokens of all rows packed on one token axis, row b's at
        tokens[cu_seqlens[b]:cu_seqlens[b+1]] (jax_kv.gqa_prefill_packed's contract); what
        the Generator prefills with. The Engine also passes `decode_tokens` [B] and
        `decode_bound` [B] (and under a mesh `decode_attention`): other rows advance by one
        token in the same call, as decode_step would advance them (jax_kv.models.llama).
    decode_step(params, tokens [B], caches, lengths [B], *, layout, committed)
        -> (logits [B, V], caches, status [B]): one token per sequence at lengths[b]. The
        Engine with decode row buckets also passes `rows` int32 [n]: the rows the step
        advances, then B (padding); the logits are then theirs, [n, V]
        (jax_kv.models.llama.decode_step).
    Both run inside jax.jit with the caches donated: per layer (k_cache, v_cache) in `layout`.
    Both take `attention=`, a function of the op's contract (jax_kv.parallel.head_sharded's
    wrapper, under a mesh).

    Optional, for tensor parallelism (jax_kv.parallel): partition_specs(axis) -> the
    PartitionSpec pytree of `params` over a mesh axis.
    """

    config: Any
    params: Any
    tokenizer: Any

    @property
    def dtype(self) -> Any: ...

    def prefill_packed(
        self, params: Any, tokens: Any, cu_seqlens: Any, caches: Any, lengths: Any, **kw: Any
    ) -> tuple: ...

    def decode_step(
        self, params: Any, tokens: Any, caches: Any, lengths: Any, **kw: Any
    ) -> tuple: ...

    def fused_params(self) -> Any:
        """Params the steps run faster on (same outputs), without modifying `params`."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...
