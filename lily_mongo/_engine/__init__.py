"""The delivery engine: intake, admission, deadlines, and driving each delivery to its settlement
(docs/lifecycle.md, docs/settlement.md)."""
