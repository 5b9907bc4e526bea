# Build and push both kvferry images with one command (docs/install.md "Images first"):
#
#   REGISTRY=registry.example.com/kvferry docker buildx bake --push
#
# then install with the same registry: `helm install ... --set image.registry=$REGISTRY`. The operator
# gets it from the chart and renders the router, injector and p5/p5en engine images from it. Tags are
# those of operator/render/images.py (tests/unit/images checks they agree). Without --push, bake builds
# into the local image store; `docker buildx bake --print` shows the resolved targets.

# Registry and path the images are pushed to; the chart's image.registry must name the same.
variable "REGISTRY" {
  default = "ghcr.io/kvferry"
}

# kvferry's version (pyproject.toml, Chart.yaml appVersion): the operator image's tag.
variable "VERSION" {
  default = "0.1.0"
}

# The upstream vLLM release the engine image builds on (vllm/vllm-openai:v<VLLM_VERSION>).
variable "VLLM_VERSION" {
  default = "0.32.0"
}

group "default" {
  targets = ["operator", "vllm"]
}

# The nodes are x86_64 (P5/P5en, trn2 and CPU nodes alike): build for them from any machine.
target "operator" {
  context    = "."
  dockerfile = "images/operator/Dockerfile"
  platforms  = ["linux/amd64"]
  tags       = ["${REGISTRY}/operator:${VERSION}"]
}

target "vllm" {
  context    = "."
  dockerfile = "images/vllm/Dockerfile"
  platforms  = ["linux/amd64"]
  args = {
    VLLM_IMAGE = "vllm/vllm-openai:v${VLLM_VERSION}"
  }
  tags = ["${REGISTRY}/vllm:${VLLM_VERSION}-kvferry${VERSION}"]
}
