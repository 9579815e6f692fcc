"""Set-up the test modules share: tiny models, engines, training runs."""
