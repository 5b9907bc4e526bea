"""The spec's compileCache section: where Neuron presets keep compiled graphs across pod restarts.

Rendered by operator/render/presets.py as one volume mounted where the preset points vLLM's and the
Neuron compiler's caches (docs/trainium.md "Compile cache"). Presets that compile nothing ahead of
serving (GPU, cpu, none) ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.operator.spec.fields import f

VOLUMES = ("hostPath", "persistentVolumeClaim", "emptyDir")
DEFAULT_HOST_PATH = "/var/lib/kvferry/neuron-cache"


@dataclass
class CompileCache:
    """Where a Neuron engine's compiled graphs (NEFFs) live, so a restart does not compile again."""

    volume: str = f(
        "hostPath: a directory on the node; it survives pod restarts and reschedules onto the same "
        "node, and prefill and decode pods on one node share it (vLLM Neuron locks each cache entry). "
        "persistentVolumeClaim: the PVC `claimName` (ReadWriteMany, e.g. FSx for Lustre, to share "
        "across nodes). emptyDir: per pod, gone with it (every start compiles again).",
        "hostPath",
        enum=list(VOLUMES),
    )
    path: str = f(
        "Node directory for volume hostPath (created if missing).",
        DEFAULT_HOST_PATH,
        minLength=2,
        maxLength=4096,
    )
    claim_name: str | None = f(
        "PersistentVolumeClaim in the CR's namespace, for volume persistentVolumeClaim.",
        None,
        minLength=1,
        maxLength=253,
    )
