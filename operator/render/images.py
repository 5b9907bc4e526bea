"""The kvferry images, named once: what docker-bake.hcl builds and pushes, the chart pulls and the
operator renders (router Deployments, `inject` init containers, the p5/p5en presets' engines).

One registry moves all of them: the chart's `image.registry` value sets the operator's own image and
KVFERRY_IMAGE_REGISTRY, which the operator passes to render(). tests/unit/images checks docker-bake.hcl,
the Dockerfiles, pyproject.toml and Chart.yaml against the names and versions here.
"""

from __future__ import annotations

from typing import Any

DEFAULT_REGISTRY = "ghcr.io/kvferry"  # the operator's and `kvferry render`'s default; nothing is published
# manifests/install.yaml's stand-in registry (the chart itself requires image.registry): `.invalid` never
# resolves (RFC 2606), so an unedited install fails at the pull, named (ImagePullFailed), not silently.
PLACEHOLDER_REGISTRY = "registry.invalid/kvferry"
# What a registry value may be (host[:port]/path, lower case as image references need): the chart's
# values.schema.json and the operator's KVFERRY_IMAGE_REGISTRY check the same pattern.
REGISTRY_PATTERN = r"^[a-z0-9]([a-z0-9._:-]*[a-z0-9])?(/[a-z0-9]([a-z0-9._-]*[a-z0-9])?)*$"
VERSION = "0.1.0"  # kvferry's version: pyproject.toml, charts/kvferry/Chart.yaml appVersion
VLLM_VERSION = "0.32.0"  # the upstream vllm/vllm-openai images/vllm/Dockerfile builds on

# image name -> its tag: images/<name>/Dockerfile is pushed as <registry>/<name>:<tag>
TAGS = {
    "operator": VERSION,  # operator + router + injector (images/operator/Dockerfile)
    "vllm": f"{VLLM_VERSION}-kvferry{VERSION}",  # vLLM + connector + EFA libfabric (images/vllm/Dockerfile)
}


def image(name: str, registry: str = DEFAULT_REGISTRY) -> str:
    """`<registry>/<name>:<tag>` of one kvferry image."""
    if name not in TAGS:
        raise ValueError(f"no kvferry image {name!r} (known: {', '.join(TAGS)})")
    return f"{registry.rstrip('/')}/{name}:{TAGS[name]}"


def operator_image(registry: str = DEFAULT_REGISTRY) -> str:
    return image("operator", registry)


def resolve(preset_image: Any, registry: str = DEFAULT_REGISTRY) -> str:
    """A preset's `image`: a reference as written, or `{kvferry: NAME}` for kvferry's own image NAME."""
    if isinstance(preset_image, dict):
        return image(preset_image["kvferry"], registry)
    return str(preset_image or "")
