"""python -m jax_kv never answers a user error with a traceback: one line `error: ...` on
stderr, exit status 2, and argument values are checked before the model loads. A reader that
closes the pipe (`| head`) ends the command quietly. Issue 19, item 7.

The commands run as a user runs them (a subprocess) on a tiny random Llama written to a
temporary directory (config.json, model.safetensors, a word-level tokenizer.json), so no test
here needs the default model or the network.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import jax_kv.models as jm
from jax_kv import cli
from jax_kv.models import loading

WORDS = [f"w{i}" for i in range(1, 64)]
TINY = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=64,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: every run generates all its tokens
    tie_word_embeddings=False,
)


def write_checkpoint(path: Path, *, nan_in: str | None = None) -> Path:
    """A tiny random Llama checkpoint directory with a word-level tokenizer (w1 .. w63)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(TINY))
    config = jm.from_hf_config(TINY)
    rng = np.random.default_rng(0)
    tensors = {}
    for _, name, shape in loading._plan_keys(config, loading.HF_NAMES, loading.HF_LAYER_NAMES):
        x = rng.standard_normal(shape).astype(np.float32)
        tensors[name] = x / np.sqrt(shape[-1]) if len(shape) == 2 else 1.0 + 0.0 * x
    if nan_in is not None:
        tensors[nan_in][0, 0] = np.nan
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    vocab = {"[UNK]": 0, **{w: i for i, w in enumerate(WORDS, start=1)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("cli") / "tiny")


@pytest.fixture(scope="module")
def trap(tmp_path_factory) -> Path:
    """A checkpoint whose loading fails at once (config.json is not JSON): a command that
    reports anything else about it did not try to load it."""
    path = tmp_path_factory.mktemp("cli") / "trap"
    path.mkdir()
    (path / "config.json").write_text("{this is not JSON")
    return path


def run(*args: str, stdout=subprocess.PIPE, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    return subprocess.run(
        [sys.executable, "-m", "jax_kv", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        timeout=timeout,
    )


def assert_user_error(p: subprocess.CompletedProcess, match: str) -> None:
    """Exit 2 and exactly one stderr line, `error: ...`, containing `match`."""
    lines = p.stderr.splitlines()
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert match in lines[0], (match, lines[0])


# ---------------------------------------------------------------------------------------------
# Argument values: refused by argparse types, before anything loads.

BAD_ARGUMENTS = [
    (("--max-new-tokens", "0"), "--max-new-tokens: expected an int >= 1, got '0'"),
    (("--max-new-tokens", "-3"), "--max-new-tokens: expected an int >= 1, got '-3'"),
    (("--max-new-tokens", "2.7"), "--max-new-tokens: expected an int >= 1, got '2.7'"),
    (("--max-new-tokens", "lots"), "--max-new-tokens: expected an int >= 1, got 'lots'"),
    (("--temperature", "-1"), "--temperature: expected a finite number >= 0, got '-1'"),
    (("--temperature", "nan"), "--temperature: expected a finite number >= 0, got 'nan'"),
    (("--temperature", "inf"), "--temperature: expected a finite number >= 0, got 'inf'"),
    (("--temperature", "1e400"), "--temperature: expected a finite number >= 0, got '1e400'"),
    (("--temperature", "warm"), "--temperature: expected a finite number >= 0, got 'warm'"),
    (("--top-p", "0"), "--top-p: expected a number in (0, 1], got '0'"),
    (("--top-p", "1.5"), "--top-p: expected a number in (0, 1], got '1.5'"),
    (("--top-p", "-0.1"), "--top-p: expected a number in (0, 1], got '-0.1'"),
    (("--top-p", "nan"), "--top-p: expected a number in (0, 1], got 'nan'"),
    (("--top-k", "-1"), "--top-k: expected an int >= 0, got '-1'"),
    (("--top-k", "2.5"), "--top-k: expected an int >= 0, got '2.5'"),
    (("--seed", str(2**63)), f"--seed: expected an int in [-2**63, 2**63), got '{2**63}'"),
    (("--seed", "1.5"), "--seed: expected an int in [-2**63, 2**63), got '1.5'"),
    (("--min-bucket", "0"), "--min-bucket: expected a power of two >= 1, got '0'"),
    (("--min-bucket", "3"), "--min-bucket: expected a power of two >= 1, got '3'"),
    (("--min-bucket", "x"), "--min-bucket: expected a power of two >= 1, got 'x'"),
    (("--tokens-per-call", "0"), "--tokens-per-call: expected an int >= 1, got '0'"),
    (("--max-len", "0"), "--max-len: expected an int >= 1, got '0'"),
    (("--layout", "diagonal"), "--layout: invalid choice: 'diagonal'"),
    (("--arena", "huge"), "--arena: invalid choice: 'huge'"),
    (("--dtype", "int8"), "--dtype: invalid choice: 'int8'"),
    (("--max-new-tokens",), "--max-new-tokens: expected one argument"),
    (("--frobnicate",), "unrecognized arguments: --frobnicate"),
]


@pytest.mark.parametrize("args, match", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_argument_is_one_error_line(trap, args, match):
    # --model names a checkpoint that fails to load: the message about the argument shows
    # the value was checked first.
    assert_user_error(run("generate", "--model", str(trap), *args), match)


@pytest.mark.parametrize(
    "args, match",
    [
        ((), "the following arguments are required: command"),
        (("chat",), "command: invalid choice: 'chat'"),
        (("demo", "--steps", "0"), "--steps: expected an int >= 1, got '0'"),
    ],
)
def test_bad_command_is_one_error_line(args, match):
    assert_user_error(run(*args), match)


def test_help_is_not_an_error():
    p = run("generate", "--help")
    assert p.returncode == 0 and "--arena {auto,vmm,eager}" in p.stdout and p.stderr == ""


@pytest.mark.parametrize("args", [a for a, _ in BAD_ARGUMENTS if len(a) == 2], ids=" ".join)
def test_bad_argument_refused_before_the_model_loads(monkeypatch, capsys, args):
    """In process, with a loader that fails the test if called."""

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(jm, "load", no_load)
    monkeypatch.setattr(jm, "default", no_load)
    assert cli.main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {args[0]}: ") and err.count("\n") == 1, err


def test_missing_model_refused_before_jax_work(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(jm, "load", lambda *a, **k: pytest.fail("load called"))
    assert cli.main(["generate", "--model", str(tmp_path / "nope")]) == 2
    assert (
        capsys.readouterr().err
        == f"error: --model: {tmp_path / 'nope'}: no such file or directory\n"
    )


def test_serve_refusals_before_the_model_loads(monkeypatch, capsys, tmp_path):
    """serve: a missing --model, --random-weights beside --model, and a bad port are one
    error line each, before any model loads or any socket opens."""
    monkeypatch.setattr(jm, "load", lambda *a, **k: pytest.fail("load called"))
    monkeypatch.setattr(jm, "default", lambda *a, **k: pytest.fail("default model loaded"))
    monkeypatch.setattr(jm, "random_model", lambda *a, **k: pytest.fail("random model made"))
    cases = [
        (["--model", str(tmp_path / "nope")], f"--model: {tmp_path / 'nope'}: no such file"),
        (["--model", str(tmp_path), "--random-weights", "tiny-llama"], "give it or --model"),
        (["--port", "70000"], "--port: expected an int in [0, 65535], got '70000'"),
        (["--random-weights", "gpt-5"], "--random-weights: invalid choice: 'gpt-5'"),
        (["--tp", "0"], "--tp: expected an int >= 1, got '0'"),
        (["--tp", "4096"], f"--tp: 4096 devices asked for, {jax.device_count()} present"),
    ]
    for args, match in cases:
        assert cli.main(["serve", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and match in err and err.count("\n") == 1, err


def test_arena_vmm_without_a_gpu_refused_before_the_model_loads(monkeypatch, capsys):
    if jax.default_backend() != "cpu":
        pytest.skip("a GPU is present: VmmArena() works")
    monkeypatch.setattr(jm, "default", lambda *a, **k: pytest.fail("default model loaded"))
    assert cli.main(["generate", "--arena", "vmm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --arena vmm: needs a CUDA GPU with virtual memory (")
    assert err.count("\n") == 1


# ---------------------------------------------------------------------------------------------
# Models and prompts: the library's refusals, one line each.


def test_missing_model_path(tmp_path):
    p = run("generate", "--model", str(tmp_path / "missing.gguf"))
    assert_user_error(p, f"--model: {tmp_path / 'missing.gguf'}: no such file or directory")


def test_model_file_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model\n" * 10)
    p = run("generate", "--model", str(tmp_path / "notes.txt"))
    assert_user_error(p, "notes.txt: expected a Hugging Face checkpoint directory or a .gguf file")


def test_truncated_gguf(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    assert_user_error(
        run("generate", "--model", str(tmp_path / "m.gguf")), "m.gguf: not a readable GGUF file"
    )


def test_directory_that_is_not_a_checkpoint(tmp_path):
    assert_user_error(run("generate", "--model", str(tmp_path)), "no config.json")


def test_config_json_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[]")
    assert_user_error(
        run("generate", "--model", str(tmp_path)), "config.json: expected a JSON object, got list"
    )


def test_checkpoint_with_a_nan_tensor(tmp_path):
    path = write_checkpoint(tmp_path / "nan", nan_in="model.layers.0.mlp.down_proj.weight")
    assert_user_error(
        run("generate", "--model", str(path)),
        "model.safetensors: tensor model.layers.0.mlp.down_proj.weight: expected finite values",
    )


def test_corrupt_tokenizer_json(tmp_path, tiny):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(tiny, path)
    (path / "tokenizer.json").write_text('{"model": "half a file')
    assert_user_error(
        run("generate", "--model", str(path)), "tokenizer.json: not a readable tokenizer"
    )


def test_prompt_longer_than_max_len(tiny):
    p = run("generate", "--model", str(tiny), "--max-len", "4", "--prompt", "w1 w2 w3 w4 w5")
    assert_user_error(
        p, "--prompt: expected fewer than 4 tokens (--max-len) to leave room for a new token, got 5"
    )


def test_prompt_longer_than_the_model(tiny):
    p = run("generate", "--model", str(tiny), "--prompt", " ".join(WORDS[:40] * 2))
    assert_user_error(
        p, "--prompt: expected fewer than 64 tokens (the model's max_position_embeddings)"
    )


def test_empty_prompt_refused_by_the_library(tiny):
    p = run("generate", "--model", str(tiny), "--prompt", "")
    assert_user_error(p, "prompts: expected one or more non-empty prompts")


def test_chat_without_a_template_refused_by_the_library(tiny):
    assert_user_error(run("generate", "--model", str(tiny), "--chat"), "no chat template")


def test_multi_line_library_error_is_one_line(monkeypatch, capsys, tiny):
    def refuse(*a, **k):
        raise ValueError("first line\n  second line\n")

    monkeypatch.setattr(jm, "load", refuse)
    assert cli.main(["generate", "--model", str(tiny)]) == 2
    assert capsys.readouterr().err == "error: first line second line\n"


def test_internal_error_keeps_its_traceback(monkeypatch, tiny):
    """Only user errors are turned into one line: a bug still surfaces as itself."""

    def bug(*a, **k):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(jm, "load", bug)
    with pytest.raises(RuntimeError, match="an internal bug"):
        cli.main(["generate", "--model", str(tiny)])


def test_interrupt_exits_130_quietly(monkeypatch, capsys, tiny):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(jm, "load", interrupted)
    try:
        status = cli.main(["generate", "--model", str(tiny)])
    except KeyboardInterrupt:  # would stop the whole pytest session
        pytest.fail("KeyboardInterrupt escaped main")
    assert status == 130
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------
# Runs that work: --arena, --json's finish_reasons, a closed pipe.


def test_arena_eager_json_and_finish_reasons(tiny):
    from jax_kv.decode.generator import GenerationResult

    p = run(
        "generate",
        "--model",
        str(tiny),
        "--prompt",
        "w1 w2 w3",
        "--max-new-tokens",
        "4",
        "--min-bucket",
        "8",
        "--arena",
        "eager",
        "--json",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["stats"]["arena"] == "eager" and len(r["tokens"]) == 4
    if "finish_reasons" in {f.name for f in dataclasses.fields(GenerationResult)}:
        assert r["finish_reasons"] == ["max_new_tokens"]
    else:
        assert "finish_reasons" not in r


def test_arena_auto_is_the_library_default():
    assert cli._make_arena("auto") is None
    from jax_kv.memory import EagerArena

    assert isinstance(cli._make_arena("eager"), EagerArena)


def _run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """Runs with stdout a pipe whose reader has already gone: the first write fails."""
    r, w = os.pipe()
    os.close(r)
    try:
        return run(*args, stdout=w)
    finally:
        os.close(w)


@pytest.mark.parametrize("mode", [(), ("--json",)], ids=["stream", "json"])
def test_closed_pipe_ends_quietly(tiny, mode):
    p = _run_into_closed_pipe(
        "generate",
        "--model",
        str(tiny),
        "--prompt",
        "w1 w2",
        "--max-new-tokens",
        "6",
        "--min-bucket",
        "8",
        *mode,
    )
    assert p.returncode in (0, 141), p.stderr
    assert p.stderr == "", p.stderr  # no traceback, no "Exception ignored ... BrokenPipeError"


def test_pipe_into_head(tiny):
    """The shell's `python -m jax_kv generate ... | head -c 10`, as a user types it."""
    command = (
        f"set -o pipefail; {sys.executable} -m jax_kv generate --model {tiny} "
        f"--prompt 'w1 w2' --max-new-tokens 24 --min-bucket 8 2>err.txt | head -c 10; "
        f'echo " rc=$?"'
    )
    cwd = tiny.parent
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    p = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )
    err = (cwd / "err.txt").read_text()
    assert p.stdout.startswith("w1 w2") and p.stdout.split(" rc=")[-1].strip() in ("0", "141")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_serve_builds_the_engine_where_the_flag_says(monkeypatch):
    """serve passes run() a picklable engine factory (the engine's process rebuilds it) and
    engine_process=True unless --engine-in-process; the factory builds the Engine it was
    given the arguments for."""
    pytest.importorskip("uvicorn")
    from jax_kv.server import main as server_main

    seen = []
    monkeypatch.setattr(server_main, "run", lambda make, **kw: seen.append((make, kw)) or 0)
    args = ["serve", "--random-weights", "tiny-llama", "--max-slots", "3", "--max-len", "128"]
    assert cli.main(args) == 0
    assert cli.main([*args, "--engine-in-process"]) == 0
    (factory, kw), (_, kw_thread) = seen
    assert kw["engine_process"] is True and kw_thread["engine_process"] is False
    assert kw["model_name"] == "random-tiny-llama"
    factory = pickle.loads(pickle.dumps(factory))  # what the spawned process receives
    with factory() as engine:
        assert (engine.max_slots, engine.max_len) == (3, 128)
        assert engine.model.config.num_layers == jm.preset("tiny-llama").num_layers
