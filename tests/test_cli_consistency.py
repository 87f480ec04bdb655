"""The command line behaves alike in every subcommand: flag order, sizes, unforeseen errors."""

from __future__ import annotations

import os

import pytest

from edgeinfer import cli
from edgeinfer.cli import main
from edgeinfer.units import human_bytes


@pytest.mark.parametrize("argv", [
    ["tokenize", "{m}", "--pieces", "hello world"],
    ["tokenize", "--pieces", "{m}", "hello world"],
    ["tokenize", "{m}", "hello world", "--pieces"],
])
def test_tokenize_options_in_any_position(tiny_models, capsys, argv):
    argv = [a.format(m=tiny_models["llama"]) for a in argv]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out and all("\t" in line or "'" in line for line in out)  # the --pieces form, one per token


@pytest.mark.parametrize("command, positionals, flag, dest, value", [
    ("tokenize", ["m.gguf", "text"], ["--json"], "json", True),
    ("detokenize", ["m.gguf", "1", "2"], ["--skip-special"], "skip_special", True),
    ("show", ["m.gguf"], ["--json"], "json", True),
    ("run", ["m.gguf", "a prompt"], ["-n", "7"], "max_tokens", 7),
    ("serve", ["m.gguf"], ["--port", "8099"], "port", 8099),
    ("bench", ["m.gguf"], ["--json"], "json", True),
])
def test_flag_after_positionals_parses_as_before_them(command, positionals, flag, dest, value):
    parser = cli.build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    known = [a for a in sub._actions if dest == a.dest]
    assert known, f"{command} has no {dest}"
    before, extra1 = parser.parse_known_args([command, *flag, *positionals])
    after, extra2 = parser.parse_known_args([command, *positionals, *flag])
    assert extra1 == extra2 == []
    assert getattr(after, dest) == getattr(before, dest) == value
    assert vars(after) == vars(before)


def test_unquoted_prompt_words_make_one_prompt():
    parser = cli.build_parser()
    args, extras = parser.parse_known_args(["run", "m.gguf", "-n", "3", "why", "is", "the", "sky", "blue"])
    assert args.prompt == "why" and extras == ["is", "the", "sky", "blue"]  # main() joins them
    assert args.max_tokens == 3


def test_unforeseen_error_is_one_line_not_a_traceback(monkeypatch, capsys):
    def broken(_args):
        raise ValueError("something nobody planned for")

    import edgeinfer.commands.show as show

    monkeypatch.setattr(show, "show", broken, raising=False)
    monkeypatch.delenv("EDGEINFER_DEBUG", raising=False)
    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser, "show", broken))
    assert main(["show", "whatever.gguf"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("edgeinfer: error: ValueError: something nobody planned for")


def _with_func(parser, command, func):
    parser._subparsers._group_actions[0].choices[command].set_defaults(func=func)
    return parser


def test_one_size_formatter_for_list_show_bench_and_tui(tiny_models, capsys):
    from edgeinfer import model_info
    from edgeinfer.commands import store

    path = tiny_models["llama"]
    assert main(["show", str(path)]) == 0
    assert human_bytes(os.path.getsize(path)) in capsys.readouterr().out
    # list (store), show and bench (model_info) and the TUI's picker (model_info) share one function
    assert model_info.human_bytes is human_bytes and store.human_bytes is human_bytes
    assert human_bytes(253_000_000) == "253 MB" and human_bytes(4_920_000_000) == "4.9 GB"
