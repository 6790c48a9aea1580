"""Which files we read, by name: the kind of a file and the language of its code fence.

The ONE place a file name is mapped to a document kind. Names only -- no I/O -- so the UI can
ask `is_probably_supported` on every drag-enter. Content sniffing (binary, encoding, PDF magic)
happens in `text.py` and `extract.py` once the file is read.
"""

from __future__ import annotations

import os
from pathlib import PurePath

# Kinds a Document can have.
TEXT, MARKDOWN, CODE, CSV, JSON, PDF, DOCX = "text", "markdown", "code", "csv", "json", "pdf", "docx"

# Source code and config: suffix -> language name for the prompt's code fence.
CODE_LANGUAGES: dict[str, str] = {
    ".py": "python", ".pyi": "python", ".pyw": "python",
    ".js": "javascript", ".mjs": "javascript", ".cjs": "javascript", ".jsx": "jsx",
    ".ts": "typescript", ".mts": "typescript", ".cts": "typescript", ".tsx": "tsx",
    ".c": "c", ".h": "c",
    ".cpp": "cpp", ".cc": "cpp", ".cxx": "cpp", ".c++": "cpp",
    ".hpp": "cpp", ".hh": "cpp", ".hxx": "cpp", ".h++": "cpp", ".ino": "cpp",
    ".cu": "cuda", ".cuh": "cuda",
    ".m": "objectivec", ".mm": "objectivec",
    ".rs": "rust", ".go": "go", ".zig": "zig", ".nim": "nim", ".d": "d", ".v": "verilog",
    ".java": "java", ".kt": "kotlin", ".kts": "kotlin", ".scala": "scala", ".sc": "scala",
    ".groovy": "groovy", ".gradle": "groovy", ".clj": "clojure", ".cljs": "clojure",
    ".swift": "swift", ".dart": "dart",
    ".cs": "csharp", ".fs": "fsharp", ".fsx": "fsharp", ".vb": "vbnet",
    ".rb": "ruby", ".php": "php", ".pl": "perl", ".pm": "perl", ".lua": "lua",
    ".r": "r", ".jl": "julia", ".ex": "elixir", ".exs": "elixir", ".erl": "erlang",
    ".hs": "haskell", ".ml": "ocaml", ".mli": "ocaml", ".elm": "elm",
    ".f90": "fortran", ".f95": "fortran", ".f": "fortran", ".pas": "pascal",
    ".asm": "asm", ".s": "asm", ".sol": "solidity", ".vhd": "vhdl", ".vhdl": "vhdl",
    ".sh": "sh", ".bash": "bash", ".zsh": "zsh", ".fish": "fish",
    ".ps1": "powershell", ".psm1": "powershell", ".bat": "batch", ".cmd": "batch",
    ".sql": "sql", ".graphql": "graphql", ".gql": "graphql", ".proto": "protobuf",
    ".html": "html", ".htm": "html", ".xhtml": "html", ".css": "css", ".scss": "scss",
    ".sass": "sass", ".less": "less", ".vue": "vue", ".svelte": "svelte", ".astro": "astro",
    ".xml": "xml", ".xsd": "xml", ".xsl": "xml", ".svg": "xml", ".plist": "xml",
    ".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".ini": "ini", ".cfg": "ini",
    ".conf": "ini", ".properties": "properties", ".env": "dotenv",
    ".tf": "hcl", ".hcl": "hcl", ".nix": "nix", ".cmake": "cmake", ".mk": "makefile",
    ".dockerfile": "dockerfile", ".tex": "latex", ".bib": "bibtex",
    ".diff": "diff", ".patch": "diff",
}

# Well-known extension-less (or oddly named) source files: name -> fence language.
CODE_FILE_NAMES: dict[str, str] = {
    "Dockerfile": "dockerfile", "Containerfile": "dockerfile", "Makefile": "makefile",
    "GNUmakefile": "makefile", "CMakeLists.txt": "cmake", "Gemfile": "ruby",
    "Rakefile": "ruby", "Vagrantfile": "ruby", "Jenkinsfile": "groovy",
}

