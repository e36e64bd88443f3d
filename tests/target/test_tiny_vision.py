"""The README's pipeline on tiny vision-language targets (Qwen3-VL with deepstack, the Qwen3.5/3.6 hybrid layout)
with drawn images in every data shape read: every stage exits 0, online evaluation is lossless with offline τ equal
to online τ, the report gives τ with and without images, and a drafter trained at other positions than the served
ones (or carrying M-RoPE fields) is caught by `doctor --serving` and `eval`."""

from __future__ import annotations

import base64
import json

import pytest

from flashdraft.data.cache_reader import HiddenStateCache
from tests.conftest import run_cli
from tests.target.tiny_vision import IMAGE_TOKEN_ID, draw_image, save_vl_target


def write_image_prompts(directory):
    """One row of each shape with images, and a text-only one; the images drawn into `directory`/img."""
    (directory / "img").mkdir()
    for k in range(3):
        draw_image(directory / "img" / f"{k}.png", seed=k)
    data_url = "data:image/png;base64," + base64.b64encode((directory / "img" / "2.png").read_bytes()).decode()

    def user(*parts):
        return [{"role": "user", "content": [*parts, {"type": "text", "text": "t1 t2 t3"}]}]

    two = "t3 <image> t4 <image>"  # ShareGPT: the images list in order of the markers
    rows = [
        {"id": "url", "messages": user({"type": "image_url", "image_url": {"url": "img/0.png"}})},
        {"id": "file", "messages": user({"type": "image", "image": f"file://{directory}/img/1.png"})},
        {"id": "data", "messages": user({"type": "image_url", "image_url": {"url": data_url}})},
        {"id": "llava", "image": "img/0.png", "conversations": [{"from": "human", "value": "<image>\nt9 t10"}]},
        {
            "id": "sharegpt",
            "images": ["img/1.png", "img/2.png"],
            "conversations": [{"from": "human", "value": two}],
        },
        {"id": "text", "messages": [{"role": "user", "content": "t11 t12 t13"}]},
    ]
    (directory / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("layout", ["qwen3_vl", "qwen3_5"])
def test_every_stage_of_the_pipeline_runs_with_images(layout, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    save_vl_target(tmp_path / "target", layout)
    write_image_prompts(tmp_path)
    t = ["--target-model", "target"]
    stages = [
        ["generate", *t, "--prompts", "prompts.jsonl", "--out", "train.json", "--max-new-tokens", "16"],
        ["cache", *t, "--completions", "train.json", "--out", "cache", "--layers", "0,1,2"],
        ["doctor", "cache", *t],  # its records re-run with their images: features and loss masks as stored
        ["init", *t, "--out", "init", "--draft-layers", "1", "--block-size", "4", "--target-layer-ids", "0,1,2"],
        ["train", *t, "--cached-hidden-states", "cache", "--out", "run", "--init", "init", "--max-steps", "2"],
        ["train", *t, "--completions", "train.json", "--out", "online", "--init", "init", "--max-steps", "2"],
        ["eval", "--checkpoint", "run", *t, "--cached-hidden-states", "cache", "--report", "report"],
        ["eval", "--checkpoint", "run", *t, "--completions", "train.json", "--online", "--check-consistency"],
        [
            "eval",
            "--checkpoint",
            "run",
            *t,
            "--completions",
            "train.json",
            "--online",
            "--tree",
            "ddtree",
            "--tree-budget",
            "4",
        ],
        ["export", "--checkpoint", "run", "--out", "drafter", *t],
        ["doctor", "drafter", "--serving", *t],
    ]
    for argv in stages:
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 0, (argv[0], err[-400:])
        if argv[0] == "eval":  # τ on the conversations with images beside the text-only one
            assert "τ by modality: with images " in out and "text only " in out and "(5 prompts" in out
        if "--check-consistency" in argv:
            assert "offline vs online: identical acceptance lengths" in out and "lossless (all prompts)   " in out
        if "--tree" in argv:  # draft trees with images: the tree loop lossless and equal to the offline tree walk
            assert "online: tau" in out and "lossless, the offline walk's acceptance lengths" in out
        if "--serving" in argv:
            assert "ok   positions: vLLM's DFlash proposer" in out and "the drafter was trained at mrope-row-0" in out
    assert "τ by modality" in (tmp_path / "report" / "report.md").read_text()
    records = {r["id"]: r for r in json.loads((tmp_path / "train.json").read_text())["records"]}
    assert [len(records[k].get("images", [])) for k in records] == [1, 1, 1, 1, 2, 0]
    assert records["sharegpt"]["images"][0] == str((tmp_path / "img" / "1.png").resolve())
    assert records["url"]["position_runs"][1][2] == 0  # the image's placeholders share one row-0 position
    cache = HiddenStateCache(tmp_path / "cache")
    for i in range(len(cache)):
        r = cache[i]
        assert not bool((r.loss_mask & (r.input_ids == IMAGE_TOKEN_ID)).any())  # never a loss on a placeholder
        assert (r.drafter_positions is None) == (cache.ids[i] == "text")

    # planted: the drafter trained at the token index where the server gives M-RoPE's row 0
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(config | {"trained_positions": "token-index"}))
    rc, out, _ = run_cli(capsys, "doctor", "drafter", "--serving", *t)
    assert rc == 1 and "FAIL positions: " in out and "the drafter was trained at token-index" in out
    rc, out, _ = run_cli(capsys, "eval", "--checkpoint", "drafter", *t, "--cached-hidden-states", "cache")
    assert rc == 0 and "warning: positions: trained at token-index, served (and evaluated here) at mrope-row-0" in out
    # planted: M-RoPE fields in the drafter config, which vLLM's DFlash proposer refuses
    mrope = config | {"rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]}}
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(mrope))
    rc, out, _ = run_cli(capsys, "doctor", "drafter", "--serving", *t)
    assert rc == 1 and "FAIL positions: M-RoPE fields in the drafter config: rope_scaling.mrope_section" in out
