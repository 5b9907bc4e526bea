"""The kvferry images are named in one place (operator/render/images.py): docker-bake.hcl pushes exactly
those names, the chart and the operator pull them from one registry value, and the versions agree."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from kvferry.operator.render import images
from kvferry.operator.render.objects import render
from kvferry.operator.runtime.config import OperatorConfig

from tests.unit.operator.cases import make_inference

ROOT = Path(__file__).resolve().parents[3]
BAKE = (ROOT / "docker-bake.hcl").read_text()


def bake_variables() -> dict[str, str]:
    return dict(re.findall(r'variable "(\w+)" \{\s*default = "([^"]*)"\s*\}', BAKE))


def bake_targets(**overrides: str) -> dict[str, dict[str, object]]:
    """Each target's dockerfile, tags and args, with ${VAR} filled from the defaults and `overrides`."""
    variables = {**bake_variables(), **overrides}

    def fill(text: str) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda m: variables[m.group(1)], text)

    targets = {}
    for name, body in re.findall(r'^target "([\w-]+)" \{\n(.*?)^\}', BAKE, re.M | re.S):
        args_block = re.search(r"args = \{\n(.*?)\n *\}", body, re.S)
        targets[name] = {
            "dockerfile": re.search(r'dockerfile\s*=\s*"([^"]+)"', body).group(1),
            "tags": [
                fill(t) for t in re.findall(r'"([^"]+)"', re.search(r"tags\s*=\s*\[(.*?)\]", body).group(1))
            ],
            "args": {k: fill(v) for k, v in re.findall(r'(\w+)\s*=\s*"([^"]*)"', args_block.group(1))}
            if args_block
            else {},
        }
    return targets


def test_bake_pushes_every_image_under_its_one_name() -> None:
    assert re.search(r'group "default" \{\s*targets = \["operator", "vllm"\]', BAKE)
    for registry in (images.DEFAULT_REGISTRY, "registry.example.com/team/kvferry"):
        targets = bake_targets(REGISTRY=registry)
        assert set(targets) == set(images.TAGS)
        for name, target in targets.items():
            assert target["dockerfile"] == f"images/{name}/Dockerfile"
            assert target["tags"] == [images.image(name, registry)]
    assert bake_variables()["REGISTRY"] == images.DEFAULT_REGISTRY


def test_versions_agree() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    chart = yaml.safe_load((ROOT / "charts/kvferry/Chart.yaml").read_text())
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == images.VERSION
    assert chart["appVersion"] == images.VERSION
    assert bake_variables()["VERSION"] == images.VERSION
    assert bake_variables()["VLLM_VERSION"] == images.VLLM_VERSION
    base = f"vllm/vllm-openai:v{images.VLLM_VERSION}"
    assert bake_targets()["vllm"]["args"] == {"VLLM_IMAGE": base}
    assert f"ARG VLLM_IMAGE={base}\n" in (ROOT / "images/vllm/Dockerfile").read_text()


def test_release_workflow_pushes_both_images_on_a_tag() -> None:
    workflow = yaml.safe_load((ROOT / ".github/workflows/release.yaml").read_text())
    assert workflow[True] == {"push": {"tags": ["v*"]}}  # YAML 1.1 reads the key `on` as True
    (job,) = workflow["jobs"].values()
    runs = [step.get("run", "") for step in job["steps"]]
    assert any("docker buildx bake --push" in run for run in runs)


def test_no_other_file_spells_a_kvferry_image_name() -> None:
    """Only images.py names the images; the chart has no default registry (it requires one)."""
    listed = subprocess.run(
        ["git", "grep", "-l", "ghcr.io/kvferry", "--", "operator", "charts", "router", "connector", "tools"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert sorted(listed) == ["operator/render/images.py"]


@pytest.mark.parametrize("accelerator", ["p5en", "p5"])
def test_one_registry_moves_the_engine_router_and_injector_images(accelerator: str) -> None:
    cr = make_inference("m", accelerator=accelerator, kvTransfer={"connectorSource": "inject"}).obj()
    registry = "registry.example.com/team/kvferry"
    used = set()
    for obj in render(cr, registry=registry).objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        used |= {c["image"] for c in pod.get("initContainers", []) + pod.get("containers", [])}
    assert used == {images.image("vllm", registry), images.image("operator", registry)}
    default = {
        c["image"]
        for obj in render(cr).objects
        for c in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
    }
    assert default == {images.image("vllm"), images.image("operator")}


def test_a_preset_names_a_kvferry_image_that_exists() -> None:
    assert images.resolve({"kvferry": "vllm"}, "r.example/x/") == "r.example/x/vllm:" + images.TAGS["vllm"]
    assert images.resolve("public.ecr.aws/neuron/x:1") == "public.ecr.aws/neuron/x:1"
    with pytest.raises(ValueError, match="no kvferry image 'vllm-cpu'"):
        images.resolve({"kvferry": "vllm-cpu"})


def test_the_registry_value_is_checked_alike_by_the_chart_and_the_operator() -> None:
    schema = json.loads((ROOT / "charts/kvferry/values.schema.json").read_text())
    # Empty passes the schema so the chart's `required` can say what to do (no image is published).
    registry = schema["properties"]["image"]["properties"]["registry"]
    assert registry["pattern"] == f"^$|{images.REGISTRY_PATTERN}"
    config = OperatorConfig.from_env({"KVFERRY_IMAGE_REGISTRY": "registry.example.com:5000/team/kvferry"})
    assert config.image_registry == "registry.example.com:5000/team/kvferry"
    assert OperatorConfig.from_env({}).image_registry == images.DEFAULT_REGISTRY
    with pytest.raises(ValueError, match="KVFERRY_IMAGE_REGISTRY='Registry/KV'"):
        OperatorConfig.from_env({"KVFERRY_IMAGE_REGISTRY": "Registry/KV"})
    chart = (ROOT / "charts/kvferry/templates/operator-deployment.yaml").read_text()
    chart_env = set(re.findall(r"name: (KVFERRY_\w+)", chart))
    assert {"KVFERRY_IMAGE_REGISTRY", "KVFERRY_ROUTER_IMAGE"} <= chart_env
