"""The reconcile loop: spec -> sizing -> children (per runtime) -> server-side apply -> status."""
