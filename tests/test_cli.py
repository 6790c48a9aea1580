"""The headless CLI contract, exercised as a user runs it: `python -m app ...` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


# Only ends a hang: each run waits for its process to exit, however slow a loaded machine is.
SAFETY_TIMEOUT_S = 900


def run_app(*args: str, stdin: str = "", data_dir=None, timeout: int = SAFETY_TIMEOUT_S):
    env = dict(os.environ)
    if data_dir is not None:
        env["FERROX_DATA_DIR"] = str(data_dir)
    return subprocess.run([sys.executable, "-m", "app", *args], input=stdin, text=True,
                          capture_output=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def model_arg(embedded_model_path):
    return ["--model", str(embedded_model_path)]


@pytest.mark.slow
def test_generate_json_greedy_matches_reference(model_arg, shared_dir):
    ref = json.loads((shared_dir / "reference" / "gemma3-270m-reference.json").read_text())["cases"][0]
    ids = ",".join(map(str, ref["prompt_ids"]))
    proc = run_app("generate", *model_arg, "--prompt-ids", ids, "--max-tokens", "8",
                   "--temperature", "0", "--dtype", "float32", "--top-logprobs", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"model", "device", "dtype", "prompt_ids", "completion_ids", "text",
                        "finish_reason", "logprobs", "usage", "timings"}
    assert out["device"] == "cpu" and out["dtype"] == "float32"
    assert out["prompt_ids"] == ref["prompt_ids"]
    assert out["completion_ids"] == ref["transformers"]["generated_ids"][:8]
    assert out["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 6, "cached_tokens": 0, "completion_tokens": 8}
    assert len(out["logprobs"]) == 8
    first = out["logprobs"][0]
    assert first["id"] == 506 and [t[0] for t in first["top"]] == [506, 496, 9079]
    assert set(out["timings"]) == {"load_s", "prefill_s", "decode_tokens_per_s"}


@pytest.mark.slow
def test_generate_text_streams_to_stdout_with_bos_and_seed(model_arg):
    # A pinned dtype: `auto` checks its measured format on every run, and on a busy machine
    # the check may choose another (the logits move, and a sampled token with them).
    args = ["generate", *model_arg, "--prompt", "Once upon a time", "--max-tokens", "12",
            "--seed", "7", "--temperature", "0.9", "--dtype", "int4"]
    first, second = run_app(*args), run_app(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() and first.stdout == second.stdout  # same seed, same text


@pytest.mark.slow
def test_generate_applies_the_repetition_penalty(model_arg):
    def greedy(penalty: str) -> list[int]:
        proc = run_app("generate", *model_arg, "--prompt", "The cat sat on the mat. The cat",
                       "--max-tokens", "24", "--temperature", "0", "--dtype", "int4", "--json",
                       "--repetition-penalty", penalty)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["completion_ids"]

    plain, penalized = greedy("1"), greedy("3")
    assert plain != penalized  # a strong penalty moves the greedy path off repeated tokens


@pytest.mark.slow
def test_generate_chat_wraps_the_prompt_in_a_user_turn(model_arg):
    proc = run_app("generate", *model_arg, "--prompt", "Hi", "--chat", "--max-tokens", "2",
                   "--temperature", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["prompt_ids"][:3] == [2, 105, 2364]


@pytest.mark.slow
def test_tokenize_plain_special_and_jsonl(model_arg):
    proc = run_app("tokenize", *model_arg, stdin="Hello, world!")
    assert json.loads(proc.stdout) == [9259, 236764, 1902, 236888]
    proc = run_app("tokenize", *model_arg, "--special", "--jsonl",
                   stdin='"<start_of_turn>user"\n"Hello, world!"\n')
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines == [[105, 2364], [9259, 236764, 1902, 236888]]


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/no/such/model.gguf", "--prompt", "x"], "not found"),
    (["generate", "--prompt", "x", "--top-p", "2"], "top_p"),
    (["generate", "--prompt-ids", "2,x"], "token ids"),
    (["generate"], "required"),
    (["generate", "--prompt", "x", "--device", "tpu"], "invalid choice"),
    (["generate", "--prompt", "x", "--repetition-penalty", "0"], "repetition_penalty must be positive"),
])
def test_errors_are_one_clear_line(args, message, tmp_path):
    proc = run_app(*args, data_dir=tmp_path)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_a_broken_model_file_is_refused_clearly(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 30)
    proc = run_app("generate", "--model", str(bad), "--prompt", "x")
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and "broken.gguf" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_out_of_vocabulary_ids_and_too_long_prompts_are_refused(model_arg):
    proc = run_app("generate", *model_arg, "--prompt-ids", "2,999999")
    assert proc.returncode == 1 and "outside the vocabulary" in proc.stderr
    proc = run_app("generate", *model_arg, "--prompt", "x", "--max-tokens", "40000")
    assert proc.returncode == 1 and "context" in proc.stderr
