"""The chat screen's policy (tui/controller.py, tui/export.py) as plain functions: no terminal."""

from __future__ import annotations

import pytest

from edgeinfer.sessions.conversations import Conversation
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


# -- loading ---------------------------------------------------------------------------------------

def test_load_progress_names_the_kernel_count():
    done, label = c.load_progress("compile", 0.25, count=(3, 12))
    assert label == "compiling kernels (first start only) 3/12"
    assert c.load_progress("prepare", 1)[0] <= done <= c.load_progress("compile", 1)[0]


def test_the_first_starts_compile_count_reaches_the_loading_stage():
    from edgeinfer.kernels_cpu import compile_progress
    from edgeinfer.tui.loading import open_model

    before = compile_progress.get_reporter()
    seen = []

    def progress(stage, fraction=None, count=None):
        seen.append((stage, count))

    class Model:
        path = "m.gguf"

    def loader(name, n_ctx):  # edgeinfer.load warms up under the installed reporter
        report = compile_progress.get_reporter()
        report(0, 2, False), report(1, 2, False), report(2, 2, True)
        return Model()

    assert isinstance(open_model(loader, "m", 64, progress, warm_up=False), Model)
    assert seen == [("read", None), ("compile", (0, 2)), ("compile", (1, 2)), ("compile", (2, 2))]
    assert compile_progress.get_reporter() is before  # put back after the load
    with pytest.raises(RuntimeError):
        open_model(lambda name, n_ctx: (_ for _ in ()).throw(RuntimeError("x")), "m", 64, progress,
                   warm_up=False)
    assert compile_progress.get_reporter() is before


def test_live_rate_times_the_first_piece_then_counts_pieces_per_second():
    live = c.LiveRate(prompt_tokens=10, start=100.0)
    live.piece(100.5)
    assert live.ttft_s == 0.5 and live.gen_tps is None and live.ctx_used == 11
    live.piece(101.0), live.piece(101.5)
    assert live.gen_tps == 2.0 and live.ctx_used == 13


# -- conversation, model and K/V policy (tui/session_policy.py) -----------------------------------

from types import SimpleNamespace  # noqa: E402

from edgeinfer.tui import session_policy as sp  # noqa: E402

A = {"name": "a", "size": 100, "digest": "aa" * 32}
B = {"name": "b", "size": 200, "digest": "bb" * 32}


@pytest.fixture
def files(monkeypatch):
    """Model names on this machine -> their file identities (conversations.identify, offline)."""
    local = {"a": A, "/models/a.gguf": A, "b": B}
    asked = []

    def identify(name, size=None):
        asked.append(name)
        ident = local.get(name)
        return ident if ident and (size is None or ident["size"] == size) else None

    monkeypatch.setattr(sp, "identify", identify)
    return asked


def said(model="", identity=None, path="", n_kv=0, save_kv=False, cid="chat-1"):
    return Conversation(id=cid, model=model, identity=dict(identity or {}), model_path=path, n_kv=n_kv,
                        settings={"n_ctx": 64, "save_kv": save_kv},
                        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])


def follow(conv, loaded=None, loading=None, model_name=None, candidates=("a", "b")):
    return sp.follow_model(conv, loaded=loaded, loading=loading, model_name=model_name,
                           candidates=lambda: list(candidates))


def test_opening_a_conversation_follows_its_model(files):
    assert follow(Conversation()) == sp.Follow("keep")  # empty: nothing to follow
    assert follow(said("b", B), loaded=B, model_name="b") == sp.Follow("restore")
    assert follow(said("b", B), loaded=A, model_name="a") == sp.Follow("load", "b")
    assert follow(said("b", B), loading="b", model_name="b") == sp.Follow("wait")
    assert follow(said("b", B), loading="a", model_name="a") == sp.Follow("load", "b")
    # Known by its file only: found among the local models under another name.
    assert follow(said("renamed-b", B), loaded=A, model_name="a") == sp.Follow("load", "b")
    # Its file is not on this machine (or has another size): the messages show with the loaded model.
    assert follow(said("c", {"name": "c", "size": 1, "digest": "cc" * 32}), loaded=A) == sp.Follow("missing")
    assert follow(said("b", {**B, "size": 201}), loaded=A) == sp.Follow("missing")
    # An early conversation, known only by a name: missing unless it is the loaded name.
    assert follow(said("old-name"), loaded=A, model_name="a") == sp.Follow("missing")
    assert follow(said("old-name"), loaded=A, model_name="old-name") == sp.Follow("keep")
    # With no identity saved, the name it was loaded by says which file it means.
    assert follow(said("a"), loaded=A, model_name="a") == sp.Follow("restore")