_KIND_BY_SUFFIX: dict[str, str] = {
    **{suffix: CODE for suffix in CODE_LANGUAGES},
    ".txt": TEXT, ".text": TEXT, ".log": TEXT, ".rst": TEXT, ".adoc": TEXT, ".org": TEXT,
    ".srt": TEXT, ".vtt": TEXT, ".rtf": TEXT,
    ".md": MARKDOWN, ".markdown": MARKDOWN, ".mdx": MARKDOWN,
    ".csv": CSV, ".tsv": CSV,
    ".json": JSON, ".jsonl": JSON, ".ndjson": JSON, ".geojson": JSON, ".ipynb": JSON,
    ".pdf": PDF, ".docx": DOCX,
}

# What the file dialog offers (lower-case, with the dot).
SUPPORTED_SUFFIXES: frozenset[str] = frozenset(_KIND_BY_SUFFIX)

GGUF_REASON = "it is a GGUF model file; add it as a model instead of attaching it to a message."

# Suffixes we refuse without reading the file: suffix -> what the file is, for the message.
_REFUSED_SUFFIXES: dict[str, str] = {
    **{s: "an image" for s in (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif",
                               ".tiff", ".ico", ".heic", ".heif", ".avif", ".psd")},
    **{s: "audio or video" for s in (".mp3", ".wav", ".flac", ".ogg", ".m4a", ".aac", ".mp4",
                                     ".mkv", ".mov", ".avi", ".webm", ".wmv")},
    **{s: "an archive" for s in (".zip", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z", ".rar",
                                 ".tar", ".jar", ".whl", ".dmg", ".iso")},
    **{s: "a program or library" for s in (".exe", ".dll", ".so", ".dylib", ".o", ".a",
                                           ".obj", ".lib", ".class", ".pyc", ".wasm", ".msi",
                                           ".app", ".apk", ".deb", ".rpm")},
    **{s: "a model weights file" for s in (".safetensors", ".pt", ".pth", ".ckpt", ".onnx")},
    **{s: "a database" for s in (".sqlite", ".sqlite3", ".db")},
    **{s: "a font" for s in (".ttf", ".otf", ".woff", ".woff2")},
}
# Documents whose text we could want but cannot read.
_UNREADABLE_DOCUMENT_SUFFIXES = frozenset({".doc", ".xls", ".xlsx", ".ppt", ".pptx", ".odt",
                                           ".ods", ".odp", ".pages", ".numbers", ".epub"})


def suffix_of(path: str | os.PathLike) -> str:
    return PurePath(path).suffix.lower()


def kind_of(path: str | os.PathLike) -> str:
    """The kind a file is read as, by name. Unknown and missing suffixes read as text."""
    if PurePath(path).name in CODE_FILE_NAMES:
        return CODE
    return _KIND_BY_SUFFIX.get(suffix_of(path), TEXT)


def fence_language(path: str | os.PathLike) -> str:
    """The language name for a code fence around this file's text; '' when there is none."""
    name = PurePath(path).name
    if name in CODE_FILE_NAMES:
        return CODE_FILE_NAMES[name]
    suffix = suffix_of(path)
    if suffix in CODE_LANGUAGES:
        return CODE_LANGUAGES[suffix]
    return {MARKDOWN: "markdown", CSV: "csv", JSON: "json"}.get(_KIND_BY_SUFFIX.get(suffix), "")


def refusal_by_name(path: str | os.PathLike) -> str | None:
    """Why a file cannot be attached, judged by its suffix alone; None when it may be read."""
    suffix = suffix_of(path)
    if suffix == ".gguf":
        return GGUF_REASON
    if suffix in _REFUSED_SUFFIXES:
        return f"it is {_REFUSED_SUFFIXES[suffix]}, not a text document."
    if suffix in _UNREADABLE_DOCUMENT_SUFFIXES:
        return (f"{suffix} files cannot be read; save it as a Word .docx, PDF, CSV or plain "
                "text file and attach that.")
    return None


def is_probably_supported(path: str | os.PathLike) -> bool:
    """A cheap, name-only guess for drag-enter feedback.

    True for the supported suffixes and for unknown or missing suffixes (those are sniffed as
    text when dropped); False for images, media, archives, programs, model files and Office
    formats other than .docx. `extract_document` has the final word.
    """
    return refusal_by_name(path) is None
