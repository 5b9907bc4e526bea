"""Node agent: runs the pods bound to one Node as local processes (`kvferry demo`'s kubelet).

Reading path: `agent` (NodeAgent: start/stop, heartbeats) -> `watch` (which pods are ours) -> `pod`
(one worker per pod) -> `volumes` and `podspec` (what to run) -> `runner` (the process) -> `probes`
-> `status` (what the API sees). `alloc` hands out pod IPs and cores,
`netns` gives the node its network namespace (pod IPs must not be loopback: EndpointSlices refuse them).
Container images are ignored: the local virtualenv is "the image", so containers need a `command`.
"""
