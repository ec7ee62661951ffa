"""The trained draft head's making, fenced off from the engine: cache the target's features over
the standard library (draft_data), train the head on them (train_draft), and measure it in
speculative generation on held-out files (draft_eval). `make draft` runs all three."""
