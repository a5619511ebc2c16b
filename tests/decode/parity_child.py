"""One Generator-vs-transformers parity configuration, run in its own process (the seed's
lesson: process-frozen state must not leak between configurations).

    python tests/decode/parity_child.py MODEL LAYOUT MIN_BUCKET NEW_TOKENS [DTYPE [DEVICE]]

MODEL is a tiny random checkpoint name of tests/models/model_ref.py, or "smollm2". Prints one
JSON line: the Generator's tokens and stats, transformers' greedy tokens per prompt, and per
Generator token its relative logit gap under transformers fed the same sequence
(hf_logit_gaps).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

import numpy as np  # noqa: E402
from model_ref import import_reference, make_hf_model, quiet  # noqa: E402

import jax_kv.models as jm  # noqa: E402
from jax_kv.decode import Generator  # noqa: E402

PROMPTS_TEXT = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3,",
]


def hf_greedy(ref, hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy tokens, by hand over its own KV cache: generate() would stop at
    the checkpoint's EOS, and this comparison wants every one of the tokens."""
    torch = ref.torch
    out: list[int] = []
    device = next(hf_model.parameters()).device
    ids, past = torch.tensor([prompt], device=device), None
    with torch.no_grad(), quiet():
        for _ in range(new_tokens):
            step = hf_model(input_ids=ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]], device=device)
    return out


def hf_logit_gaps(ref, hf_model, prompt: list[int], tokens: list[int]) -> list[float]:
    """For each of the Generator's tokens, how far below transformers' best logit it sits,
    relative to that position's largest |logit|, with transformers fed the Generator's own
    sequence (one forward, teacher-forced). 0 where the two greedy choices agree; a bf16
    near-tie shows as a small fraction; a wrong cache or a wrong token as a large one."""
    torch = ref.torch
    device = next(hf_model.parameters()).device
    ids = torch.tensor([prompt + tokens[:-1]], device=device)
    with torch.no_grad(), quiet():
        logits = hf_model(input_ids=ids).logits[0].float()
    rows = logits[len(prompt) - 1 :]
    best = rows.max(dim=-1).values
    mine = rows[torch.arange(len(tokens), device=device), torch.tensor(tokens, device=device)]
    scale = rows.abs().max(dim=-1).values.clamp_min(1e-6)
    return ((best - mine) / scale).tolist()


def main() -> None:
    name, layout, min_bucket, new_tokens = (
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    dtype = sys.argv[5] if len(sys.argv) > 5 else "float32"
    device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
    if dtype == "float32":
        # f32 parity means f32 arithmetic: no TF32 matmuls on either side.
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")
    ref = import_reference()
    ref.torch.backends.cuda.matmul.allow_tf32 = False
    if name == "smollm2":
        path = jm.default_gguf_path(install=True)
        model = jm.load(path, dtype=dtype, progress=False)
        with quiet():
            hf_model = ref.transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=ref.torch.float32
            ).eval()
        prompts = [model.encode(t) for t in PROMPTS_TEXT]
    else:
        hf_model = make_hf_model(ref, name)
        tmp = tempfile.mkdtemp()
        with quiet():
            hf_model.save_pretrained(tmp)
        model = jm.load(tmp, dtype=dtype, progress=False)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (5, 11, 3)]
    # transformers runs in the Generator's dtype on the same kind of device.
    hf_model = hf_model.to(device=device, dtype=getattr(ref.torch, dtype))
    gen = Generator(model, layout=layout, min_bucket=min_bucket)
    result = gen.generate(prompts, new_tokens, stop_tokens=())
    want = [hf_greedy(ref, hf_model, p, new_tokens) for p in prompts]
    pairs = list(zip(prompts, result.tokens, strict=True))
    gaps = [hf_logit_gaps(ref, hf_model, p, t) for p, t in pairs]
    # The negative control: the same tokens in reverse order must sit far below the best logit.
    control = [hf_logit_gaps(ref, hf_model, p, t[::-1]) for p, t in pairs]
    stats = result.stats.as_dict()
    stats["decisions"] = [d.__dict__ if hasattr(d, "__dict__") else d for d in stats["decisions"]]
    print(
        json.dumps(
            dict(
                tokens=result.tokens,
                want=want,
                logit_gaps=gaps,
                control_logit_gaps=control,
                texts=result.texts,
                stats=stats,
                prompt_lengths=[len(p) for p in prompts],
            )
        )
    )


if __name__ == "__main__":
    main()
