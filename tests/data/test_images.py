"""Images in prompt data (`flashdraft.data.images`): every shape read to local image parts, and the refusals (a
remote URL, a missing file, a bad data URL, images for a text-only target) one line each, exit 2, nothing written."""

from __future__ import annotations

import base64
import json

import pytest

from flashdraft.data.prompts import load_prompts
from flashdraft.errors import FlashdraftError
from tests.conftest import run_cli, save_chat_target
from tests.target.tiny_vision import draw_image


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_every_image_shape_is_read_as_local_image_parts(tmp_path):
    draw_image(tmp_path / "a.png")
    draw_image(tmp_path / "b.png", seed=1)
    data_url = "data:image/png;base64," + base64.b64encode((tmp_path / "b.png").read_bytes()).decode()
    a, b = str((tmp_path / "a.png").resolve()), str((tmp_path / "b.png").resolve())
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": f"file://{b}"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": data_url}]}]},
        {"image": "a.png", "conversations": [{"from": "human", "value": "t1 <image> t2"}]},
        {"images": ["b.png", "a.png"], "conversations": [{"from": "human", "value": "<image> t1 <image>"}]},
        {"images": ["a.png"], "conversations": [{"from": "human", "value": "t3"}]},  # no marker: the image first
    ]
    prompts = load_prompts(write_rows(tmp_path / "p.jsonl", rows), quiet=True)

    def parts(k):
        return prompts[k].conversation([])[-1]["content"]

    assert parts(0) == [{"type": "image", "image": a}]  # relative to the prompt file's folder
    assert parts(1) == [{"type": "image", "image": b}] and parts(2) == [{"type": "image", "image": data_url}]
    assert parts(3) == [{"type": "text", "text": "t1"}, {"type": "image", "image": a}, {"type": "text", "text": "t2"}]
    assert [p.get("image") for p in parts(4)] == [b, None, a]  # the list in the order of the markers
    assert parts(5) == [{"type": "image", "image": a}, {"type": "text", "text": "t3"}]


@pytest.mark.parametrize(
    "part, message",
    [
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}},
            "is a remote URL; nothing is fetched",
        ),
        ({"type": "image", "image": "missing.png"}, "missing.png does not exist; expected a local image file"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}, "is not valid base64"),
        ({"type": "image_url", "image_url": {"url": "data:text/plain,x"}}, "expected data:image/<type>;base64"),
    ],
)
def test_a_remote_url_a_missing_file_or_a_bad_data_url_is_refused_in_one_line(tmp_path, part, message):
    rows = [{"messages": [{"role": "user", "content": [part]}]}]
    with pytest.raises(FlashdraftError, match="p.jsonl:1: messages\\[0\\].content\\[0\\]") as e:
        load_prompts(write_rows(tmp_path / "p.jsonl", rows), quiet=True)
    assert message in str(e.value) and "\n" not in str(e.value)
    llava = [{"image": "gone.png", "conversations": [{"from": "human", "value": "<image> t1"}]}]
    with pytest.raises(FlashdraftError, match="image\\[0\\]: image file .*gone.png does not exist"):
        load_prompts(write_rows(tmp_path / "l.jsonl", llava), quiet=True)
    markers = [{"images": [str(tmp_path / "p.jsonl")], "conversations": [{"from": "human", "value": "<image><image>"}]}]
    with pytest.raises(FlashdraftError, match="2 <image> markers for 1 image"):
        load_prompts(write_rows(tmp_path / "m.jsonl", markers), quiet=True)


def test_generate_refuses_images_for_a_text_only_target_and_remote_urls_with_nothing_written(tmp_path, capsys):
    target = save_chat_target(tmp_path / "text-target")
    draw_image(tmp_path / "a.png")
    capsys.readouterr()  # the target's saving
    image = {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]}
    remote = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y"}}]}]}
    for rows, expected in (
        ([{"prompt": "t1 t2"}, image], "has image parts, but the target"),
        ([remote], "is a remote URL; nothing is fetched"),
    ):
        prompts = write_rows(tmp_path / "p.jsonl", rows)
        argv = ["generate", "--target-model", target, "--prompts", prompts, "--out", tmp_path / "out.json"]
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2 and expected in err and len(err.strip().splitlines()) == 1
        assert not any(p.name.startswith("out.json") for p in tmp_path.iterdir())  # no file, no part, no lock


def test_the_engine_paths_refuse_images_in_one_line_saying_why(tmp_path, capsys):
    from tests.target.tiny_vision import save_vl_target

    target = save_vl_target(tmp_path / "vl", "qwen3_vl")
    draw_image(tmp_path / "a.png")
    capsys.readouterr()
    prompts = write_rows(
        tmp_path / "p.jsonl", [{"images": ["a.png"], "conversations": [{"from": "human", "value": "t1"}]}]
    )
    argv = ["generate", "--target-model", target, "--prompts", prompts, "--out", tmp_path / "out.json"]
    rc, _, err = run_cli(capsys, *argv, "--engine", "vllm")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "has images; the engine is sent token ids only" in err and "loads no vision-language model without" in err
    assert not any(p.name.startswith("out.json") for p in tmp_path.iterdir())
