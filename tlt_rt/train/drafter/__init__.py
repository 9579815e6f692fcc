"""Drafter training: its data buffer, loss, trainer, evaluation, warm-up and spot/tail scheduling."""
