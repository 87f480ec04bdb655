"""Chat image parts become the marker in one string per message, joined as llama-server joins them."""
import base64

import pytest

from edgeinfer.errors import EdgeInferError
from edgeinfer.vision.request_images import chat_images

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n not decoded here").decode()


def _image():
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}


def test_text_parts_on_their_own_lines_and_no_newline_at_a_marker():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, _image(), {"type": "text", "text": "and"},
                                             {"type": "text", "text": "this"}, _image(), _image()]}]
    out, images = chat_images(messages, "<M>")
    assert out[0] == messages[0]
    assert out[1] == {"role": "user", "content": "look<M>and\nthis<M><M>"}
    assert len(images) == 3 and images[0].startswith(b"\x89PNG")


def test_a_message_without_images_is_left_as_sent():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    out, images = chat_images([{"role": "user", "content": parts}], "<M>")
    assert out == [{"role": "user", "content": parts}] and images == []


@pytest.mark.parametrize("part", [{"type": "audio"}, "plain", {"type": "text", "text": 3}])
def test_another_part_beside_an_image_is_one_clear_error(part):
    with pytest.raises(EdgeInferError, match="content part"):
        chat_images([{"role": "user", "content": [_image(), part]}], "<M>")
