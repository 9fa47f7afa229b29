"""Kubernetes discovery: the endpoint set from an `InferencePool` and the Pods it selects.

`pool` (pure) maps objects to endpoints; `settings` (pure) resolves flags and environment;
`client` and `watcher` are the edge (kubernetes-asyncio, list and watch)."""
