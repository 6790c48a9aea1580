#!/usr/bin/env python3
"""Dev-only: llama.cpp's token ids for a few hundred varied texts, as a test fixture.

Runs in a separate virtual environment with `llama-cpp-python` (built from source; never a
dependency of the app) and imports only llama_cpp and the standard library:

    /work/llama-venv/bin/python scripts/make_tokenizer_fixture.py MODEL.gguf [MODEL.gguf ...]

For each model it writes tests/fixtures/tokenizer_ids_<stem>.json, where <stem> is the file name
lower-cased without ".gguf":

    {"model": file name, "sha256": ..., "add_bos": ..., "add_eos": ..., "bos_id": ..., "eos_id": ...,
     "control_ids": [...], "eog_ids": [...], "llama_cpp": version,
     "cases": [{"text": ..., "special": bool, "ids": [...]}, ...]}

Every text is tokenized with `add_bos=False`, once with `special=False` (special-token strings
are plain text) and once with `special=True` (they become their tokens). The texts are made
here, deterministically (fixed lists plus a seeded mix of them); nothing is downloaded.
tests/models/test_tokenizer_llama_cpp.py checks our tokenizer against these ids.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

# Hand-picked texts, grouped by what they exercise.
PROSE = [
    "Hello world",
    "Hello, world!",
    " Hello world",
    "  Hello world",
    "hello  world",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Summarise this document in three bullet points.",
    "I'm sure you're right, but they'd say it's not what we'll do.",
    "don't I'll we've she's they're can't won't y'all",
    "DON'T I'LL WE'VE SHE'S THEY'RE",
    "It's 'quoted' and \"double quoted\" and `backticked`.",
    "Mr. Smith went to Washington D.C. on Jan. 5th.",
    "e.g. i.e. etc. vs. a.m. p.m.",
    "ALL CAPS SENTENCE WITH SOME WORDS",
    "camelCaseIdentifier snake_case_identifier kebab-case-identifier",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "A", "a", "I", ".", ",", "?", "!", "-", "_", "'", "\"",
]

NUMBERS = [
    "1234567", "3.14", "3.14159265358979", "-42", "+7", "1,000,000", "1 000 000", "0.001",
    "1e-10", "6.022e23", "0x1F 0b1010 0o777", "2024-01-15", "12:34:56", "$19.99", "99.9%",
    "Call 555-0123 or +1 (800) 555-0199.", "v1.2.3-beta.4", "192.168.0.1", "1/2 3/4",
    "100000000000000000000", "9", "12", "123", "1234", "12345", "123456",
]

CODE = [
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "if __name__ == \"__main__\":\n    main()",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)",
    "const add = (a, b) => a + b;\nconsole.log(add(1, 2));",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "<div class=\"box\"><p>Hi</p></div>",
    "<table><tr><td>1</td><td>2</td></tr></table>",
    "<h1>Title</h1><strong>bold</strong> <em>em</em> <code>x</code>",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }",
    "x += 1; y -= 2; z *= 3; w /= 4; v **= 5; u //= 6",
    "a != b && c == d || !e",
    "fn main() { let v: Vec<u8> = vec![1, 2, 3]; }",
    "$ ls -la | grep \".py\" > out.txt 2>&1",
    "https://example.com/path?q=1&r=two#frag",
    "user@example.org",
    "C:\\Users\\name\\Documents\\file.txt",
    "// comment\n/* block */\n# hash\n-- dash",
    "    indented four\n        indented eight\n\tTabbed",
]

WHITESPACE = [
    " ", "  ", "   ", "    ", "        ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r",
    " \n ", "\n \n", "a  b   c    d", "a\tb\t\tc", "a\nb\n\nc\n\n\nd", "line one\r\nline two",
    "trailing space ", "trailing spaces   ", "   leading spaces", "\tleading tab",
    "\nleading newline", "trailing newline\n", "mixed \t \n \t\n", "word\u00a0nbsp",
    "em\u2003space", "zero\u200bwidth", "\u3000ideographic space",
]

UNICODE = [
    "Café crème brûlée à la française",
    "naïve coöperate résumé façade",
    "Ünïcödé Äpfel Öl Übermut straße",
    "e\u0301 a\u0300 o\u0308 n\u0303",  # combining marks
    "Z\u0351\u0368\u0308a\u0300\u0301l\u0351g\u0351o\u0308",
    "Å (U+00C5) vs A\u030a (A + ring)",
    "你好，世界！",
    "我喜欢吃苹果和香蕉。",
    "日本語のテキストです。カタカナとひらがな。",
    "한국어 문장입니다.",
    "مرحبا بالعالم",
    "السلام عليكم ورحمة الله",
    "שלום עולם",
    "Привет, мир! Как дела?",
    "Γειά σου Κόσμε",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "Xin chào thế giới",
    "Tiếng Việt có dấu: ắ ằ ẳ ẵ ặ",
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷🇯🇵", "❤️", "I love 🍕 and 🍣!",
    "Emoji in a row: 😀😃😄😁😆😅😂🤣",
    "math: ∀x ∈ ℝ, ∃y: x² + y² ≤ 1 → √2 ≈ 1.414",
    "arrows ← ↑ → ↓ ↔ and boxes ┌─┐ └─┘",
    "currency € £ ¥ ₹ ₿ ¢",
    "“smart quotes” ‘single’ — em dash – en dash … ellipsis",
    "ﬁ ligature ﬂ and fullwidth ＡＢＣ１２３",
    "\u0000 null and \u0007 bell",
    "\ufeffBOM at start",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙",
    "ᚠᛇᚻ᛫ᛒᛦᚦ runes",
]

# Special-token strings of both built-in models (and some that are in neither), whole,
# partial and inside text.
SPECIAL = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>",
    "text<|im_end|>more", "<|im_start", "<|im_start|", "|im_start|>", "<|im_start|><|im_end|>",
    "<|endoftext|><|endoftext|>", " <|im_start|> ", "<repo_name>ferrox<file_sep>main.py",
    "<jupyter_code>print(1)<jupyter_output>1",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<unused0>", "<unused99>",
    "<start_of_image>", "<end_of_image>", "[multimodal]",
    "<s>", "</s>", "<|begin_of_text|>", "<|eot_id|>", "<think>reasoning</think>",
    "a<bos>b", "<bos><bos>", "<start_of_turn", "<end_of_turn>x",
]

# Fragments mixed by a seeded generator into longer texts.
WORDS = ("the of and to in is that it for was on are as with his they at be this from have or "
         "one had by word but not what all were we when your can said there use an each which "
         "she do how their if will up other about out many then them these so some her would "
         "make like him into time has look two more write go see number no way could people my "
         "than first water been call who oil its now find long down day did get come made may "
         "part tokenizer llama gemma chat ferrox model").split()
JOINERS = [" ", " ", " ", " ", "  ", "\n", "\n\n", "\t", ", ", ". ", "! ", "? ", "'s ", "'ll ",
           "n't ", " - ", "...", ": ", "; ", " (", ") ", "\" ", " \"", "/"]
ODDS = ["1234567", "3.14", "42", "2026", "😀", "你好", "مرحبا", "é", "e\u0301", "<|im_start|>",
        "<start_of_turn>", "<b>", "</div>", "    ", "\t\t", "\n\n\n", "don't", "I'll", "café",
        "naïve", "Привет", "ß", "İstanbul", "ǅ", "x²", "½", "①", "ﬁ"]


def generated_texts(count: int, seed: int = 20260101) -> list[str]:
    """`count` texts mixing words, joiners and odd fragments (the same on every run)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 24)):
            roll = rng.random()
            if roll < 0.7:
                word = rng.choice(WORDS)
                style = rng.random()
                word = word.capitalize() if style < 0.15 else word.upper() if style < 0.2 else word
                parts.append(word)
            elif roll < 0.85:
                parts.append(rng.choice(ODDS))
            else:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
            parts.append(rng.choice(JOINERS))
        text = "".join(parts)
        if rng.random() < 0.5:
            text = text.rstrip()
        if rng.random() < 0.2:
            text = " " + text
        texts.append(text)
    return texts


