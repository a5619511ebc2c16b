"""Model: a loaded decoder (config, params on the device, tokenizer, chat template) and the
chat formatting of instruct checkpoints."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jax_kv.layout import Layout
from jax_kv.models import llama
from jax_kv.models.config import ModelConfig


@dataclasses.dataclass
class Model:
    """A decoder ready to run: `llama.prefill(model.params, model.config, ...)`.

    Attributes:
        config: the ModelConfig (static under jit).
        params: the params pytree (jax_kv.models.llama), on the device.
        tokenizer: a `tokenizers.Tokenizer`, or None (random models; GGUF vocabularies of a
            kind not rebuilt, with the reason in `tokenizer_error`).
        chat_template: the checkpoint's Jinja chat template, or None.
        source: the file or directory it came from ("random:<seed>" for random models).
    """

    config: ModelConfig
    params: llama.Params
    tokenizer: Any = None
    chat_template: str | None = None
    source: str = ""
    bos_token: str | None = None
    eos_token: str | None = None
    tokenizer_error: str | None = None

    @property
    def dtype(self) -> Any:
        return self.params["embed"].dtype

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            why = self.tokenizer_error or "this model has no tokenizer"
            raise ValueError(f"{self.source}: {why}; pass token ids instead")
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (special tokens such as <|im_start|> in it are kept whole)."""
        return list(self._need_tokenizer().encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._need_tokenizer().decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of a chat ([{"role": ..., "content": ...}, ...])."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: this checkpoint has no chat template")
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def generate_greedy(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 32,
        *,
        layout: Layout | str | int = Layout.SEQ_MAJOR,
        stop_at_eos: bool = True,
    ) -> list[int]:
        """Greedy new tokens after one prompt (text or ids): a Generator call, the one loop."""
        from jax_kv.decode import Generator  # the loop sits below the models in the layers

        stop = self.config.eos_token_ids if stop_at_eos else ()
        result = Generator(self, layout=layout).generate([prompt], max_new_tokens, stop_tokens=stop)
        return result.tokens[0]

    # -- the decoder interface the Generator runs (jax_kv.decode.DecoderModel) -----------------

    def prefill(
        self,
        params: llama.Params,
        tokens: Any,
        new_lengths: Any,
        caches: Any,
        lengths: Any,
        **kw: Any,
    ) -> tuple:
        """llama.prefill with this model's config: T new tokens per sequence."""
        return llama.prefill(params, self.config, tokens, new_lengths, caches, lengths, **kw)

    def prefill_packed(
        self,
        params: llama.Params,
        tokens: Any,
        cu_seqlens: Any,
        caches: Any,
        lengths: Any,
        **kw: Any,
    ) -> tuple:
        """llama.prefill_packed with this model's config: the real new tokens of all rows
        packed on one token axis."""
        return llama.prefill_packed(params, self.config, tokens, cu_seqlens, caches, lengths, **kw)

    def decode_step(
        self, params: llama.Params, tokens: Any, caches: Any, lengths: Any, **kw: Any
    ) -> tuple:
        """llama.decode_step with this model's config: one token per sequence."""
        return llama.decode_step(params, self.config, tokens, caches, lengths, **kw)

    def partition_specs(self, axis: str = "tp") -> Any:
        """The PartitionSpec pytree of `params` for tensor parallelism over `axis`
        (llama.partition_specs: Megatron-style, on the unfused weights)."""
        return llama.partition_specs(self.params, axis)

    def fused_params(self) -> llama.Params:
        """The params with one q/k/v and one gate/up matmul per layer, as a new pytree that
        shares every other array: nothing of `self.params` is modified or deleted."""
        return llama.fuse_projections(self.params)

    def fuse_projections(self) -> None:
        """Rewrites params in place to the fused form (llama.fuse_projections): same outputs,
        2 matmuls per layer where there were 5. The separate weights are freed; idempotent."""
        self.params = llama.fuse_projections(self.params, delete_unfused=True)

    def delete(self) -> None:
        """Frees the params' device memory now."""
        for leaf in jax.tree_util.tree_leaves(self.params):
            leaf.delete()


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> str:
    """Renders a Hugging Face chat template.

    With jinja2 installed: the template itself, in a sandbox, with transformers' settings
    (trim_blocks, lstrip_blocks, `raise_exception`). Without jinja2: only ChatML templates
    (those that use <|im_start|>), formatted as
    "<|im_start|>{role}\\n{content}<|im_end|>\\n" per message plus "<|im_start|>assistant\\n"
    when add_generation_prompt; template-specific extras (e.g. SmolLM2's default system
    message) are not reproduced by this fallback.
    """
    try:
        import jinja2.sandbox
    except ImportError:
        if "<|im_start|>" not in template:
            raise ImportError(
                "this chat template needs jinja2 (pip install jinja2); only "
                "ChatML templates have a fallback"
            ) from None
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token or "",
        eos_token=eos_token or "",
    )


__all__ = ["Model", "render_chat"]
