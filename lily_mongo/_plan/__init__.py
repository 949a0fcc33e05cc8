"""The plan: handler registrations, their parameters and the queues' options, checked against every bound
before a consumer starts (docs/handlers.md, docs/configuration.md)."""