def all_texts() -> list[str]:
    texts = PROSE + NUMBERS + CODE + WHITESPACE + UNICODE + SPECIAL
    texts.append("Long repeated text. " * 60)
    texts.append("a" * 300)
    texts.append(" " * 100 + "x")
    texts.append("\n" * 40 + "end")
    texts.append("".join(chr(c) for c in range(0x20, 0x7F)))  # printable ASCII in one string
    texts.append("".join(chr(c) for c in range(0xA0, 0x180)))  # Latin-1 and Latin Extended-A
    texts += generated_texts(200)
    seen: set[str] = set()
    return [t for t in texts if not (t in seen or seen.add(t))]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def fixture_for(path: Path) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    cases = []
    for text in all_texts():
        for special in (False, True):
            ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
            cases.append({"text": text, "special": special, "ids": [int(i) for i in ids]})
    return {
        "model": path.name,
        "sha256": sha256_of(path),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "bos_id": int(llama_cpp.llama_vocab_bos(vocab)),
        "eos_id": int(llama_cpp.llama_vocab_eos(vocab)),
        # llama.cpp's view of the vocabulary after loading: it marks some tokens CONTROL (and
        # end-of-generation) that the file stores otherwise, e.g. Gemma 3's '</s>'.
        "control_ids": [i for i in range(n_vocab)
                        if llama_cpp.llama_vocab_get_attr(vocab, i) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL],
        "eog_ids": [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "llama_cpp": llama_cpp.__version__,
        "cases": cases,
    }


def dumps(fixture: dict) -> str:
    """JSON with one case per line (readable diffs when the fixture is regenerated)."""
    head = {k: v for k, v in fixture.items() if k != "cases"}
    lines = [json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [']
    cases = [json.dumps(c, ensure_ascii=False) for c in fixture["cases"]]
    lines += [c + "," for c in cases[:-1]] + cases[-1:]
    return "\n".join(lines) + "\n]}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path, help="GGUF files")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    for path in args.models:
        fixture = fixture_for(path)
        stem = path.name.lower().removesuffix(".gguf")
        out = args.out / f"tokenizer_ids_{stem}.json"
        out.write_text(dumps(fixture), encoding="utf-8")
        print(f"{out}: {len(fixture['cases'])} cases, add_bos {fixture['add_bos']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
