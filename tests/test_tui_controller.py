"""The chat screen's policy (tui/controller.py, tui/export.py) as plain functions: no terminal."""

from __future__ import annotations

import pytest

from edgeinfer.conversations import Conversation
from edgeinfer.tui import controller as c
from edgeinfer.tui.export import export_markdown, export_name, to_markdown


# -- alternatives of a turn --------------------------------------------------------------------

def test_regenerated_answers_are_kept_and_stepped_through():
    first = c.new_answer(None, "A", "stop")
    assert first == {"role": "assistant", "content": "A", "finish_reason": "stop"}  # an ordinary message
    assert c.answer_position(first) == ""
    second = c.new_answer(first, "B", "stop")
    third = c.new_answer(second, "C", "length")
    assert third["content"] == "C" and c.answers_of(third) == ["A", "B", "C"]
    assert c.answer_position(third) == "3/3"
    assert not c.step_answer(third, +1)  # no answer after the last
    assert c.step_answer(third, -1) and third["content"] == "B" and c.answer_position(third) == "2/3"
    assert c.step_answer(third, -1) and third["content"] == "A" and c.answer_position(third) == "1/3"
    assert not c.step_answer(third, -1) and third["content"] == "A"
    # Regenerating while an older answer is shown keeps all of them, the new one last.
    fourth = c.new_answer(third, "D", "stop")
    assert c.answers_of(fourth) == ["A", "B", "C", "D"] and c.answer_position(fourth) == "4/4"


def test_messages_without_or_with_broken_alternatives_have_one_answer():
    plain = {"role": "assistant", "content": "x"}
    assert c.answers_of(plain) == ["x"] and c.choice_of(plain) == 0 and not c.step_answer(plain, 1)
    stale = {"role": "assistant", "content": "edited", "alternatives": ["a", "b"], "choice": 1}
    assert c.answers_of(stale) == ["edited"]  # content not among them: they do not describe it
    wrong_choice = {"role": "assistant", "content": "b", "alternatives": ["a", "b"], "choice": 7}
    assert c.choice_of(wrong_choice) == 1 and c.answer_position(wrong_choice) == "2/2"
    junk = {"role": "assistant", "content": "a", "alternatives": "ab"}
    assert c.answers_of(junk) == ["a"]


# -- search --------------------------------------------------------------------------------------

def conv(cid, title, *messages, system=""):
    return Conversation(id=cid, title=title, system=system,
                        messages=[{"role": r, "content": t} for r, t in messages])


def test_search_matches_titles_first_then_text_all_words_case_insensitive():
    convs = [conv("chat-1", "Paris trip", ("user", "plan a weekend")),
             conv("chat-2", "", ("user", "What is the capital of France?"), ("assistant", "It is Paris.")),
             conv("chat-3", "Cooking", ("user", "pasta recipe"))]
    hits = c.search(convs, "paris")
    assert [h.conv_id for h in hits] == ["chat-1", "chat-2"] and hits[0].in_title and not hits[1].in_title
    assert "Paris" in hits[1].snippet
    assert [h.conv_id for h in c.search(convs, "CAPITAL france")] == ["chat-2"]
    assert c.search(convs, "capital pasta") == [] and c.search(convs, "   ") == []


def test_search_finds_text_in_alternative_answers_and_the_system_prompt():
    a = conv("chat-a", "x", ("user", "q"))
    a.messages.append(c.new_answer(c.new_answer(None, "first zebra", "stop"), "second", "stop"))
    b = conv("chat-b", "y", ("user", "q"), system="You speak like a pirate")
    assert [h.conv_id for h in c.search([a, b], "zebra")] == ["chat-a"]
    assert [h.conv_id for h in c.search([a, b], "pirate")] == ["chat-b"]


# -- settings ------------------------------------------------------------------------------------

RAW = dict(temperature="0.7", top_p="0.9", top_k="40", min_p="0.05", repeat_penalty="1.1", seed="",
           stop="", max_tokens="-1", n_ctx="2048", save_kv=False)


def test_settings_parse_new_fields():
    v = c.parse_settings({**RAW, "seed": "42", "stop": "User:, \\n\\n, a\\,b"})
    assert v["seed"] == 42 and v["stop"] == ["User:", "\n\n", "a,b"]
    assert v["min_p"] == 0.05 and v["repeat_penalty"] == 1.1 and v["n_ctx"] == 2048 and v["save_kv"] is False
    assert c.parse_settings(RAW)["seed"] is None and c.parse_settings(RAW)["stop"] == []
    # What the box shows parses back to the same value.
    for stops in (["User:", "\n\n", "a,b", "x\\y"], []):
        assert c.parse_settings({**RAW, "stop": c.format_setting("stop", stops)})["stop"] == stops
    assert c.format_setting("seed", None) == "" and c.format_setting("seed", 7) == "7"


