"""A record's images read and bound to a vision-language target (`flashdraft.target.image_files`)."""

import base64
from types import SimpleNamespace

import pytest
import torch

from flashdraft.errors import FlashdraftError
from flashdraft.target.image_files import open_image, record_images, refuse_engine_images, register_record_images
from flashdraft.target.model import TargetModel
from tests.target.tiny_vision import draw_image, save_vl_target


def test_a_file_and_its_data_url_open_as_the_same_rgb_image_and_a_non_image_is_refused(tmp_path):
    draw_image(tmp_path / "a.png")
    url = "data:image/png;base64," + base64.b64encode((tmp_path / "a.png").read_bytes()).decode()
    assert open_image(str(tmp_path / "a.png"), "t").tobytes() == open_image(url, "t").tobytes()
    (tmp_path / "x.png").write_text("not an image")
    with pytest.raises(FlashdraftError, match="cannot be read as an image"):
        open_image(str(tmp_path / "x.png"), "record 'r'")
    with pytest.raises(FlashdraftError, match="record 'r' has images; the engine is sent token ids only"):
        refuse_engine_images([SimpleNamespace(id="q", images=None), SimpleNamespace(id="r", images=["a"])], "x")


def test_records_with_the_same_tokens_and_other_images_are_never_guessed_between(tmp_path):
    target = TargetModel.load(save_vl_target(tmp_path / "t", "qwen3_vl"))
    for k in range(2):
        draw_image(tmp_path / f"{k}.png", seed=k)
    text = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}]}], add_generation_prompt=True, tokenize=False
    )
    ids, _ = target.processor.encode(text, [open_image(str(tmp_path / "0.png"), "t")], "t")
    records = [SimpleNamespace(id=f"r{k}", prompt_ids=ids, images=[str(tmp_path / f"{k}.png")]) for k in range(2)]
    register_record_images(target, records)
    with pytest.raises(FlashdraftError, match="record 'r0' and record 'r1': the same prompt tokens with different"):
        target.forward(torch.tensor([ids]))
    logits = []
    for record in records:  # bound explicitly, each reads its own
        with record_images(target, record):
            logits.append(target.forward(torch.tensor([ids])).logits)
    assert not torch.allclose(logits[0], logits[1])
