"""`edgeinfer run`'s images: --mmproj / --no-mmproj / --image, the mmproj beside a stored model,
and the REPL's /image."""

from __future__ import annotations

import io

import pytest
from image_fixtures import FakeProjector, write_gemma3

from edgeinfer.api import Model
from edgeinfer.cli import build_parser, main
from edgeinfer.commands.image_input import user_content
from edgeinfer.commands.repl import Repl
from edgeinfer.engine import EngineOptions
from edgeinfer.errors import EdgeInferError
from edgeinfer.store.mmproj_lookup import mmproj_beside
from edgeinfer.vision.media_ids import image_runs

N_EMBD = 64


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    return write_gemma3(tmp_path_factory.mktemp("imgcli") / "gemma3-img.gguf", n_embd=N_EMBD)


@pytest.fixture
def png(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    path = tmp_path / "red.png"
    Image.new("RGB", (8, 8), (200, 10, 10)).save(path)
    return str(path)


def _one_line_error(capsys, code):
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("edgeinfer: error: ") and err.count("\n") == 1, err
    return err


def test_an_image_for_a_model_without_mmproj_is_one_line(gemma_path, png, capsys):
    code = main(["run", str(gemma_path), "--image", png, "the of", "-n", "1", "--backend", "reference", "-c", "64"])
    assert "--mmproj" in _one_line_error(capsys, code)


@pytest.mark.parametrize("flags, says", [(["--no-mmproj", "--image", "x.png"], "--no-mmproj"),
                                         (["--mmproj", "/nonexistent/mmproj.gguf"], "no such file"),
                                         (["--image", "x.png", "--session", "s1"], "--session")])
def test_bad_image_flags_fail_before_loading(gemma_path, flags, says, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    code = main(["run", str(gemma_path), "the of", *flags, "--backend", "reference", "-c", "64"])
    assert says in _one_line_error(capsys, code)


def test_the_mmproj_beside_a_stored_model_is_found(tmp_path):
    model = tmp_path / "gemma-3-4b-it-Q4_K_M.gguf"
    model.write_bytes(b"")
    assert mmproj_beside(model) is None
    (tmp_path / "mmproj-gemma-3-4b-it-Q8_0.gguf").write_bytes(b"")
    assert mmproj_beside(model).name == "mmproj-gemma-3-4b-it-Q8_0.gguf"
    (tmp_path / "mmproj-gemma-3-4b-it-F16.gguf").write_bytes(b"")
    assert mmproj_beside(model).name == "mmproj-gemma-3-4b-it-F16.gguf"  # llama.cpp's -hf prefers F16


def test_user_content_puts_images_at_markers_or_first(png):
    parts = user_content("the <__media__> of", [png])
    assert [p["type"] for p in parts] == ["text", "image_url", "text"]
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert [p["type"] for p in user_content("the of", [png, png])] == ["image_url", "image_url", "text"]
    assert user_content("the of", []) == "the of"


class _Lines:
    history_enabled = True

    def __init__(self, lines):
        self.lines = list(lines)

    def read_message(self):
        if not self.lines:
            raise EOFError
        return self.lines.pop(0)


def test_repl_image_goes_with_the_next_message_only(gemma_path, png):
    pytest.importorskip("edgeinfer.vision.image_io")
    model = Model("tiny-gemma3", gemma_path, EngineOptions(n_ctx=256, backend="reference"))
    projector = FakeProjector(N_EMBD)
    model.use_projector(projector)
    args = build_parser().parse_args(["run", str(gemma_path)])
    prompts = []
    out, err = io.StringIO(), io.StringIO()
    repl = Repl(model, args, {"max_tokens": 1, "temperature": 0, "on_prompt": prompts.append}, False,
                reader=_Lines([f"/image {png}", "the of", "and to", "/image /nonexistent.png"]), out=out, err=err)
    assert repl.loop() == 0
    assert "Added image" in out.getvalue() and "cannot read image" in err.getvalue()
    assert len(image_runs(prompts[0])) == 1
    # the second turn resends the first turn's image (the prefix cache holds it), and adds none
    assert len(image_runs(prompts[1])) == 1 and prompts[1][:len(prompts[0])] == prompts[0]
    assert projector.calls == 1  # encoded once: the second turn's copy came by its digest


@pytest.fixture(scope="module")
def mmprojs(tmp_path_factory):
    pytest.importorskip("edgeinfer.vision.gemma3")
    from mmproj_factory import write_gemma3_mmproj

    root = tmp_path_factory.mktemp("imgcli-mmproj")
    return {"fits": write_gemma3_mmproj(root / "mmproj-fits.gguf", n_embd_text=N_EMBD),
            "wide": write_gemma3_mmproj(root / "mmproj-wide.gguf", n_embd_text=2 * N_EMBD)}


def test_run_with_mmproj_and_images_answers(gemma_path, mmprojs, png, capsys):
    code = main(["run", str(gemma_path), "--mmproj", str(mmprojs["fits"]), "--image", png, "--image", png,
                 "the <__media__> of <__media__>", "--raw", "-n", "3", "--temp", "0", "--backend", "reference",
                 "-c", "128", "--verbose"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "prompt eval count:" in captured.err
    code = main(["run", str(gemma_path), "--mmproj", str(mmprojs["fits"]), "--image", png, "the of", "-n", "2",
                 "--temp", "0", "--backend", "reference", "-c", "128"])  # chat: the image as an image part
    assert code == 0, capsys.readouterr().err


def test_run_refuses_an_mmproj_of_another_width_and_extra_images(gemma_path, mmprojs, png, capsys):
    code = main(["run", str(gemma_path), "--mmproj", str(mmprojs["wide"]), "--image", png, "the of", "--raw",
                 "-n", "1", "--backend", "reference", "-c", "64"])
    assert "another model" in _one_line_error(capsys, code)
    code = main(["run", str(gemma_path), "--mmproj", str(mmprojs["fits"]), "--image", png, "--image", png,
                 "the <__media__> of", "--raw", "-n", "1", "--backend", "reference", "-c", "64"])
    assert "marker" in _one_line_error(capsys, code)


def test_an_mmproj_found_beside_a_stored_model_that_does_not_fit_leaves_text_working(gemma_path, mmprojs, tmp_path,
                                                                                        monkeypatch):
    import shutil

    import edgeinfer
    from edgeinfer.store import registry

    folder = tmp_path / "store"
    folder.mkdir()
    model_file = folder / "gemma3-img.gguf"
    shutil.copy(gemma_path, model_file)
    shutil.copy(mmprojs["wide"], folder / "mmproj-gemma3-img-F16.gguf")
    monkeypatch.setattr(registry, "resolve", lambda name, download=True: model_file)
    model = edgeinfer.load("some-stored-name", mmproj="auto", n_ctx=64, backend="reference")
    assert model.images is None and "another model" in model.mmproj_problem
    assert model.generate("the of", max_tokens=1, temperature=0).usage.prompt_tokens > 0
    with pytest.raises(EdgeInferError, match="another model"):
        model.generate("the of", images=[b"x"], max_tokens=1)
    shutil.copy(mmprojs["fits"], folder / "mmproj-gemma3-img-F16.gguf")
    assert edgeinfer.load("some-stored-name", mmproj="auto", n_ctx=64, backend="reference").images is not None
