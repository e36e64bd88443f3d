"""Run configs as data (`flashdraft.commands.config_file`): `flashdraft train --config FILE` reads the
train options from YAML or JSON, checked as the flags are, flags overriding the file; and every
example in configs/ loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from flashdraft.cli import build_parser
from flashdraft.commands.config_file import train_options
from flashdraft.drafter.config import DrafterConfig
from flashdraft.errors import FlashdraftError
from flashdraft.train.config import TrainConfig
from tests.conftest import run_cli
from tests.drafter.test_config import PUBLIC_QWEN36_CONFIG

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def train_args(*argv):
    """The options `flashdraft train ARGV` would run with (nothing runs)."""
    parser = build_parser()
    argv = ["train", *map(str, argv)]
    return train_options(parser, argv, parser.parse_args(argv))


def one_line_error(capsys, *argv) -> str:
    try:
        rc, _, err = run_cli(capsys, *argv)
    except SystemExit as e:  # argparse's errors, and train's required options
        rc, err = e.code, capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def write(path: Path, options: dict) -> Path:
    path.write_text(json.dumps(options) if path.suffix == ".json" else yaml.safe_dump(options))
    return path


def as_flags(options: dict) -> list[str]:
    """The command line that says what a config file says."""
    argv = []
    for key, value in options.items():
        if value is True:
            argv.append(f"--{key}")
        elif value is False:
            argv.append(f"--no-{key}")
        else:
            argv += [f"--{key}", ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return argv


# -- train --config configs/tiny.yaml -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    run = dict(target_model="tiny", max_new_tokens=24)
    from flashdraft.api import cache_hidden_states, generate_completions

    generate_completions(prompts="builtin:code", out=d / "train.json", num_prompts=4, **run)
    cache_hidden_states("tiny", d / "train.json", d / "cache", layers=[1, 2, 3])
    return d


def test_train_config_tiny_gives_the_same_weights_as_the_same_flags(tiny_data, capsys):
    d = tiny_data
    # the example's own run, shortened and pointed at this test's data: the same flags on both sides
    common = [
        "--cached-hidden-states",
        d / "cache",
        "--eval-cached-hidden-states",
        d / "cache",
        "--max-steps",
        2,
        "--batch-size",
        2,
        "--eval-every",
        2,
    ]
    rc, _, err = run_cli(capsys, "train", "--config", CONFIGS / "tiny.yaml", "--out", d / "from-file", *common)
    assert rc == 0, err
    flags = as_flags(yaml.safe_load((CONFIGS / "tiny.yaml").read_text()))
    rc, _, err = run_cli(capsys, "train", *flags, "--out", d / "from-flags", *common)
    assert rc == 0, err
    a = load_file(d / "from-file/checkpoints/step-0000002/drafter/model.safetensors")
    b = load_file(d / "from-flags/checkpoints/step-0000002/drafter/model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    config = json.loads((d / "from-file/run_config.json").read_text())  # the resolved config, as today
    assert config == json.loads((d / "from-flags/run_config.json").read_text())
    assert config["lr"] == 6e-3 and config["num_anchors"] == 8 and config["batch_size"] == 2  # file, then flag


# -- reading a file ---------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_keys_are_the_flag_names_with_dashes_or_underscores_in_yaml_or_json(tmp_path, suffix):
    options = {
        "target-model": "tiny",
        "completions": "c.json",
        "out": "run",
        "target_layer_ids": [1, 2, 3],
        "lr": "1e-3",
        "max-steps": 5,
        "keep-best": True,
        "report-to": ["wandb"],
        "optimizer": "muon",
    }
    args = train_args("--config", write(tmp_path / f"run{suffix}", options))
    assert (args.target_model, args.completions, args.out) == ("tiny", "c.json", "run")
    assert args.target_layer_ids == [1, 2, 3] and args.lr == 1e-3 and args.max_steps == 5
    assert args.keep_best is True and args.report_to == ["wandb"] and args.optimizer == "muon"
    assert args.epochs == TrainConfig.epochs  # not in the file: the flag's default


def test_flags_override_the_file_and_a_flag_data_source_replaces_the_files(tmp_path):
    path = write(
        tmp_path / "run.yaml",
        {"target-model": "tiny", "cached-hidden-states": "cache", "out": "run", "lr": 1e-3, "keep-best": True},
    )
    args = train_args("--config", path, "--lr", "2e-3", "--no-keep-best", "--out", "other")
    assert args.lr == 2e-3 and args.keep_best is False and args.out == "other"
    args = train_args("--config", path, "--completions", "c.json")
    assert args.completions == "c.json" and args.cached_hidden_states is None


def test_required_options_may_come_from_the_file_or_the_flags(tmp_path, capsys):
    path = write(tmp_path / "run.yaml", {"completions": "c.json"})
    assert train_args("--config", path, "--target-model", "tiny", "--out", "run").completions == "c.json"
    line = one_line_error(capsys, "train", "--config", path)
    assert "the following arguments are required: --target-model, --out" in line, line
    line = one_line_error(capsys, "train", "--target-model", "tiny", "--out", "run")
    assert "one of the arguments --cached-hidden-states --completions is required" in line, line


FILE_PROBLEMS = {
    "unknown key": ({"learning-rate": 1e-3}, "unknown key 'learning-rate'; expected flashdraft train's options"),
    "a recorded field": ({"data_fingerprint": "x"}, "unknown key 'data_fingerprint'"),
    "the file itself": ({"config": "other.yaml"}, "unknown key 'config'"),
    "a value out of range": ({"lr": -1}, "key 'lr': expected a number >= 0, found -1"),
    "not a count": ({"num-anchors": "many"}, "key 'num-anchors': expected a positive integer, found 'many'"),
    "not an integer": ({"seed": 1.5}, "key 'seed' is 1.5; expected an integer (invalid literal"),
    "unsorted layer ids": (
        {"target-layer-ids": [3, 1]},
        "key 'target-layer-ids': expected unique, strictly increasing ids",
    ),
    "a switch": ({"keep-best": "yes please"}, "key 'keep-best' is 'yes please'; expected true or false"),
    "a choice": ({"target-dtype": "fp8"}, "key 'target-dtype' is 'fp8'; expected one of fp32, bf16, fp16"),
    "both data sources": (
        {"completions": "c.json", "cached-hidden-states": "cache"},
        "keys 'cached-hidden-states' and 'completions' are both given",
    ),
}


@pytest.mark.parametrize("case", FILE_PROBLEMS)
def test_a_bad_key_or_value_is_refused_in_one_line_naming_the_file_and_the_key(tmp_path, capsys, case):
    options, expected = FILE_PROBLEMS[case]
    path = write(tmp_path / "run.yaml", {"target-model": "tiny", "out": str(tmp_path / "run"), **options})
    line = one_line_error(
        capsys, "train", "--config", path, *([] if "completions" in options else ["--completions", "c.json"])
    )
    assert f"{path}: " in line and expected in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("lr: [1, 2", "not valid YAML"),
        ("- lr\n- 1\n", "found a list; expected a mapping of option names"),
    ],
)
def test_a_file_that_is_not_a_mapping_is_refused(tmp_path, capsys, text, expected):
    (tmp_path / "run.yaml").write_text(text)
    line = one_line_error(capsys, "train", "--config", tmp_path / "run.yaml")
    assert str(tmp_path / "run.yaml") in line and expected in line, line


def test_a_config_file_of_another_kind_is_refused_naming_the_suffix(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("lr = 1\n")
    line = one_line_error(capsys, "train", "--config", tmp_path / "run.toml")
    assert "expected a .yaml, .yml, .json config file, found suffix '.toml'" in line, line


# -- configs/ ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(CONFIGS.iterdir()), ids=lambda p: p.name)
def test_every_example_config_loads(path):
    if path.suffix == ".json":  # a drafter config.json for init --config
        cfg = DrafterConfig.load(path)
        assert cfg.num_hidden_layers == len(cfg.layer_types)
        return
    assert path.suffix == ".yaml" and path.read_text().startswith("#"), "a train config starts with what it needs"
    args = train_args("--config", path)
    assert args.target_model and args.out and (args.cached_hidden_states or args.completions)


def test_the_qwen36_configs_are_the_published_layout_and_agree_with_it():
    drafter = json.loads((CONFIGS / "qwen3.6-27b-dflash.json").read_text())
    assert drafter == PUBLIC_QWEN36_CONFIG
    cfg = DrafterConfig.from_dict(drafter)
    assert cfg.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and cfg.sliding_window == 2048
    for mode in ("offline", "online"):
        path = CONFIGS / f"qwen3.6-27b-{mode}.yaml"
        args = train_args("--config", path)
        # what train checks against --init's config.json when it starts
        assert (args.draft_layers, args.block_size, args.target_layer_ids) == (
            cfg.num_hidden_layers,
            cfg.block_size,
            cfg.target_layer_ids,
        ), mode
        assert args.num_anchors == 512 and args.lr == 6e-4 and args.fsdp, mode
        assert (
            "torchrun --nproc-per-node 8 -m flashdraft train --config " + str(path.relative_to(CONFIGS.parent))
            in path.read_text()
        ), mode
    assert train_args("--config", CONFIGS / "qwen3.6-27b-offline.yaml").cached_hidden_states
    assert train_args("--config", CONFIGS / "qwen3.6-27b-online.yaml").completions


def test_the_dflash2_config_is_the_published_qwen38_dflash2_layout():
    from tests.drafter.test_config import PUBLIC_QWEN38_DFLASH2_CONFIG

    drafter = json.loads((CONFIGS / "qwen3.8-27b-dflash2.json").read_text())
    assert drafter == PUBLIC_QWEN38_DFLASH2_CONFIG
    assert DrafterConfig.from_dict(drafter).family == "dflash2"


def test_options_from_file_is_usable_alone_and_refuses_excluded_keys(tmp_path):
    from flashdraft.commands.config_file import options_from_file

    train = build_parser().commands["train"]
    path = write(tmp_path / "run.json", {"lr": 0.5, "draft-layers": 2})
    assert options_from_file(path, train) == {"lr": 0.5, "draft_layers": 2}
    with pytest.raises(FlashdraftError, match="unknown key 'lr'"):
        options_from_file(path, train, exclude=("lr",))


def test_a_mapping_in_the_file_reaches_a_json_flag_as_the_flag_parses_it(tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 1024}
    options = {"target-model": "tiny", "completions": "c.json", "out": "run", "rope-scaling": yarn}
    assert train_args("--config", write(tmp_path / "run.yaml", options)).rope_scaling == yarn
