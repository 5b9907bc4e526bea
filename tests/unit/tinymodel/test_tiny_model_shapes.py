"""Tiny model shapes: the default recipe keeps its pre-shape hash and folder, every override changes
the hash and the folder name says the shape, bad shapes fail naming the field, the CLI builds the
shape it was given, and one small build writes the dtype into config and weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from kvferry.local import tinymodel
from kvferry.local.tinymodel import (
    CPU_HEAD_SIZES,
    DEFAULT_SHAPE,
    SHAPES,
    Shape,
    build,
    model_dir_name,
    parse_args,
    recipe,
    recipe_hash,
)

# Hashes of the builds made before shapes existed: caches and CI keys depend on them.
PRE_SHAPE_HASHES = {"llama": "60379abcb5d3627e", "qwen": "75057756d2b57e39"}


@pytest.mark.parametrize(("arch", "digest"), sorted(PRE_SHAPE_HASHES.items()))
def test_default_recipe_keeps_its_hash_and_folder(arch: str, digest: str) -> None:
    assert recipe_hash(arch) == recipe_hash(arch, DEFAULT_SHAPE) == recipe_hash(arch, Shape()) == digest
    assert recipe(arch, Shape()) == recipe(arch)
    assert model_dir_name(arch) == f"tiny-{arch}-{digest}"


@pytest.mark.parametrize(
    "override",
    [
        {"heads": 4},
        {"kv_heads": 1},
        {"head_dim": 32},
        {"dtype": "bfloat16"},
        {"dtype": "float16"},
        {"layers": 3},
    ],
)
def test_every_override_changes_the_hash_and_names_the_folder(override: dict[str, object]) -> None:
    shape = dataclasses.replace(DEFAULT_SHAPE, **override)  # type: ignore[arg-type]
    assert recipe_hash("llama", shape) != recipe_hash("llama")
    name = model_dir_name("llama", shape)
    assert name == f"tiny-llama-{shape.tag}-{recipe_hash('llama', shape)}"
    config = recipe("llama", shape)["config"]
    assert config["num_attention_heads"] == shape.heads and config["num_key_value_heads"] == shape.kv_heads
    assert config["head_dim"] == shape.head_dim and config["num_hidden_layers"] == shape.layers
    assert config["dtype"] == shape.dtype and config["hidden_size"] == 128


def test_folder_name_says_the_shape() -> None:
    shape = Shape(heads=8, kv_heads=2, head_dim=32, dtype="bfloat16", layers=3)
    assert model_dir_name("qwen3", shape).startswith("tiny-qwen3-h8kv2d32l3-bf16-")


def test_shape_matrix_is_distinct_runnable_and_named_by_shape() -> None:
    assert next(iter(SHAPES.values())) == ("llama", DEFAULT_SHAPE)
    assert len({recipe_hash(arch, shape) for arch, shape in SHAPES.values()}) == len(SHAPES)
    for name, (arch, shape) in SHAPES.items():
        assert name == f"{arch}-{shape.tag}" and shape.head_dim in CPU_HEAD_SIZES
        assert recipe(arch, shape)["config"]["hidden_size"] == 128
    assert {shape.dtype for _, shape in SHAPES.values()} >= {"float32", "bfloat16"}
    assert any(shape.kv_heads < shape.heads for _, shape in SHAPES.values())  # GQA is covered
    assert {arch for arch, _ in SHAPES.values()} >= {"llama", "qwen3"}


def test_qwen3_is_its_own_arch() -> None:
    config = recipe("qwen3")["config"]
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert recipe_hash("qwen3") not in PRE_SHAPE_HASHES.values()


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"heads": 8, "kv_heads": 3}, "Shape.kv_heads=3"),
        ({"head_dim": 48}, "Shape.head_dim=48"),
        ({"head_dim": 1024}, "Shape.head_dim=1024"),
        ({"dtype": "fp8"}, "Shape.dtype='fp8'"),
        ({"layers": 0}, "Shape.layers"),
        ({"heads": -2}, "Shape.heads"),
        ({"kv_heads": True}, "Shape.kv_heads"),
        ({"head_dim": 64.0}, "Shape.head_dim"),
    ],
)
def test_bad_shapes_fail_naming_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        Shape(**kw)  # type: ignore[arg-type]


def test_qwen2_head_dim_must_fill_hidden_size() -> None:
    # vLLM's Qwen2 derives head_dim from hidden_size // heads; a mismatched checkpoint would not load.
    assert recipe("qwen", Shape(heads=4, kv_heads=2, head_dim=32))["config"]["head_dim"] == 32
    with pytest.raises(ValueError, match=r"Shape\.head_dim=32.*'qwen'"):
        recipe("qwen", Shape(heads=8, kv_heads=2, head_dim=32))


def test_cli_parses_every_shape_flag() -> None:
    argv = ["build", "/out", "--arch", "qwen3", "--heads", "8", "--kv-heads", "2", "--head-dim", "32"]
    args, arch, shape = parse_args([*argv, "--dtype", "bfloat16", "--layers", "3"])
    assert (args.dir, arch) == ("/out", "qwen3")
    assert shape == Shape(heads=8, kv_heads=2, head_dim=32, dtype="bfloat16", layers=3)
    assert parse_args(["build"])[1:] == ("llama", DEFAULT_SHAPE)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heads", "8", "--kv-heads", "3"], "Shape.kv_heads=3"),
        (["--head-dim", "48"], "Shape.head_dim=48"),
        (["--dtype", "fp8"], "invalid choice: 'fp8'"),
        (["--arch", "gpt"], "invalid choice: 'gpt'"),
        (["--arch", "qwen", "--heads", "8", "--kv-heads", "2", "--head-dim", "32"], "Shape.head_dim=32"),
    ],
)
def test_cli_rejects_bad_shapes_naming_the_field(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["build", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_cli_builds_the_shape_it_was_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[object, ...]] = []
    monkeypatch.setattr(tinymodel, "build", lambda *a: calls.append(("build", *a)) or Path("/built"))
    monkeypatch.setattr(tinymodel, "ensure", lambda *a: calls.append(("ensure", *a)) or Path("/cached"))
    tinymodel.main(["build", "--arch", "qwen3", "--heads", "4", "--kv-heads", "1", "--head-dim", "128"])
    tinymodel.main(["build", "/out", "--dtype", "float16"])
    assert calls == [
        ("ensure", "qwen3", Shape(heads=4, kv_heads=1, head_dim=128)),
        ("build", "/out", "llama", Shape(dtype="float16")),
    ]
    assert capsys.readouterr().out.split() == ["/cached", "/built"]


def test_a_small_bfloat16_qwen3_build_has_its_shape_and_dtype(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors")
    shape = Shape(heads=4, kv_heads=1, head_dim=32, dtype="bfloat16", layers=1)
    out = build(tmp_path / "m", "qwen3", shape)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 1, 32)
    with safetensors.safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert {weights.get_slice(k).get_dtype() for k in weights.keys()} == {"BF16"}  # noqa: SIM118
        assert weights.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [128, 128]
        assert weights.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [32, 128]
        assert weights.get_slice("model.layers.0.self_attn.q_norm.weight").get_shape() == [32]
    assert (out / tinymodel.STAMP).read_text().strip() == recipe_hash("qwen3", shape)
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert build(out, "qwen3", shape) == out and (out / "model.safetensors").stat().st_mtime_ns == mtime