def test_locating_a_model_file_tries_its_name_its_path_then_the_local_models(files):
    conv = said("gone", A, path="/models/a.gguf")
    assert sp.locate(conv, A, lambda: ["b", "a"]) == "/models/a.gguf"
    assert files[:2] == ["gone", "/models/a.gguf"]
    files.clear()
    assert sp.locate(said("b", A), A, lambda: ["b", "b", "a"]) == "a"
    assert files == ["b", "a"]  # each name tried once
    assert sp.locate(said("x", A), {**A, "size": 5}, lambda: ["a"]) is None  # the size must match too


def test_settings_saved_with_a_conversation_are_checked():
    defaults = {"temperature": 0.8, "top_k": 40, "n_ctx": 4096, "save_kv": False}
    base = dict(sp.DEFAULT_SAMPLING)
    good, ok = sp.checked_settings({"temperature": 0.2, "n_ctx": 512, "save_kv": True}, 0, defaults, base)
    assert ok and good == {**defaults, "temperature": 0.2, "n_ctx": 512, "save_kv": True}
    for bad in ({"temperature": -1.0}, {"n_ctx": 8}, {"n_ctx": "big"}, {"top_k": "x"}):
        settings, ok = sp.checked_settings({**bad, "save_kv": True}, 0, defaults, base)
        assert not ok and settings == {**defaults, "save_kv": True}
    # Made by `edgeinfer run` (no save_kv setting): keeps saving K/V when its file holds some.
    assert sp.checked_settings({}, 12, defaults, base)[0]["save_kv"] is True
    assert sp.checked_settings({}, 0, defaults, base)[0]["save_kv"] is False
    assert sp.checked_settings({"save_kv": "yes"}, 0, defaults, base)[0]["save_kv"] is False


class FakeStore:
    """What ChatSession asks of a ConversationStore, recorded."""

    def __init__(self, convs=()):
        self.convs = {cv.id: cv for cv in convs}
        self.saved = []
        self.n = 0

    def new_id(self):
        self.n += 1
        return f"chat-{self.n}"

    def load(self, conv_id):
        return self.convs[conv_id]

    def save(self, conv, *, sampling=None, kv=None, keep_kv=False):
        self.saved.append(dict(id=conv.id, sampling=sampling, kv=kv, keep_kv=keep_kv))

    def load_kv(self, conv, identity, n_layer):
        kv = ([1, 2, 3], "K", "V", 3, None, "k=f16,v=f16")  # SavedSession.saved_kv's fields
        return SimpleNamespace(tokens=[1, 2, 3], k="K", v="V", pos=3, state=None, saved_kv=lambda: kv)


def model(identity=A, exported=None, n_ctx=64):
    imported = []
    return SimpleNamespace(identity=identity, path="/models/a.gguf", n_ctx=n_ctx, imported=imported,
                           config=SimpleNamespace(n_layer=1),
                           sessions=SimpleNamespace(export_kv=lambda: exported,
                                                    import_kv=lambda *kv: imported.append(kv) or len(kv[0])))


def test_saved_kv_is_restored_once_into_the_model_that_made_it():
    store = FakeStore([said("a", A, n_kv=3, save_kv=True), said("a", A, cid="chat-2")])
    s = sp.ChatSession(store)
    assert s.open("chat-1")
    m = model()
    assert not s.restore_kv(None, False) and not s.restore_kv(m, True)  # no model yet, or loading
    assert not s.restore_kv(model(B), False)  # K/V of another model's tokens
    assert s.restore_kv(m, False)
    saved, n = s.import_kv(m, s.conv)
    assert n == 3 and m.imported == [([1, 2, 3], "K", "V", 3, None, "k=f16,v=f16")]
    assert not s.kv_restored("chat-2", saved, n)  # another conversation was opened meanwhile
    assert s.kv_restored("chat-1", saved, n) and s.kv == ([1, 2, 3], "K", "V", 3, None)  # kept for the next save
    assert not s.restore_kv(m, False)  # the model holds them now
    s.model_loading()
    assert s.restore_kv(m, False)  # a reloaded model does not
    s.open("chat-2")
    assert not s.restore_kv(m, False)  # its file holds no K/V


