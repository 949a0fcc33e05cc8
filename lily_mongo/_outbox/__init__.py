"""The transactional outbox: records written in a transaction, dispatched after its commit, a backstop relay
(docs/outbox.md)."""
