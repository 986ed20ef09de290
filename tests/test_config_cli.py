"""Where the config comes from: argparse flags and the config/config_params/args sources."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from zeroshard.config import add_config_arguments, resolve_config_source


def parse(argv: list[str]) -> argparse.Namespace:
    return add_config_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_flags_and_config_path() -> None:
    args = parse([])
    assert (args.deepspeed, args.zeroshard, args.deepspeed_config) == (False, False, None)
    args = parse(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config) == (True, "ds.json")
    args = parse(["--zeroshard", "--zeroshard_config", "zs.json"])
    assert (args.zeroshard, args.deepspeed_config) == (True, "zs.json")


def test_arguments_form_a_zeroshard_group() -> None:
    parser = argparse.ArgumentParser()
    assert add_config_arguments(parser) is parser
    group = next(g for g in parser._action_groups if g.title == "zeroshard")
    flags = {flag for action in group._group_actions for flag in action.option_strings}
    assert flags == {"--deepspeed", "--zeroshard", "--deepspeed_config", "--zeroshard_config"}


def test_one_source_is_returned_as_is() -> None:
    cfg = {"train_batch_size": 8}
    assert resolve_config_source(cfg, None, None) is cfg
    assert resolve_config_source(None, cfg, None) is cfg
    assert resolve_config_source(None, None, parse(["--deepspeed_config", "a.json"])) == "a.json"
    assert resolve_config_source(None, None, argparse.Namespace(zeroshard_config="z.json")) == "z.json"
    assert resolve_config_source(None, None, argparse.Namespace(deepscale_config="old.json")) == "old.json"


def test_the_same_source_twice_is_fine(tmp_path: Path) -> None:
    cfg = {"train_batch_size": 8}
    assert resolve_config_source(cfg, cfg, None) is cfg
    path = tmp_path / "ds.json"
    args = argparse.Namespace(deepspeed_config=str(path))
    assert resolve_config_source(path, None, args) == path


def test_different_sources_are_an_error() -> None:
    with pytest.raises(
        ValueError, match=r"config given more than once \(config, config_params\); keep exactly one"
    ):
        resolve_config_source({"train_batch_size": 8}, {"train_batch_size": 8}, None)
    args = parse(["--deepspeed_config", "a.json"])
    with pytest.raises(ValueError, match=r"\(config, args.deepspeed_config\)"):
        resolve_config_source("b.json", None, args)
    both = argparse.Namespace(deepspeed_config="a.json", zeroshard_config="b.json")
    with pytest.raises(ValueError, match=r"\(args.deepspeed_config, args.zeroshard_config\)"):
        resolve_config_source(None, None, both)


def test_no_source_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"pass config=.* or --deepspeed_config"):
        resolve_config_source(None, None, None)
    with pytest.raises(ValueError, match="no config given"):
        resolve_config_source(None, None, parse([]))
