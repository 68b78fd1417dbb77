"""The loop: the engine, the step, the objective, batches and shards, metrics and losses, the events it emits."""
