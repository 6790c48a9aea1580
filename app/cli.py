"""The headless command line: `generate`, `tokenize`, `serve` and `bench` (and the parser
`python -m app` uses).

This is a user feature and a contract external checks rely on: flags and JSON keys are kept
exactly as documented in the README. Every failure prints one clear line to stderr and exits
non-zero.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.server import DEFAULT_PORT

EXIT_ERROR = 1
EXIT_USAGE = 2


class CliError(Exception):
    """A failure to report as one line on stderr."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated token ids, e.g. 2,818,5279") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_model_options(parser: argparse.ArgumentParser, *, device: bool = True) -> None:
    from app.engine.device import DEVICE_CHOICES, DTYPE_CHOICES

    parser.add_argument("--model", default="default",
                        help="a .gguf file, a Hugging Face model folder, or 'default' for the default "
                             "built-in model")
    if device:
        parser.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
        parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--data-dir", default=None, help="where chats and models live")


def build_parser() -> argparse.ArgumentParser:
    from app.engine.sampling import SamplingParams

    defaults = SamplingParams()
    parser = _Parser(prog="ferrox-chat", description="Chat with local language models.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate a completion headlessly")
    add_model_options(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (BOS added; --chat wraps it as a user turn)")
    source.add_argument("--prompt-ids", type=_ids, help="comma-separated token ids, used exactly")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt as one user turn")
    gen.add_argument("--max-tokens", type=_positive, default=defaults.max_tokens)
    gen.add_argument("--temperature", type=float, default=defaults.temperature,
                     help="0 means greedy")
    gen.add_argument("--top-k", type=int, default=defaults.top_k)
    gen.add_argument("--top-p", type=float, default=defaults.top_p)
    gen.add_argument("--min-p", type=float, default=defaults.min_p)
    gen.add_argument("--repetition-penalty", type=float, default=defaults.repetition_penalty,
                     help="above 1 makes tokens already in the prompt or reply less likely "
                          "(the chat window gives SmolLM2 1.1: without it a 135M model loops)")
    gen.add_argument("--seed", type=int, default=None,
                     help="the sampler's seed: the same seed, prompt and --dtype give the same "
                          "text (with --dtype auto the measured format may change between runs "
                          "on a busy machine, and the text with it)")
    gen.add_argument("--top-logprobs", type=int, default=0)
    gen.add_argument("--prefill-chunk", type=_positive, default=512)
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.add_argument("--base-url", metavar="URL",
                     help="run on an OpenAI-compatible server (vLLM, SGLang, llama.cpp, Ollama) "
                          "instead of here, e.g. http://gpu-box:8000/v1; needs --chat")
    gen.add_argument("--remote-model", metavar="NAME", help="the server's model (with --base-url)")
    gen.add_argument("--api-key-env", metavar="VAR",
                     help="the environment variable holding the server's API key")

    tok = sub.add_parser("tokenize", help="text on stdin -> JSON token ids (no BOS)")
    add_model_options(tok, device=False)
    tok.add_argument("--special", action="store_true", help="parse control-token strings")
    tok.add_argument("--jsonl", action="store_true", help="each stdin line is a JSON string")
    bench = sub.add_parser("bench", help="measure decode, prefill, cache reuse and latency")
    add_model_options(bench)
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--compare-dtypes", metavar="LIST",
                       help="instead: load, decode and prefill figures for each weight dtype, "
                            "e.g. float32,auto,float16")

    ask = sub.add_parser("ask", help="answer a question from documents, with cited passages")
    add_model_options(ask)
    ask.add_argument("--doc", action="append", required=True, metavar="FILE",
                     help="a document to search (repeat for several); indexed once and kept")
    ask.add_argument("--question", required=True)
    ask.add_argument("--passages", type=_positive, default=5, help="how many passages to use")
    ask.add_argument("--max-tokens", type=_positive, default=256)
    ask.add_argument("--json", action="store_true", help="print one JSON object")

    srv = sub.add_parser("serve", help="serve an OpenAI-compatible API on this machine")
    add_model_options(srv)
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (the default takes local connections only)")
    srv.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    srv.add_argument("--kv-dir", default=None, metavar="DIR",
                     help="keep the prefix cache on disk in DIR, so conversations resume warm "
                          "after a restart (off by default)")
    srv.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                     help="let web pages from ORIGIN (e.g. http://localhost:3000) call the API; "
                          "repeat for several (off by default)")
    return parser


def resolve_model_path(spec: str, data_dir: str | None) -> Path:
    from app.paths import models_dir

    if spec == "default":
        from app.models.embedded import ensure_default_model

        return ensure_default_model(models_dir(data_dir))
    path = Path(spec).expanduser()
    if not path.exists():
        raise CliError(f"Model file not found: {path}")
    return path


