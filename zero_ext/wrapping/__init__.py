"""wrap() and what it plans before training starts: the arguments and the
launch, the ranks' agreement on the model, stage 3 units, gradient buckets,
deferred (meta) initialization, and the configuration types."""
