"""What runs while a wrapped model trains: the module hooks (gather, release,
backward bookkeeping), the wrapped module's methods, the per-model state and
its modes, and the user's calls on a wrapped model (full_params, full state
dicts, the memory report)."""