def cmd_tokenize(args: argparse.Namespace) -> int:
    from app.models.loader import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(args.model, args.data_dir))
    if not args.jsonl:
        print(json.dumps(tokenizer.encode(sys.stdin.read(), special=args.special)))
        return 0
    for n, line in enumerate(sys.stdin, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)
        except json.JSONDecodeError:
            raise CliError(f"line {n} of stdin is not a JSON string") from None
        if not isinstance(text, str):
            raise CliError(f"line {n} of stdin is JSON but not a string")
        print(json.dumps(tokenizer.encode(text, special=args.special)), flush=True)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from app.engine.device import load_on
    from app.engine.generate import generate
    from app.engine.sampling import SamplingParams
    from app.models.chat_template import Message, encode_chat
    from app.models.prompt import bos_prefix

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty,
                                seed=args.seed, top_logprobs=args.top_logprobs)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.prompt_ids is not None and args.chat:
        raise CliError("--chat applies to --prompt text, not to --prompt-ids")
    if args.base_url:
        return _generate_remote(args, params)
    if args.remote_model or args.api_key_env:
        raise CliError("--remote-model and --api-key-env go with --base-url")
    path = resolve_model_path(args.model, args.data_dir)
    loaded = load_on(path, args.device, args.dtype)
    tok = loaded.tokenizer
    if args.prompt_ids is not None:
        bad = [i for i in args.prompt_ids if not 0 <= i < tok.vocab_size]
        if bad:
            raise CliError(f"token id {bad[0]} is outside the vocabulary (0..{tok.vocab_size - 1})")
        prompt_ids = args.prompt_ids
    elif args.chat:
        prompt_ids = encode_chat(tok, loaded.template, [Message("user", args.prompt)])
    else:
        prompt_ids = bos_prefix(tok) + tok.encode(args.prompt)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = generate(loaded, prompt_ids, params, prefill_chunk=args.prefill_chunk,
                      on_text=None if args.json else stream)
    if not args.json:
        sys.stdout.write("\n")
        return 0
    print(json.dumps({
        "model": loaded.name,
        "device": str(loaded.device),
        "dtype": loaded.weights_label,
        "prompt_ids": result.prompt_ids,
        "completion_ids": result.completion_ids,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "logprobs": [{"id": c.id, "logprob": c.logprob, "top": [list(t) for t in c.top]}
                     for c in result.completion] if params.top_logprobs else [],
        "usage": {"prompt_tokens": result.usage.prompt_tokens,
                  "cached_tokens": result.usage.cached_tokens,
                  "completion_tokens": result.usage.completion_tokens},
        "timings": {"load_s": round(loaded.load_seconds, 4),
                    "prefill_s": round(result.prefill_seconds, 4),
                    "decode_tokens_per_s": round(result.decode_tokens_per_s, 2)},
    }))
    return 0


def _generate_remote(args: argparse.Namespace, params) -> int:
    """`generate --base-url`: the app's own RemoteBackend, the same JSON as a local run."""
    from app.backends import BackendError
    from app.backends.headless import generate_remote

    try:
        result = generate_remote(args, params)
    except BackendError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from app.bench import print_table, run_bench
    from app.engine.device import load_on

    path = resolve_model_path(args.model, args.data_dir)
    if args.compare_dtypes:
        from app.bench import run_dtype_comparison

        rows = run_dtype_comparison(path, args.device, args.compare_dtypes.split(","))
        for row in rows:
            print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()))
        return 0
    from app.bench import measure_load_times

    load_times = measure_load_times(path, args.device, args.dtype)
    loaded = load_on(path, args.device, args.dtype)
    if not args.json:
        print(f"Benchmarking {loaded.name} on {loaded.device} ...", file=sys.stderr)
    results = run_bench(loaded)
    results |= {k: v for k, v in load_times.items() if k != "weights"}
    if args.json:
        print(json.dumps(results))
    else:
        print_table(results)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from app.server.serve import ServeError, serve

    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be between 0 and 65535, got {args.port}")
    try:
        serve(args.host, args.port, args.model, args.device, args.dtype, args.data_dir,
              kv_dir=args.kv_dir, cors_origins=tuple(args.cors_origin))
    except ServeError as exc:
        raise CliError(str(exc)) from None
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    from app.documents import DocumentError
    from app.paths import data_dir, models_dir
    from app.retrieval.ask import ask

    docs = [Path(d).expanduser() for d in args.doc]
    for doc in docs:
        if not doc.is_file():
            raise CliError(f"Document not found: {doc}")
    try:
        result = ask(docs, args.question, data_dir=data_dir(args.data_dir),
                     models_dir=models_dir(args.data_dir),
                     model_path=resolve_model_path(args.model, args.data_dir),
                     device=args.device, dtype=args.dtype, k=args.passages, max_tokens=args.max_tokens)
    except DocumentError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps(result))
        return 0
    print(result["answer"])
    for p in result["passages"]:
        place = ", ".join(x for x in (f"page {p['page']}" if p["page"] else "", p["heading"] or "") if x)
        print(f"[{p['number']}] {p['file']}" + (f" ({place})" if place else ""))
    return 0


COMMANDS = {"ask": cmd_ask, "generate": cmd_generate, "tokenize": cmd_tokenize, "bench": cmd_bench,
            "serve": cmd_serve}


def run_command(args: argparse.Namespace) -> int:
    """Run a subcommand, turning every expected failure into one line on stderr."""
    from app.engine.device import DeviceError
    from app.engine.generate import GenerationError
    from app.models.errors import ModelError

    from app.paths import use_data_dir

    try:
        if getattr(args, "data_dir", None):
            use_data_dir(args.data_dir)
        return COMMANDS[args.command](args)
    except (CliError, ModelError, DeviceError, GenerationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
