"""StopStringMatcher against a one-shot oracle (str.find on the whole text), plus result types."""

import pytest
from hypothesis import given, settings, strategies as st

from edgeinfer.results import FinishReason, GenerationChunk, GenerationResult, Timings, Usage
from edgeinfer.stopping import StopStringMatcher

# A small alphabet makes stop strings (and their partial prefixes) occur often.
ALPHABET = "ab<\n"


def expected_visible(text: str, stops: list[str]) -> tuple[str, bool]:
    """Oracle on the whole text: cut at the stop string that completes first
    (ties: the one that starts first); no stop string -> the whole text."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if text.find(s) >= 0]
    return (text[: min(hits)[1]], True) if hits else (text, False)


def run_stream(pieces: list[str], stops: list[str]) -> tuple[list[str], bool, str]:
    m = StopStringMatcher(stops)
    emitted, stopped = [], False
    for p in pieces:
        out, stopped = m.push(p)
        emitted.append(out)
        if stopped:
            break
    tail = "" if stopped else m.flush()
    return emitted, stopped, tail


@st.composite
def split_text(draw):
    text = draw(st.text(alphabet=ALPHABET, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=400, deadline=None)
@given(split_text(), st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), max_size=4))
def test_stream_matches_oracle(text_pieces, stops):
    text, pieces = text_pieces
    emitted, stopped, tail = run_stream(pieces, stops)
    want, want_stopped = expected_visible(text, stops)
    assert "".join(emitted) + tail == want
    assert stopped == want_stopped
    # Nothing shown so far ever contains a stop string, even across chunk boundaries.
    shown = ""
    for out in emitted:
        shown += out
        assert not any(s in shown for s in stops)


def test_partial_stop_is_held_then_released():
    m = StopStringMatcher(["</s>"])
    assert m.push("hello </") == ("hello ", False)
    assert m.push("b") == ("</b", False)
    assert m.push(" </s") == (" ", False)
    assert m.flush() == "</s"


def test_stop_inside_one_piece_and_after_stop():
    m = StopStringMatcher(["STOP", "END"])
    assert m.push("abcENDxSTOP") == ("abc", True)
    assert m.matched == "END"
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_overlapping_stop_strings_earliest_start_wins():
    # "xab" starts earlier than "ab" although "ab" completes at the same point.
    emitted, stopped, _ = run_stream(["0x", "a", "b1"], ["ab", "xab"])
    assert "".join(emitted) == "0" and stopped


@pytest.mark.parametrize("pieces", [["a<<"], ["a<", "<"], ["a", "<", "<"]])
def test_shorter_stop_that_completes_first_wins_for_any_split(pieces):
    emitted, stopped, _ = run_stream(pieces, ["<", "a<<"])
    assert "".join(emitted) == "a" and stopped


def test_no_stop_strings_pass_everything():
    m = StopStringMatcher([])
    assert m.push("abc") == ("abc", False)
    assert m.flush() == ""


def test_timings_from_clock():
    t = Timings.from_clock(t_start=10.0, t_first_token=10.5, t_end=12.5,
                           n_prompt_tokens_evaluated=100, n_generated=11)
    assert t.ttft_s == pytest.approx(0.5) and t.prompt_s == pytest.approx(0.5)
    assert t.prompt_tps == pytest.approx(200.0)
    assert t.gen_s == pytest.approx(2.0)
    assert t.gen_tps == pytest.approx(5.0)      # 10 tokens after the first in 2 s
    assert t.tpot_s == pytest.approx(0.2)


def test_timings_without_tokens_has_no_division_by_zero():
    t = Timings.from_clock(1.0, None, 1.0, 0, 0)
    assert (t.ttft_s, t.prompt_tps, t.gen_tps, t.tpot_s) == (0.0, 0.0, 0.0, 0.0)


def test_result_types():
    u = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4)
    assert u.total_tokens == 10
    t = Timings.from_clock(0.0, 0.1, 0.3, 7, 3)
    r = GenerationResult(text="hi", tokens=[1, 2, 3], finish_reason=FinishReason.LENGTH, usage=u, timings=t)
    c = GenerationChunk(text="", token=None, finish_reason=FinishReason.STOP, usage=u, timings=t)
    assert r.finish_reason == "length" and c.finish_reason == "stop" and c.token is None
