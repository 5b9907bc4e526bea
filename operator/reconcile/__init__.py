"""The reconcile domain: the numbered steps (`steps`), server-side apply and the one ownership gate
(`apply`), stored vs rendered (`drift`), engine pods' network-node labels (`network`) and Secret
references checked by metadata (`secrets`)."""
