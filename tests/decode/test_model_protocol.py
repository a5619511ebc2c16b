"""The loop depends on the DecoderModel protocol, not on llama (issue 20, item 5): a model of
another class that provides prefill_packed / decode_step / fused_params runs in the Generator
unchanged, and an object that is not a model is refused by name."""

import dataclasses

import jax.numpy as jnp
import pytest
from reference_loop import greedy_static

import jax_kv.models as jm
from jax_kv.decode import DecoderModel, Generator


@dataclasses.dataclass
class NegatedLogits:
    """A second 'family': the wrapped model with its logits negated (greedy then picks the
    least likely token), written against the protocol alone."""

    inner: jm.Model

    config = property(lambda self: self.inner.config)
    params = property(lambda self: self.inner.params)
    tokenizer = None
    dtype = property(lambda self: self.inner.dtype)

    def prefill_packed(self, params, tokens, cu_seqlens, caches, lengths, **kw):
        logits, *rest = self.inner.prefill_packed(params, tokens, cu_seqlens, caches, lengths, **kw)
        return (-logits, *rest)

    def decode_step(self, params, tokens, caches, lengths, **kw):
        logits, *rest = self.inner.decode_step(params, tokens, caches, lengths, **kw)
        return (-logits, *rest)

    def fused_params(self):
        return self.inner.params

    def encode(self, text):
        raise ValueError("no tokenizer")

    def decode(self, ids):
        raise ValueError("no tokenizer")


def test_a_model_of_another_class_runs_in_the_loop():
    base = jm.random_model("tiny-llama", seed=5)
    other = NegatedLogits(base)
    assert isinstance(base, DecoderModel) and isinstance(other, DecoderModel)
    prompts = [[5, 9, 13], [11, 3, 4, 4]]
    got = Generator(other, min_bucket=8).generate(prompts, 6, stop_tokens=()).tokens
    plain = Generator(base, min_bucket=8).generate(prompts, 6, stop_tokens=()).tokens
    assert plain == greedy_static(base.params, base.config, prompts, 6)
    assert got != plain  # the wrapper's negated logits drove the loop
    assert all(len(row) == 6 for row in got)


@pytest.mark.parametrize("thing", [object(), "tiny-llama", {"params": {}}])
def test_not_a_model_is_refused(thing):
    with pytest.raises(ValueError, match=r"model: expected a jax_kv.decode.DecoderModel"):
        Generator(thing)


def test_model_generate_greedy_is_the_generator():
    model = jm.random_model("tiny-llama", seed=6)
    prompts = [[1, 2, 3, 4]]
    want = greedy_static(model.params, model.config, prompts, 5)[0]
    assert model.generate_greedy([1, 2, 3, 4], 5, stop_at_eos=False) == want
    assert jnp.dtype(model.dtype) == jnp.float32
