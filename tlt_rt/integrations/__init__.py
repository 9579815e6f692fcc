"""Bridges to other RL frameworks (verl). Each module imports its framework; importing tlt_rt does not."""
