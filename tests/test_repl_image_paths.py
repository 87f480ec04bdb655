"""The REPL attaches image files whose paths are typed into a message, as `ollama run` does
(edgeinfer/commands/image_paths.py), only for a model that takes images."""

from __future__ import annotations

import io

import pytest
from image_fixtures import FakeProjector, write_gemma3

from edgeinfer.api import Model
from edgeinfer.cli import build_parser
from edgeinfer.commands.image_paths import image_paths, starts_with_image_path
from edgeinfer.commands.repl import Repl
from edgeinfer.engine import EngineOptions
from edgeinfer.vision.media_ids import image_runs

N_EMBD = 64


@pytest.fixture
def pics(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    (tmp_path / "my pics").mkdir()
    paths = {"red": tmp_path / "red.png", "spaced": tmp_path / "my pics" / "Blue Cat.JPG",
             "gif": tmp_path / "anim.gif", "text": tmp_path / "notes.png"}
    Image.new("RGB", (8, 6), (200, 10, 10)).save(paths["red"])
    Image.new("RGB", (4, 4), (10, 10, 200)).save(paths["spaced"], format="JPEG")
    Image.new("RGB", (3, 3), (10, 200, 10)).save(paths["gif"], format="GIF")
    paths["text"].write_text("not an image at all")
    return {k: str(v) for k, v in paths.items()}


def test_existing_paths_are_taken_out_and_missing_ones_stay(pics):
    red = pics["red"]
    assert image_paths(f"what is {red} please") == ("what is please", [red])
    assert image_paths(f"what is {red}, please?") == ("what is, please?", [red])
    assert image_paths(f"{red}") == ("", [red])
    missing = red.replace("red.png", "nope.png")
    assert image_paths(f"compare {missing} and {red}") == (f"compare {missing} and", [red])
    assert image_paths("a bare red.png or http://x/y.png stays") == ("a bare red.png or http://x/y.png stays", [])
    assert image_paths(f"not {red}.bak nor {red}x") == (f"not {red}.bak nor {red}x", [])


def test_quoted_escaped_home_and_other_extensions(pics, monkeypatch):
    spaced, gif = pics["spaced"], pics["gif"]
    assert image_paths(f"see '{spaced}' now") == ("see now", [spaced])  # a dropped file, quoted
    assert image_paths(f'see "{spaced}"') == ("see", [spaced])
    escaped = spaced.replace(" ", "\\ ")
    assert image_paths(f"see {escaped} and {gif}.") == ("see and.", [spaced, gif])
    home = str(pics["red"]).rsplit("/", 1)[0]
    monkeypatch.setenv("HOME", home)
    assert image_paths("look ~/red.png") == ("look", ["~/red.png"])
    assert starts_with_image_path(f"{pics['red']} what is it") and not starts_with_image_path("/set verbose")


class _Lines:
    history_enabled = True

    def __init__(self, lines):
        self.lines = list(lines)

    def read_message(self):
        if not self.lines:
            raise EOFError
        return self.lines.pop(0)


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    return write_gemma3(tmp_path_factory.mktemp("replpaths") / "gemma3-img.gguf", n_embd=N_EMBD)


def _repl(gemma_path, lines, images: bool):
    pytest.importorskip("edgeinfer.vision.image_io")
    model = Model("tiny-gemma3", gemma_path, EngineOptions(n_ctx=256, backend="reference"))
    if images:
        model.use_projector(FakeProjector(N_EMBD))
    prompts: list = []
    args = build_parser().parse_args(["run", str(gemma_path)])
    repl = Repl(model, args, {"max_tokens": 1, "temperature": 0, "on_prompt": prompts.append}, False,
                reader=_Lines(lines), out=io.StringIO(), err=io.StringIO())
    assert repl.loop() == 0
    return repl, prompts


def test_a_typed_path_is_attached_for_a_model_that_takes_images(gemma_path, pics):
    red = pics["red"]
    repl, prompts = _repl(gemma_path, [f"the {red} of", f"{red} and to"], images=True)
    first = repl.history[0]["content"]
    assert [p["type"] for p in first] == ["image_url", "text"] and first[1]["text"] == "the of"
    assert first[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert len(image_runs(prompts[0])) == 1
    # a line that opens with the path is a message, not an unknown slash command
    assert repl.history[2]["content"][1]["text"] == "and to" and len(image_runs(prompts[1])) == 2
    assert repl.out.getvalue().count(f"Added image '{red}'") == 2 and "unknown command" not in repl.err.getvalue()


def test_without_an_mmproj_the_line_stays_as_typed(gemma_path, pics):
    line = f"the {pics['red']} of"
    repl, prompts = _repl(gemma_path, [line], images=False)
    assert repl.history[0]["content"] == line and not image_runs(prompts[0])
    assert "Added image" not in repl.out.getvalue()


def test_a_bad_image_is_one_line_and_nothing_is_sent(gemma_path, pics):
    repl, prompts = _repl(gemma_path, [f"the {pics['text']} of"], images=True)
    errors = [line for line in repl.err.getvalue().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "notes.png" in errors[0] and "not an image" in errors[0]
    assert repl.history == [] and prompts == []
