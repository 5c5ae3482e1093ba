"""The scaling loop: pods and KV metrics -> `decide()` -> replicas, status and Events."""
