"""The operator process: kopf's handlers and their wiring (`handlers`), start-up (`run`, `config`), watch
events without managedFields (`lean`), leader election's peering object (`peering`), sharding (`shard`),
finalizers (`finalizers`) and the operator's own metrics (`selfmetrics`)."""
