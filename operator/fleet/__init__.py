"""What keeps one operator fast across thousands of CRs: which watch events matter (`changes`), status
refreshes batched per CR (`coalesce`), drift checks off kopf's worker, newest wins (`latest`), and
indexed copies packed small (`packed`)."""