@pytest.mark.parametrize("key, value, words", [
    ("min_p", "1.5", "min_p"), ("repeat_penalty", "0", "repeat_penalty"), ("seed", "-5", "Seed"),
    ("seed", "abc", "Seed"), ("temperature", "warm", "Temperature"), ("top_k", "2.5", "Top-k"),
    ("n_ctx", "8", "Context size"), ("top_p", "nan", "Top-p"), ("max_tokens", "-2", "max_tokens"),
])
def test_bad_settings_are_one_line_errors(key, value, words):
    with pytest.raises(c.SettingsError) as err:
        c.parse_settings({**RAW, key: value})
    assert words in str(err.value) and "\n" not in str(err.value)


# -- layout and texts -----------------------------------------------------------------------------

KEYS = [c.Key("Enter", "send"), c.Key("Esc", "stop"), c.Key("^N", "new"), c.Key("^R", "regenerate"),
        c.Key("^S", "settings"), c.Key("^O", "model"), c.Key("F3", "copy answer"), c.Key("F1", "help")]


@pytest.mark.parametrize("columns", [20, 40, 80, 120, 200])
def test_footer_always_fits_and_always_names_help(columns):
    line = c.footer_text(KEYS, columns)
    assert len(line) <= columns and "F1 help" in line


def test_footer_shows_every_key_when_wide_and_the_first_ones_when_narrow():
    wide = c.footer_text(KEYS, 200)
    assert all(f"{k.key} {k.label}" in wide for k in KEYS)
    narrow = c.footer_text(KEYS, 60)
    assert narrow.startswith("Enter send") and narrow.endswith("F1 help") and "F3" not in narrow


def test_sidebar_narrows_on_small_terminals():
    assert c.sidebar_width(120) == 30 and c.sidebar_width(80) == 22 and c.sidebar_width(40) == 18


def test_welcome_names_the_model_or_how_to_get_one():
    assert "**gemma3-270m**" in c.welcome_text("gemma3-270m") and "F1" in c.welcome_text("x")
    assert "Ctrl+O" in c.welcome_text(None) and "No model" in c.welcome_text(None)


def test_new_chat_notice_says_what_carries_over():
    defaults = {"temperature": 0.8, "top_k": 40}
    assert c.new_chat_notice("", defaults, defaults) == \
        "New chat: keeps no system prompt and the default settings (Ctrl+S changes them)"
    assert "the system prompt and changed settings (temperature)" in \
        c.new_chat_notice("Be brief", {"temperature": 0.2, "top_k": 40}, defaults)


def test_load_progress_moves_forward_through_the_stages():
    seen = [c.load_progress(s, f)[0] for s, f in
            [("resolve", 0), ("read", 0.5), ("read", 1), ("prepare", None), ("compile", 0.5), ("ready", 1)]]
    assert seen == sorted(seen) and seen[-1] == 1.0
    assert "compiling kernels" in c.load_progress("compile")[1]
    assert c.load_progress("something new") == (0.0, "something new")


# -- export ---------------------------------------------------------------------------------------

def test_markdown_export_holds_every_part_and_is_written_atomically(tmp_path):
    chat = conv("chat-0123456789ab", "Trip/../plan", ("user", "where?"), system="Be brief")
    chat.model = "gemma3-270m"
    chat.messages.append(c.new_answer(c.new_answer(None, "Rome", "stop"), "Paris", "stop"))
    text = to_markdown(chat)
    assert text.startswith("# Trip/../plan\n") and "*Model: gemma3-270m*" in text
    assert "## System\n\nBe brief" in text and "## You\n\nwhere?" in text
    assert "## Assistant (answer 2 of 2)\n\nParis" in text and "### Other answer 1 of 2\n\nRome" in text
    assert export_name(chat) == "trip-plan-chat-0123456789ab.md"  # never a path from the title
    path = export_markdown(chat, tmp_path)
    assert path.parent == tmp_path and path.read_text(encoding="utf-8") == text
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    path.write_text("old")
    export_markdown(chat, tmp_path)
    assert path.read_text(encoding="utf-8") == text