def test_what_a_save_writes():
    store = FakeStore()
    s = sp.ChatSession(store, sampling={"temperature": 0.3, "seed": 7}, n_ctx=64)
    m = model(exported=("toks", "k", "v", 2))
    s.conv.messages.append({"role": "user", "content": "hi"})
    s.begin_answer(m, "a")
    assert s.conv.model == "a" and s.conv.identity == A and s.conv.model_path == "/models/a.gguf"
    s.save(m, generating=True)  # the question, before the answer
    assert store.saved[-1]["kv"] is None and store.saved[-1]["keep_kv"] is False  # save_kv off
    assert store.saved[-1]["sampling"]["temperature"] == 0.3 and store.saved[-1]["sampling"]["seed"] == 7
    s.conv.settings["save_kv"] = True
    s.save(m, generating=True)
    assert store.saved[-1]["kv"] is None and store.saved[-1]["keep_kv"]  # mid-answer: keep the file's K/V
    s.answered()
    s.save(m, generating=False)
    assert store.saved[-1]["kv"] == ("toks", "k", "v", 2)  # idle and holding this conversation: export
    s.begin_answer(model(B), "b")  # the same conversation goes on with another model
    assert s.kv is None
    s.save(model(B, exported=("other",)), generating=False)
    assert store.saved[-1]["kv"] == ("other",)  # it answered for this conversation (resident)
    s.model_loading()
    s.save(model(B, exported=("stale",)), generating=False)
    assert store.saved[-1]["kv"] == ("other",)  # reloaded: what was exported last


def test_settings_apply_to_the_conversation_and_the_next_new_ones():
    store = FakeStore()
    s = sp.ChatSession(store, sampling={"top_k": 5}, system="Be brief", n_ctx=64)
    assert s.conv.system == "Be brief" and s.conv.settings["top_k"] == 5 and s.conv.settings["n_ctx"] == 64
    values = {**s.conv.settings, "temperature": 0.1, "n_ctx": 128, "system": "Be kind"}
    assert not s.apply_settings(values)  # nothing to save yet
    assert s.params()["temperature"] == 0.1 and s.context_to_load(model(n_ctx=64)) == 128
    assert s.context_to_load(model(n_ctx=128)) is None and s.context_to_load(None) is None
    s.conv.messages.append({"role": "user", "content": "hi"})
    assert s.apply_settings(values)
    old = s.start_new(model(), "a")
    assert s.conv.id != old.id and s.conv.system == "Be kind" and s.conv.settings["temperature"] == 0.1
    assert s.conv.identity == A and s.conv.messages == []
    assert s.initial_settings["temperature"] == 0.8 and s.fresh(None, None).settings["n_ctx"] == 128
    s.keep_partial(None, "half an ans")
    assert s.conv.messages[-1] == {"role": "assistant", "content": "half an ans", "finish_reason": "cancelled"}
    assert s.last_answer() == "half an ans"


def test_an_answer_that_ends_settles_the_turn():
    s = sp.ChatSession(FakeStore())
    s.conv.messages.append({"role": "user", "content": "q"})
    end = s.end_answer(None, "A", "stop")
    assert end.kind == "answer" and s.conv.messages[-1] == end.message == \
        {"role": "assistant", "content": "A", "finish_reason": "stop"}
    previous = s.conv.messages.pop()
    end = s.end_answer(previous, "B", None)  # regenerated; no final chunk came
    assert end.message["finish_reason"] == "error" and c.answers_of(end.message) == ["A", "B"]
    previous = s.conv.messages.pop()
    assert s.end_answer(previous, "", "cancelled") == sp.AnswerEnd("previous", message=previous)
    assert s.conv.messages[-1] is previous  # nothing streamed: the earlier answers are back
    s.conv.messages.append({"role": "user", "content": "again"})
    assert s.end_answer(None, "", "cancelled") == sp.AnswerEnd("question", question="again")
    assert s.conv.messages[-1] is previous  # the question went back to the prompt box
    assert s.take_back_last_message() == (1, "q") and s.conv.messages == []
    assert s.take_back_last_message() == (0, None) and s.end_answer(None, "", "stop").kind == "nothing"
