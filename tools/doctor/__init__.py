"""`kvferry doctor`: what one DisaggregatedInference needs from a cluster, checked with the user's kubeconfig.

needs.py (pure: the CR rendered offline -> what its pods ask of nodes and add-ons), checks.py (pure: needs +
a snapshot of the cluster -> one finding per check, each gap with its fix), cluster.py (the snapshot, read
with the kubernetes client), cli.py (the command: one line per check, exit 1 on any gap).
"""
