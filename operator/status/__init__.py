"""Status: observations (pods, engines' metrics, apply results) -> one set of conditions, one writer."""
