"""`edgeinfer tokenize NAME TEXT` and `edgeinfer detokenize NAME IDS...` (like llama-tokenize).

    edgeinfer tokenize gemma3-270m "Hello world"          # 2 9259 1902
    edgeinfer tokenize m.gguf --file prompt.txt --json    # [2, 9259, ...]
    edgeinfer tokenize m.gguf "Hi" --pieces               # one "id<TAB>'piece'" line per token
    edgeinfer detokenize m.gguf 2 9259 1902               # <bos>Hello world
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from edgeinfer.errors import EdgeInferError, TokenizerError


def register(sub) -> None:
    p = sub.add_parser("tokenize", help="print the token ids of a text")
    p.add_argument("name", help="model alias, hf.co/owner/repo[:quant] or path to a .gguf file")
    p.add_argument("text", nargs="?", help="text to tokenize (or use --file / stdin '-')")
    p.add_argument("--file", "-f", type=Path, help="read the text from this file")
    p.add_argument("--json", action="store_true", help="print a JSON list of ids only")
    p.add_argument("--pieces", action="store_true", help="print id and piece per token")
    p.add_argument("--no-bos", action="store_true", help="do not add BOS/EOS as the model would")
    p.add_argument("--parse-special", action="store_true",
                   help="turn special-token text like <|eot_id|> into special tokens")
    p.set_defaults(func=run_tokenize)

    d = sub.add_parser("detokenize", help="print the text of token ids")
    d.add_argument("name", help="model alias, hf.co/owner/repo[:quant] or path to a .gguf file")
    d.add_argument("ids", nargs="+", help="token ids (spaces or commas between them; JSON list ok)")
    d.add_argument("--skip-special", action="store_true", help="leave out control tokens")
    d.set_defaults(func=run_detokenize)


def _tokenizer(name: str):
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.store.registry import resolve
    from edgeinfer.tokenizer import load_tokenizer

    return load_tokenizer(GGUFFile.open(resolve(name, download=False)))


def _read_text(args) -> str:
    if args.file is not None:
        if args.text is not None:
            raise EdgeInferError("give either TEXT or --file, not both")
        try:
            return args.file.read_bytes().decode("utf-8", "surrogateescape")
        except OSError as exc:
            raise EdgeInferError(f"cannot read {args.file}: {exc.strerror}") from None
    if args.text is None or args.text == "-":
        return sys.stdin.read()
    return args.text


def run_tokenize(args) -> int:
    text = _read_text(args)
    tok = _tokenizer(args.name)
    # surrogateescape keeps bytes that are not UTF-8 (from --file) exactly as they were
    data = text.encode("utf-8", "surrogateescape")
    ids = tok.tokenize(data, add_special=not args.no_bos, parse_special=args.parse_special)
    if args.json:
        print(json.dumps(ids))
    elif args.pieces:
        for i in ids:
            piece = tok.token_to_piece(i, special=True).decode("utf-8", "replace")
            print(f"{i:>7} {piece!r}")
    else:
        print(" ".join(map(str, ids)))
    return 0


def parse_ids(words: list[str]) -> list[int]:
    """Ids from CLI words: '1 2 3', '1,2,3' or '[1, 2, 3]'."""
    ids = []
    for part in " ".join(words).replace(",", " ").replace("[", " ").replace("]", " ").split():
        try:
            ids.append(int(part))
        except ValueError:
            raise TokenizerError(f"not a token id: {part!r}") from None
    return ids


def run_detokenize(args) -> int:
    ids = parse_ids(args.ids)
    tok = _tokenizer(args.name)
    for i in ids:
        if not 0 <= i < tok.vocab_size:
            raise TokenizerError(f"token id {i} is out of range 0..{tok.vocab_size - 1}")
    sys.stdout.write(tok.detokenize(ids, skip_special=args.skip_special) + "\n")
    return 0
