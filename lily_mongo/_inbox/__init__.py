"""The inbox: one record per (handler, event) carries the lease and the completion (docs/inbox.md)."""
