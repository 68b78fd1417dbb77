"""What keeps a run: checkpoints, continuity across stops, the non-finite guard, signals, resume, the final evaluation."""
